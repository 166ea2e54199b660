"""Tests for colocate_rl.prompts and colocate_rl.rewards: prompt datasets, reward functions, reward resolution. Offline; no model training."""

import json
import os
import re
import subprocess
import sys

import pytest

from colocate_rl.errors import UserError
from colocate_rl.prompts import BUILTIN_TASKS, load_prompts
from colocate_rl.rewards import (
    BUILTIN_REWARDS,
    answer_match,
    check_reward_spec,
    digit_share,
    format_think,
    length_penalty,
    math_verify,
    resolve_reward,
    reward_columns,
)


@pytest.fixture(autouse=True)
def offline(monkeypatch, tmp_path):
    """No hub access and a private datasets cache in every test."""
    import datasets

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))


def raises_user_error(key, fn, /, *args, **kwargs) -> str:
    """Call fn, expect a UserError whose every line is one line naming `key`; return the message."""
    with pytest.raises(UserError) as info:
        fn(*args, **kwargs)
    lines = info.value.lines
    assert lines, "UserError without a message"
    for line in lines:
        assert "\n" not in line
        assert key in line, f"{key!r} not named in: {line}"
    return str(info.value)


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def as_messages(texts):
    return [[{"role": "assistant", "content": t}] for t in texts]


# ---------------------------------------------------------------------------------------------- datasets


@pytest.mark.slow
def test_import_is_instant():
    code = "import sys, colocate_rl.prompts, colocate_rl.rewards, colocate_rl.data_check; assert not {'datasets', 'torch', 'trl'} & set(sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=os.path.dirname(os.path.dirname(__file__)))


@pytest.mark.parametrize("chat", [True, False])
@pytest.mark.parametrize("task", sorted(BUILTIN_TASKS))
def test_builtin_task_loads(task, chat):
    ds = load_prompts(f"builtin:{task}", chat=chat)
    assert len(ds) == 512
    expected = {"digits": {"prompt"}, "arithmetic": {"prompt", "answer"}}[task]
    assert set(ds.column_names) == expected
    for prompt in ds["prompt"][:20]:
        if chat:
            assert prompt == [{"role": "user", "content": prompt[0]["content"]}]
            assert prompt[0]["content"].strip()
        else:
            assert isinstance(prompt, str) and prompt.strip()


def test_builtin_system_prompt_and_num_samples():
    ds = load_prompts("builtin:digits", system_prompt="Answer with numbers.", num_samples=7)
    assert len(ds) == 7
    assert all(p[0] == {"role": "system", "content": "Answer with numbers."} for p in ds["prompt"])
    assert all(p[1]["role"] == "user" for p in ds["prompt"])


def test_builtin_determinism():
    a = load_prompts("builtin:arithmetic", seed=3)
    assert a.to_list() == load_prompts("builtin:arithmetic", seed=3).to_list()
    assert a["prompt"] != load_prompts("builtin:arithmetic", seed=4)["prompt"]
    assert load_prompts("builtin:arithmetic", seed=3, num_samples=10).to_list() == a.to_list()[:10]


def test_arithmetic_answers_are_right():
    ds = load_prompts("builtin:arithmetic", chat=False, num_samples=200)
    ops = set()
    for prompt, answer in zip(ds["prompt"], ds["answer"]):
        a, op, b = re.search(r"(\d+) ([-+*]) (\d+)", prompt).groups()
        ops.add(op)
        assert answer == str({"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op])
    assert ops == {"+", "-", "*"}
    assert len({re.sub(r"\d+", "N", p) for p in ds["prompt"]}) > 5  # varied wording


def test_digits_wording_varies():
    prompts = load_prompts("builtin:digits", chat=False)["prompt"]
    assert len({re.sub(r"\d+", "N", p) for p in prompts}) >= 8
    assert len(set(prompts)) > 200


def test_unknown_builtin_task():
    msg = raises_user_error("data.source", load_prompts, "builtin:digit")
    assert "did you mean 'digits'" in msg and "builtin:arithmetic" in msg


def test_bad_options():
    raises_user_error("data.num_samples", load_prompts, "builtin:digits", num_samples=0)
    raises_user_error("data.system_prompt", load_prompts, "builtin:digits", chat=False, system_prompt="hi")
    raises_user_error("data.source", load_prompts, "")


ROWS = [{"prompt": f"question {i}", "answer": str(i), "id": i} for i in range(5)]


def _write(kind, path):
    if kind == "jsonl":
        return write_jsonl(path, ROWS)
    if kind == "json":
        path.write_text(json.dumps(ROWS))
        return str(path)
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(ROWS), path)
    return str(path)


@pytest.mark.parametrize("kind", ["jsonl", "json", "parquet"])
@pytest.mark.parametrize("chat", [True, False])
def test_file_loads(tmp_path, kind, chat):
    path = _write(kind, tmp_path / f"data.{kind}")
    ds = load_prompts(path, chat=chat)
    assert set(ds.column_names) == {"prompt", "answer", "id"}
    assert ds["id"] == [0, 1, 2, 3, 4]  # file order kept
    assert ds["answer"] == ["0", "1", "2", "3", "4"]
    first = ds["prompt"][0]
    assert first == ([{"role": "user", "content": "question 0"}] if chat else "question 0")
    assert load_prompts(path, num_samples=2, seed=9)["id"] == [0, 1]  # truncation, no shuffle
    assert len(load_prompts(path, num_samples=50)) == 5


def test_file_path_with_tilde(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    write_jsonl(tmp_path / "d.jsonl", ROWS)
    assert load_prompts("~/d.jsonl", chat=False)["prompt"] == [r["prompt"] for r in ROWS]


def test_file_prompt_field_gsm8k_style(tmp_path):
    rows = [{"question": "Natalia sold 48 clips, then half as many. How many?", "answer": "48/2 = 24\n#### 72"}]
    ds = load_prompts(write_jsonl(tmp_path / "gsm.jsonl", rows), prompt_field="question", system_prompt="Think.")
    assert set(ds.column_names) == {"question", "answer", "prompt"}
    assert ds["prompt"][0] == [
        {"role": "system", "content": "Think."},
        {"role": "user", "content": rows[0]["question"]},
    ]
    assert answer_match(ds["prompt"], ["... so 72 in total"], answer=ds["answer"]) == [1.0]


def test_file_with_chat_messages(tmp_path):
    rows = [{"prompt": [{"role": "user", "content": "Count to 3."}]}]
    path = write_jsonl(tmp_path / "chat.jsonl", rows)
    assert load_prompts(path)["prompt"][0] == rows[0]["prompt"]
    raises_user_error("data.chat", load_prompts, path, chat=False)


def test_missing_prompt_field(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"question": "q", "answer": "1"}])
    msg = raises_user_error("data.prompt_field", load_prompts, path)
    assert "question, answer" in msg
    raises_user_error("data.prompt_field", load_prompts, "builtin:digits", prompt_field="text")


def test_non_text_prompt(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": 1}, {"prompt": 2}])
    raises_user_error("data.prompt_field", load_prompts, path)


def test_missing_file(tmp_path):
    msg = raises_user_error("data.source", load_prompts, str(tmp_path / "nope.jsonl"))
    assert "nope.jsonl" in msg and "not found" in msg


@pytest.mark.parametrize("name,content", [("e.jsonl", ""), ("e.json", "[]\n"), ("w.jsonl", "\n\n")])
def test_empty_file(tmp_path, name, content):
    (tmp_path / name).write_text(content)
    assert "empty" in raises_user_error("data.source", load_prompts, str(tmp_path / name))


def test_parquet_without_rows(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"prompt": pa.array([], pa.string())}), tmp_path / "e.parquet")
    assert "empty" in raises_user_error("data.source", load_prompts, str(tmp_path / "e.parquet"))


def test_unreadable_and_unsupported_files(tmp_path):
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    raises_user_error("data.source", load_prompts, str(tmp_path / "bad.jsonl"))
    (tmp_path / "d.csv").write_text("prompt\nhi\n")
    assert ".csv" in raises_user_error("data.source", load_prompts, str(tmp_path / "d.csv"))


def test_hub_dataset_offline():
    msg = raises_user_error("data.source", load_prompts, "openai/gsm8k", subset="main")
    assert "openai/gsm8k" in msg and "'main'" in msg


# ---------------------------------------------------------------------------------------------- rewards


@pytest.mark.parametrize("wrap", [list, as_messages], ids=["str", "messages"])
def test_reward_values(wrap):
    c = wrap(["abc 123", "", "42", "1, 2, 3", "   "])
    assert digit_share(None, c) == [0.5, 0.0, 1.0, 0.6, 0.0]

    c = wrap(["The answer is 42.", "42 or 41", "so 1,234", "x = -5", "5-7", "7.0", "none", "72"])
    gold = ["42", "42", "#### 1,234", "-5", "7", "7", "3", "48/2 = 24\n#### 72"]
    assert answer_match(None, c, answer=gold) == [1.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0, 1.0]
    assert answer_match(None, wrap(["1", "1"]), answer=[None, "1"]) == [None, 1.0]

    c = wrap(
        [
            "<think>hmm</think> 42",
            "<think>hmm</think>  ",
            "42",
            "<think>a</think>b<think>c</think>d",
            "\n<think>\nmulti\nline\n</think>\nAnswer: 3",
            "<think></think>x",
            "think</think> 4",
        ]
    )
    assert format_think(None, c) == [1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0]

    assert length_penalty(None, wrap(["a" * 500, "", "xy"])) == [-0.5, 0.0, -0.002]


def test_answer_match_needs_answer_column():
    raises_user_error("answer", answer_match, None, ["1"])


def test_multi_turn_completion_uses_assistant_turns():
    completion = [
        {"role": "assistant", "content": "let me check", "tool_calls": []},
        {"role": "tool", "content": "99999"},
        {"role": "assistant", "content": [{"type": "text", "text": "12"}]},
    ]
    assert answer_match(None, [completion], answer=["12"]) == [1.0]
    assert digit_share(None, [completion]) == [2 / 12]


def test_rewards_accept_trl_call_convention():
    """TRL calls reward_func(prompts=, completions=, completion_ids=, **columns, trainer_state=, log_*=)."""
    ds = load_prompts("builtin:arithmetic", num_samples=2)
    rows = [ds[0], ds[0], ds[1], ds[1]]
    kwargs = {k: [r[k] for r in rows] for k in rows[0] if k not in ("prompt", "completion", "completion_ids")}
    kwargs.update(trainer_state=object(), log_extra=lambda *a: None, log_metric=lambda *a: None)
    completions = as_messages([rows[0]["answer"], "no", rows[2]["answer"], "<think>x</think>0"])
    for name in BUILTIN_REWARDS:
        fn = resolve_reward(name, key="rewards[0].name")
        out = fn(prompts=[r["prompt"] for r in rows], completions=completions, completion_ids=[[1]] * 4, **kwargs)
        assert len(out) == 4 and all(isinstance(x, float) for x in out), name
    assert answer_match(prompts=None, completions=completions, completion_ids=None, **kwargs) == [1.0, 0.0, 1.0, 0.0]


def _tiny_model_and_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(["<pad>", "<eos>", *"abcdefghijklmnopqrstuvwxyz0123456789 ?.,+-*=:<>/"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    config = LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=1,
    )
    return LlamaForCausalLM(config), tokenizer


def test_grpo_trainer_reward_path(tmp_path, monkeypatch):
    """A builtin task + resolved rewards go through GRPOTrainer's own reward computation (no training)."""
    from trl import GRPOConfig, GRPOTrainer
    from trl.data_utils import is_conversational

    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_reward.py").write_text(
        "def always_one(prompts, completions, **kwargs):\n    return [1.0 for _ in completions]\n"
    )
    ds = load_prompts("builtin:arithmetic", num_samples=4)
    assert is_conversational(ds[0])
    assert not is_conversational(load_prompts("builtin:digits", chat=False, num_samples=1)[0])
    names = ["digit_share", "answer_match", "my_reward.py:always_one"]
    funcs = [resolve_reward(n, key=f"rewards[{i}].name") for i, n in enumerate(names)]
    model, tokenizer = _tiny_model_and_tokenizer()
    args = GRPOConfig(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=2,
        num_generations=2,
        max_completion_length=4,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
    )
    trainer = GRPOTrainer(model=model, reward_funcs=funcs, args=args, train_dataset=ds, processing_class=tokenizer)
    assert trainer.reward_func_names == ["digit_share", "answer_match", "always_one"]

    inputs = [ds[0], ds[0], ds[1], ds[1]]
    completions = as_messages([inputs[0]["answer"], "abc", "a1", ""])
    rewards = trainer._calculate_rewards(inputs, [x["prompt"] for x in inputs], completions, [[5], [6], [7], []])
    assert rewards.tolist() == [[1.0, 1.0, 1.0], [0.0, 0.0, 1.0], [0.5, 0.0, 1.0], [0.0, 0.0, 1.0]]


# ---------------------------------------------------------------------------------------------- resolve_reward


def test_resolve_builtin():
    for name, fn in BUILTIN_REWARDS.items():
        assert resolve_reward(name, key="rewards[0].name") is fn
        assert fn.__name__ == name
    assert check_reward_spec(" digit_share ", key="rewards[0].name") is None


REWARD_MODULE = """
def shout(prompts, completions, **kwargs):
    return [float(len(c)) for c in completions]

class Scorer:
    def __call__(self, prompts, completions, **kwargs):
        return [2.0 for _ in completions]

scorer = Scorer()
THRESHOLD = 3

def strict(prompts, completions):
    return [0.0 for _ in completions]
"""


@pytest.fixture
def reward_module(tmp_path, monkeypatch):
    """An importable module `cr_test_rewards_mod` in tmp_path, removed from sys.modules afterwards."""
    (tmp_path / "cr_test_rewards_mod.py").write_text(REWARD_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "cr_test_rewards_mod", raising=False)
    yield "cr_test_rewards_mod"
    sys.modules.pop("cr_test_rewards_mod", None)


def test_resolve_module_function(reward_module):
    fn = resolve_reward(f"{reward_module}:shout", key="rewards[1].name")
    assert fn.__name__ == "shout"
    assert fn(prompts=None, completions=["ab", "abcd"], completion_ids=None, trainer_state=None) == [2.0, 4.0]
    inst = resolve_reward(f"{reward_module}:scorer", key="rewards[1].name")
    assert inst.__name__ == "scorer" and inst(None, ["x"]) == [2.0]
    check_reward_spec(f"{reward_module}:shout", key="rewards[1].name")


def test_resolve_file_function(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "rewards").mkdir()
    (tmp_path / "rewards" / "custom.py").write_text(REWARD_MODULE)
    fn = resolve_reward("rewards/custom.py:shout", key="rewards[2].name")
    assert fn.__name__ == "shout" and fn(None, ["abc"]) == [3.0]
    assert resolve_reward(f"{tmp_path}/rewards/custom.py:shout", key="k")(None, ["a"]) == [1.0]


def test_resolve_errors(tmp_path, monkeypatch, reward_module):
    key = "rewards[1].name"
    msg = raises_user_error(key, resolve_reward, "digit_shares", key=key)
    assert "did you mean 'digit_share'" in msg and "answer_match" in msg
    assert "No module named" in raises_user_error(key, resolve_reward, "no_such_module_xyz:fn", key=key)
    msg = raises_user_error(key, resolve_reward, f"{reward_module}:shuot", key=key)
    assert "did you mean 'shout'" in msg and "strict" in msg
    assert "not a function" in raises_user_error(key, resolve_reward, f"{reward_module}:THRESHOLD", key=key)
    assert "class" in raises_user_error(key, resolve_reward, f"{reward_module}:Scorer", key=key)
    assert "**kwargs" in raises_user_error(key, resolve_reward, f"{reward_module}:strict", key=key)
    raises_user_error(key, resolve_reward, f"{reward_module}:", key=key)
    raises_user_error(key, resolve_reward, "", key=key)

    monkeypatch.chdir(tmp_path)
    assert "not found" in raises_user_error(key, resolve_reward, "missing.py:fn", key=key)
    (tmp_path / "broken.py").write_text("def f(:\n")
    assert "SyntaxError" in raises_user_error(key, resolve_reward, "broken.py:f", key=key)
    (tmp_path / "boom.py").write_text("raise RuntimeError('bad\\nconfig')\n")
    assert "RuntimeError: bad config" in raises_user_error(key, resolve_reward, "boom.py:f", key=key)
    (tmp_path / "cr_test_boom_mod.py").write_text("import no_such_dependency_xyz\n")
    msg = raises_user_error(key, resolve_reward, "cr_test_boom_mod:f", key=key)
    assert "no_such_dependency_xyz" in msg
    sys.modules.pop("cr_test_boom_mod", None)
    raises_user_error(key, check_reward_spec, "missing.py:fn", key=key)


def test_math_verify_compares_answers_mathematically():
    completions = [
        "So the answer is \\boxed{\\frac{1}{2}}.",  # LaTeX fraction vs a decimal answer
        "<think>maybe it is 3</think> It is 0.5",  # the thought's 3 is left out
        "I get 41.",
        [{"role": "assistant", "content": "The total is 1,234."}],  # a chat completion; GSM8K answer below
        "anything",
    ]
    answers = ["0.5", "1/2", "42", "Adding them up.\n#### 1234", None]
    assert math_verify(None, completions, answer=answers) == [1.0, 1.0, 0.0, 1.0, None]
    assert reward_columns("math_verify") == ("answer",)
    message = raises_user_error("rewards", math_verify, None, ["42"])
    assert "math_verify needs an `answer` column" in message
