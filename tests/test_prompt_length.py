"""The data's longest prompt in tokens (colocate_rl/prompt_length.py), measured in the pre-flight with the local
model's own tokenizer, and the memory estimate sizing its sequences with it."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import QWEN05, resolved
from transformers import AutoTokenizer

from colocate_rl import prompt_length as P
from colocate_rl.builtin_model import build_model
from colocate_rl.memory.estimate import estimate
from colocate_rl.plan.host import Gpu, Host

H200 = Host(gpus=(Gpu("NVIDIA H200", 140.0),), has_vllm=True, cpu_count=16)
SYSTEM = "Answer with a number."
QUESTIONS = [("word " * n).strip() + "?" for n in (3, 40, 7, 25, 1)]  # the longest: row 1


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model("tiny", tmp_path_factory.mktemp("m") / "tiny")


def recipe(model_dir, data, *sets):
    base = {
        "algorithm": "grpo",
        "model": {"name": str(model_dir)},
        "data": {"source": str(data), "prompt_field": "question", "system_prompt": SYSTEM},
        "rewards": [{"name": "digit_share"}],
        "trainer": {"max_completion_length": 64, "per_device_train_batch_size": 8, "num_generations": 4},
        "generation": {"max_model_length": 1024},
    }
    return resolved(base, H200, *sets)


def rendered_tokens(model_dir, question: str) -> int:
    """The prompt as TRL tokenizes one: the chat template applied with the generation prompt, tokenized with it."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    return len(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"])


@pytest.mark.parametrize("form", ["jsonl", "json"])
def test_the_longest_prompt_is_measured_with_the_models_chat_template(model_dir, tmp_path, form):
    data = tmp_path / f"d.{form}"
    rows = [{"question": q} for q in QUESTIONS]
    data.write_text("\n".join(map(json.dumps, rows)) if form == "jsonl" else json.dumps(rows))
    r = recipe(model_dir, data)
    longest = r.preflight.longest_prompt
    assert longest == P.LongestPrompt(rendered_tokens(model_dir, QUESTIONS[1]), 5, True)
    assert longest.tokens > rendered_tokens(model_dir, QUESTIONS[3]) > 40  # words, the template and system prompt
    kv = estimate(r, 140.0).kv
    assert kv["prompt_tokens"] == longest.tokens  # not max_model_length less the completion (960)
    assert estimate(r, 140.0, prompt_tokens=300).kv["prompt_tokens"] == 300  # --prompt-tokens still decides


def test_of_many_rows_the_longest_by_characters_are_tokenized(model_dir, tmp_path, monkeypatch):
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(json.dumps({"question": q}) for q in QUESTIONS))
    monkeypatch.setattr(P, "TOKENIZED", 2)
    assert recipe(model_dir, data).preflight.longest_prompt.tokens == rendered_tokens(model_dir, QUESTIONS[1])
    monkeypatch.setattr(P, "MAX_ROWS", 3)
    first3 = recipe(model_dir, data).preflight.longest_prompt
    assert first3.rows == 3 and not first3.complete and "the first 3 rows" in first3.line(str(data))
    assert recipe(model_dir, data, "data.num_samples=3").preflight.longest_prompt.complete  # what training reads


@pytest.mark.parametrize(
    ("sets", "why"),
    [
        (("model.chat_template=tpl.jinja",), "another template renders the prompts"),
        (("data.source=org/some-dataset",), "a hub dataset is not opened before launch"),
    ],
)
def test_where_it_cannot_be_measured_here_the_estimate_keeps_its_assumption(model_dir, tmp_path, sets, why):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"question": "q?"}))
    (tmp_path / "tpl.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    r = recipe(model_dir, data, *(s.replace("tpl.jinja", str(tmp_path / "tpl.jinja")) for s in sets))
    assert r.preflight.longest_prompt is None, why
    assert estimate(r, 140.0).kv["prompt_tokens"] == 1024 - 64


def test_a_builtin_models_prompts_are_measured_with_the_tokenizer_its_build_trains(model_dir, tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(json.dumps({"question": q}) for q in QUESTIONS))
    r = recipe(model_dir, data, "model.name=builtin:tiny")  # nothing built: the pre-flight trains the tokenizer
    assert r.preflight.longest_prompt == P.LongestPrompt(rendered_tokens(model_dir, QUESTIONS[1]), 5, True)


@pytest.mark.parametrize("layout", ["tiny", "tiny-calc"])
def test_a_builtin_layouts_tokens_without_transformers_are_transformers_own(layout, tmp_path):
    """The pre-flight counts a built-in model's prompt tokens with `tokenizers` and jinja2 (transformers' import
    takes over a second); the counts equal transformers' on the tokenizer the build writes, chat template and all."""
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX as TRANSFORMERS_REGEX

    from colocate_rl.builtin_model import PRETOKENIZE_REGEX, _train_tokenizer

    assert PRETOKENIZE_REGEX == TRANSFORMERS_REGEX
    _train_tokenizer(tmp_path, 2048, layout)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    chats = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}] for q in QUESTIONS]
    texts = tokenizer.apply_chat_template(chats, add_generation_prompt=True, tokenize=False)
    assert P._builtin_ids(layout, chats, True) == tokenizer(texts, add_special_tokens=False)["input_ids"]
    assert P._builtin_ids(layout, QUESTIONS, False) == tokenizer(QUESTIONS)["input_ids"]


def test_the_preflight_measures_a_builtin_models_prompts_without_importing_transformers():
    code = (
        "import sys; from colocate_rl.pipeline import resolve; from colocate_rl.plan.host import assumed_host;"
        "from colocate_rl.recipe.load import parse_recipe;"
        f"r = resolve(parse_recipe({QWEN05!r}), assumed_host(1, 140.0));"
        "print(r.preflight.longest_prompt.tokens, 'transformers' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=Path(__file__).parent)
    assert done.stdout.split() == ["40", "False"], done.stderr


def test_a_builtin_task_and_a_parquet_file_are_measured_too(model_dir, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    task = recipe(model_dir, "builtin:arithmetic", "data.prompt_field=prompt", "data.num_samples=100")
    longest = task.preflight.longest_prompt
    assert (longest.rows, longest.complete) == (100, True) and longest.tokens > 10
    table = tmp_path / "d.parquet"
    pq.write_table(pa.table({"question": QUESTIONS}), table)
    assert recipe(model_dir, table).preflight.longest_prompt == P.LongestPrompt(
        rendered_tokens(model_dir, QUESTIONS[1]), 5, True
    )
