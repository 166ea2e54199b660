"""`trainer.micro_batch_size`: a rank's step split into fewer, larger micro-batches; `auto` from the estimate.

The step (per_device_train_batch_size × gradient_accumulation_steps completions per rank) and the generation batch
stay; what TRL gets as per_device_train_batch_size / gradient_accumulation_steps changes, and the run directory's
recipe.yaml holds it."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import yaml
from conftest import CPU, H200_GIB, QWEN05, ROOT, import_benchmark, write_recipe
from conftest import resolved as resolved_for
from typer.testing import CliRunner

from colocate_rl.cli import app
from colocate_rl.errors import UserError
from colocate_rl.memory import forecast as fc
from colocate_rl.memory import micro_batch as M
from colocate_rl.memory.autolayout import LAYOUT_HEADROOM
from colocate_rl.memory.estimate import estimate
from colocate_rl.pipeline import resolve
from colocate_rl.plan.host import assumed_host
from colocate_rl.plan.launch_plan import make_plan
from colocate_rl.plan.preflight import preflight
from colocate_rl.prompt_length import LongestPrompt
from colocate_rl.recipe.load import apply_overrides, parse_recipe, parse_sets, read_yaml
from colocate_rl.recipe.shipped import find_recipe

# QWEN05 with a step of 64 completions per rank in micro-batches of 8 (8 accumulation steps)
STEP64 = ("trainer.per_device_train_batch_size=8", "trainer.gradient_accumulation_steps=8")
AUTO = "trainer.micro_batch_size=auto"


def resolved(gib: float, *sets: str):
    return resolved_for(QWEN05, assumed_host(1, gib), *STEP64, *sets)


def plan_files(r, run_dir: Path) -> dict[str, str]:
    return make_plan(
        r, run_dir=run_dir, python="python", cwd=run_dir.parent, cache_dir=run_dir.parent, base_env={}
    ).files


def peak_at(gib: float, size: int) -> float:
    """The estimated peak of the STEP64 recipe split into micro-batches of `size`, as auto sees it."""
    r = resolved(gib, AUTO)  # the layout and sleep level auto settles on, at the recipe's micro-batch
    return estimate(replace(r, recipe=M.with_micro_batch(resolved(gib).recipe, size)), gib).peak()[1]


def test_an_explicit_size_moves_the_step_into_larger_micro_batches(tmp_path):
    r = resolved(H200_GIB, "trainer.micro_batch_size=32")
    t = r.recipe.trainer
    assert (t.per_device_train_batch_size, t.gradient_accumulation_steps, t.micro_batch_size) == (32, 2, None)
    assert r.micro_batch_choice is None  # nothing was chosen
    files = plan_files(r, tmp_path / "run")
    trl = json.loads(files["launch.json"])["trl_args"]
    assert (trl["per_device_train_batch_size"], trl["gradient_accumulation_steps"]) == (32, 2)
    assert "steps_per_generation" not in trl  # TRL's default (the accumulation steps): one generation of 64 per step
    written = yaml.safe_load(files["recipe.yaml"])["trainer"]
    assert (written["per_device_train_batch_size"], written["gradient_accumulation_steps"]) == (32, 2)
    assert written.get("micro_batch_size") is None  # a resume re-plans nothing


def test_auto_takes_the_largest_divisor_that_fits():
    """On an H200 the whole step of 64 fits in one micro-batch; on a smaller GPU the largest divisor whose peak stays
    within the GPU less the margin, checked against the estimate of the next larger one."""
    big = resolved(H200_GIB, AUTO)
    assert big.micro_batch_choice.size == 64 and big.recipe.trainer.gradient_accumulation_steps == 1
    assert big.micro_batch_choice.peak_gib == pytest.approx(peak_at(H200_GIB, 64))
    for gib in (16.0, 20.0, 40.0, 64.0):
        choice = resolved(gib, AUTO).micro_batch_choice
        limit = gib * (1 - LAYOUT_HEADROOM)
        assert choice.limit_gib == pytest.approx(limit)
        assert choice.size in (8, 16, 32, 64) and choice.steps * choice.size == 64
        assert choice.peak_gib == pytest.approx(peak_at(gib, choice.size)) and choice.peak_gib <= limit
        larger = [m for m in (16, 32, 64) if m > choice.size]
        assert all(peak_at(gib, m) > limit for m in larger), (gib, choice)
    sizes = {resolved(gib, AUTO).micro_batch_choice.size for gib in (16.0, 20.0, 40.0, H200_GIB)}
    assert sizes == {8, 16, 32, 64}  # the GPU sizes above lead to every choice


def test_auto_never_goes_below_the_recipe_and_says_why():
    tight = resolved(12.0, AUTO)
    choice = tight.micro_batch_choice
    assert choice.size == 8 and tight.recipe.trainer.per_device_train_batch_size == 8
    assert choice.reason.startswith("no larger one fits (at 8 the peak is ")


def test_auto_without_a_gpu_keeps_the_recipe():
    r = resolved_for(QWEN05, CPU, *STEP64, AUTO)
    assert r.micro_batch_choice.size == 8 and r.recipe.trainer.gradient_accumulation_steps == 8
    assert "no GPU here" in r.micro_batch_choice.reason


def test_without_a_forecast_auto_holds_to_the_sleep_level_chosen_at_the_recipes_micro_batch():
    """Sleep auto is decided first, at the recipe's micro-batch; on GPUs the step-time forecast does not cover (not
    taken as H200s) a larger micro-batch never turns it to 2."""
    for gib in (40.0, 48.0, 80.0, H200_GIB):
        without = resolved(gib, "generation.sleep_level=auto")
        with_auto = resolved(gib, "generation.sleep_level=auto", AUTO)
        assert with_auto.recipe.generation.sleep_level == without.recipe.generation.sleep_level
        assert with_auto.micro_batch_choice.peak_gib <= gib * (1 - LAYOUT_HEADROOM)
    # at 48 GiB vLLM asleep would let micro-batches of 64 fit where 32 do awake; no forecast there, so it stays awake
    awake = resolved(48.0, "generation.sleep_level=auto", AUTO)
    asleep = resolved(48.0, "generation.sleep_level=2", AUTO)
    assert (awake.recipe.generation.sleep_level, awake.micro_batch_choice.size) == (0, 32)
    assert asleep.micro_batch_choice.size == 64 and fc.forecast(awake).reason.startswith("the assumed GPUs have 48 GiB")


# 256 completions per rank in micro-batches of 32 under ZeRO-2 (whose passes cost most: a larger micro-batch saves
# most) at a share that leaves the trainer little while vLLM is awake
SQUEEZED = ("trainer.per_device_train_batch_size=32", "trainer.gradient_accumulation_steps=8",
            "distributed.deepspeed=zero3", "distributed.zero_stage=2",
            "generation.vllm_gpu_memory_utilization=0.65", "generation.sleep_level=auto", AUTO,
            "generation.overlap=off")  # fmt: skip


def test_auto_sleeps_for_a_larger_micro_batch_where_the_forecast_says_it_is_faster():
    r = resolved_for(QWEN05, assumed_host(1, H200_GIB), *SQUEEZED)
    sleep, micro = r.sleep_choice, r.micro_batch_choice
    assert (r.recipe.generation.sleep_level, micro.size, r.recipe.trainer.gradient_accumulation_steps) == (2, 256, 1)
    # what the two would be, set by hand: awake only micro-batches of 32 fit
    awake = resolved_for(QWEN05, assumed_host(1, H200_GIB), *SQUEEZED, "generation.sleep_level=0")
    assert awake.micro_batch_choice.size == 32
    fast, slow = fc.forecast(r).s_per_step, fc.forecast(awake).s_per_step
    assert fast <= slow * (1 - M.SLEEP_FOR_SPEED)
    assert sleep.reason == (
        f"faster by the forecast: {fast:.2f} s/step with vLLM asleep while training in micro-batches of 256, "
        f"{slow:.2f} awake in micro-batches of 32, which fit beside vLLM (peak {sleep.peak_gib:.2f} ≤ "
        f"{sleep.limit_gib:.1f} GiB at sleep 0)"
    )
    assert sleep.peak_gib == pytest.approx(estimate(awake, H200_GIB).peak()[1])  # awake, micro-batches of 32
    assert micro.peak_gib <= micro.limit_gib  # the larger micro-batch fits with vLLM asleep
    assert r.recorded_recipe().generation.sleep_level == 2  # a resume re-decides nothing


def test_the_measuring_probe_sweeps_level_0_from_the_micro_batch_auto_would_take_awake(tmp_path):
    from colocate_rl.memory.probe import plan_probe

    r = resolved_for(QWEN05, assumed_host(1, H200_GIB), *SQUEEZED)
    assert r.sleep_choice.to_json()["awake_micro_batch"] == 32
    swept = [(c.sleep_level, c.micro_batch) for c in plan_probe(r, H200_GIB, tmp_path).sweep_configs()]
    assert swept == [(0, 32), (0, 64), (0, 128), (0, 256), (2, 256)]  # awake's choice against auto's


def test_auto_stays_awake_where_the_forecast_gains_too_little_or_the_recipe_keeps_vllm_awake(monkeypatch):
    h200 = assumed_host(1, H200_GIB)
    fixed = resolved_for(QWEN05, h200, *SQUEEZED, "generation.sleep_level=0")
    assert (fixed.recipe.generation.sleep_level, fixed.micro_batch_choice.size) == (0, 32)
    overlapped = resolved_for(QWEN05, h200, *SQUEEZED, "generation.overlap=one_step")
    assert (overlapped.recipe.generation.sleep_level, overlapped.micro_batch_choice.size) == (0, 32)
    monkeypatch.setattr(M, "SLEEP_FOR_SPEED", 0.5)  # a forecast must now save half the step
    r = resolved_for(QWEN05, h200, *SQUEEZED)
    assert (r.recipe.generation.sleep_level, r.micro_batch_choice.size) == (0, 32)
    assert r.sleep_choice.reason.startswith("trainer and vLLM fit together (peak ")


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (["trainer.micro_batch_size=3"], "trainer.micro_batch_size: 3 does not divide the 16 completions"),
        (["trainer.micro_batch_size=0"], "trainer.micro_batch_size: input should be greater than 0"),
        (
            ["trainer.micro_batch_size=auto", "trainer.extra_args={steps_per_generation: 2}"],
            "trainer.micro_batch_size: cannot be combined with extra_args.steps_per_generation",
        ),
        (
            ["trainer.micro_batch_size=8", "trainer.extra_args={generation_batch_size: 64}"],
            "trainer.micro_batch_size: cannot be combined with extra_args.generation_batch_size",
        ),
    ],
)
def test_bad_sizes_are_refused_with_the_key(sets, message):
    from colocate_rl.recipe.load import apply_overrides, parse_sets

    with pytest.raises(UserError) as err:
        parse_recipe(apply_overrides(QWEN05, parse_sets(sets)))
    [line] = err.value.lines
    assert line.startswith(message), line


def test_the_default_auto_yields_to_a_generation_batch_set_in_extra_args():
    """auto is the default: a recipe that fixes TRL's generation batch itself (extra_args) keeps its micro-batch as
    written, with no error and nothing chosen; the same with micro_batch_size written out is refused (above)."""
    from colocate_rl.recipe.load import apply_overrides, parse_sets

    assert parse_recipe(QWEN05).trainer.micro_batch_size == "auto"
    fixed = "trainer.extra_args={steps_per_generation: 2}"
    assert parse_recipe(apply_overrides(QWEN05, parse_sets([fixed]))).trainer.micro_batch_size is None
    r = resolved(H200_GIB, fixed)
    assert r.micro_batch_choice is None and r.recipe.trainer.per_device_train_batch_size == 8
    assert resolved(H200_GIB).micro_batch_choice.size == 64  # without it, the default auto chooses
    one = resolved_for(QWEN05, assumed_host(1, H200_GIB))  # a step of one micro-batch: nothing to choose or print
    assert one.micro_batch_choice is None and one.recipe.trainer.micro_batch_size is None
    assert not any("micro_batch_size" in line for line in one.choice_lines())


def test_validate_dry_run_and_mem_probe_print_the_choice(tmp_path):
    recipe = write_recipe(
        tmp_path / "r.yaml",
        {
            **QWEN05,
            "trainer": {**QWEN05["trainer"], "per_device_train_batch_size": 8, "gradient_accumulation_steps": 8},
        },
    )
    runner, on_h200 = CliRunner(), ["--gpus", "1", "--gpu-memory", str(H200_GIB), "--set", AUTO]
    valid = runner.invoke(app, ["validate", str(recipe), *on_h200], env={"COLUMNS": "200"})
    assert valid.exit_code == 0, valid.output
    assert "trainer.micro_batch_size auto: 64 (× 1 accumulation step) — the step's 64 completions fit" in valid.stdout
    assert "100 × 64 completions (8 per prompt)" in valid.stdout
    dry = runner.invoke(app, ["train", str(recipe), "--dry-run", "--run-dir", str(tmp_path / "run"), *on_h200])
    assert dry.exit_code == 0, dry.output
    assert "# trainer.micro_batch_size auto: 64" in dry.stdout and not (tmp_path / "run").exists()
    data = json.loads(runner.invoke(app, ["mem-probe", str(recipe), "--estimate", "--json", *on_h200]).stdout)
    assert data["micro_batch_choice"]["size"] == 64 and data["micro_batch_choice"]["gradient_accumulation_steps"] == 1
    default = runner.invoke(app, ["validate", str(recipe), "--gpus", "1", "--gpu-memory", str(H200_GIB)])
    assert "trainer.micro_batch_size auto: 64" in default.stdout  # auto is the default
    off = ["--set", "trainer.micro_batch_size=null"]
    plain = runner.invoke(app, ["validate", str(recipe), "--gpus", "1", *off], env={"COLUMNS": "200"})
    assert "micro_batch_size auto" not in plain.stdout
    assert "100 × 64 completions (8 per prompt), micro-batches of 8 × 8 per rank" in plain.stdout


def test_the_measuring_probe_pins_the_size():
    from colocate_rl.memory import probe as P

    r = resolved(H200_GIB, AUTO)
    plan = P.plan_probe(r, H200_GIB, Path("/nonexistent/probe"))
    assert plan.pinned["trainer.micro_batch_size"] == 64


def test_auto_plans_what_the_recorded_h200_sweep_found_fastest_within_the_limit():
    """The 0.5B layout at 256 completions (docs/benchmarks/results/raw-2026-12-04b/mp05-probe.json): the sweep timed
    sleep 0 and 2 × micro-batches 64-256 on one H200 and found sleep 0 × 128 the fastest within the limit (0 × 256
    ran faster but peaked above it); the plan for that GPU chooses the same."""
    probe = json.loads((ROOT / "docs/benchmarks/results/raw-2026-12-04b/mp05-probe.json").read_text())
    fastest = probe["sweep"]["fastest"]
    share = f"generation.vllm_gpu_memory_utilization={probe['sweep']['share']}"  # the sweep's (auto's then: 0.09)
    sets = ("trainer.gradient_accumulation_steps=16", "generation.sleep_level=auto", share)
    r = resolved_for(ROOT / "recipes/gpu-0.5b-layout.yaml", assumed_host(1, probe["gpu_memory_gib"]), *sets)
    planned = (r.recipe.generation.sleep_level, r.recipe.trainer.per_device_train_batch_size)
    assert planned == (fastest["sleep_level"], fastest["micro_batch"]) == (0, 128)
    assert r.micro_batch_choice.peak_gib == pytest.approx(fastest["peak_gib"], rel=0.05)  # estimated against measured


def test_auto_plans_for_the_1p7b_shape_the_configuration_whose_recorded_runs_were_faster():
    """The SmolLM2-1.7B shape at 256 completions (the hub id's layout, as the random-init copy has it; its prompts
    measured at 181 tokens at most on the GPU, given here): the recorded H200 runs at share 0.24 (raw-2026-12-04's
    sweep and raw-2026-12-04b's A-B-A-B, as benchmarks/fit_forecast.py reads them) measured sleep 2 × 64 at 6.38, 6.03
    and 5.99 s/step and sleep 0 × 32 at 5.72, 6.75 and 6.76; the plan chooses the configuration with the lower median,
    by the forecast (sleep 0 × 32 fits beside vLLM, so the forecast decides), at the share those runs had."""
    runs: dict[tuple[int, int], list[float]] = {}
    for row in import_benchmark("fit_forecast").load_rows():
        if round(row.shape.params_b, 3) == 1.711 and ("0.24" in row.key or "ab17" in row.key):
            runs.setdefault((row.shape.sleep_level, 256 // row.shape.micro_batches), []).append(row.measured["s/step"])
    assert sorted(len(v) for v in runs.values()) == [3, 3]
    faster = min(runs, key=lambda k: sorted(runs[k])[1])
    sets = ["model.name=HuggingFaceTB/SmolLM2-1.7B-Instruct", "eval.every_steps=null"]
    sets += ["trainer.gradient_accumulation_steps=8", "generation.vllm_gpu_memory_utilization=auto"]
    sets += ["generation.overlap=off"]  # the runs took turns (overlap's own d256 runs: docs/benchmarks, O)
    recipe = parse_recipe(apply_overrides(read_yaml(find_recipe("smollm2-135m-gsm8k")), parse_sets(sets)))
    pre = replace(preflight(recipe), measure_prompt=lambda: LongestPrompt(181, 1000, False))
    r = resolve(recipe, assumed_host(1, H200_GIB), pre)
    assert r.recipe.generation.vllm_gpu_memory_utilization == 0.24
    planned = (r.recipe.generation.sleep_level, r.recipe.trainer.per_device_train_batch_size)
    assert planned == faster == (2, 64)
    assert r.sleep_choice.awake_micro_batch == 32  # sleep 0 fitted at 32: chosen against it by the forecast
