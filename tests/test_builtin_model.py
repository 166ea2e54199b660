"""Built-in offline model: build `tiny`, load it the ways transformers / TRL / vLLM do, pin tokenizer behaviour."""

import json
import subprocess
import sys

import pytest

from colocate_rl import builtin_model as bm
from colocate_rl.errors import UserError
from colocate_rl.memory.shapes import layout_for


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return bm.build_model("tiny", tmp_path_factory.mktemp("b") / "tiny", seed=0)


def _weights(path):
    from safetensors.torch import load_file

    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


@pytest.mark.slow
def test_import_is_light():
    code = (
        "import sys, colocate_rl.builtin_model; print(sorted({'torch','transformers','tokenizers'} & set(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_files_and_config(tiny):
    for f in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", bm.MARKER):
        assert (tiny / f).is_file(), f
    assert list(tiny.glob("*.safetensors"))
    cfg = json.loads((tiny / "config.json").read_text())
    assert cfg["model_type"] == "qwen2" and cfg["architectures"] == ["Qwen2ForCausalLM"]
    assert (cfg["eos_token_id"], cfg["pad_token_id"], cfg["bos_token_id"]) == (2, 0, None)
    assert json.loads((tiny / "generation_config.json").read_text())["eos_token_id"] == 2
    tok = bm.load_tokenizer(tiny)
    assert (tok.eos_token, tok.pad_token) == ("<|im_end|>", "<|endoftext|>")
    assert (tok.eos_token_id, tok.pad_token_id) == (2, 0)
    assert tok.convert_tokens_to_ids("<|im_start|>") == 1


def test_load_forward_generate(tiny):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny).eval()
    assert sum(p.numel() for p in model.parameters()) == layout_for("builtin:tiny").params
    tok = bm.load_tokenizer(tiny)
    batch = tok(["What is 2 + 3?", "hi"], return_tensors="pt", padding=True)
    with torch.no_grad():
        logits = model(**batch).logits
        assert logits.shape == (2, batch.input_ids.shape[1], bm.LAYOUTS["tiny"]["vocab_size"])
        assert torch.isfinite(logits).all()
        ids = tok(["What is 2 + 3?"], return_tensors="pt")
        out = model.generate(**ids, max_new_tokens=4, do_sample=False)
    assert out.shape[1] <= ids.input_ids.shape[1] + 4


def test_param_count_known_sizes():
    assert layout_for("builtin:qwen2.5-0.5b").params == 494_032_768
    assert layout_for("builtin:qwen2.5-1.5b").params == 1_543_714_304
    assert layout_for("builtin:qwen2.5-7b").params == 7_615_616_512


def test_deterministic_and_idempotent(tiny, tmp_path):
    same = bm.build_model("tiny", tmp_path / "same", seed=0)
    other = bm.build_model("tiny", tmp_path / "other", seed=1)
    a, b, c = _weights(tiny), _weights(same), _weights(other)
    assert a.keys() == b.keys() == c.keys()
    assert all(a[k].equal(b[k]) for k in a)
    assert any(not a[k].equal(c[k]) for k in a)
    assert (tiny / "tokenizer.json").read_bytes() == (same / "tokenizer.json").read_bytes()
    # Rebuilding the same thing is a no-op; a different seed replaces the directory cleanly.
    mtime = (same / "model.safetensors").stat().st_mtime_ns
    assert bm.build_model("tiny", same, seed=0) == same
    assert (same / "model.safetensors").stat().st_mtime_ns == mtime
    bm.build_model("tiny", same, seed=1)
    assert json.loads((same / bm.MARKER).read_text())["seed"] == 1
    assert all(_weights(same)[k].equal(c[k]) for k in c)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other", "same"]  # no temp/old dirs left


def test_dtype(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    p = bm.build_model("tiny", tmp_path / "bf16", dtype="bfloat16")
    assert {t.dtype for t in _weights(p).values()} == {torch.bfloat16}
    assert AutoModelForCausalLM.from_pretrained(p, dtype="auto").dtype == torch.bfloat16


STRINGS = [
    "What is 12 + 345? The answer is 357.",
    "  leading spaces, trailing spaces   ",
    "line one\nline two\n\n\ttabbed\r\nwindows",
    "1234567890 3.14159 -42 1e-6 1,000,000",
    "héllo wörld — naïve café 日本語 中文 🙂👍 Ελληνικά",
    "don't I'll we're THEY'VE it's",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
    "",
]


def test_tokenizer_same_under_both_loaders(tiny):
    """transformers 5 maps qwen2 dirs to Qwen2Tokenizer (rebuilding the pipeline, ignoring tokenizer_class);
    vLLM/TRL use AutoTokenizer. Both loaders must produce the same ids, and round-trip text."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast.from_pretrained(tiny)
    auto = AutoTokenizer.from_pretrained(tiny)
    chat = auto.apply_chat_template(
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "What is 7 * 6?"},
            {"role": "assistant", "content": "42"},
        ],
        tokenize=False,
    )
    for s in STRINGS + [chat]:
        ids = fast(s).input_ids
        assert ids == auto(s).input_ids, s
        assert fast.decode(ids) == s and auto.decode(ids) == s, s
    assert len(fast) == len(auto) == bm.TOKENIZER_VOCAB
    assert fast("<|im_start|>").input_ids == [1] and fast.decode([1, 2], skip_special_tokens=True) == ""


def test_chat_template(tiny):
    tok = bm.load_tokenizer(tiny)
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "What is 1 + 1?"}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert (
        text == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nWhat is 1 + 1?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert text.endswith("<|im_start|>assistant\n")
    assert not tok.apply_chat_template(msgs, tokenize=False).endswith("assistant\n")
    assert "chat_template" in json.loads((tiny / "tokenizer_config.json").read_text())


def test_unknown_layout_and_dtype(tmp_path):
    with pytest.raises(
        UserError, match=r"model.name: unknown built-in layout 'x'; choose one of: builtin:tiny, builtin:qwen2.5-0.5b"
    ):
        bm.build_model("x", tmp_path / "m")
    with pytest.raises(UserError, match="unknown built-in layout"):
        layout_for("builtin:qwen9")
    with pytest.raises(UserError, match="dtype"):
        bm.build_model("tiny", tmp_path / "m", dtype="int8")
    assert not (tmp_path / "m").exists()


def test_refuses_foreign_dir(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "keep.txt").write_text("x")
    with pytest.raises(UserError, match="not a built-in model directory"):
        bm.build_model("tiny", tmp_path / "m")
    assert (tmp_path / "m" / "keep.txt").read_text() == "x"


@pytest.mark.slow
def test_subprocess_build_leaves_torch_out_of_the_caller(tmp_path, tiny):
    # The launcher supervises the whole run: a build in its own process would keep the CUDA context and torch's
    # cached blocks (the whole model) on GPU 0 until the run ends. Built in a child, the caller never loads torch,
    # and the child's build is the same files as an in-process build with the same seed.
    code = (
        "import json, sys; from colocate_rl.builtin_model import build_model_in_subprocess as b; "
        f"print(b('tiny', {str(tmp_path / 'm')!r}, seed=0)); "
        "print(json.dumps(sorted({'torch', 'transformers', 'tokenizers'} & set(sys.modules))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.splitlines()
    assert out == [str(tmp_path / "m"), "[]"]
    assert _weights(tmp_path / "m").keys() == _weights(tiny).keys()
    assert all((_weights(tmp_path / "m")[k] == v).all() for k, v in _weights(tiny).items())


@pytest.mark.slow
def test_subprocess_build_reports_the_childs_user_error(tmp_path):
    with pytest.raises(UserError, match=r"^model.name: unknown built-in layout 'x'; choose one of: builtin:tiny"):
        bm.build_model_in_subprocess("x", tmp_path / "m")
    with pytest.raises(UserError, match="dtype"):
        bm.build_model_in_subprocess("tiny", tmp_path / "m", dtype="int8")
    assert not (tmp_path / "m").exists()


def test_tiny_calc_carries_what_trl_parses_and_the_calculators_schema():
    """`builtin:tiny-calc` is warm-started on chats rendered as TRL renders them: TRL's own qwen2_5 template (the one it
    parses tool calls for), the calculator's schema as transformers derives it, and the arithmetic task's questions
    (its generator copied, so the copy must stay the same; the held-out stream is the one evaluation draws from)."""
    from transformers.utils import get_json_schema

    from colocate_rl import prompts, warm_start
    from colocate_rl.plan.tools import TRL_PARSED_TEMPLATES, trl_templates_dir
    from colocate_rl.tools import calculator

    assert "qwen2_5" in TRL_PARSED_TEMPLATES
    assert bm.layout_chat_template("tiny-calc") == (trl_templates_dir() / "qwen2_5.jinja").read_text()
    assert bm.layout_chat_template("tiny") == bm.CHAT_TEMPLATE
    assert warm_start.CALCULATOR_SCHEMA == get_json_schema(calculator)
    for seed in (0, 7, f"3:{prompts.HELDOUT_STREAM}"):
        ours, theirs = warm_start.arithmetic_rows(seed), prompts.iter_builtin_rows("arithmetic", seed)
        assert [next(ours) for _ in range(300)] == [next(theirs) for _ in range(300)]
    for row in prompts.builtin_rows("arithmetic", 200, 0):
        assert calculator(warm_start.expression(row["prompt"])) == row["answer"], row
    rendered = warm_start.render([warm_start.chat("What is 2 + 3?", "5", call_tool=True)], bm.qwen2_5_chat_template())
    assert '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2 + 3"}}\n</tool_call>' in rendered[0]
    assert "<tool_response>\n5\n</tool_response>" in rendered[0] and '"name": "calculator"' in rendered[0]
