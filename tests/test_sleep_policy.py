"""`generation.sleep_level: auto` (colocate_rl/memory/autolayout.py `choose_sleep_level`, resolved in
colocate_rl/pipeline.py `resolve`): 0 when the estimate with vLLM awake through training fits the layout choice's
limit, else 2; 2 without vLLM on a GPU; explicit levels kept; the resolved level in the run-dir files, on resume, in
`validate`, `train --dry-run`, `mem-probe --estimate` and the measuring probe's pinned trials. Plan-level only: the
real run is tests/test_gpu.py::test_sleep_level_auto_runs_the_level_the_plan_chose."""

import json
from dataclasses import replace
from pathlib import Path

import pytest
import yaml
from conftest import CPU, H200_GIB, QWEN05, QWEN7_1GPU, write_recipe
from conftest import resolved as resolved_for
from typer.testing import CliRunner

from colocate_rl.cli import app
from colocate_rl.errors import UserError
from colocate_rl.launch.failures import OOM, advice
from colocate_rl.memory import autolayout as A
from colocate_rl.memory import probe as P
from colocate_rl.memory.bisect import TrialResult
from colocate_rl.memory.estimate import estimate
from colocate_rl.plan.host import Gpu, Host, assumed_host
from colocate_rl.plan.launch_plan import make_plan
from colocate_rl.recipe.load import parse_recipe

AUTO = "generation.sleep_level=auto"


def resolved(recipe: dict, gpus: int, gib: float, *sets: str):
    """The recipe on `gpus` GPUs of `gib`, the engine in the rank's process (overlap's engine process: test_overlap)."""
    return resolved_for(recipe, assumed_host(gpus, gib), "generation.overlap=off", *sets)


def plan_files(r, run_dir: Path) -> dict[str, str]:
    plan = make_plan(r, run_dir=run_dir, python="python", cwd=run_dir.parent, cache_dir=run_dir.parent, base_env={})
    return plan.files


def awake(r):
    """`r` with vLLM awake through training (sleep 0), nothing else changed."""
    return replace(r, recipe=A.with_sleep_level(r.recipe, 0))


def test_schema_default_is_auto_and_takes_the_levels():
    base = {k: v for k, v in QWEN05.items() if k != "generation"}
    assert parse_recipe(base).generation.sleep_level == "auto"
    for level in (0, 1, 2, "auto"):
        assert parse_recipe({**base, "generation": {"sleep_level": level}}).generation.sleep_level == level
    with pytest.raises(UserError, match="generation.sleep_level"):
        parse_recipe({**base, "generation": {"sleep_level": 3}})


def test_auto_is_0_when_trainer_and_vllm_fit_together():
    """0.5B layout, 1 H200, share 0.25: the trainer (DDP, ~18 GiB in training) and vLLM's 35 GiB fit together."""
    r = resolved(QWEN05, 1, H200_GIB, AUTO)
    choice = r.sleep_choice
    assert r.recipe.generation.sleep_level == 0 and choice.level == 0
    assert choice.limit_gib == pytest.approx(H200_GIB * (1 - A.LAYOUT_HEADROOM))
    assert choice.peak_gib == pytest.approx(estimate(awake(resolved(QWEN05, 1, H200_GIB)), H200_GIB).peak()[1])
    assert choice.peak_gib > 0.25 * H200_GIB  # vLLM's whole share is counted in training, not only in generation
    assert choice.line().startswith("generation.sleep_level auto: 0 — trainer and vLLM fit together (peak ")
    assert f"≤ {choice.limit_gib:.1f} GiB at sleep 0" in choice.line()


@pytest.mark.parametrize(
    "recipe, gpus, gib",
    [
        (QWEN05, 1, 20.0),  # the 0.5B layout fits a 20 GiB GPU only with vLLM asleep in training
        (QWEN7_1GPU, 1, 120.0),  # 7B layout on one 120 GiB GPU: even the offload layout auto picks needs sleep
    ],
)
def test_auto_is_2_when_sleep_0_would_not_fit(recipe, gpus, gib):
    r = resolved(recipe, gpus, gib, AUTO)
    choice = r.sleep_choice
    assert r.recipe.generation.sleep_level == 2 and choice.level == 2
    assert choice.peak_gib > choice.limit_gib == pytest.approx(gib * 0.9)
    assert choice.line().startswith("generation.sleep_level auto: 2 — at sleep 0 the peak would be ")


@pytest.mark.parametrize("gib", [12.0, 16.0, 20.0, 24.0, 28.0, 32.0, 48.0, 80.0, H200_GIB])
def test_auto_follows_the_rule_on_every_gpu_size(gib):
    """The choice is exactly: 0 iff the estimated peak at sleep 0 (for the layout chosen at sleep 2) is at most
    90 % of the GPU (the 0.5B layout with zero_stage and checkpointing auto, so the layout varies too)."""
    sets = ("distributed.zero_stage=auto", "trainer.gradient_checkpointing=auto")
    r = resolved(QWEN05, 1, gib, AUTO, *sets)
    fixed = resolved(QWEN05, 1, gib, "generation.sleep_level=2", *sets)
    assert r.layout_choice.chosen == fixed.layout_choice.chosen  # the layout is chosen as with sleep 2
    peak = estimate(awake(fixed), gib).peak()[1]
    assert r.recipe.generation.sleep_level == (0 if peak <= 0.9 * gib else 2)


def test_both_levels_occur_in_the_rule_table():
    levels = {resolved(QWEN05, 1, gib, AUTO).recipe.generation.sleep_level for gib in (12.0, 20.0, 80.0)}
    assert levels == {0, 2}


@pytest.mark.parametrize("level", [0, 1, 2])
@pytest.mark.parametrize("recipe, gib", [(QWEN05, H200_GIB), (QWEN7_1GPU, H200_GIB), (QWEN05, 20.0)])
def test_explicit_levels_are_kept(level, recipe, gib):
    r = resolved(recipe, 1, gib, f"generation.sleep_level={level}")
    assert r.recipe.generation.sleep_level == level and r.sleep_choice is None


@pytest.mark.parametrize(
    "host",
    [CPU, Host(gpus=(Gpu("H200", 140.0),), has_vllm=False, cpu_count=16)],
    ids=["cpu", "gpu-without-vllm"],
)
def test_without_vllm_on_a_gpu_auto_is_2(host):
    r = resolved_for(QWEN05, host, AUTO)
    assert r.backend == "transformers" and r.recipe.generation.sleep_level == 2
    assert r.sleep_choice.peak_gib is None
    assert "no vLLM on a GPU here (generation with transformers)" in r.sleep_choice.line()


def test_no_estimate_means_2(tmp_path):
    """A model whose layout the estimate refuses (here: TP that does not divide the heads of a local model)."""
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "model_type": "qwen2",
                "hidden_size": 896,
                "num_hidden_layers": 24,
                "num_attention_heads": 14,
                "num_key_value_heads": 2,
                "intermediate_size": 4864,
                "vocab_size": 151936,
            }
        )
    )
    sets = (AUTO, f"model.name={tmp_path}", "generation.tensor_parallel_size=4", "distributed.nproc_per_node=4")
    r = resolved(QWEN05, 4, H200_GIB, *sets)
    assert r.recipe.generation.sleep_level == 2
    assert "no estimate (generation.tensor_parallel_size: 4 does not divide" in r.sleep_choice.reason


@pytest.mark.parametrize("recipe, gib, level", [(QWEN05, H200_GIB, 0), (QWEN7_1GPU, 120.0, 2)])
def test_engine_trl_gets_0_or_2(recipe, gib, level, tmp_path):
    r = resolved(recipe, 1, gib, AUTO, "generation.engine=trl")
    assert r.recipe.generation.sleep_level == level
    launch = json.loads(plan_files(r, tmp_path / "run")["launch.json"])
    assert launch["engine"] is None and launch["trl_args"]["vllm_enable_sleep_mode"] is (level > 0)


def test_the_run_dir_files_hold_the_resolved_level(tmp_path):
    r = resolved(QWEN05, 1, H200_GIB, AUTO)
    files = plan_files(r, tmp_path / "run")
    assert yaml.safe_load(files["recipe.yaml"])["generation"]["sleep_level"] == 0  # what every rank reads
    launch = json.loads(files["launch.json"])
    assert launch["engine"]["sleep_level"] == 0 and launch["trl_args"]["vllm_enable_sleep_mode"] is False
    # an out-of-memory failure of that run is advised to turn sleep on (the advice reads the run dir's recipe)
    run_recipe = parse_recipe(yaml.safe_load(files["recipe.yaml"]))
    assert "turn on sleep mode (generation.sleep_level: 2)" in advice(OOM, run_recipe)
    slept = parse_recipe(yaml.safe_load(plan_files(resolved(QWEN05, 1, 20.0, AUTO), tmp_path / "r2")["recipe.yaml"]))
    assert "turn on sleep mode" not in advice(OOM, slept)


def test_resume_keeps_the_level_the_run_started_with(tmp_path):
    """Started on an H200 (auto → 0), resumed where auto would pick 2: the run keeps 0, and cannot be changed."""
    from colocate_rl.resume import plan_resume
    from colocate_rl.rundir import CHECKPOINT_COMPLETE, write_run_dir

    run_dir = tmp_path / "run"
    started = resolved(QWEN05, 1, H200_GIB, AUTO, "trainer.max_steps=4")
    write_run_dir(run_dir, plan_files(started, run_dir))
    (run_dir / "checkpoints" / "checkpoint-2").mkdir(parents=True)
    (run_dir / "checkpoints" / "checkpoint-2" / CHECKPOINT_COMPLETE).write_text("{}")
    assert resolved(QWEN05, 1, 20.0, AUTO).recipe.generation.sleep_level == 2
    kw = dict(host=assumed_host(1, 20.0), env={}, cwd=tmp_path)
    r, plan = plan_resume(run_dir, **kw)
    assert r.recipe.generation.sleep_level == 0 and r.sleep_choice is None
    assert yaml.safe_load(plan.files["recipe.yaml"])["generation"]["sleep_level"] == 0
    with pytest.raises(UserError, match="--set generation.sleep_level: a resumed run keeps"):
        plan_resume(run_dir, {"generation.sleep_level": "auto"}, **kw)


def test_validate_and_dry_run_print_the_choice(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    recipe = write_recipe(
        tmp_path / "r.yaml", {**QWEN05, "generation": {**QWEN05["generation"], "sleep_level": "auto"}}
    )
    runner = CliRunner()
    fits = runner.invoke(app, ["validate", str(recipe), "--gpus", "1", "--gpu-memory", "140.4"], env={"COLUMNS": "200"})
    assert fits.exit_code == 0, fits.output
    assert "sleep 0 (auto)" in fits.stdout
    assert "generation.sleep_level auto: 0 — trainer and vLLM fit together (peak " in fits.stdout
    small = runner.invoke(app, ["validate", str(recipe), "--gpus", "1", "--gpu-memory", "20"], env={"COLUMNS": "200"})
    assert small.exit_code == 0, small.output
    assert "sleep 2 (auto)" in small.stdout
    assert "generation.sleep_level auto: 2 — at sleep 0 the peak would be " in small.stdout
    assert "> 18.0 GiB (20.0 GiB less 10% margin)" in small.stdout
    pinned = runner.invoke(
        app, ["validate", str(recipe), "--gpus", "1", "--set", "generation.sleep_level=2"], env={"COLUMNS": "200"}
    )
    assert pinned.exit_code == 0 and "sleep_level auto" not in pinned.stdout
    assert "TP 1, sleep 2" in pinned.stdout and "(auto)" not in pinned.stdout
    run_dir = tmp_path / "run"
    dry = runner.invoke(
        app, ["train", str(recipe), "--dry-run", "--run-dir", str(run_dir), "--gpus", "1", "--gpu-memory", "140.4"]
    )
    assert dry.exit_code == 0, dry.output
    assert "# generation.sleep_level auto: 0 — trainer and vLLM fit together" in dry.stdout
    assert not run_dir.exists()  # a dry run writes nothing
    cpu = runner.invoke(app, ["train", str(recipe), "--dry-run", "--gpus", "0"])
    assert cpu.exit_code == 0, cpu.output
    assert "# generation.sleep_level auto: 2 — no vLLM on a GPU here" in cpu.stdout


def test_mem_probe_estimate_shows_the_choice(tmp_path):
    recipe = write_recipe(
        tmp_path / "r.yaml", {**QWEN05, "generation": {**QWEN05["generation"], "sleep_level": "auto"}}
    )
    args = ["mem-probe", str(recipe), "--estimate", "--gpus", "1", "--gpu-memory", "140.4"]
    runner = CliRunner()
    data = json.loads(runner.invoke(app, [*args, "--json"]).stdout)
    assert data["sleep_choice"]["level"] == 0 and data["sleep_choice"]["limit_gib"] == pytest.approx(140.4 * 0.9)
    assert data["sleep_choice"]["reason"].startswith("trainer and vLLM fit together")
    assert not any("sleep mode off would also fit" in n for n in data["recommendation"]["notes"])  # it is off
    text = runner.invoke(app, args, env={"COLUMNS": "200"}).stdout
    assert "sleep level 0" in text and "generation.sleep_level auto: 0 — trainer and vLLM fit together" in text
    explicit = json.loads(runner.invoke(app, [*args, "--json", "--set", "generation.sleep_level=2"]).stdout)
    assert explicit["sleep_choice"] is None


def test_measuring_probe_pins_and_checks_the_level(tmp_path, monkeypatch):
    """`mem-probe` on the GPUs (host and trials faked): every trial runs at the level auto chose at the recipe's
    share (at the trials' large shares auto would pick 2), `--write` pins it, and the best trial's peak, moved to the
    recipe's share, confirms 0 or names the fix."""
    from colocate_rl.plan import host

    monkeypatch.setattr(host, "detect_host", lambda: assumed_host(1, H200_GIB))
    assert resolved(QWEN05, 1, H200_GIB, AUTO, "generation.vllm_gpu_memory_utilization=0.8").sleep_choice.level == 2
    recipe = write_recipe(
        tmp_path / "r.yaml", {**QWEN05, "generation": {**QWEN05["generation"], "sleep_level": "auto"}}
    )
    levels = []

    def fake(training_gib):
        def run_trial(trial_plan, util, steps, timeout_s):
            level = yaml.safe_load(trial_plan.files["recipe.yaml"])["generation"]["sleep_level"]
            levels.append(level)
            ok = util <= 0.6
            peaks = {"generation": 10 + util * H200_GIB, "training": training_gib + util * H200_GIB}
            s = (1.0 if level == 0 else 1.2) if ok else None
            return TrialResult(
                util, "ok" if ok else "out of memory", 1.0, steps if ok else 0, "x", peaks=peaks, s_per_step=s
            )

        return run_trial

    monkeypatch.setattr(P, "run_trial", fake(20.0))
    out = tmp_path / "probed.yaml"
    args = ["mem-probe", str(recipe), "--steps", "2", "--probe-dir", str(tmp_path / "probe"), "--write", str(out)]
    result = CliRunner().invoke(app, args, env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert set(levels[:-2]) == {0} and levels[-2:] == [0, 2]  # the bisection at auto's level, then the sweep of both
    assert "every trial trains with what auto chose at the recipe's share (sleep level 0): --set " in result.stdout
    assert "sleep level (auto): sleep level 0 confirmed: measured peak 55.10 GiB" in result.stdout
    assert "sleep_level: 0" in out.read_text()
    r = resolved(QWEN05, 1, H200_GIB, AUTO)

    def resolve_with(extra):
        return resolved(QWEN05, 1, H200_GIB, AUTO, *(f"{k}={json.dumps(v)}" for k, v in extra.items()))

    monkeypatch.setattr(P, "run_trial", fake(100.0))
    bad = P.measure(P.plan_probe(r, H200_GIB, tmp_path / "probe2"), resolve_with, steps=2)
    check = bad.sleep_check
    assert check["confirmed"] is False and check["at_share"] == 0.25 and bad.to_json()["sleep_check"] == check
    assert check["measured_peak_gib"] == pytest.approx(100.0 + 0.25 * H200_GIB, abs=0.01)
    assert check["line"].endswith("set generation.sleep_level: 2")


def test_confirm_of_level_2_measures_nothing():
    ok, line = A.SleepChoice(2, "at sleep 0 the peak would be …", 150.0, 126.4).confirm(40.0)
    assert ok and line.startswith("sleep level 2, not measured at 0")
