"""benchmarks/bench_real_model.py on CPU: the commands its --dry-run prints (sets, GPUs, vLLM shares, schedule), the
scheduling of rows over slots, and the tables it builds from run directories.

The driver itself cannot run here: every row is a real `colocate-rl train` of SmolLM2-135M on a GPU with vLLM. The
runs below are fakes: the metrics.jsonl files are written by hand to test the table code, and the end-to-end test
replaces the train command with a tiny Python process."""

import json
import shlex
import subprocess
import sys
import threading
import time

import pytest
from conftest import ROOT, import_benchmark

B = import_benchmark("bench_real_model")
SCRIPT = ROOT / "benchmarks" / "bench_real_model.py"


def driver(*args, timeout=120):
    return subprocess.run(
        [sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True, cwd=ROOT, timeout=timeout
    )


def commands(stdout: str) -> dict[str, tuple[dict, list[str], list[str]]]:
    """row → (environment, argv before the sets, the --set items) of each printed command."""
    found = {}
    for line in stdout.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        words = shlex.split(line)
        env = dict(w.split("=", 1) for w in words if "=" in w and w.split("=", 1)[0].isupper())
        argv = words[len(env) :]
        first_set = argv.index("--set")
        sets = argv[first_set + 1 :: 2]
        assert argv[first_set::2] == ["--set"] * len(sets), line
        run_dir = argv[argv.index("--run-dir") + 1]
        found[run_dir.rsplit("/", 1)[1]] = (env, argv[:first_set], sets)
    return found


@pytest.mark.slow
def test_dry_run_prints_one_command_per_row_with_its_sets_gpu_and_share(tmp_path):
    out = tmp_path / "out"
    result = driver(
        "--out",
        out,
        "--model",
        "/models/smol",
        "--data",
        "/data/gsm",
        "--devices",
        "0,1",
        "--per-gpu",
        "2",
        "--set",
        "generation.enforce_eager=true",
        "--dry-run",
    )
    assert result.returncode == 0, result.stderr
    assert not out.exists()  # runs and writes nothing
    found = commands(result.stdout)
    assert sorted(found) == sorted(f"{a}-{m}-s{s}" for a in ("grpo", "rloo") for m in ("full", "lora") for s in (0, 1))
    assert len([line for line in result.stdout.splitlines() if "-m colocate_rl train" in line]) == 8
    env, head, sets = found["rloo-lora-s1"]
    assert head == [
        sys.executable,
        "-m",
        "colocate_rl",
        "train",
        "recipes/smollm2-135m-gsm8k.yaml",
        "--run-dir",
        str(out / "runs" / "rloo-lora-s1"),
    ]
    assert sets == [
        "model.name=/models/smol",
        "data.source=/data/gsm/gsm_symbolic_train.jsonl",
        "eval.source=/data/gsm/gsm_symbolic_test.jsonl",
        "algorithm=rloo",
        "trainer.seed=1",
        "trainer.max_steps=100",
        "eval.every_steps=20",
        "eval.num_samples=200",
        "model.lora={r: 16, alpha: 32}",
        "trainer.learning_rate=2.0e-4",
        "generation.vllm_gpu_memory_utilization=0.2",  # min(recipe 0.3, 0.4 / 2 runs per GPU)
        "generation.enforce_eager=true",  # the user's --set, last
    ]
    _, _, full = found["grpo-full-s0"]  # full fine-tuning: no LoRA, the recipe's learning rate
    assert full == [
        "model.name=/models/smol",
        "data.source=/data/gsm/gsm_symbolic_train.jsonl",
        "eval.source=/data/gsm/gsm_symbolic_test.jsonl",
        "algorithm=grpo",
        "trainer.seed=0",
        "trainer.max_steps=100",
        "eval.every_steps=20",
        "eval.num_samples=200",
        "generation.vllm_gpu_memory_utilization=0.2",
        "generation.enforce_eager=true",
    ]
    # 4 slots interleaved over the GPUs (0, 1, 0, 1); with equal run times slot i runs rows i and i + 4, so each
    # GPU has one full and one LoRA run of the same algorithm at a time
    gpu = {row: env["CUDA_VISIBLE_DEVICES"] for row, (env, _, _) in found.items()}
    assert gpu == {
        "grpo-full-s0": "0",
        "rloo-full-s0": "1",
        "grpo-lora-s0": "0",
        "rloo-lora-s0": "1",
        "grpo-full-s1": "0",
        "rloo-full-s1": "1",
        "grpo-lora-s1": "0",
        "rloo-lora-s1": "1",
    }
    assert all(e["HF_HUB_OFFLINE"] == "1" for e, _, _ in found.values())
    assert "vLLM share 0.2 per run = min(recipe 0.3, 0.4 / 2 runs per GPU)" in result.stdout
    assert "#   slot 0 (GPU 0): grpo-full-s0, grpo-full-s1" in result.stdout
    assert "#   slot 3 (GPU 1): rloo-lora-s0, rloo-lora-s1" in result.stdout


def test_vllm_share_follows_the_runs_per_gpu():
    assert B.vllm_share(1, 0.4, [])[0] == 0.3  # alone: the recipe's share
    assert B.vllm_share(2, 0.4, [])[0] == 0.2
    assert B.vllm_share(3, 0.4, [])[0] == 0.133
    assert B.vllm_share(2, 0.8, [])[0] == 0.3  # the brief's 0.8 / K leaves the recipe's share at K = 2
    assert B.vllm_share(4, 0.8, [])[0] == 0.2
    # the user's --set wins and adds nothing
    assert B.vllm_share(4, 0.4, ["generation.vllm_gpu_memory_utilization=0.25"]) == (0.25, None)


@pytest.mark.slow
def test_a_share_given_by_set_is_not_overridden(tmp_path):
    result = driver(
        *("--out", tmp_path, "--model", "/m", "--data", "/d", "--per-gpu", "3", "--rows", "grpo-full-s0"),
        *("--set", "generation.vllm_gpu_memory_utilization=0.25", "--dry-run"),
    )
    assert result.returncode == 0, result.stderr
    (_, _, sets), *_ = commands(result.stdout).values()
    assert [s for s in sets if "vllm_gpu_memory_utilization" in s] == ["generation.vllm_gpu_memory_utilization=0.25"]
    assert "vLLM share 0.25 per run (given by --set)" in result.stdout


@pytest.mark.parametrize("row", list(B.ROWS))
def test_each_rows_sets_are_recipe_keys_with_the_intended_values(row, tmp_path):
    """The sets of a row, applied to the shipped recipe as `train --set` applies them, pass the recipe schema."""
    from colocate_rl.recipe.load import apply_overrides, parse_recipe, parse_sets, read_yaml

    sets = B.row_sets(row, tmp_path / "m", tmp_path / "d", 100, 20, 200, 0.2, [])
    recipe = parse_recipe(apply_overrides(read_yaml(ROOT / B.RECIPE), parse_sets(sets)))
    algorithm, mode, seed = row.split("-")
    assert (recipe.algorithm, recipe.trainer.seed) == (algorithm, int(seed[1:]))
    assert (recipe.trainer.max_steps, recipe.eval.every_steps, recipe.eval.num_samples) == (100, 20, 200)
    assert recipe.model.name == str(tmp_path / "m")
    assert recipe.data.source == str(tmp_path / "d" / "gsm_symbolic_train.jsonl")
    assert recipe.eval.source == str(tmp_path / "d" / "gsm_symbolic_test.jsonl")
    assert recipe.generation.vllm_gpu_memory_utilization == 0.2
    if mode == "lora":
        assert (recipe.model.lora.r, recipe.model.lora.alpha, recipe.trainer.learning_rate) == (16, 32, 2.0e-4)
    else:
        assert recipe.model.lora is None and recipe.trainer.learning_rate == 1.0e-5


@pytest.mark.slow
def test_timing_mode_runs_the_full_lora_pair_one_per_gpu(tmp_path):
    result = driver("--out", tmp_path, "--model", "/m", "--data", "/d", "--devices", "0,1", "--timing", "--dry-run")
    assert result.returncode == 0, result.stderr
    found = commands(result.stdout)
    assert list(found) == ["grpo-full-s0", "grpo-lora-s0"]
    assert [env["CUDA_VISIBLE_DEVICES"] for env, _, _ in found.values()] == ["0", "1"]
    for _, head, sets in found.values():
        assert head[-1].startswith(str(tmp_path / "timing")) and "trainer.max_steps=30" in sets
        assert "generation.vllm_gpu_memory_utilization=0.3" in sets  # alone on its GPU: the recipe's share
    assert "GPU 0 × 1, GPU 1 × 1" in result.stdout
    bad = driver("--out", tmp_path, "--model", "/m", "--data", "/d", "--timing", "--per-gpu", "2", "--dry-run")
    assert bad.returncode == 2 and "one run per GPU" in bad.stderr


@pytest.mark.slow
def test_rows_are_picked_by_name_or_pattern(tmp_path):
    picked = driver("--out", tmp_path, "--model", "/m", "--data", "/d", "--rows", "rloo-*,grpo-lora-s1", "--dry-run")
    assert picked.returncode == 0, picked.stderr
    assert list(commands(picked.stdout)) == [
        "rloo-full-s0",
        "rloo-lora-s0",
        "rloo-full-s1",
        "grpo-lora-s1",
        "rloo-lora-s1",
    ]
    bad = driver("--out", tmp_path, "--model", "/m", "--data", "/d", "--rows", "ppo-full-s0", "--dry-run")
    assert bad.returncode == 2 and "unknown rows ['ppo-full-s0']" in bad.stderr
    late = driver("--out", tmp_path, "--model", "/m", "--data", "/d", "--steps", "10", "--dry-run")
    assert late.returncode == 2 and "--eval-every ≤ --steps" in late.stderr


def test_a_taken_run_directory_gets_the_next_suffix(tmp_path):
    assert B.run_dir_for(tmp_path, "matrix", "grpo-full-s0") == tmp_path / "runs" / "grpo-full-s0"
    (tmp_path / "runs" / "grpo-full-s0").mkdir(parents=True)
    assert B.run_dir_for(tmp_path, "matrix", "grpo-full-s0") == tmp_path / "runs" / "grpo-full-s0.2"
    assert B.run_dir_for(tmp_path, "timing", "grpo-full-s0") == tmp_path / "timing" / "grpo-full-s0"


# ---------------------------------------------------------------------------------------------- scheduling


@pytest.fixture(autouse=True)
def quick_polls(monkeypatch):
    monkeypatch.setattr(B, "POLL_S", 0.01)  # the scheduler looks at waiting starts every 10 ms, not 2 s


def fake_jobs(tmp_path, rows):
    return [B.Job(row, tmp_path / row, ["true"]) for row in rows]


def timed_launch(durations, log):
    t0 = time.monotonic()

    def launch(job, device, timeout):
        start = time.monotonic() - t0
        time.sleep(durations[job.row])
        log.append((job.row, device, round(start, 2), round(time.monotonic() - t0, 2), timeout))
        return {"row": job.row, "exit": 0}

    return launch


def test_a_slot_takes_the_next_row_when_its_run_ends(tmp_path):
    """Two GPUs × 2 runs; the runs take different times: a slot that is free first takes the next row, and never
    more than 2 runs share a GPU."""
    durations = {"a": 0.6, "b": 0.2, "c": 0.4, "d": 0.2, "e": 0.1, "f": 0.1}
    log = []
    results, skipped = B.schedule(
        fake_jobs(tmp_path, durations), B.slots(["0", "1"], 2), timed_launch(durations, log), start_wait=0
    )
    assert skipped == [] and sorted(r["row"] for r in results) == list("abcdef")
    where = {row: device for row, device, *_ in log}
    assert [where[r] for r in "abcd"] == ["0", "1", "0", "1"]  # the first rows fill the slots in turn
    # b and d (0.2 s, GPU 1) end first: their slots take e and f, while a and c still run on GPU 0
    assert where["e"] == where["f"] == "1"
    for device in "01":
        spans = [(s, e) for _, d, s, e, _ in log if d == device]
        for s, _ in spans:
            assert sum(a <= s + 0.01 < b for a, b in spans) <= 2


def test_runs_that_end_in_start_order_follow_the_printed_schedule(tmp_path):
    """Starts staggered (no engine seen: start_wait 0.05 s), runs that end in the order they started: each row lands
    on the slot the dry run's schedule names."""
    rows = list(B.ROWS)
    durations = dict(zip(rows, [0.3, 0.4, 0.5, 0.6] + [0.6] * 4))
    log = []
    lanes = B.slots(["0", "1"], 2)
    B.schedule(fake_jobs(tmp_path, rows), lanes, timed_launch(durations, log), start_wait=0.05)
    plan = B.planned_schedule(rows, len(lanes))
    assert {row: device for row, device, *_ in log} == {r: lanes[i] for i, rs in enumerate(plan) for r in rs}
    starts = {row: s for row, _, s, _, _ in log}
    assert starts["grpo-full-s0"] + 0.04 <= starts["rloo-full-s0"]  # GPU 1's first run waits for the first run
    assert starts["grpo-full-s0"] + 0.04 <= starts["grpo-lora-s0"]  # GPU 0's second run waits for its first


def test_a_run_starts_once_the_one_before_has_its_engine_up(tmp_path):
    """Start-ups are staggered: the next run waits for the previous run's vLLM engine (here: a flag), for the
    previous run's end, or at most start_wait."""
    up = threading.Event()
    log = []
    durations = {"a": 2.0, "b": 0.1}  # wide margins: the windows below hold on a loaded 2-core machine

    def ready(run_dir):
        return run_dir.name == "a" and up.is_set()

    threading.Timer(0.4, up.set).start()
    B.schedule(fake_jobs(tmp_path, durations), ["0", "1"], timed_launch(durations, log), start_wait=5, ready=ready)
    starts = {row: s for row, _, s, _, _ in log}
    assert 0.35 <= starts["b"] - starts["a"] < 1.5  # waited for a's engine (0.4 s), not for a's end (2 s)
    log.clear()
    B.schedule(fake_jobs(tmp_path, durations), ["0", "1"], timed_launch(durations, log), start_wait=0.2)
    starts = {row: s for row, _, s, _, _ in log}
    assert 0.15 <= starts["b"] - starts["a"] < 1.5  # no engine seen: at most start_wait, not a's end
    log.clear()  # per GPU: c (GPU 0) waits for a's engine only, d (GPU 1) for b's as well
    engines = {"a": threading.Event(), "b": threading.Event()}
    threading.Timer(0.3, engines["a"].set).start()
    threading.Timer(1.2, engines["b"].set).start()
    durations = dict.fromkeys("abcd", 2.5)
    B.schedule(
        fake_jobs(tmp_path, durations),
        ["0", "1", "0", "1"],
        timed_launch(durations, log),
        start_wait=5,
        ready=lambda run_dir: run_dir.name in engines and engines[run_dir.name].is_set(),
    )
    starts = {row: s - min(s for _, _, s, _, _ in log) for row, _, s, _, _ in log}
    assert 0.25 <= starts["b"] < 1.0 and 0.25 <= starts["c"] < 1.0 and 1.15 <= starts["d"] < 2.0, starts
    log.clear()
    durations = {"a": 0.1, "b": 0.1}
    B.schedule(fake_jobs(tmp_path, durations), ["0", "1"], timed_launch(durations, log), start_wait=5)
    starts = {row: s for row, _, s, _, _ in log}
    assert 0.05 <= starts["b"] - starts["a"] < 1.5  # a ended (before its engine was seen): b starts, no 5 s wait


def test_with_a_fixed_kv_pool_runs_wait_for_the_first_engine_only(tmp_path):
    """generation.kv_cache_memory set: vLLM's start-up measures no free memory, so the runs on one GPU start together
    once the first run's engine is up (its compile is then cached); without it they are staggered one by one."""
    assert B.fixed_kv_pool(["generation.kv_cache_memory=3GiB"]) and not B.fixed_kv_pool([])
    engines = {row: threading.Event() for row in "abcd"}
    threading.Timer(0.3, engines["a"].set).start()
    threading.Timer(1.5, engines["b"].set).start()
    log = []
    durations = dict.fromkeys("abcd", 2.0)
    B.schedule(
        fake_jobs(tmp_path, durations),
        ["0"] * 4,
        timed_launch(durations, log),
        start_wait=5,
        ready=lambda run_dir: engines[run_dir.name].is_set(),
        after_previous=False,
    )
    starts = {row: s - min(s for _, _, s, _, _ in log) for row, _, s, _, _ in log}
    assert all(0.25 <= starts[row] < 1.2 for row in "bcd"), starts  # after a's engine (0.3 s), not b's (1.5 s)


def test_engine_up_reads_the_runs_event(tmp_path):
    assert not B.engine_up(tmp_path)
    (tmp_path / "events.jsonl").write_text(json.dumps({"t": 1, "rank": 0, "kind": "engine_memory"}) + "\n")
    assert B.engine_up(tmp_path)


def test_the_deadline_bounds_the_runs_and_starts_no_more(tmp_path, monkeypatch):
    monkeypatch.setattr(B, "MIN_START_S", 0.3)
    durations = {"a": 0.5, "b": 0.1}
    log = []
    results, skipped = B.schedule(
        fake_jobs(tmp_path, durations),
        ["0"],
        timed_launch(durations, log),
        start_wait=0,
        deadline=time.monotonic() + 0.7,
    )
    assert [r["row"] for r in results] == ["a"] and skipped == ["b"]  # 0.2 s left after a: less than 0.3
    assert 0.6 <= log[0][4] <= 0.7  # a's timeout: the time left to the deadline


# ---------------------------------------------------------------------------------------------- figures and tables


def write_run(run_dir, evals, rewards, *, walls=None, sync=0.05, peak=30.0, lora=False, launch=True):
    """A run directory written by hand (not by a run) to test the table code: metrics.jsonl with training records
    and eval records, launch.json, final/."""
    from colocate_rl.plan.engine_options import EngineOptions
    from colocate_rl.plan.launch_spec import LaunchSpec

    run_dir.mkdir(parents=True)
    walls = walls or [10.0 + 1.5 * i for i in range(len(rewards))]
    records = [
        {
            "step": i + 1,
            "max_steps": len(rewards),
            "wall_s": walls[i],
            "reward": reward,
            "time/step_s": 1.4,
            "time/weight_sync_s": sync * (10 if i == 0 else 1),  # step 1 (warm-up) is left out
            "mem/gpu_peak_gib": peak + (1.0 if i == 2 else 0.0),
        }
        for i, reward in enumerate(rewards)
    ]
    for step, (total, correct, fmt) in evals.items():
        records.insert(
            step,
            {
                "step": step,
                "wall_s": walls[step - 1] + 0.5,
                "eval/math_verify": correct,
                "eval/hash_answer_format": fmt,
                "eval/reward": total,
                "eval/completion_length": 150.0,
                "time/eval_s": 4.0,
            },
        )
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    if launch:
        engine = EngineOptions(0, None, False, None, 8192, False, 64 * 2**20, False, True, False, 1)
        spec = LaunchSpec(
            "/m", "grpo", "vllm", "cuda", 1, {"vllm_gpu_memory_utilization": 0.2, "learning_rate": 1e-5}, engine, "h"
        )
        (run_dir / "launch.json").write_text(spec.to_json())
    final = run_dir / "final"
    final.mkdir()
    name = "adapter_model.safetensors" if lora else "model.safetensors"
    (final / name).write_bytes(b"\0" * (2**20 if lora else 3 * 2**20))


def test_figures_of_a_run_from_its_metrics(tmp_path):
    run = tmp_path / "grpo-full-s0"
    rewards = [0.0, 0.1, 0.0, 0.1, 0.05, 0.2, 0.3, 0.2, 0.4, 0.3, 0.2]
    walls = [10.0, 11.5, 13.0, 14.0, 15.5, 17.0, 18.5, 20.0, 21.5, 23.0, 30.0]  # step 11 waited for an eval
    write_run(run, {5: (0.1, 0.0, 0.2), 10: (0.3, 0.05, 0.5)}, rewards, walls=walls)
    f = B.figures(run, 0)
    assert f["eval_reward"] == [[5, 0.1], [10, 0.3]] and (f["eval_first"], f["eval_last"]) == (0.1, 0.3)
    assert f["eval_last_by_reward"] == {"math_verify": 0.05, "hash_answer_format": 0.5}
    assert f["eval_last_completion_length"] == 150.0
    assert f["reward_first5"] == pytest.approx(0.05) and f["reward_last5"] == pytest.approx(0.28)
    assert f["reward_mean"] == pytest.approx(sum(rewards) / 11, abs=1e-4)
    assert f["steps"] == 11 and f["s_per_step"] == 1.5  # median of the wall_s differences after step 1
    assert f["weight_sync_s"] == 0.05 and f["step_s"] == 1.4 and f["gpu_peak_gib"] == 31.0
    assert f["launched"]["vllm_share"] == 0.2 and f["launched"]["sleep_level"] == 0
    assert (f["final_mib"], f["final_kind"]) == (3.0, "model")
    assert "log_tail" not in f
    short = tmp_path / "short"  # 3 steps: step 1 (vLLM compile, first sync) would move the medians
    short.mkdir()
    records = [
        {"step": s, "wall_s": w, "reward": 0.1, "time/step_s": t, "time/weight_sync_s": t / 10}
        for s, w, t in ((1, 30.0, 30.0), (2, 31.0, 1.0), (3, 33.0, 2.0))
    ]
    (short / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    f = B.figures(short, 0)
    assert (f["s_per_step"], f["step_s"], f["weight_sync_s"], f["eval_reward"]) == (1.5, 1.5, 0.15, [])
    assert "eval_first" not in f


def test_a_failed_run_keeps_its_log_tails(tmp_path):
    run = tmp_path / "rloo-full-s0"
    run.mkdir()
    (run / "train.log").write_text("x" * 5000 + "CUDA error: out of memory\n")
    cli_log = tmp_path / "rloo-full-s0.log"
    cli_log.write_text("error: the ranks stopped\n")
    f = B.figures(run, 1, cli_log)
    assert f["exit"] == 1 and f["steps"] == 0 and "launched" not in f
    assert f["log_tail"].endswith("CUDA error: out of memory\n") and len(f["log_tail"]) == 3000
    assert f["cli_tail"] == "error: the ranks stopped\n"


def result_row(run_dir, row, per_gpu, mode="matrix", code=0):
    algorithm, kind, seed = B.ROWS[row]
    return {
        "row": row,
        "mode": mode,
        "algorithm": algorithm,
        "lora": kind == "lora",
        "seed": seed,
        "device": "0",
        "per_gpu": per_gpu,
        "wall_s": 300.0,
        **B.figures(run_dir, code),
    }


def test_tables_from_hand_written_runs(tmp_path):
    ten = [0.1] * 5 + [0.3] * 5
    write_run(tmp_path / "a", {5: (0.1, 0.0, 0.2), 10: (0.3, 0.05, 0.5)}, ten)
    write_run(tmp_path / "b", {5: (0.2, 0.0, 0.4), 10: (0.25, 0.0, 0.5)}, ten)
    write_run(tmp_path / "c", {5: (0.15, 0.0, 0.3), 10: (0.35, 0.1, 0.5)}, ten, lora=True, sync=0.02, peak=20.0)
    (tmp_path / "d").mkdir()
    write_run(tmp_path / "t-full", {5: (0.1, 0.0, 0.2), 10: (0.3, 0.0, 0.6)}, ten, sync=0.08, peak=40.0)
    write_run(tmp_path / "t-lora", {5: (0.1, 0.0, 0.2), 10: (0.3, 0.0, 0.6)}, ten, lora=True, sync=0.02, peak=30.0)
    results = [
        result_row(tmp_path / "d", "grpo-full-s0", 2, code=1),  # failed, then run again:
        result_row(tmp_path / "a", "grpo-full-s0", 2),
        result_row(tmp_path / "b", "grpo-full-s1", 2),
        result_row(tmp_path / "c", "grpo-lora-s0", 2),
        result_row(tmp_path / "d", "rloo-full-s0", 2, code=1),
        result_row(tmp_path / "t-full", "grpo-full-s0", 1, mode="timing"),
        result_row(tmp_path / "t-lora", "grpo-lora-s0", 1, mode="timing"),
    ]
    text = B.table(results)
    # per row: the last result of grpo-full-s0 (the rerun) only
    per_row = text.split("## Per config")[0]
    assert per_row.count("| grpo-full-s0 |") == 1 and "| grpo-full-s0 | 0 | 300.0 | 10 | 0 | 2 |" in per_row
    assert "| 5: 0.100, 10: 0.300 | 0.100 → 0.300 | math_verify 0.050, hash_answer_format 0.500 | 150.0 |" in text
    assert "| 0.100 → 0.300 |" in text  # training reward, first 5 → last 5 steps
    # per config: mean (min–max) over the seeds that finished
    assert (
        "| grpo-full | 2 of 2 (0, 1) | 0.150 (0.100–0.200) | 0.275 (0.250–0.300) | +0.125 (+0.050–+0.200) | 2 of 2 |"
        in text
    )
    assert "| grpo-lora | 1 of 1 (0) | 0.150 | 0.350 | +0.200 | 1 of 1 |" in text
    assert "| 2 of 2 | 0.100 → 0.300 | 0.200 (0.200–0.200) |" in text  # then the mean reward of every step
    assert "| rloo-full | 0 of 1 |" in text
    # time and memory: the matrix marked with its runs per GPU, the timing rows apart
    assert "## Time and memory, measured with 2 run(s) per GPU" in text and "includes the other runs" in text
    matrix_part, timing_part = text.split("## Time and memory, one run per GPU")
    assert "| grpo-lora-s0 | 2 | 0.200 | 0 | False | 1.500 | 1.400 | 0.0200 | 21.00 |  | 1.0 (adapter) | 0 |" in (
        matrix_part
    )
    assert "| grpo-full-s0 | 1 | 0.200 | 0 | False | 1.500 | 1.400 | 0.0800 | 41.00 |  | 3.0 (model) | 0 |" in (
        timing_part
    )
    assert (
        "- grpo seed 0, LoRA vs full: s/step 1.00×, weight sync 0.25×, GPU peak 31.0 vs 41.0 GiB, final/ 1.0 vs 3.0"
        in (timing_part)
    )


def fake_train(monkeypatch, outcomes):
    """Replace the train command of each row with a small Python process: exit code and output from `outcomes`
    (row → (code, text)); a row that exits 0 leaves a hand-written metrics.jsonl in its run directory."""
    script = (
        "import json, pathlib, sys\n"
        "run, code, text = pathlib.Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]\n"
        "run.mkdir(parents=True)\n"
        "print(text)\n"
        "if code == 0:\n"
        "    recs = [{'step': s, 'wall_s': 1.5 * s, 'reward': 0.1} for s in (1, 2, 3)]\n"
        "    recs.insert(3, {'step': 3, 'wall_s': 5.0, 'eval/reward': 0.4, 'eval/math_verify': 0.1})\n"
        "    (run / 'metrics.jsonl').write_text(''.join(json.dumps(r) + '\\n' for r in recs))\n"
        "sys.exit(code)\n"
    )

    def command(run_dir, sets):
        code, text = outcomes[run_dir.name]
        return [sys.executable, "-c", script, str(run_dir), str(code), text]

    monkeypatch.setattr(B, "command", command)


@pytest.mark.slow
def test_a_failing_row_is_recorded_and_the_driver_goes_on(tmp_path, monkeypatch):
    model, data, out = tmp_path / "model", tmp_path / "data", tmp_path / "out"
    model.mkdir(), data.mkdir()
    (model / "config.json").write_text("{}")
    (data / "gsm_symbolic_train.jsonl").write_text("{}\n")
    (data / "gsm_symbolic_test.jsonl").write_text("{}\n")
    fake_train(monkeypatch, {"grpo-full-s0": (3, "boom: the first row failed"), "grpo-lora-s0": (0, "ok")})
    args = ["--out", str(out), "--model", str(model), "--data", str(data), "--rows", "grpo-full-s0,grpo-lora-s0"]
    code = B.main([*args, "--steps", "3", "--eval-every", "3", "--start-wait", "0"])
    assert code == 1  # a row failed
    results = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    by = {r["row"]: r for r in results}
    assert set(by) == {"grpo-full-s0", "grpo-lora-s0"}
    assert by["grpo-full-s0"]["exit"] == 3 and "boom: the first row failed" in by["grpo-full-s0"]["cli_tail"]
    assert by["grpo-lora-s0"]["exit"] == 0 and by["grpo-lora-s0"]["eval_reward"] == [[3, 0.4]]
    assert by["grpo-lora-s0"]["command"].startswith("CUDA_VISIBLE_DEVICES=0 OMP_NUM_THREADS=")
    assert (by["grpo-lora-s0"]["per_gpu"], by["grpo-lora-s0"]["vllm_share"]) == (1, 0.3)
    table = (out / "table.md").read_text()
    assert "| grpo-lora-s0 | 0 |" in table and "| grpo-full-s0 | 3 |" in table
    # --table rewrites table.md from results.jsonl alone
    (out / "table.md").unlink()
    again = driver("--out", out, "--table")
    assert again.returncode == 0, again.stderr
    assert (out / "table.md").read_text() == table
    # a second attempt at a row goes to a new run directory and its result is the one the table shows
    fake_train(monkeypatch, {"grpo-full-s0.2": (0, "ok now")})
    assert B.main([*args[:-1], "grpo-full-s0", "--steps", "3", "--eval-every", "3", "--start-wait", "0"]) == 0
    assert (out / "runs" / "grpo-full-s0.2" / "metrics.jsonl").is_file()
    table = (out / "table.md").read_text()
    assert "| grpo-full-s0 | 0 |" in table and "| grpo-full-s0 | 3 |" not in table
