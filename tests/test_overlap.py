"""`generation.overlap` and `generation.engine_process` (colocate_rl/plan/overlap.py, the look-ahead in
colocate_rl/rank/adapter/trl.py, colocate_rl/rank/engine_process.py): what auto decides and why, what cannot run
together (one line each, exit 2), what the run directory records, and — slow, through real torchrun on CPU with the
engine in its own process (transformers there; vLLM on GPUs, tests/test_gpu.py) — that an overlapped run learns,
stops and resumes with every step once, and ends in one line when the engine process dies."""

import json
import re
import signal

import psutil
import pytest
from conftest import (
    CPU,
    H200_GIB,
    HANG_GUARD_S,
    QWEN05,
    QWEN7_1GPU,
    assert_user_error,
    cli,
    cli_here,
    import_benchmark,
    start,
    wait_for_steps,
    write_recipe,
)
from conftest import resolved as resolved_for

from colocate_rl.plan.host import assumed_host
from colocate_rl.plan.launch_plan import make_plan
from colocate_rl.rundir import RunDir, read_metrics, step_records
from colocate_rl.telemetry import events

# plain DDP: faster to start than the quickstart's ZeRO-3 (the learning test keeps ZeRO-3: the push gathers there)
DDP = ("--set", "distributed.deepspeed=null", "--set", "distributed.deepspeed_overrides={}")


def on_h200(recipe, *sets):
    return resolved_for(recipe, assumed_host(1, H200_GIB), *sets)


def launch_of(r, tmp_path) -> dict:
    plan = make_plan(r, run_dir=tmp_path / "run", python="python", cwd=tmp_path, cache_dir=tmp_path, base_env={})
    return json.loads(plan.files["launch.json"])


def test_auto_overlaps_where_trainer_and_vllm_fit_awake(tmp_path):
    r = on_h200(QWEN05, "generation.overlap=auto", "generation.sleep_level=auto")
    assert r.recipe.generation.sleep_level == 0 and r.recipe.generation.overlap == "one_step"
    assert r.overlap_choice.on and r.overlap_choice.line().startswith("generation.overlap auto: one_step — trainer and")
    assert r.choice_lines()[0] == (  # decided before overlap, as if it will run
        "generation.engine_processes auto: 1 — generation.vllm_gpu_memory_utilization is set, for one engine process "
        "(set generation.engine_processes: 2 to split it)"
    )
    recorded = r.recorded_recipe().generation
    assert (recorded.overlap, recorded.engine_process) == ("one_step", True)  # no auto left for a resume to decide
    launch = launch_of(r, tmp_path)
    assert launch["overlap"] is True and launch["engine_process"] is True


def test_ranks_beside_an_awake_engine_process_run_torchs_allocator_on_expandable_segments_unless_the_user_set_it(
    tmp_path,
):
    from colocate_rl.plan.launch_plan import rank_env

    xs = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    overlapped = on_h200(QWEN05, "generation.overlap=one_step", "generation.sleep_level=0")
    assert rank_env(overlapped, {}, tmp_path).items() >= xs.items()
    awake = on_h200(QWEN05, "generation.engine_process=true", "generation.sleep_level=0", "generation.overlap=off")
    assert awake.recipe.generation.overlap == "off" and rank_env(awake, {}, tmp_path).items() >= xs.items()
    assert "PYTORCH_CUDA_ALLOC_CONF" not in rank_env(
        overlapped, {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:64"}, tmp_path
    )
    asleep = on_h200(QWEN05, "generation.engine_process=true", "generation.sleep_level=2")  # vLLM's sleep pool
    in_rank = on_h200(
        QWEN05, "generation.sleep_level=0", "generation.overlap=off"
    )  # the engine in the rank: not measured
    for r in (asleep, in_rank, on_h200(QWEN05)):
        assert "PYTORCH_CUDA_ALLOC_CONF" not in rank_env(r, {}, tmp_path)
    cpu = resolved_for(QWEN05, CPU, "generation.overlap=one_step", "generation.sleep_level=0")
    assert cpu.recipe.generation.overlap == "one_step" and "PYTORCH_CUDA_ALLOC_CONF" not in rank_env(cpu, {}, tmp_path)


def test_auto_does_not_overlap_where_vllm_must_sleep_or_something_rules_it_out(tmp_path):
    big = resolved_for(QWEN7_1GPU, assumed_host(1, 120.0), "generation.overlap=auto", "generation.sleep_level=auto")
    assert big.recipe.generation.sleep_level == 2 and big.recipe.generation.overlap == "off"
    assert "(sleep level 2: trainer and vLLM do not fit awake together)" in big.overlap_choice.reason
    fixed = on_h200(QWEN05, "generation.overlap=auto", "generation.sleep_level=2")
    assert "(sleep level 2: the recipe's generation.sleep_level)" in fixed.overlap_choice.reason
    assert launch_of(big, tmp_path)["engine_process"] is False
    rloo_twice = on_h200(
        QWEN05, "generation.overlap=auto", "trainer.extra_args={num_iterations: 2}", "generation.sleep_level=0"
    )
    assert rloo_twice.recipe.generation.overlap == "off"
    assert "trainer.extra_args.num_iterations other than 1" in rloo_twice.overlap_choice.reason
    eager = on_h200(QWEN05, "generation.overlap=auto", "generation.sleep_level=0", "generation.enforce_eager=true")
    assert eager.recipe.generation.overlap == "off" and "eager vLLM" in eager.overlap_choice.reason
    cpu = resolved_for(QWEN05, CPU, "generation.overlap=auto")
    assert cpu.recipe.generation.overlap == "off" and "overlap is for vLLM on GPUs" in cpu.overlap_choice.reason


def test_the_default_is_auto_overlapping_where_it_fits_with_the_engine_processes_one_step_would_run(tmp_path):
    """A recipe that leaves overlap, the engine process and their count to auto gets the engine processes an
    explicit one_step would (two on a 135M model, the share sized for both) where they fit awake beside the
    trainer; where only one does, all is planned again for one; where none does, overlap is off."""
    r = on_h200("smollm2-135m-gsm8k")
    explicit = on_h200("smollm2-135m-gsm8k", "generation.overlap=one_step")
    gen = r.recipe.generation
    assert (gen.overlap, gen.engine_process, gen.engine_processes, gen.sleep_level) == ("one_step", True, 2, 0)
    assert gen.vllm_gpu_memory_utilization == explicit.recipe.generation.vllm_gpu_memory_utilization == 0.09
    assert r.choice_lines()[0] == explicit.choice_lines()[0]  # "engine_processes auto: 2 — a model of 0.13B …"
    assert r.overlap_choice.line().startswith("generation.overlap auto: one_step — trainer and vLLM fit awake")
    launch = launch_of(r, tmp_path)
    assert (launch["overlap"], launch["engine_process"], launch["engine"]["processes"]) == (True, True, 2)
    one = resolved_for("smollm2-135m-gsm8k", assumed_host(1, 34.0))  # two do not fit awake, one does
    assert (one.recipe.generation.overlap, one.recipe.generation.engine_processes) == ("one_step", 1)
    assert one.engine_processes_choice.reason == (
        "with 2 engine processes trainer and vLLM did not fit awake together for overlap"
    )
    assert one.recipe.generation.vllm_gpu_memory_utilization < 0.14 + 0.01  # sized for one copy
    in_rank = resolved_for("smollm2-135m-gsm8k", assumed_host(1, 32.0))  # only with vLLM in the rank's process
    assert (in_rank.recipe.generation.overlap, in_rank.recipe.generation.sleep_level) == ("off", 0)
    assert "fit awake together only with vLLM in the rank's process" in in_rank.overlap_choice.reason
    none = resolved_for("smollm2-135m-gsm8k", assumed_host(1, 30.0))
    assert (none.recipe.generation.overlap, none.recipe.generation.sleep_level) == ("off", 2)
    assert none.overlap_choice.reason.endswith("(sleep level 2: trainer and vLLM do not fit awake together)")
    assert launch_of(none, tmp_path)["engine_process"] is False
    cpu = resolved_for("quickstart", CPU)
    assert cpu.recipe.generation.overlap == "off" and "overlap is for vLLM on GPUs" in cpu.overlap_choice.reason


def test_auto_never_overlaps_with_the_engine_in_the_rank():
    r = on_h200("smollm2-135m-gsm8k", "generation.engine_process=false")
    assert r.recipe.generation.overlap == "off" and r.recorded_recipe().generation.engine_process is False
    assert (
        r.overlap_choice.reason
        == "generation.engine_process: false (overlap generates in an engine process of its own)"
    )


def test_one_step_keeps_vllm_awake_whatever_the_memory_estimate_would_pick():
    r = on_h200(QWEN05, "generation.overlap=one_step", "generation.sleep_level=auto")
    assert r.recipe.generation.sleep_level == 0 and r.sleep_choice is None  # decided by the recipe, not by memory


@pytest.mark.parametrize(
    "sets, fragment",
    [
        (["generation.sleep_level=2"], "generation.overlap: one_step keeps vLLM awake while the trainer trains, but"),
        (["generation.engine=trl", "generation.sleep_level=0"], "cannot run with generation.engine: trl"),
        (["generation.engine_process=false"], "generation.overlap: one_step needs the engine in its own process"),
        (["trainer.extra_args={steps_per_generation: 2}"], "cannot run with trainer.extra_args.steps_per_generation"),
        (["tools.functions=[calculator]"], "cannot run with tools (multi-turn episodes"),
    ],
)
def test_settings_that_cannot_overlap_are_refused_in_one_line(tmp_path, sets, fragment):
    recipe = write_recipe(
        tmp_path / "r.yaml",
        {**QWEN05, "generation": {**QWEN05.get("generation", {}), "overlap": "one_step", "sleep_level": "auto"}},
    )
    args = [a for s in sets for a in ("--set", s)]
    assert_user_error(cli_here("validate", recipe, "--gpus", "1", *args), fragment, "set generation.overlap: off")


def test_an_engine_process_generates_on_its_own_gpu_only(tmp_path):
    recipe = write_recipe(tmp_path / "r.yaml", {**QWEN05, "distributed": {"nproc_per_node": 2}})
    result = cli_here(
        "validate", recipe, "--gpus", "2", "--set", "generation.engine_process=true",
        "--set", "generation.tensor_parallel_size=2",
    )  # fmt: skip
    assert_user_error(result, "generation.engine_process: true generates on each rank's own GPU", one_line=True)
    offload = cli_here(
        "validate", recipe, "--gpus", "2", "--set", "generation.engine_process=true",
        "--set", "generation.offload_trainer_during_generation=true", "--set", "distributed.deepspeed=zero3",
        "--set", "distributed.zero_stage=2",
    )  # fmt: skip
    assert_user_error(offload, "cannot move the trainer's DeepSpeed states from another process", one_line=True)


# ---------------------------------------------------------------------------------------------- slow: real runs


def engine_processes(proc) -> list[psutil.Process]:
    """The engine processes (spawned by the ranks) in the launcher's process tree."""
    return [p for p in psutil.Process(proc.pid).children(recursive=True) if "spawn_main" in " ".join(p.cmdline())]


@pytest.mark.slow
def test_an_overlapped_run_learns_with_each_batch_generated_a_step_ahead(tmp_path, fake_mps):
    """The quickstart (ZeRO-3, 2 ranks, 40 steps) with overlap: from step 2 on every generation batch was generated
    while the step before trained (overlap/ahead 1), so the generate phase is only the wait for it. Measured on 2
    cores: reward 0.004 -> 0.833 (without overlap 0.011 -> 0.963; the first steps learn slower, from one-step-old
    samples and, with transformers, no importance-sampling correction), 0.216 against 0.310 s/step. With
    `generation.mps: on`, as auto runs a large model on a GPU: torchrun under the MPS daemon (here conftest's test
    double), which quits after the run; the trainers below the engine processes in MPS priority (the benchmark's
    overlap-prio-mps), each process's settings in train.log."""
    run_dir = tmp_path / "run"
    prio = {"CUDA_MPS_CLIENT_PRIORITY": "1", "COLOCATE_RL_ENGINE_MPS_PRIORITY": "0"}
    proc = start(run_dir, "quickstart", *("--set", "generation.overlap=one_step", "--set", "generation.mps=on"),
                 env={**fake_mps, **prio})  # fmt: skip
    out, _ = proc.communicate(timeout=HANG_GUARD_S)
    assert proc.returncode == 0, out + (run_dir / "train.log").read_text()[-5000:]
    steps = step_records(run_dir)
    assert len(steps) == 40
    assert [r["overlap/ahead"] for r in steps] == [0.0] + [1.0] * 39
    assert all(r["engine_process/generate_s"] > 0 for r in steps)  # timed in the engine process
    values = [r["reward"] for r in steps]
    assert sum(values[-5:]) / 5 > sum(values[:5]) / 5 + 0.5, values
    log = (run_dir / "train.log").read_text()
    assert log.count("(transformers) ready; staging buffer") == 2  # one engine process per rank
    stops = [line for line in log.splitlines() if "engine process stopped in" in line]
    assert len(stops) == 2 and not any("dropped" in line for line in stops)  # no batch generated after the last step
    assert "overlap one_step, under CUDA MPS, engine in its own process" in out
    assert "CUDA MPS daemon" in log and (run_dir / "mps" / "fake.json").exists() and (run_dir / "mps" / "quit").exists()
    assert "clients' settings CUDA_MPS_CLIENT_PRIORITY=1" in log
    assert log.count("MPS client settings CUDA_MPS_CLIENT_PRIORITY=0") == 2  # each rank's engine process


@pytest.mark.slow
def test_without_overlap_two_engine_processes_generate_each_batch_in_turn(tmp_path):
    """generation.engine_process: true with overlap off (bench_overlap's `process-2e` arm: the engine processes' own
    generation speed, nothing beside them), two engine processes per rank each generating half of every batch: every
    step generates now, and its time in the engine processes is logged."""
    run_dir = tmp_path / "run"
    proc = start(
        run_dir, "quickstart", *DDP, *("--set", "generation.engine_process=true", "--set", "trainer.max_steps=4"),
        *("--set", "generation.engine_processes=2"),
        *("--set", "rewards=[{name: digit_share, processes: 2}]"),  # and the reward scored on 2 processes per rank
    )  # fmt: skip
    out, _ = proc.communicate(timeout=HANG_GUARD_S)
    assert proc.returncode == 0, out + (run_dir / "train.log").read_text()[-5000:]
    steps = step_records(run_dir)
    assert len(steps) == 4 and not any("overlap/ahead" in r for r in steps)
    assert (run_dir / "train.log").read_text().count("rewards[0].name digit_share: scored on 2 processes") == 2
    assert all(0 <= r["rewards/digit_share/mean"] <= 1 for r in steps) and any(r["reward"] > 0 for r in steps)
    assert all(0 < r["engine_process/generate_s"] <= r["time/generate_s"] for r in steps)  # within the phase
    ready = [line for line in (run_dir / "train.log").read_text().splitlines() if "ready; staging buffer" in line]
    assert len(ready) == 2 and all(re.search(r"engine processes \d+, \d+ \(transformers\) ready", x) for x in ready)
    # what benchmarks/bench_overlap.py reads of such a run (its `process-2e` arm)
    started = json.loads((run_dir / "timeline" / "rank0.jsonl").read_text().splitlines()[0])["t0"]
    f = import_benchmark("bench_overlap").figures("process-2e", run_dir, started=started)
    assert f["steps"] == 4 and f["s_per_step_range"][0] <= f["s_per_step"] <= f["s_per_step_range"][1]
    assert f["engine_generate_s"] > 0 and 0 < f["startup_s"] < HANG_GUARD_S  # rank 0's start to its first step
    assert f["engine_generate_steps"] == [round(r["engine_process/generate_s"], 3) for r in steps]
    assert all(r["engine_process/cpu_s"] > 0 and r["engine_process/preempted"] >= 0 for r in steps)
    assert f["engine_cpu_s"] > 0 and f["engine_preempted"] >= 0
    assert sum(line.count("ready; staging buffer") for line in f["startup_lines"]) == 2  # 2 ranks, 1 log


@pytest.mark.slow
def test_an_overlapped_run_stops_and_resumes_with_every_step_once(tmp_path):
    """Overlap with two engine processes per rank (what `engine_processes: auto` gives a small model on a GPU) and
    evaluation every 2 steps: a stop drops the generation in flight, the resume generates that batch again and then
    ahead again, and evaluation (through the engine processes, beside the batch generated ahead) keeps its steps."""
    run_dir = tmp_path / "run"
    max_steps = 12  # room for the stop: on a loaded 2-core machine SIGTERM landed 4 steps after step 3 was logged
    proc = start(
        run_dir, "quickstart", *DDP, *("--set", "generation.overlap=one_step", "--set", f"trainer.max_steps={max_steps}"),
        *("--set", "generation.engine_processes=2", "--set", "eval.every_steps=2", "--set", "eval.num_samples=16"),
    )  # fmt: skip
    wait_for_steps(proc, run_dir, 3)
    engines = engine_processes(proc)
    assert len(engines) == 4  # two for each of the two ranks
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=HANG_GUARD_S)
    assert proc.returncode == 143, out
    _, alive = psutil.wait_procs(engines, timeout=10)
    assert alive == []  # the generation they still ran for the next step was dropped with them
    [stopped] = events.read_events(run_dir, events.STOPPED)
    assert stopped["step"] <= max_steps - 2, "stopped too late to see a resumed step ahead again"
    resumed = cli("train", "--resume", run_dir, timeout=HANG_GUARD_S)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    steps = step_records(run_dir)
    assert [r["step"] for r in steps] == list(range(1, max_steps + 1))  # every step once
    after = [r["overlap/ahead"] for r in steps if r["step"] > stopped["step"]]
    assert after[0] == 0.0 and set(after[1:]) == {1.0}  # the dropped batch was generated again, then ahead again
    assert RunDir(run_dir).done.exists()
    stops = [line for line in (run_dir / "train.log").read_text().splitlines() if "processes stopped in" in line]
    assert len(stops) >= 2 and not any("dropped" in line for line in stops[-2:])  # the resumed run's end: nothing ahead
    evals = {r["step"]: r for r in read_metrics(run_dir) if "eval/reward" in r}
    assert set(range(0, max_steps + 1, 2)) - {stopped["step"]} <= set(evals)  # at 0 and every 2 steps (not the stop's)
    assert all(r["eval/completion_length"] > 0 and 0 <= r["eval/reward"] <= 1 for r in evals.values())


@pytest.mark.slow
def test_a_dead_engine_process_ends_the_run_in_one_line(tmp_path):
    run_dir = tmp_path / "run"
    proc = start(
        run_dir, "quickstart", *DDP, *("--set", "generation.overlap=one_step"), *("--set", "trainer.max_steps=400")
    )
    wait_for_steps(proc, run_dir, 2)
    victim = engine_processes(proc)[0]
    victim.kill()
    out, _ = proc.communicate(timeout=HANG_GUARD_S)
    assert proc.returncode != 0
    assert f"the generation engine process (pid {victim.pid}) ended with exit code -9" in out, out[-3000:]
    assert [e["kind"] for e in events.read_events(run_dir, events.ENGINE_FAILED)] == [events.ENGINE_FAILED]


def test_the_memory_estimate_counts_the_engine_process():
    """A second CUDA context and the staging buffer (the whole bf16 0.5B model: smaller than a 1 GiB bucket)."""
    from colocate_rl.memory.estimate import CUDA_CONTEXT_GIB, estimate

    inside = estimate(on_h200(QWEN05, "generation.sleep_level=0", "generation.overlap=off"), H200_GIB)
    overlap = ("generation.overlap=one_step", "generation.sleep_level=auto")
    own = estimate(on_h200(QWEN05, *overlap), H200_GIB)
    term = own.terms["engine process (CUDA context, staging buffer)"]
    model_gib = 2 * inside.layout.params / 2**30
    assert term["training"] == pytest.approx(CUDA_CONTEXT_GIB + model_gib) and model_gib < 1
    assert "engine process (CUDA context, staging buffer)" not in inside.terms
    assert own.peak()[1] == pytest.approx(inside.peak()[1] + term["training"], abs=0.01)
    mp = on_h200(QWEN05, *overlap, "generation.vllm_multiprocessing=true")
    beside = estimate(mp, H200_GIB).terms["engine process (CUDA context, staging buffer)"]
    assert beside["training"] == pytest.approx(term["training"] + CUDA_CONTEXT_GIB)  # vLLM's engine core: a third


def test_the_memory_estimate_counts_every_engine_process():
    """Two engine processes: a CUDA context, vLLM's weights and its allowance each, the staging buffer and one batch's
    KV cache once; `auto` asks for the larger share (each engine process gets half of it)."""
    from colocate_rl.memory.estimate import CUDA_CONTEXT_GIB, VLLM_ALLOWANCE_GIB, estimate

    overlap = ("generation.overlap=one_step", "generation.sleep_level=0", "generation.vllm_gpu_memory_utilization=0.3")
    one = estimate(on_h200(QWEN05, *overlap), H200_GIB)
    two = estimate(on_h200(QWEN05, *overlap, "generation.engine_processes=2"), H200_GIB)
    engine = "engine process (CUDA context, staging buffer)"
    assert two.terms[engine]["training"] == pytest.approx(one.terms[engine]["training"] + CUDA_CONTEXT_GIB)
    weights = one.terms["vLLM weights"]["generation"]
    assert two.terms["vLLM weights"]["generation"] == pytest.approx(2 * weights)
    assert two.need_gib == pytest.approx(one.need_gib + weights + VLLM_ALLOWANCE_GIB)
    assert two.kv == one.kv and two.chosen > one.chosen
    assert two.max_seqs(0.3) < one.max_seqs(0.3)  # the same share less a second copy of weights and allowance
    assert two.peak()[1] == pytest.approx(one.peak()[1] + CUDA_CONTEXT_GIB, abs=0.01)  # the share is the recipe's
    from colocate_rl.memory.autolayout import choose_share

    auto_one = choose_share(on_h200(QWEN05, *overlap), H200_GIB)
    auto_two = choose_share(on_h200(QWEN05, *overlap, "generation.engine_processes=2"), H200_GIB)
    assert auto_two.share == two.chosen > auto_one.share == one.chosen
    assert "2 engine processes' vLLM weights and allowances" in auto_two.reason
    assert "vLLM's weights" in auto_one.reason and "engine processes" not in auto_one.reason


def test_engine_processes_auto_runs_two_for_a_small_model_when_the_recipe_puts_the_engine_in_its_own_process(tmp_path):
    """Two where vLLM's one-thread loop limited SmolLM2-135M's generation on an H200 (docs/benchmarks, invocation L);
    decided before vLLM's share, which then holds both copies; recorded, so the ranks and a resume read 2."""
    r = on_h200("smollm2-135m-gsm8k", "generation.overlap=one_step")
    gen = r.recipe.generation
    assert (gen.engine_processes, gen.vllm_gpu_memory_utilization) == (2, 0.09)
    assert r.choice_lines()[:2] == [
        "generation.engine_processes auto: 2 — a model of 0.13B parameters: vLLM's per-token loop on one CPU core is "
        "what its generation waits for, so 2 loops each generate part of every batch (32 CPU cores a rank)",
        r.share_choice.line(),
    ]
    assert "2 engine processes' vLLM weights and allowances" in r.share_choice.reason
    assert r.recorded_recipe().generation.engine_processes == 2
    assert launch_of(r, tmp_path)["engine"]["processes"] == 2
    same = on_h200("smollm2-135m-gsm8k", "generation.engine_process=true")  # without overlap, too
    assert same.recipe.generation.engine_processes == 2


def test_the_estimate_says_the_batch_is_split_and_each_engine_process_has_its_weights_and_allowance():
    result = cli_here(
        "mem-probe", "smollm2-135m-gsm8k", "--estimate", "--gpus", "1", "--gpu-memory", "140.4",
        "--set", "generation.overlap=one_step",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "32 sequences per vLLM engine (split among its 2 engine processes) × 768 tokens" in result.stdout
    assert "(2 × (vLLM weights + 2 GiB allowance) + KV = 5.03 GiB)" in result.stdout


@pytest.mark.parametrize(
    ("recipe", "sets", "host", "reason"),
    [
        ("smollm2-135m-gsm8k", ("generation.overlap=off",), None, "the engine runs in the rank's process"),
        (
            "smollm2-135m-gsm8k",
            ("generation.overlap=one_step", "generation.vllm_gpu_memory_utilization=0.2"),
            None,
            "generation.vllm_gpu_memory_utilization is set, for one engine process",
        ),
        (
            QWEN05,
            ("generation.overlap=one_step", "generation.sleep_level=0", "generation.vllm_gpu_memory_utilization=auto"),
            None,
            "a model of 0.49B parameters: more engine processes were measured faster only up to 0.25B",
        ),
        ("smollm2-135m-gsm8k", ("generation.overlap=one_step",), 3, "3 CPU cores a rank (two engine loops need 4)"),
    ],
    ids=["in-the-rank", "explicit-share", "0.5b", "3-cores"],
)
def test_engine_processes_auto_runs_one_otherwise_and_says_why(recipe, sets, host, reason):
    h = assumed_host(1, H200_GIB, **({"cpu_count": host} if host else {}))
    r = resolved_for(recipe, h, *sets)
    assert r.recipe.generation.engine_processes == 1
    assert r.engine_processes_choice.count == 1 and r.engine_processes_choice.reason.startswith(reason)
    assert r.recorded_recipe().generation.engine_processes == 1


def test_engine_processes_auto_on_cpu_generates_with_one_transformers_process():
    r = resolved_for("quickstart", CPU, "generation.engine_process=true")
    assert r.backend == "transformers" and r.recipe.generation.engine_processes == 1
    assert "generation.engine_processes auto: 1 — generation with transformers" in r.choice_lines()
    explicit = resolved_for("quickstart", CPU, "generation.engine_process=true", "generation.engine_processes=2")
    assert explicit.engine_processes_choice is None and explicit.recipe.generation.engine_processes == 2


def test_engine_processes_are_recorded_and_need_the_engine_in_its_own_process(tmp_path):
    r = on_h200(QWEN05, "generation.overlap=one_step", "generation.sleep_level=0", "generation.engine_processes=3")
    assert launch_of(r, tmp_path)["engine"]["processes"] == 3
    recipe = write_recipe(tmp_path / "r.yaml", QWEN05)
    result = cli_here("validate", recipe, "--gpus", "1", "--set", "generation.engine_processes=2")
    assert_user_error(result, "generation.engine_processes: 2 needs the engine in its own process", one_line=True)
    zero = cli_here("validate", recipe, "--gpus", "1", "--set", "generation.engine_processes=0")
    assert_user_error(zero, "generation.engine_processes")


def test_vllms_engine_core_runs_in_a_process_of_its_own_only_when_asked(tmp_path):
    """Off by default (beside training it generated slower on the H200); the ranks read it from the engine options."""
    r = on_h200(QWEN05, "generation.overlap=one_step", "generation.sleep_level=auto")
    assert launch_of(r, tmp_path)["engine"]["multiprocessing"] is False
    mp = on_h200(
        QWEN05, "generation.overlap=one_step", "generation.sleep_level=0", "generation.vllm_multiprocessing=true"
    )
    assert launch_of(mp, tmp_path)["engine"]["multiprocessing"] is True


def test_vllms_engine_core_in_its_own_process_needs_the_engine_process(tmp_path):
    recipe = write_recipe(tmp_path / "r.yaml", QWEN05)
    result = cli_here("validate", recipe, "--gpus", "1", "--set", "generation.vllm_multiprocessing=true")
    assert_user_error(
        result, "generation.vllm_multiprocessing: true needs vLLM generating in an engine process", one_line=True
    )
    ok = cli_here(
        "validate", recipe, "--gpus", "1", "--set", "generation.vllm_multiprocessing=true",
        "--set", "generation.engine_process=true",
    )  # fmt: skip
    assert ok.returncode == 0, ok.stderr
