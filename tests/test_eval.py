"""Held-out evaluation (the recipe's `eval:` section): schema and checks before launch, the held-out split, the
evaluation on a real TRL trainer (GRPO and RLOO, in process), the report's plots and one run through real torchrun."""

import json
from pathlib import Path

import pytest
from conftest import CPU, assert_user_error, cli, cli_here, write_recipe

from colocate_rl.errors import UserError
from colocate_rl.pipeline import resolve
from colocate_rl.prompts import builtin_rows, heldout_builtin_rows, load_eval_prompts, load_prompts
from colocate_rl.recipe.load import parse_recipe
from colocate_rl.recipe.schema import Recipe

REWARDS = [{"name": "digit_share"}]


def errors(**sections) -> list[str]:
    with pytest.raises(UserError) as info:
        resolve(parse_recipe({"rewards": REWARDS, **sections}), CPU)
    return info.value.lines


@pytest.fixture
def rows5(tmp_path) -> Path:
    path = tmp_path / "d5.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"p{i}", "answer": str(i)}) + "\n" for i in range(5)))
    return path


# ---------------------------------------------------------------------------------------------- schema and checks


def test_eval_is_off_by_default_and_defaults_are_documented_values():
    recipe = Recipe(rewards=REWARDS)
    assert recipe.eval.every_steps is None  # default runs are unchanged
    assert (recipe.eval.source, recipe.eval.split, recipe.eval.num_samples, recipe.eval.temperature) == (
        None,
        "test",
        64,
        0.0,
    )
    resolve(parse_recipe({"rewards": REWARDS, "eval": {"every_steps": 10}}), CPU)  # the defaults validate


@pytest.mark.parametrize(
    "section, line",
    [
        ({"every_steps": 2.0}, "eval.every_steps: input should be a valid integer"),
        ({"every_steps": 0}, "eval.every_steps: input should be greater than 0"),
        ({"every_steps": 2, "temperature": -1}, "eval.temperature: input should be greater than or equal to 0"),
        ({"every_steps": 2, "num_samples": 0}, "eval.num_samples: input should be greater than 0"),
        ({"every_steps": 2, "num_sample": 3}, "eval.num_sample: unknown key; did you mean 'num_samples'?"),
    ],
)
def test_schema_errors_name_the_eval_key(section, line):
    assert errors(eval=section)[0].startswith(line)


def test_checks_before_launch(rows5, tmp_path):
    assert errors(eval={"every_steps": 200}) == [
        "eval.every_steps: 200 is more than trainer.max_steps (100). Fix: set at most 100 (evaluation also runs "
        "after the last step)."
    ]
    assert errors(eval={"every_steps": 2, "source": "builtin:digits"})[0].startswith(
        "eval.source: is data.source, so evaluation would score prompts training uses."
    )
    assert errors(data={"source": "openai/gsm8k", "split": "test"}, eval={"every_steps": 2})[0].startswith(
        "eval.split: 'test' is data.split"
    )
    # a local file: its last eval.num_samples rows are held out, training keeps the rest
    assert errors(data={"source": str(rows5)}, eval={"every_steps": 2, "num_samples": 5})[0].startswith(
        f"eval.num_samples: the last 5 rows of '{rows5}' are held out for evaluation, which leaves none of its 5 rows"
    )
    assert errors(data={"source": str(rows5), "num_samples": 4}, eval={"every_steps": 2, "num_samples": 2}) == [
        f"data.num_samples: 4 but '{rows5}' has 5 rows and its last 2 are held out for evaluation (eval.num_samples)."
        " Fix: set it to at most 3, or lower eval.num_samples."
    ]
    assert errors(eval={"every_steps": 2, "num_samples": 20000}) == [
        "eval.num_samples: 20000 prompts of builtin:digits. Fix: use at most 10000."
    ]
    assert errors(eval={"every_steps": 2, "source": "builtin:digit"})[0].startswith(
        "eval.source: unknown built-in task 'digit' (did you mean 'digits'?)"
    )
    # an explicit eval.source is checked as data.source is: file, prompt column, rows, the rewards' columns
    assert errors(eval={"every_steps": 2, "source": str(tmp_path / "missing.jsonl")})[0].startswith(
        f"eval.source: file '{tmp_path / 'missing.jsonl'}' not found"
    )
    two = tmp_path / "two.jsonl"
    two.write_text('{"prompt": "q"}\n{"prompt": "r"}\n')
    assert errors(eval={"every_steps": 2, "source": str(two)}) == [
        f"eval.num_samples: 64 but '{two}' has 2 rows. Fix: set it to at most 2, or add rows."
    ]
    arithmetic = {"rewards": [{"name": "answer_match"}], "data": {"source": "builtin:arithmetic"}}
    with pytest.raises(UserError) as info:
        resolve(parse_recipe({**arithmetic, "eval": {"every_steps": 2, "source": str(two), "num_samples": 2}}), CPU)
    assert info.value.lines == [
        f"eval.source: '{two}' has no column answer, which rewards[0].name answer_match needs (it has prompt). "
        "Fix: evaluate on prompts with that column."
    ]
    # every check passes: another built-in task, a file's held-out rows
    resolve(parse_recipe({"rewards": REWARDS, "eval": {"every_steps": 2, "source": "builtin:arithmetic"}}), CPU)
    held_out = {"every_steps": 2, "num_samples": 2}
    resolve(parse_recipe({"rewards": REWARDS, "data": {"source": str(rows5)}, "eval": held_out}), CPU)


def test_trl_eval_options_point_at_the_eval_section():
    from colocate_rl.plan.trl_args import EVALUATION_FIELDS, trl_field_names

    assert {"per_device_eval_batch_size", "num_generations_eval", "eval_strategy"} <= EVALUATION_FIELDS
    assert EVALUATION_FIELDS <= trl_field_names("grpo") & trl_field_names("rloo")
    lines = errors(trainer={"extra_args": {"per_device_eval_batch_size": 4}})
    assert lines == [
        "trainer.extra_args.per_device_eval_batch_size: TRL's own evaluation is not used; remove it and evaluate "
        "with the recipe's eval section (eval.every_steps, eval.num_samples, eval.temperature, eval.source)"
    ]


def test_validate_refuses_a_bad_eval_section_in_one_line(tmp_path):
    recipe = write_recipe(tmp_path / "r.yaml", {"rewards": REWARDS, "eval": {"every_steps": 2, "source": "x.jsonl"}})
    assert_user_error(cli_here("validate", recipe), "eval.source: file", one_line=True)


# ---------------------------------------------------------------------------------------------- the held-out split


def test_builtin_heldout_prompts_are_disjoint_from_training(monkeypatch):
    for task, train_rows in (("digits", 512), ("digits", 3000), ("arithmetic", 512)):
        training = {r["prompt"] for r in builtin_rows(task, train_rows, 7)}
        options = dict(train_source=f"builtin:{task}", num_samples=200, seed=7, train_num_samples=train_rows)
        heldout = load_eval_prompts(None, chat=False, **options)["prompt"]
        assert len(heldout) == len(set(heldout)) == 200 and not training & set(heldout)
        assert heldout == load_eval_prompts(None, chat=False, **options)["prompt"]  # the same at every evaluation
    assert (
        "answer" in load_eval_prompts("builtin:arithmetic", train_source="builtin:digits", num_samples=3).column_names
    )
    # the task has 17,738 distinct prompts (2,000,000 draws, 15 s); 100,000 draws find 14,557 in 0.7 s
    monkeypatch.setattr("colocate_rl.prompts.HELDOUT_DRAWS_PER_ROW", 5)
    with pytest.raises(UserError, match=r"^eval.num_samples: 20000 held-out prompts of builtin:digits, but only"):
        heldout_builtin_rows("digits", 20000, 0)


def test_a_local_file_holds_out_its_last_rows(rows5):
    train = load_prompts(str(rows5), chat=False, held_out=2)
    heldout = load_eval_prompts(None, train_source=str(rows5), num_samples=2, chat=False)
    assert train["prompt"] == ["p0", "p1", "p2"] and heldout["prompt"] == ["p3", "p4"]
    assert heldout["answer"] == ["3", "4"]  # every column reaches the rewards
    assert load_prompts(str(rows5), chat=False, held_out=2, num_samples=2)["prompt"] == ["p0", "p1"]
    # an explicit eval.source: its first rows, in TRL's chat format
    explicit = load_eval_prompts(str(rows5), train_source="builtin:digits", num_samples=2, system_prompt="Be brief.")
    assert explicit["prompt"][0] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "p0"}]
    with pytest.raises(UserError, match=r"^eval.num_samples: its last 5 rows of .* leaves none of its 5 rows"):
        load_prompts(str(rows5), held_out=5)
    with pytest.raises(UserError, match=r"^eval.source: file '.*missing.jsonl' not found"):
        load_eval_prompts(str(rows5.parent / "missing.jsonl"), train_source="builtin:digits")


def test_metric_names_are_unique_and_leave_the_sum_its_own_key():
    from colocate_rl.rank.evaluation import metric_names

    assert metric_names(["digit_share", "score", "score", "reward"]) == [
        "eval/digit_share",
        "eval/score_1",
        "eval/score_2",
        "eval/reward_3",
    ]


# ---------------------------------------------------------------------------------------------- on a real trainer


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from colocate_rl.builtin_model import build_model

    return build_model("tiny", tmp_path_factory.mktemp("model") / "tiny", seed=0)


@pytest.mark.parametrize("algorithm", ["grpo", "rloo"])
def test_evaluate_on_a_real_trainer(tiny, tmp_path, algorithm):
    """One process, CPU, colocate-rl's trainer generating through the transformers engine: greedy is repeatable, the
    weighted sum is TRL's, the training metrics and token count are untouched, and the generation config is left as
    it was."""
    import torch
    import trl

    from colocate_rl.builtin_model import load_tokenizer
    from colocate_rl.rank.adapter import engine_trainer
    from colocate_rl.rank.evaluation import evaluate
    from colocate_rl.rank.hf_engine import transformers_engine
    from colocate_rl.rewards import resolve_reward

    Config, Trainer = (trl.GRPOConfig, trl.GRPOTrainer) if algorithm == "grpo" else (trl.RLOOConfig, trl.RLOOTrainer)
    config = Config(
        output_dir=str(tmp_path),
        use_cpu=True,
        bf16=False,
        report_to="none",
        per_device_train_batch_size=2,
        num_generations=2,
        max_completion_length=8,
        reward_weights=[1.0, 0.5],
        max_steps=1,
    )
    rewards = [resolve_reward("digit_share", key="r"), resolve_reward("length_penalty", key="r")]
    dataset = load_eval_prompts(None, train_source="builtin:digits", num_samples=5)
    trainer = engine_trainer(Trainer)(
        model=str(tiny),
        reward_funcs=rewards,
        args=config,
        train_dataset=dataset,
        processing_class=load_tokenizer(tiny),
        engine_factory=transformers_engine,
    )
    saved = trainer.generation_config
    trainer.model.train()  # as between two training steps
    torch.manual_seed(1)
    first = evaluate(trainer, dataset, 0.0)
    torch.manual_seed(2)
    again = evaluate(trainer, dataset, 0.0)
    assert first.pop("time/eval_s") > 0 and again.pop("time/eval_s") > 0
    assert first == again  # greedy: whatever the random state
    assert set(first) == {"eval/digit_share", "eval/length_penalty", "eval/reward", "eval/completion_length"}
    assert first["eval/reward"] == pytest.approx(first["eval/digit_share"] + 0.5 * first["eval/length_penalty"])
    assert 0 < first["eval/completion_length"] <= 8
    assert trainer.generation_config is saved and saved.do_sample  # sampling again after the evaluation
    assert trainer.model.training and not trainer._metrics["train"] and not trainer._metrics["eval"]
    assert trainer.state.num_input_tokens_seen == 0
    torch.manual_seed(1)
    state = torch.get_rng_state()
    sampled = evaluate(trainer, dataset, 1.0)
    assert torch.equal(torch.get_rng_state(), state)  # training's sampling goes on as without the evaluation
    torch.manual_seed(2)
    resampled = evaluate(trainer, dataset, 1.0)
    assert sampled.pop("time/eval_s") > 0 and resampled.pop("time/eval_s") > 0
    assert sampled != resampled and set(sampled) == set(first)  # sampled at temperature 1


@pytest.mark.parametrize(
    ("before_training", "start_step", "want"),
    [(True, 0, [0, 2, 4]), (False, 0, [2, 4]), (True, 2, [4])],  # a resumed run (start past 0) has its baseline
)
def test_evaluations_are_scheduled_before_training_and_every_n_steps(monkeypatch, before_training, start_step, want):
    """When the callback evaluates; `evaluate` and transformers' `Trainer.log` are replaced by recorders (what they
    do is tested on a real trainer above and through torchrun below)."""
    from transformers import Trainer, TrainerControl, TrainerState

    import colocate_rl.rank.evaluation as E

    recipe = parse_recipe(
        {
            "rewards": REWARDS,
            "eval": {"every_steps": 2, "before_training": before_training},
            "trainer": {"max_steps": 4},
        }
    )
    logged = []
    monkeypatch.setattr(E, "evaluate", lambda trainer, dataset, temperature: {"eval/reward": 0.5})
    monkeypatch.setattr(Trainer, "log", lambda self, logs: logged.append(state.global_step))
    callback = E.make_eval_callback(recipe)
    callback.trainer = type("T", (), {"control": TrainerControl()})()
    state, control = TrainerState(global_step=start_step, max_steps=4), TrainerControl()
    callback.on_train_begin(None, state, control)
    while state.global_step < 4:
        state.global_step += 1
        callback.on_step_end(None, state, control)
    assert logged == want


# ---------------------------------------------------------------------------------------------- report


def test_report_plots_the_held_out_curves(tmp_path):
    from rich.console import Console

    from colocate_rl.telemetry.report import load_run, report

    run = tmp_path / "run"
    run.mkdir()
    records = [{"step": s, "max_steps": 4, "wall_s": s, "reward": 0.1 * s} for s in (1, 2, 3, 4)]
    records += [{"step": s, "eval/reward": 0.2 * s, "eval/digit_share": 0.2 * s} for s in (2, 4)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert [r["step"] for r in load_run(run).steps] == [1, 2, 3, 4]  # evaluations are not training steps
    assert [r["step"] for r in load_run(run).evals] == [2, 4]
    console = Console(record=True, width=200)
    written = report([run], console=console)
    assert run / "eval.png" in written and (run / "eval.png").stat().st_size > 10_000
    assert "eval reward (last eval)" in console.export_text()


# ---------------------------------------------------------------------------------------------- end to end


@pytest.mark.slow
def test_eval_records_through_torchrun(tmp_path):
    """Quickstart (2 ranks, ZeRO-3, CPU) for 4 steps, evaluating before training and every 2 steps on 3 held-out
    prompts (the second rank's share padded): eval records at steps 0, 2 and 4, every training step still logged."""
    run_dir = tmp_path / "run"
    sets = [
        "trainer.max_steps=4",
        "eval.every_steps=2",
        "eval.num_samples=3",
        "rewards=[{name: digit_share}, {name: length_penalty, weight: 0.5}]",
    ]
    result = cli(
        "train", "recipes/quickstart.yaml", "--run-dir", run_dir, *[a for s in sets for a in ("--set", s)], timeout=900
    )
    assert result.returncode == 0, result.stdout[-3000:] + (run_dir / "train.log").read_text()[-5000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if "eval/reward" in r]
    assert [r["step"] for r in evals] == [0, 2, 4]  # step 0: before training (eval.before_training)
    assert [r["step"] for r in records if "reward" in r] == [1, 2, 3, 4]
    assert records[0]["step"] == 0 and "eval/reward" in records[0]  # the baseline comes first
    for r in evals:
        assert r["eval/reward"] == pytest.approx(r["eval/digit_share"] + 0.5 * r["eval/length_penalty"], abs=2e-6)
        assert r["eval/length_penalty"] < 0 and 0 < r["eval/completion_length"] <= 16 and r["time/eval_s"] > 0
    assert "eval at step 0/4  eval/reward" in result.stdout and "eval at step 2/4  eval/reward" in result.stdout
