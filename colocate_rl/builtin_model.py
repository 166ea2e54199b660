"""Offline built-in models: a random-init Qwen2 causal LM plus a locally trained byte-level BPE tokenizer,
saved as an ordinary Hugging Face model directory (transformers, TRL and vLLM load it; nothing is downloaded).

The tokenizer is trained with exactly the normalizer / pre-tokenizer / decoder that transformers' `Qwen2Tokenizer`
hard-codes. That matters: for a `model_type: qwen2` directory, `AutoTokenizer` (used by vLLM and TRL) always returns
`Qwen2Tokenizer`, ignoring `tokenizer_class`, and rebuilds the pipeline from vocab/merges; with the same pipeline
that rebuild is a no-op, so `AutoTokenizer` and `PreTrainedTokenizerFast` give identical ids.

`tiny-calc` is not random-init: `tiny`'s shape with a 768-token tokenizer of its own (the tool-call tags added,
non-special, trained on the corpus below plus calculator transcripts) carrying TRL's Qwen2.5 chat template (read from
the installed trl: TRL renders the tools and parses the model's `<tool_call>` JSON); a short supervised warm start
(`colocate_rl.warm_start`) teaches it the call format and to copy numbers, and leaves when to call the tool to RL."""

from __future__ import annotations

import functools
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from colocate_rl.errors import UserError

PREFIX = "builtin:"  # model.name of a built-in model: builtin:<layout>
MARKER = "colocate_rl_build.json"
_FORMAT = 2  # bump when the files written change, so old builds are rebuilt
DTYPES = ("float32", "bfloat16", "float16")
PAD, BOS_START, EOS = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [PAD, BOS_START, EOS]  # trained first, so ids 0, 1, 2
TOKENIZER_VOCAB = 512
TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]  # tiny-calc's, ids 3-6
CALC_TOKENIZER_VOCAB = 768

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Shared Qwen2.5 values (from the released config.json files).
_QWEN = dict(
    hidden_act="silu",
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    initializer_range=0.02,
    attention_dropout=0.0,
    use_sliding_window=False,
    use_cache=True,
)

LAYOUTS: dict[str, dict] = {
    "tiny": dict(
        _QWEN,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=TOKENIZER_VOCAB,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        max_window_layers=2,
    ),
    "qwen2.5-0.5b": dict(
        _QWEN,
        hidden_size=896,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        intermediate_size=4864,
        vocab_size=151936,
        max_position_embeddings=32768,
        tie_word_embeddings=True,
        max_window_layers=21,
    ),
    "qwen2.5-1.5b": dict(
        _QWEN,
        hidden_size=1536,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        intermediate_size=8960,
        vocab_size=151936,
        max_position_embeddings=32768,
        tie_word_embeddings=True,
        max_window_layers=21,
    ),
    "qwen2.5-7b": dict(
        _QWEN,
        hidden_size=3584,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        intermediate_size=18944,
        vocab_size=152064,
        max_position_embeddings=32768,
        tie_word_embeddings=False,
        max_window_layers=28,
    ),
}
LAYOUTS["tiny-calc"] = dict(LAYOUTS["tiny"], vocab_size=CALC_TOKENIZER_VOCAB)
# How a layout is warm-started (colocate_rl.warm_start's docstring says what each step does); kept out of LAYOUTS,
# whose entries are Qwen2Config kwargs. Part of the build's identity: changing it rebuilds.
WARM_STARTS: dict[str, dict] = {
    "tiny-calc": dict(
        chats=1500, probe_chats=32, exclude_heldout=1024, batch=16, lr=1e-2, warmup=20,
        attempts=3, attempt_steps=300, formed=0.3, max_steps=600, probe_every=50, target=[0.9, 0.75],
        calib_steps=120, calib_lr=3e-3, calib_tool_share={"*": 0.9, "+": 0.1, "-": 0.1},
    ),
}  # fmt: skip
WARM_START_FILE = "warm_start.json"  # in a warm-started model's directory: the table's entry and what was measured


# `tiny`'s (tied) embeddings are drawn 8× wider than the initializer's 0.02: at 0.02 every logit stays within about
# ±1.3, the output is nearly uniform whatever the layers compute, and only training the embeddings (full
# fine-tuning) could move a reward; at 0.16 the layers steer the output, as in a pretrained model, so LoRA learns too.
# The GPU layouts keep the plain init (their benchmarks rely on completions running to the length limit).
EMBEDDING_SCALE = {"tiny": 8.0}


def _unknown(layout: str) -> UserError:
    return UserError(
        f"model.name: unknown built-in layout '{layout}'; choose one of: " + ", ".join(f"{PREFIX}{k}" for k in LAYOUTS)
    )


def builtin_layout(model_name: str) -> str | None:
    """The layout of a `builtin:<layout>` model name; None for any other model name. Fails (UserError) on an
    unknown layout."""
    if not model_name.startswith(PREFIX):
        return None
    layout = model_name.removeprefix(PREFIX)
    if layout not in LAYOUTS:
        raise _unknown(layout)
    return layout


def _layout(layout: str) -> dict:
    if layout not in LAYOUTS:
        raise _unknown(layout)
    return LAYOUTS[layout]


def _corpus(n: int = 3000) -> list[str]:
    """Deterministic English-ish text: sentences, numbers, arithmetic, chat-formatted turns."""
    rng = random.Random(1234)
    words = (
        "the a an of to and in is it you that he she was for on are as with his her they at be this have from "
        "or one had by word but not what all were we when your can said there use each which do how their if "
        "will up other about out many then them these so some would make like him into time has look two more "
        "write go see number no way could people my than first water been call who now find long down day did "
        "get come made may part answer question think step solve total sum add plus minus times equals apple "
        "books each left right true false yes because therefore"
    ).split()
    roles = ("system", "user", "assistant")
    out = []
    for _ in range(n):
        k = rng.randrange(5)
        a, b = rng.randrange(1000), rng.randrange(1, 100)
        if k == 0:
            op = rng.choice("+-*")
            out.append(f"What is {a} {op} {b}? The answer is {eval(f'{a}{op}{b}')}.")
        elif k == 1:
            out.append(
                f"{rng.choice(words).capitalize()} has {a} {rng.choice(words)}s and gives away {b}: "
                f"{a} - {b} = {a - b}.\n#### {a - b}"
            )
        elif k == 2:
            out.append(f"{rng.choice(roles)}\n" + " ".join(rng.choice(words) for _ in range(rng.randrange(2, 9))))
        else:
            s = " ".join(rng.choice(words) for _ in range(rng.randrange(3, 14)))
            out.append(s.capitalize() + rng.choice([".", "?", "!", ",", ".\n", ".\n\n", ";"]))
    return out


# transformers' Qwen2Tokenizer pre-tokenizer pattern (transformers.models.qwen2.tokenization_qwen2), copied so that the
# pre-flight tokenizes without importing transformers (1.4 s); tests/test_builtin_model.py checks the two are equal
PRETOKENIZE_REGEX = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""


@functools.cache
def _bpe_json(layout: str) -> str:
    from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors, trainers
    from tokenizers.models import BPE

    _layout(layout)  # UserError for an unknown layout
    warm = layout in WARM_STARTS
    tok = Tokenizer(BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    split = pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False)
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    trainer = trainers.BpeTrainer(
        vocab_size=CALC_TOKENIZER_VOCAB if warm else TOKENIZER_VOCAB,
        special_tokens=SPECIAL_TOKENS + (TOOL_TOKENS if warm else []),
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
    )
    if not warm:
        tok.train_from_iterator(_corpus(), trainer)
        return tok.to_str()
    from colocate_rl.warm_start import transcripts

    tok.train_from_iterator(_corpus() + transcripts(3000, 0, layout_chat_template(layout)), trainer)
    spec = json.loads(tok.to_str())  # the tool tokens not special, as Qwen2.5's: decoding keeps them (TRL, vLLM)
    for added in spec["added_tokens"]:
        added["special"] = added["content"] in SPECIAL_TOKENS
    return json.dumps(spec)


def bpe_tokenizer(layout: str):
    """`layout`'s byte-level BPE (512 tokens; warm-started layouts: 768 with TOOL_TOKENS, also trained on calculator
    transcripts) as a build saves it: trained once per process (< 0.1 s), a copy each call. UserError: unknown layout."""
    from tokenizers import Tokenizer

    return Tokenizer.from_str(_bpe_json(layout))


def _train_tokenizer(out_dir: Path, model_max_length: int, layout: str = "tiny") -> None:
    """Save `bpe_tokenizer(layout)` as tokenizer.json + tokenizer_config.json (with chat_template)."""
    from transformers import PreTrainedTokenizerFast

    special = dict(eos_token=EOS, pad_token=PAD, bos_token=None, additional_special_tokens=[BOS_START])
    fast = PreTrainedTokenizerFast(tokenizer_object=bpe_tokenizer(layout), model_max_length=model_max_length, **special)
    fast.save_pretrained(str(out_dir))
    # Keep the template inside tokenizer_config.json (read by every transformers/vLLM version), not a .jinja file.
    (out_dir / "chat_template.jinja").unlink(missing_ok=True)
    cfg_path = out_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = layout_chat_template(layout)
    # What Qwen2.5 ships; transformers 5 picks Qwen2Tokenizer for qwen2 dirs anyway, 4.x then loads tokenizer.json as-is.
    cfg["tokenizer_class"] = "Qwen2Tokenizer"
    cfg["additional_special_tokens"] = cfg.pop("extra_special_tokens", [BOS_START])  # list form both 4.x and 5 read
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")


def _write(out_dir: Path, layout: str, seed: int, dtype: str) -> int:
    """Write tokenizer, config, generation config and safetensors weights into out_dir; return the parameters."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig, Qwen2Config

    c = LAYOUTS[layout]
    _train_tokenizer(out_dir, c["max_position_embeddings"], layout)
    ids = {t: i for i, t in enumerate(SPECIAL_TOKENS)}  # BpeTrainer puts special tokens first
    config = Qwen2Config(**c, bos_token_id=None, eos_token_id=ids[EOS], pad_token_id=ids[PAD])
    config.architectures = ["Qwen2ForCausalLM"]
    warm = layout in WARM_STARTS  # trained on the CPU, in float32, then cast
    device = "cuda" if torch.cuda.is_available() and not warm else "cpu"

    def new_model(init_seed: int):
        torch.manual_seed(init_seed)
        with torch.device(device):  # allocated directly in the target dtype: 7B bf16 needs ~15 GB, not 30
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32 if warm else getattr(torch, dtype))
        if layout in EMBEDDING_SCALE:
            with torch.no_grad():
                model.get_input_embeddings().weight.mul_(EMBEDDING_SCALE[layout])
        return model

    model = _warm_start(out_dir, layout, seed, new_model).to(getattr(torch, dtype)) if warm else new_model(seed)
    model.generation_config = GenerationConfig(bos_token_id=None, eos_token_id=ids[EOS], pad_token_id=ids[PAD])
    model.save_pretrained(str(out_dir), max_shard_size="2GB")  # small shards bound the extra RAM while saving
    params = sum(p.numel() for p in model.parameters())
    del model
    return params


def _warm_start(out_dir: Path, layout: str, seed: int, new_model):
    """colocate_rl.warm_start on `new_model(init_seed)` models with the tokenizer just saved; writes WARM_START_FILE."""
    from colocate_rl.warm_start import warm_start

    tok, template = load_tokenizer(out_dir), layout_chat_template(layout)
    model, stats = warm_start(new_model, tok, template, WARM_STARTS[layout], seed)
    record = {"layout": layout, "seed": seed, "spec": WARM_STARTS[layout], **stats}
    (out_dir / WARM_START_FILE).write_text(json.dumps(record, indent=2) + "\n")
    return model.eval()


def _is_built(out: Path, want: dict) -> bool:
    try:
        got = json.loads((out / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return (
        {k: got.get(k) for k in want} == want
        and (out / "config.json").is_file()
        and (out / "tokenizer.json").is_file()
        and any(out.glob("*.safetensors"))
    )


def build_model(layout: str, out_dir: str | Path, *, seed: int = 0, dtype: str = "float32") -> Path:
    """Build `layout` into out_dir (config.json, *.safetensors, generation_config.json, tokenizer files) and
    return out_dir. Deterministic per (seed, device kind: CPU and CUDA RNGs differ); returns at once if out_dir
    already holds the same build. Builds in a temp dir next to out_dir and renames it into place, so a crash leaves
    no half-written model (at worst a `.NAME.tmp-*` dir). Raises UserError for an unknown layout or dtype, or when
    out_dir is a non-empty directory this module did not write (it is never deleted); OSError on disk problems."""
    _layout(layout)
    if dtype not in DTYPES:
        raise UserError(f"model.dtype: unknown dtype {dtype!r}; choose one of: {', '.join(DTYPES)}")
    out = Path(out_dir)
    want = {"format": _FORMAT, "layout": layout, "seed": seed, "dtype": dtype}
    if layout in WARM_STARTS:
        want["warm_start"] = WARM_STARTS[layout]
    if _is_built(out, want):
        return out
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not (out / MARKER).exists())):
        raise UserError(
            f"model: {out} exists and is not a built-in model directory (no {MARKER}); "
            "remove it or choose another output directory"
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    old = None
    try:
        params = _write(tmp, layout, seed, dtype)
        (tmp / MARKER).write_text(json.dumps(dict(want, params=params), indent=2) + "\n")  # last
        try:
            os.rename(tmp, out)  # replaces a missing or empty out_dir
        except OSError:
            if _is_built(out, want):  # a concurrent builder (another rank) won the race
                return out
            old = out.parent / f".{out.name}.old-{tmp.name.rsplit('-', 1)[-1]}"
            os.rename(out, old)  # an older build of ours (other layout/seed/dtype): swap it out
            os.rename(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    return out


def build_model_in_subprocess(
    layout: str, out_dir: str | Path, *, seed: int = 0, dtype: str = "float32", python: str = sys.executable
) -> Path:
    """build_model in a child Python process, so the caller never loads torch. The build runs on the GPU when
    there is one, and a process that did so keeps its CUDA context and torch's cached blocks (the whole model) on
    GPU 0 until it exits: the launcher waits for the whole run. Raises UserError with the child's own error lines
    (exit 2), RuntimeError with its stderr tail for anything else."""
    spec = json.dumps({"layout": layout, "out_dir": str(out_dir), "seed": seed, "dtype": dtype})
    done = subprocess.run([python, "-m", "colocate_rl.builtin_model", spec], capture_output=True, text=True)
    errors = [line.removeprefix("error: ") for line in done.stderr.splitlines() if line.startswith("error: ")]
    if done.returncode == 2 and errors:
        raise UserError(*errors)
    if done.returncode != 0:
        raise RuntimeError(f"building the built-in model {layout} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return Path(done.stdout.strip().splitlines()[-1])


def _main(argv: list[str]) -> int:
    """`python -m colocate_rl.builtin_model SPEC_JSON`: build_model(**SPEC), print the directory."""
    try:
        print(build_model(**json.loads(argv[0])))
    except UserError as e:
        for line in e.lines:
            print(f"error: {line}", file=sys.stderr)
        return 2
    return 0


def load_tokenizer(path: str | Path):
    """The tokenizer for a built-in model dir, loaded as vLLM and TRL load it (AutoTokenizer); pad/eos set.
    Raises OSError if path holds no tokenizer files."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    tok.pad_token, tok.eos_token = tok.pad_token or PAD, tok.eos_token or EOS
    return tok


def layout_chat_template(layout: str) -> str:
    """The chat template a built-in layout's tokenizer carries (what the pre-flight checks tools against)."""
    return qwen2_5_chat_template() if layout in WARM_STARTS else CHAT_TEMPLATE


def qwen2_5_chat_template() -> str:
    """TRL's Qwen2.5 chat template, as the installed trl ships it (TRL parses tool calls only for templates it knows,
    compared as text); found without importing trl. OSError when trl is not installed."""
    import importlib.util

    found = importlib.util.find_spec("trl")
    if found is None or not found.submodule_search_locations:
        raise OSError("trl is not installed; the built-in tool-use model carries TRL's qwen2_5 chat template")
    return (Path(list(found.submodule_search_locations)[0]) / "chat_templates" / "qwen2_5.jinja").read_text("utf-8")


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
