"""The step-time forecast (colocate_rl.memory.forecast): its constants are the fit of the measured rows
(benchmarks/fit_forecast.py), it reproduces those rows within the error measured, it refuses what the rows do not
cover, and validate / train --dry-run / mem-probe --estimate print it, the run directory records it and `report`
sets it against the run."""

import json
import statistics
from dataclasses import replace
from datetime import datetime

import pytest
from conftest import CPU, H200_GIB, cli_here, import_benchmark, resolved

from colocate_rl.memory import forecast as fc
from colocate_rl.pipeline import plan_run
from colocate_rl.plan.host import Gpu, Host, assumed_host
from colocate_rl.telemetry import report as rep

H200 = Host(gpus=(Gpu("NVIDIA H200", H200_GIB),), has_vllm=True, cpu_count=16)
H200_ARGS = ("--gpus", "1", "--gpu-memory", "140")
TURNS = ("generation.overlap=off",)  # generation and training in turn, as the in-turn rows ran
# Largest |fit − measured| / measured (%) over the rows, each phase and s/step, with every row in the fit
IN_SAMPLE_LARGEST = {
    "s/step": 26,
    "generation": 45,
    "training": 46,
    "weight push": 66,
    "sleep/wake": 69,
    "rest": 80,
}


@pytest.fixture(scope="module")
def fit():
    return import_benchmark("fit_forecast").analysis()


def test_the_constants_are_the_fit_of_the_measured_rows(fit):
    assert fit["fitted"].keys() == fc.FITTED.keys()
    for name, value in fit["fitted"].items():
        assert fc.FITTED[name] == pytest.approx(value, rel=1e-3), name
    assert all(value >= 0 for value in fc.FITTED.values())  # each term adds time (or none: held at 0)
    assert [k for k, v in fc.FITTED.items() if v == 0] == ["decode step, per sequence and B params"]
    assert fit["leave_one_out"] == fc.LEAVE_ONE_OUT
    assert fit["startup"][:3] == pytest.approx(fc.STARTUP_S, abs=0.05) and fit["startup"][3] == 12
    assert fit["covered"] == fc.COVERED
    assert len(fit["rows"]) == 50  # 49 in the fit (48 with s/step), the LoRA row apart


def test_every_row_is_reproduced_within_the_error_measured(fit):
    for key, errors in fit["in_sample"].items():
        assert errors and max(abs(e) for _, e in errors) <= IN_SAMPLE_LARGEST[key], key
    for key, errors in fit["loo"].items():
        assert max(abs(e) for _, e in errors) <= fc.LEAVE_ONE_OUT[key][1] + 0.05, key


def test_the_issue_target_at_256_completions_holds_per_configuration(fit):
    """±20 % of measured s/step at 256 completions per step on the three sizes of issue 29 (SmolLM2-135M, the 0.5B
    layout, the 1.7B shape): each configuration measured (micro-batches, layout, sleep level) against the median of
    its runs (the same configuration varied by up to 18 % between invocations: 1.7B sleep 0 × 32 ran 5.72, 6.75 and
    6.76 s/step). The 1.5B layout is fitted but not one of the three: its sleep 2 × 64 run generated a batch in 1.81 s
    against 2.42 and 2.95 at sleep 0 (+25 %). Left out of the fit one row at a time, the largest errors at 256
    completions are rows that alone measured a term's regime: SmolLM2-135M at 8 micro-batches (−44.7 %: the
    DeepSpeed floor at a small model) and that 1.5B run (+37.6 %); the others within 22 %."""
    groups: dict[tuple, list] = {}
    for r in fit["rows"]:
        if r.shape.completions == 256 and "s/step" in r.measured and not r.lora:
            groups.setdefault(r.shape, []).append(r.measured["s/step"])
    assert {round(shape.params_b, 3) for shape in groups} == {0.135, 0.494, 1.544, 1.711}
    for shape, measured in groups.items():
        median = statistics.median(measured)
        error = sum(fc.phase_seconds(shape).values()) / median - 1
        assert abs(error) <= (0.26 if round(shape.params_b, 3) == 1.544 else 0.2), (shape, measured)
    loo = sorted(abs(e) for r, e in fit["loo"]["s/step"] if r.shape.completions == 256)
    assert len(loo) == 30 and loo[-1] < 45 and loo[-3] < 22


def test_the_rows_resolve_to_what_they_ran(fit):
    """Each row is resolved from its own command: the layout the layouts rows name, the micro-batches auto chose."""
    by_key = {(r.source, r.key): r.shape for r in fit["rows"]}
    layouts = {"ZeRO-2": "zero", "ZeRO-3": "zero3", "DDP": "plain"}
    for x in import_benchmark("fit_forecast")._jsonl("layouts-results.jsonl"):
        if not x["row"].startswith("server"):
            shape = by_key["layouts-results", f"{x['row']} ({x.get('session', '2026-11-30 #1')})"]
            assert shape.layout == layouts[x["layout"]] and shape.gpus == 2 and shape.sleep_level == 2
    assert by_key["generation-results", "c256+mbauto (2026-12-02)"].micro_batches == 2  # 128 × 2, as README says
    assert by_key["generation-results", "a128+mbauto (2026-12-02)"].micro_batches == 2  # 64 × 2
    assert by_key["generation-results", "c256 (2026-12-02)"].micro_batches == 8  # 32 × 8, as written
    assert by_key["generation-results", "a128 (2026-12-02)"].sleep_level == 0  # auto chose 0
    # overlap-results' runs without overlap, as the README says they were planned; F without TRL's old-logprob forward
    shapes = {k: by_key["overlap-results", f"off ({k})"] for k in ("A2", "C", "D", "D2", "F")}
    assert {k: (s.layout, s.sleep_level, s.micro_batches, s.old_forward) for k, s in shapes.items()} == {
        "A2": ("zero", 0, 2, True),
        "C": ("zero", 0, 2, True),
        "D": ("zero", 0, 1, True),
        "D2": ("zero", 0, 1, True),
        "F": ("zero", 0, 1, False),
    }
    # every row before e3de169 ran it; F, the mem-probe rows and the train runs came after
    after = [r.key for r in fit["rows"] if not r.shape.old_forward]
    assert len(after) == 19 and all(r.source in ("overlap-results", "mem-probe", "train runs") for r in fit["rows"]
                                    if r.key in after)  # fmt: skip
    # the probe's and the train runs' configurations, as they ran (1.7B: the hub layout of the random-init shape)
    probed = {(round(r.shape.params_b, 3), r.shape.sleep_level, r.shape.micro_batches) for r in fit["rows"]
              if r.source in ("mem-probe", "train runs")}  # fmt: skip
    assert probed == {(0.494, 0, 4), (0.494, 0, 2), (0.494, 0, 1), (0.494, 2, 4), (0.494, 2, 2), (0.494, 2, 1),
                      (1.711, 0, 8), (1.711, 2, 4), (1.544, 0, 4), (1.544, 2, 4), (1.544, 0, 8)}  # fmt: skip


def test_rloo_runs_trls_old_logprob_forward_and_grpo_forms_them_in_the_loss():
    grpo = resolved("smollm2-135m-gsm8k", H200, *TURNS)
    rloo = resolved("smollm2-135m-gsm8k", H200, "algorithm=rloo", *TURNS)
    assert (fc.shape_of(grpo).old_forward, fc.shape_of(rloo).old_forward) == (False, True)
    extra = fc.forecast(rloo).phases["rest"] - fc.forecast(grpo).phases["rest"]
    completions = rloo.recipe.trainer.step_completions
    assert extra == pytest.approx(completions * fc.FITTED["rest, TRL's old-logprob forward per completion"])


def test_a_cpu_run_gets_no_forecast():
    f = fc.forecast(resolved("quickstart", CPU))
    assert f.reason == "a CPU run; the step-time model is fitted to H200 GPU runs with vLLM" and not f.phases
    assert fc.forecast_lines(f) == [f"forecast: none — {f.reason}"]
    assert json.loads(fc.forecast_json(f)) == {"available": False, "reason": f.reason}


@pytest.mark.parametrize(
    ("recipe", "host", "sets", "why"),
    [
        ("gpu-0.5b-layout", assumed_host(1, 80.0), (), "the assumed GPUs have 80 GiB"),
        ("gpu-0.5b-layout", replace(H200, gpus=(Gpu("NVIDIA A100-SXM4-80GB", 80.0),)), (), "GPUs are NVIDIA A100"),
        ("gpu-0.5b-layout", H200, ("generation.engine=trl",), "generation.engine: trl"),
        ("gpu-0.5b-layout", H200, ("generation.enforce_eager=true",), "generation.enforce_eager"),
        ("gpu-7b-layout-1gpu", H200, (), "offload"),  # auto's layout offloads the optimizer
        ("smollm2-135m-calculator", H200, (), "tools"),
        (
            "smollm2-135m-gsm8k",
            H200,
            ("generation.overlap=one_step", "generation.engine_processes=4"),
            "overlap with 4 engine processes; the overlapped rows ran one engine process, 2 engine processes, one "
            "engine process under MPS, 2 engine processes under MPS",
        ),
        (
            "smollm2-135m-gsm8k",
            H200,
            ("generation.overlap=one_step", "generation.vllm_multiprocessing=true"),
            "generation.vllm_multiprocessing",
        ),
        ("smollm2-135m-gsm8k", H200, ("generation.engine_process=true", *TURNS), "generation.engine_process"),
        ("qwen2.5-72b-grpo-colocate", assumed_host(8, 140.0), (), "several nodes"),  # before any GPU check
        ("quickstart", CPU, ("distributed.nnodes=2", "distributed.rdzv_endpoint=node0:29500"), "several nodes"),
    ],
)
def test_what_the_rows_do_not_cover_gets_no_forecast(recipe, host, sets, why):
    assert why in fc.forecast(resolved(recipe, host, *sets)).reason


def test_a_forecast_names_what_is_beyond_the_rows():
    f = fc.forecast(resolved("qwen2.5-7b-grpo", assumed_host(8, 140.0)))
    assert f.reason is None and f.gpu == "140 GiB GPUs taken as H200s"
    assert f.beyond[:3] == (
        "parameters 7.62B (rows: 0.135–1.71B)",
        "max_completion_length 1024 (rows: 256)",
        "GPUs 8 (rows: 1–2)",
    )
    assert fc.forecast_lines(f)[-1].startswith("forecast beyond the rows: parameters 7.62B")
    assert not fc.forecast(resolved("smollm2-135m-gsm8k", H200, *TURNS)).beyond  # a measured configuration
    overlapped = fc.forecast(resolved("smollm2-135m-gsm8k", H200))  # as shipped: 32 completions a step, overlapped
    assert overlapped.beyond == ("overlapped with 2 engine processes, completions per rank 32 (rows: 256)",)


def test_the_overlap_factors_are_the_fit_of_the_overlapped_rows(fit):
    o = fit["overlap"]
    assert o["fitted"].keys() == fc.OVERLAP_FITTED.keys()
    for regime, factors in o["fitted"].items():
        assert factors == pytest.approx(fc.OVERLAP_FITTED[regime], rel=1e-3), regime
    assert o["leave_one_out"] == fc.OVERLAP_LEAVE_ONE_OUT and o["covered"] == fc.OVERLAP_COVERED
    assert {r.shape.overlap for r in o["rows"]} == set(fc.OVERLAP_FITTED) and len(o["rows"]) == 22
    assert all(abs(e) <= fc.OVERLAP_LEAVE_ONE_OUT["s/step"][1] + 0.05 for _, e in o["loo"])
    # the rows resolve to what they ran: ZeRO-2 at sleep 0, c256 in one micro-batch, d256 in 8
    assert {(round(r.shape.params_b, 3), r.shape.micro_batches, r.shape.layout, r.shape.sleep_level)
            for r in o["rows"]} == {(0.135, 1, "zero", 0), (1.711, 8, "zero", 0)}  # fmt: skip


def test_an_overlapped_step_is_the_ranks_work_beside_the_engine_and_the_wait_for_its_batch():
    """Overlapped, training and the rest take their in-turn time × the regime's factor (beside the engine), and
    generation is the wait for the batch generated ahead: the engine's time beside them less theirs, or none."""
    r = resolved("smollm2-135m-gsm8k", H200, "trainer.gradient_accumulation_steps=8", "eval.every_steps=null")
    assert r.recipe.generation.overlap == "one_step" and r.recipe.generation.engine_processes == 2  # the default
    f = fc.forecast(r)
    shape = fc.shape_of(r)
    assert f.reason is None and f.overlap == shape.overlap == "2 engine processes"
    turns, factors = fc.phase_seconds(replace(shape, overlap=None)), fc.OVERLAP_FITTED["2 engine processes"]
    assert f.phases["training"] == pytest.approx(turns["training"] * factors["training"])
    assert f.phases["rest"] == pytest.approx(turns["rest"] * factors["rest"])
    wait = turns["generation"] * factors["generation"] - f.phases["training"] - f.phases["rest"]
    assert f.phases["generation"] == pytest.approx(max(0.0, wait)) and f.phases["sleep/wake"] == 0
    assert f.phases["weight push"] == turns["weight push"]
    lines = fc.forecast_lines(f)
    assert "forecast error on its 22 overlapped rows (2 engine processes), each left out" in lines[1]
    assert json.loads(fc.forecast_json(f))["overlap"] == "2 engine processes"
    assert not f.beyond  # a measured configuration: 256 completions on one H200
    d256 = ("model.name=HuggingFaceTB/SmolLM2-1.7B-Instruct", "trainer.gradient_accumulation_steps=8",
            "eval.every_steps=null", "distributed.deepspeed=zero3", "distributed.zero_stage=2",
            "trainer.micro_batch_size=32", "generation.overlap=one_step")  # fmt: skip
    host = replace(H200, mps_control=True)
    under, beside = (
        fc.forecast(resolved("smollm2-135m-gsm8k", host, *d256, f"generation.mps={m}")) for m in ("on", "off")
    )
    assert (under.overlap, beside.overlap) == ("one engine process under MPS", "one engine process")
    assert under.phases["training"] < beside.phases["training"]  # measured: 3.4 against 4.7 s a step
    assert not under.beyond and not beside.beyond  # d256: measured in both regimes
    # each regime names the rows it was fitted to: the MPS rows are all at the 1.7B shape
    small = fc.forecast(resolved("smollm2-135m-gsm8k", host, *d256[1:], "generation.mps=on"))
    assert small.beyond == ("overlapped with 2 engine processes under MPS, parameters 0.135B (rows: 1.71B)",)
    # MPS client settings from the environment (the benchmark's prio arm): no row ran them, so they are named
    prio = replace(host, mps_settings=("COLOCATE_RL_ENGINE_MPS_PRIORITY=0", "CUDA_MPS_CLIENT_PRIORITY=1"))
    under_prio, beside_prio = (
        fc.forecast(resolved("smollm2-135m-gsm8k", prio, *d256, f"generation.mps={m}")) for m in ("on", "off")
    )
    assert under_prio.beyond == (
        "MPS client settings COLOCATE_RL_ENGINE_MPS_PRIORITY=0 CUDA_MPS_CLIENT_PRIORITY=1 (rows: NVIDIA's defaults)",
    )
    assert not beside_prio.beyond  # without MPS they change nothing


def test_the_host_reads_the_mps_client_settings_from_the_environment(monkeypatch):
    from colocate_rl.plan.host import detect_host

    for name in ("CUDA_MPS_CLIENT_PRIORITY", "COLOCATE_RL_ENGINE_MPS_THREAD_PERCENTAGE", "CUDA_MPS_PIPE_DIRECTORY"):
        monkeypatch.setenv(name, "1")
    settings = detect_host().mps_settings
    assert settings == ("COLOCATE_RL_ENGINE_MPS_THREAD_PERCENTAGE=1", "CUDA_MPS_CLIENT_PRIORITY=1")  # not the pipe's


def test_the_forecast_is_the_sum_of_its_phases():
    f = fc.forecast(resolved("smollm2-135m-gsm8k", H200, "trainer.max_steps=50", *TURNS))
    assert f.gpu == "H200" and list(f.phases) == list(fc.PHASES) and f.phases["sleep/wake"] == 0  # auto: sleep 0
    assert f.s_per_step == pytest.approx(sum(f.phases.values()))
    assert f.total_s == pytest.approx(50 * f.s_per_step + fc.STARTUP_S[0])
    record = json.loads(fc.forecast_json(f))
    assert record["available"] and record["s_per_step"] == pytest.approx(f.s_per_step, abs=1e-4)
    assert record["phases"]["training"]["metrics"] == ["train", "optimizer"] and record["max_steps"] == 50


def test_validate_dry_run_and_estimate_print_the_forecast():
    validate = cli_here("validate", "gpu-0.5b-layout", *H200_ARGS)
    dry = cli_here("train", "gpu-0.5b-layout", *H200_ARGS, "--dry-run")
    estimate = cli_here("mem-probe", "gpu-0.5b-layout", "--estimate", *H200_ARGS)
    lines = fc.forecast_lines(fc.forecast(resolved("gpu-0.5b-layout", assumed_host(1, 140.0))))
    assert lines[0].startswith("forecast (140 GiB GPUs taken as H200s): ") and " s/step = generation " in lines[0]
    assert "each left out of the fit in turn: s/step median 7.2 %, largest 45 %" in lines[1] and len(lines) == 2
    for result, prefix in ((validate, ""), (dry, "# "), (estimate, "")):
        assert result.returncode == 0, result.stdout + result.stderr
        assert [prefix + line for line in lines] == [x for x in result.stdout.splitlines() if "forecast" in x]
    cpu = cli_here("validate", "quickstart")
    assert "forecast: none — a CPU run; the step-time model is fitted to H200 GPU runs with vLLM" in cpu.stdout


def test_the_run_dir_records_the_forecast(tmp_path):
    res = resolved("gpu-0.5b-layout", assumed_host(1, 140.0))
    plan = plan_run(res, tmp_path / "run", env={}, now=datetime(2026, 1, 1), cwd=tmp_path)
    assert plan.files["forecast.json"] == fc.forecast_json(fc.forecast(res))
    cpu = plan_run(resolved("quickstart", CPU), tmp_path / "cpu", env={}, now=datetime(2026, 1, 1), cwd=tmp_path)
    assert json.loads(cpu.files["forecast.json"])["available"] is False


def _run_dir(path, forecast_text):
    """A run of 3 steps: step 1 slower (left out), steps 2-3 with the phases below."""
    path.mkdir()
    steps = []
    for step, generate in ((1, 9.0), (2, 1.0), (3, 1.2)):
        phases = {"generate": generate, "train": 0.4, "optimizer": 0.1, "weight_sync": 0.05, "prepare": 0.2}
        steps.append(
            {
                "step": step,
                "reward": 0.1,
                "time/step_s": sum(phases.values()) + 0.05,
                **{f"time/{k}_s": v for k, v in phases.items()},
            }
        )
    (path / "metrics.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
    if forecast_text is not None:
        (path / "forecast.json").write_text(forecast_text)
    return path


def test_report_sets_the_forecast_against_the_run(tmp_path):
    f = fc.Forecast(
        phases={"generation": 1.0, "training": 0.6, "weight push": 0.05, "sleep/wake": 0.0, "rest": 0.2},
        max_steps=3,
        gpu="H200",
    )
    run = rep.load_run(_run_dir(tmp_path / "run", fc.forecast_json(f)))
    summary = rep.run_summary(run)
    # steps 2 and 3: s/step 1.8 and 2.0 (median 1.9); generation 1.0 / 1.2; rest = prepare 0.2 + untimed 0.05
    assert summary["s/step: forecast vs measured median"] == "1.85 vs 1.90 (-3 %)"
    assert summary["  generation s: forecast vs measured"] == "1.00 vs 1.10 (-9 %)"
    assert summary["  training s: forecast vs measured"] == "0.60 vs 0.50 (+20 %)"
    assert summary["  sleep/wake s: forecast vs measured"] == "0.00 vs 0.00"
    assert summary["  rest s: forecast vs measured"] == "0.20 vs 0.25 (-20 %)"
    printed = cli_here("report", run.path, "--out", tmp_path / "png")
    assert printed.returncode == 0 and "1.85 vs 1.90 (-3 %)" in printed.stdout
    none = rep.load_run(_run_dir(tmp_path / "none", fc.forecast_json(fc.Forecast(reason="a CPU run"))))
    assert rep.run_summary(none)["forecast"] == "none — a CPU run"
    old = rep.run_summary(rep.load_run(_run_dir(tmp_path / "old", None)))  # written before forecasts
    assert not any("forecast" in key for key in old)
    broken = rep.run_summary(rep.load_run(_run_dir(tmp_path / "broken", '{"available": true}')))
    assert broken["forecast"] == "forecast.json unreadable"
