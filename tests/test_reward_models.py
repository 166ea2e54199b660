"""Reward models (`rewards: [{model: DIR_OR_HUB_ID}]`): the schema, the checks before launch, the memory estimate and
a real run on CPU with a tiny local classifier; and the guide's custom reward that reads a dataset column."""

import json
import re
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import CPU, GPU8, QWEN05, ROOT, assert_user_error, cli, cli_here, resolved, write_recipe

from colocate_rl.builtin_model import build_model
from colocate_rl.errors import UserError
from colocate_rl.memory.estimate import GIB, estimate
from colocate_rl.plan.launch_plan import rank_env
from colocate_rl.plan.trl_args import trl_args
from colocate_rl.recipe.load import parse_recipe
from colocate_rl.recipe.shipped import find_recipe

CLASSIFIER_PARAMS = 107_136  # the tiny decoder without its tied LM head (107,072) + a 64 × 1 score head


@pytest.fixture(scope="module")
def tiny_policy(tmp_path_factory) -> Path:
    return build_model("tiny", tmp_path_factory.mktemp("policy") / "tiny")


@pytest.fixture(scope="module")
def classifier(tiny_policy, tmp_path_factory) -> Path:
    """A tiny reward model, as one is made from a causal LM: the built-in tiny model's decoder with a one-label
    score head (random init, seeded), saved with the model's tokenizer (chat template included)."""
    import torch
    from transformers import AutoModelForSequenceClassification

    out = tmp_path_factory.mktemp("reward") / "tiny-rm"
    torch.manual_seed(0)
    AutoModelForSequenceClassification.from_pretrained(str(tiny_policy), num_labels=1).save_pretrained(str(out))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_policy / name, out / name)
    return out


def with_reward_model(path, weight: float = 0.5) -> str:
    return f"rewards=[{{name: digit_share}}, {{model: '{path}', weight: {weight}}}]"


def quickstart(host, *sets: str):
    return resolved(find_recipe("quickstart"), host, *sets)


# ------------------------------------------------------------------------------------------------ the schema


@pytest.mark.parametrize(
    "reward, line",
    [
        (
            {"name": "digit_share", "model": "./rm"},
            "rewards[1]: has both name and model; give one per list item: name (a reward function) or model "
            "(a reward model)",
        ),
        (
            {"weight": 2.0},
            "rewards[1]: has neither name nor model; give one per list item: name (a reward function) or model "
            "(a reward model)",
        ),
    ],
)
def test_a_reward_is_a_function_or_a_model(reward, line):
    with pytest.raises(UserError) as e:
        parse_recipe({"rewards": [{"name": "digit_share"}, reward]})
    assert e.value.lines == [line]
    spec = parse_recipe({"rewards": [{"model": "org/rm", "weight": 0.5}]}).rewards[0]
    assert (spec.name, spec.model, spec.weight) == (None, "org/rm", 0.5)


# ------------------------------------------------------------------------------------------ checks and the plan


def test_a_reward_model_validates_and_its_weight_reaches_trl(classifier, tmp_path):
    r = quickstart(CPU, with_reward_model(classifier))
    args = trl_args(r, tmp_path)
    assert args["reward_weights"] == [1.0, 0.5]
    assert rank_env(r, {}, tmp_path)["HF_HUB_OFFLINE"] == "1"  # a built-in policy and a local reward model
    hub = parse_recipe({"rewards": [{"model": "org/reward-model"}]})
    assert "HF_HUB_OFFLINE" not in rank_env(replace(r, recipe=hub), {}, tmp_path)  # the ranks download it


def two_labels(classifier: Path, _policy: Path, tmp: Path) -> Path:
    out = shutil.copytree(classifier, tmp / "two-labels")
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "id2label": {"0": "bad", "1": "good"}}))
    return out


def no_tokenizer(classifier: Path, _policy: Path, tmp: Path) -> Path:
    out = shutil.copytree(classifier, tmp / "no-tokenizer")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (out / name).unlink()
    return out


def no_chat_template(classifier: Path, _policy: Path, tmp: Path) -> Path:
    out = shutil.copytree(classifier, tmp / "no-template")
    config = json.loads((out / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "chat_template"}))
    return out


@pytest.mark.parametrize(
    "make, fragment",
    [
        (lambda c, p, t: p, "is not a sequence-classification model (its config names Qwen2ForCausalLM); TRL scores"),
        (two_labels, "has 2 labels; TRL reads one score per completion (num_labels 1)"),
        (no_tokenizer, "has no tokenizer (tokenizer.json, tokenizer_config.json)"),
        (no_chat_template, "has no chat template and data.chat is true"),
        (lambda c, p, t: t / "missing", "is not a model directory (no config.json)"),
        (lambda c, p, t: t / "rm.gguf", "is a GGUF file"),
        (lambda c, p, t: "builtin:tiny", "the built-in models are causal LMs, not reward models"),
        (lambda c, p, t: "org/reward-model", "the config of 'org/reward-model' could not be fetched (HF_HUB_OFFLINE"),
    ],
)
def test_reward_model_problems_are_one_line_before_launch(
    classifier, tiny_policy, tmp_path, monkeypatch, make, fragment
):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # a hub id: no connection, as in CI
    path = make(classifier, tiny_policy, tmp_path)
    with pytest.raises(UserError) as e:
        quickstart(CPU, with_reward_model(path))
    assert len(e.value.lines) == 1 and e.value.lines[0].startswith("rewards[1].model: ")
    assert fragment in e.value.lines[0]


def test_no_chat_template_is_fine_for_text_prompts(classifier, tmp_path):
    quickstart(CPU, with_reward_model(no_chat_template(classifier, None, tmp_path)), "data.chat=false")


def test_validate_names_the_reward_model_and_exits_2(tiny_policy, tmp_path):
    recipe = write_recipe(tmp_path / "r.yaml", {"rewards": [{"model": str(tiny_policy)}]})
    assert_user_error(
        cli_here("validate", recipe), "rewards[0].model: ", "not a sequence-classification", one_line=True
    )


# ------------------------------------------------------------------------------------------ the memory estimate


def test_estimate_holds_the_reward_model_on_every_rank(classifier):
    ddp = estimate(resolved(QWEN05, GPU8, with_reward_model(classifier), "distributed.nproc_per_node=1"), 141)
    assert ddp.terms["reward models"] == {p: 2 * CLASSIFIER_PARAMS / GIB for p in ddp.terms["trainer weights"]}
    assert f"rewards[1].model {classifier}: {CLASSIFIER_PARAMS:,} parameters on every rank" in ddp.notes
    zero3 = estimate(resolved(QWEN05, GPU8, with_reward_model(classifier), "distributed.deepspeed=zero3"), 141)
    assert zero3.terms["reward models"]["generation"] == 2 * CLASSIFIER_PARAMS / 8 / GIB  # sharded over 8 ranks
    sets = (with_reward_model(classifier), "distributed.deepspeed=zero3", "distributed.offload_params=true")
    assert "reward models" not in estimate(resolved(QWEN05, GPU8, *sets), 141).terms  # on CPU with the params
    plain = estimate(resolved(QWEN05, GPU8, "distributed.nproc_per_node=1"), 141)
    assert ddp.total("training") == pytest.approx(plain.total("training") + 2 * CLASSIFIER_PARAMS / GIB)


def test_mem_probe_estimate_shows_the_reward_models_row(classifier, tmp_path):
    recipe = write_recipe(tmp_path / "r.yaml", QWEN05)
    result = cli_here(
        "mem-probe", recipe, "--estimate", "--gpus", "1", "--gpu-memory", "80", "--set", with_reward_model(classifier)
    )
    assert result.returncode == 0, result.stderr
    assert re.search(r"reward models\W+0\.00", result.stdout), result.stdout  # whatever border rich draws
    assert f"{CLASSIFIER_PARAMS:,} parameters on every rank" in result.stdout


# ----------------------------------------------------------------------- the guide's reward with a dataset column


def guide_reward_file(tmp_path: Path) -> Path:
    """The `answer_reward.py` example of docs/guide/recipes.md, written out as a user would save it."""
    guide = (ROOT / "docs" / "guide" / "recipes.md").read_text()
    code = re.search(r"```python\n(# answer_reward\.py.*?)```", guide, re.DOTALL).group(1)
    path = tmp_path / "answer_reward.py"
    path.write_text(code)
    return path


def test_the_guides_reward_reads_the_answer_column(tmp_path):
    path = guide_reward_file(tmp_path)
    sets = (f"rewards=[{{name: '{path}:answer_on_last_line'}}]",)
    quickstart(CPU, *sets, "data.source=builtin:arithmetic")  # called on the sample's rows with their answers
    with pytest.raises(UserError) as e:
        quickstart(CPU, *sets)  # builtin:digits has no answer column
    assert e.value.lines[0].startswith(f"rewards[0].name: reward '{path}:answer_on_last_line' raised TypeError")
    assert "missing 1 required positional argument: 'answer'" in e.value.lines[0]
    assert e.value.lines[0].endswith(
        "builtin:digits has none besides the prompt: use data with that column, or rename the parameter."
    )
    namespace: dict = {}
    exec(path.read_text(), namespace)
    completions = [[{"role": "assistant", "content": "12 + 30\n= 42"}], [{"role": "assistant", "content": "41"}]]
    assert namespace["answer_on_last_line"](["q", "q"], completions, answer=["42", "42"]) == [1.0, 0.0]


# ---------------------------------------------------------------------------------- end to end: real torchrun


@pytest.mark.slow
def test_a_run_with_a_reward_model_logs_it_and_sums_the_weighted_rewards(classifier, tmp_path):
    run_dir = tmp_path / "run"
    result = cli(
        "train",
        "recipes/quickstart.yaml",
        *("--set", with_reward_model(classifier), "--set", "trainer.max_steps=3", "--run-dir", run_dir),
        timeout=900,
    )
    assert result.returncode == 0, result.stdout[-3000:] + (run_dir / "train.log").read_text()[-5000:]
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in steps if "reward" in r]
    assert len(steps) == 3
    for r in steps:  # TRL's weighted sum: digit_share × 1 + the classifier's logit × 0.5
        assert r["rewards/tiny-rm/mean"] != 0
        assert r["reward"] == pytest.approx(r["rewards/digit_share/mean"] + 0.5 * r["rewards/tiny-rm/mean"], abs=1e-5)
    assert json.loads((run_dir / "DONE").read_text())["global_step"] == 3
