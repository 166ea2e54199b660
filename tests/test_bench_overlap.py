"""benchmarks/bench_overlap.py's helpers on CPU. The driver itself cannot run here: every run is a GPU run with vLLM
(or TRL's colocated vLLM), so its commands are checked against the recipe schema, and its figures are read from a
run directory a real CPU run writes in tests/test_overlap.py (the engine process without overlap: the `process` arm)."""

import json
import os
import shlex
import sys
from pathlib import Path

import pytest
from conftest import ROOT, import_benchmark

from colocate_rl.recipe.load import apply_overrides, parse_recipe, parse_sets, read_yaml

B = import_benchmark("bench_overlap")


def recipe_of(argv: list[str]):
    sets = [argv[i + 1] for i, a in enumerate(argv) if a == "--set"]
    return parse_recipe(apply_overrides(read_yaml(ROOT / B.RECIPE), parse_sets(sets)))


@pytest.mark.parametrize("workload", ["c256", "arith"])
def test_each_arm_runs_the_recipe_with_overlap_on_or_off(workload, tmp_path):
    data = None if workload == "arith" else tmp_path / "d.jsonl"
    for arm, overlap, process in (("overlap", "one_step", "auto"), ("off", "off", "auto"), ("process", "off", True)):
        r = recipe_of(B.command(arm, workload, tmp_path / "m", data, tmp_path / "run", 12, [], seed=1))
        assert (r.generation.overlap, r.trainer.max_steps, r.trainer.seed) == (overlap, 12, 1)
        assert r.generation.engine_process == process
        completions = r.trainer.per_device_train_batch_size * r.trainer.gradient_accumulation_steps
        if workload == "c256":
            assert (completions, r.eval.every_steps, r.data.source) == (256, None, str(data))
        else:
            assert (completions, r.eval.every_steps, r.data.source) == (64, 20, "builtin:arithmetic")
            assert [x.name for x in r.rewards] == ["math_verify"]


def test_trl_runs_its_own_script_with_the_micro_batch_set_by_hand(tmp_path):
    argv = B.command("trl", "c256", tmp_path / "m", tmp_path / "d.jsonl", tmp_path / "run", 12, [])
    assert argv[1] == "benchmarks/trl_grpo.py"
    assert argv[argv.index("--micro-batch") + 1 :] == ["128", "--grad-accum", "2", "--share", "0.3"]
    lean = B.command("trl-lean", "c256", tmp_path / "m", tmp_path / "d.jsonl", tmp_path / "run", 12, [])
    assert lean[lean.index("--micro-batch") + 1 :] == ["256", "--grad-accum", "1", "--share", "0.1"]
    # the 1.7B shape: TRL's default gradient checkpointing on (128 x 2 does not fit without it)
    big = B.command("trl", "d256", tmp_path / "m", tmp_path / "d.jsonl", tmp_path / "run", 12, [])
    assert big[big.index("--micro-batch") + 1 :] == [
        "128",
        "--grad-accum",
        "2",
        "--share",
        "0.3",
        "--gradient-checkpointing",
    ]
    # colocate-rl's micro-batch at the 1.7B shape, without checkpointing
    small = B.command("trl-mb32", "d256", tmp_path / "m", tmp_path / "d.jsonl", tmp_path / "run", 12, [])
    assert small[small.index("--micro-batch") + 1 :] == ["32", "--grad-accum", "8", "--share", "0.3"]


def test_a_bad_order_is_refused(capsys, tmp_path):
    with pytest.raises(SystemExit):
        B.main(["--out", str(tmp_path), "--model", "/m", "--data", "/d", "--order", "overlap,fast"])
    assert "unknown arm(s) ['fast']" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        B.main(["--out", str(tmp_path), "--model", "/m", "--workload", "arith", "--order", "overlap,trl"])
    assert "compares overlap and off only" in capsys.readouterr().err


def test_the_table_pools_each_arm_and_sets_it_against_trl():
    rows = [
        {"order": 1, "workload": "c256", "arm": "overlap", "exit": 0, "s_per_step": 2.0, "s_per_step_range": [1, 3]},
        {"order": 2, "workload": "c256", "arm": "trl", "exit": 0, "s_per_step": 4.0, "s_per_step_range": [3, 5]},
        {"order": 3, "workload": "c256", "arm": "overlap", "exit": 0, "s_per_step": 2.2, "s_per_step_range": [1, 3]},
        {"order": 4, "workload": "c256", "arm": "off", "exit": 1},
    ]
    text = B.table(rows)
    assert "| c256 | overlap | 2 | 2.100 | 1.90× |" in text and "| c256 | trl | 1 | 4.000 | 1.00× |" in text
    assert "| c256 | off |" not in text.split("pooled")[1]  # a failed run is not pooled


def test_concurrent_runs_are_for_learning_only_with_a_fixed_kv_cache(capsys, tmp_path):
    with pytest.raises(SystemExit):
        B.main(["--out", str(tmp_path), "--model", "m", "--data", "d", "--workload", "c256", "--concurrent"])
    assert "only the arith workload" in capsys.readouterr().err
    B.main(["--out", str(tmp_path), "--model", "m", "--workload", "arith", "--order", "overlap,off", "--concurrent",
            "--seeds", "0,1", "--dry-run"])  # fmt: skip
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[")]
    assert len(printed) == 4
    for line in printed:
        r = recipe_of(shlex.split(line.split("] ", 1)[1]))
        assert r.generation.kv_cache_memory == B.CONCURRENT_KV and r.eval.every_steps == 20


def test_concurrent_runs_start_in_waves_of_at_once_the_first_alone_until_it_trains(monkeypatch, tmp_path):
    # the runs' processes are replaced by a record of the driver's calls (they need a GPU); the waves are the driver's
    events = []

    def finish(run, a, results_file, concurrent):
        events.append(("finish", run.order))
        with results_file.open("a") as f:
            f.write(json.dumps({"order": run.order, "workload": "arith", "arm": run.arm, "exit": 0}) + "\n")

    monkeypatch.setattr(B.Run, "start", lambda run, out, env: events.append(("start", run.order)))
    monkeypatch.setattr(B.Run, "wait_for_first_step", lambda run, timeout: events.append(("trained", run.order)))
    monkeypatch.setattr(B.Run, "finish", finish)
    argv = ["--out", str(tmp_path), "--model", "m", "--workload", "arith", "--order", "overlap,off", "--concurrent"]
    assert B.main([*argv, "--seeds", "0,1,2", "--at-once", "4"]) == 0
    assert events == [("start", 1), ("trained", 1), ("start", 2), ("start", 3), ("start", 4),
                      *[("finish", k) for k in (1, 2, 3, 4)], ("start", 5), ("start", 6), ("finish", 5), ("finish", 6)]  # fmt: skip
    with pytest.raises(SystemExit):
        B.main([*argv, "--at-once", "0"])


def test_the_mps_arm_is_the_overlap_run_under_colocate_rls_mps_daemon(tmp_path):
    overlap = recipe_of(B.command("overlap", "d256", tmp_path / "m", tmp_path / "d.jsonl", tmp_path / "run", 8, []))
    mps = recipe_of(B.command("overlap-mps", "d256", tmp_path / "m", tmp_path / "d.jsonl", tmp_path / "run", 8, []))
    assert (overlap.generation.mps, mps.generation.mps) == ("off", "on")
    assert overlap.generation.model_copy(update={"mps": "on"}) == mps.generation
    with pytest.raises(SystemExit):
        B.main(["--out", str(tmp_path), "--model", "m", "--workload", "arith", "--order", "overlap-mps,off",
                "--concurrent", "--dry-run"])  # fmt: skip


@pytest.mark.parametrize(
    ("arm", "base", "env"),
    [
        ("overlap-prio-mps", "overlap-mps", {"CUDA_MPS_CLIENT_PRIORITY": "1", "COLOCATE_RL_ENGINE_MPS_PRIORITY": "0"}),
        ("overlap-cap-mps", "overlap-mps",
         {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "75", "COLOCATE_RL_ENGINE_MPS_THREAD_PERCENTAGE": "100"}),
        ("overlap-2e-prio-mps", "overlap-2e-mps",
         {"CUDA_MPS_CLIENT_PRIORITY": "1", "COLOCATE_RL_ENGINE_MPS_PRIORITY": "0"}),
        ("overlap-prio-ecap50-mps", "overlap-mps",
         {"CUDA_MPS_CLIENT_PRIORITY": "1", "COLOCATE_RL_ENGINE_MPS_PRIORITY": "0",
          "COLOCATE_RL_ENGINE_MPS_THREAD_PERCENTAGE": "50"}),
    ],
)  # fmt: skip
def test_the_mps_settings_arms_are_their_base_run_in_the_environment_that_sets_them(arm, base, env, tmp_path):
    """Same recipe as the base arm; the difference is the environment the run starts in (recorded in the row)."""

    def recipe(name):
        return recipe_of(B.command(name, "d256", tmp_path / "m", tmp_path / "d.jsonl", tmp_path / "run", 8, []))

    assert recipe(arm) == recipe(base) and recipe(arm).generation.mps == "on"
    run = B.Run(1, arm, 0, "r", tmp_path / "run", [sys.executable, "-c", "import os; print(dict(os.environ))"])
    run.start(tmp_path, {"PATH": os.environ["PATH"]})
    run.proc.wait(timeout=60)
    run.log.close()
    run.peak.stop()
    shown = (tmp_path / "r.log").read_text()
    assert all(f"'{name}': '{value}'" in shown for name, value in env.items()), shown
    assert B.ARM_ENV[arm] == env and B.ARM_ENV.get(base) is None


def test_the_mp_arm_is_the_overlap_run_with_vllms_engine_core_in_a_process_of_its_own(tmp_path):
    overlap = recipe_of(B.command("overlap", "c256", tmp_path / "m", tmp_path / "d.jsonl", tmp_path / "run", 12, []))
    mp = recipe_of(B.command("overlap-mp", "c256", tmp_path / "m", tmp_path / "d.jsonl", tmp_path / "r", 12, []))
    assert (overlap.generation.vllm_multiprocessing, mp.generation.vllm_multiprocessing) == (False, True)
    assert overlap.model_copy(update={"generation": mp.generation, "output": mp.output}) == mp


def test_the_plain_arm_is_the_overlap_run_without_deepspeed_and_with_fp32_weights(tmp_path):
    overlap = recipe_of(B.command("overlap", "c256", tmp_path / "m", tmp_path / "d.jsonl", tmp_path / "run", 12, []))
    plain = recipe_of(B.command("overlap-plain", "c256", tmp_path / "m", tmp_path / "d.jsonl", tmp_path / "r", 12, []))
    assert (overlap.distributed.zero_stage, overlap.model.dtype) == ("auto", "auto")
    assert (plain.distributed.zero_stage, plain.model.dtype, plain.generation.overlap) == (None, "float32", "one_step")
    assert overlap.model_copy(update={"distributed": plain.distributed, "model": plain.model}) == plain


def test_the_nogroup_arm_is_the_overlap_run_with_trls_micro_batches(tmp_path):
    overlap = recipe_of(B.command("overlap", "d256", tmp_path / "m", tmp_path / "d.jsonl", tmp_path / "run", 8, []))
    plain = recipe_of(B.command("overlap-nogroup", "d256", tmp_path / "m", tmp_path / "d.jsonl", tmp_path / "r", 8, []))
    assert (overlap.trainer.length_grouping, plain.trainer.length_grouping) == (True, False)
    assert overlap.model_copy(update={"trainer": plain.trainer, "output": plain.output}) == plain


def test_the_1e_2e_and_4e_arms_are_their_runs_with_that_many_engine_processes(tmp_path):
    """The base arms leave the count to `engine_processes: auto`; an -Ne arm is its base run with N set."""

    def recipe(arm):
        return recipe_of(B.command(arm, "c256", tmp_path / "m", tmp_path / "d.jsonl", tmp_path / arm, 12, []))

    for one, several, n in (("overlap", "overlap-1e", 1), ("overlap", "overlap-2e", 2), ("process", "process-1e", 1),
                            ("process", "process-2e", 2), ("process", "process-4e", 4),
                            ("overlap", "overlap-4e", 4)):  # fmt: skip
        base, arm = recipe(one), recipe(several)
        assert (base.generation.engine_processes, arm.generation.engine_processes) == ("auto", n)
        assert arm.generation == base.generation.model_copy(update={"engine_processes": n})
        assert arm.model_copy(update={"generation": base.generation, "output": base.output}) == base


def test_the_omp1_arm_is_the_overlap_run_with_one_cpu_thread_a_process(tmp_path, monkeypatch):
    overlap = recipe_of(B.command("overlap", "c256", tmp_path / "m", tmp_path / "d.jsonl", tmp_path / "run", 12, []))
    omp1 = recipe_of(B.command("overlap-omp1", "c256", tmp_path / "m", tmp_path / "d.jsonl", tmp_path / "r", 12, []))
    assert omp1.model_copy(update={"output": overlap.output}) == overlap
    started = {}

    class Popen:  # the run's command is not started here (a GPU run); what it would get is recorded
        def __init__(self, argv, cwd, env, stdout, stderr):
            started[argv[-1]] = env

    monkeypatch.setattr(B.subprocess, "Popen", Popen)
    monkeypatch.setattr(B, "PeakMemory", lambda: type("P", (), {"start": lambda self: None})())
    for arm in ("overlap", "overlap-omp1"):
        B.Run(1, arm, 0, arm, tmp_path / arm, ["python", arm]).start(tmp_path, {"OMP_NUM_THREADS": "16"})
    # the plan leaves a variable set in the launcher's environment alone for the ranks (and their engine processes):
    # tests/test_overlap.py checks that rule with PYTORCH_CUDA_ALLOC_CONF
    assert (started["overlap"]["OMP_NUM_THREADS"], started["overlap-omp1"]["OMP_NUM_THREADS"]) == ("16", "1")


def test_the_larger_shape_keeps_the_source_tokenizers_chat_template(tmp_path, monkeypatch):
    """transformers 5 saves a chat template as chat_template.jinja; without it the d256 run stopped at its rank."""
    from colocate_rl.builtin_model import build_model
    from colocate_rl.model_config import has_chat_template

    src = build_model("tiny", tmp_path / "src", seed=0)
    (src / "chat_template.jinja").write_text("{{ messages }}")
    monkeypatch.setattr(B, "SHAPE_1P7B", {"intermediate_size": 96})
    shape = B.build_1p7b(src, tmp_path / "shape")
    assert (shape / "chat_template.jinja").read_text() == "{{ messages }}" and has_chat_template(str(shape))


def test_a_run_that_failed_before_its_first_step_is_a_row_without_figures(tmp_path):
    """A rank that died before writing its timeline (the d256 run) leaves an empty file: the row says so, and the
    driver goes on to the next arm."""
    (tmp_path / "timeline").mkdir()
    (tmp_path / "timeline" / "rank0.jsonl").write_text("")
    assert B.training_start(tmp_path) is None
    assert B.figures("overlap", tmp_path, started=0.0)["steps"] == 0


def test_the_device_session_script_gives_each_stage_a_command_the_drivers_accept(tmp_path):
    """benchmarks/overlap_session.sh with EXTRA=--dry-run: every stage but the GPU test prints its drivers' commands
    (an unknown arm or option would stop a stage with a usage error, found only on the GPU otherwise), and each
    timed run's recipe parses with the arm's settings."""
    import os
    import subprocess

    env = {**os.environ, "EXTRA": "--dry-run", "R": str(tmp_path / "res"), "RUNS": str(tmp_path / "runs")}
    env.update(M=str(tmp_path / "m"), D=str(tmp_path / "d.jsonl"), STAGES="learn d256 c256 c4e gen d2e prio balance")
    done = subprocess.run(["bash", str(ROOT / "benchmarks" / "overlap_session.sh")], env=env, timeout=240)
    assert done.returncode == 0
    res = tmp_path / "res"
    stages = [line.split()[1] for line in (res / "progress").read_text().splitlines() if line.startswith("== ")]
    assert stages == ["learn", "d256", "c256", "c4e", "gen", "d2e", "prio", "balance", "done"]
    arms = {}
    for stage in ("learn", "d256", "c256", "c4e", "d2e", "prio", "balance"):
        log = (res / f"{stage}.log").read_text()
        assert "usage:" not in log and "error" not in log.lower(), log
        lines = [line for line in log.splitlines() if line.startswith("[")]
        assert lines, log
        for line in lines:
            argv = shlex.split(line.split("] ", 1)[1])
            if "colocate_rl" in argv:  # a colocate-rl arm (TRL's runs are benchmarks/trl_grpo.py)
                run = Path(argv[argv.index("--run-dir") + 1]).name  # <workload>-<order>-<arm>
                arms[(stage, run.split("-", 2)[-1])] = recipe_of(argv)
    assert arms[("c4e", "overlap-4e")].generation.engine_processes == 4
    two, one = arms[("d2e", "overlap-2e-mps")], arms[("d2e", "overlap-mps")]
    assert (two.generation.engine_processes, two.generation.mps) == (2, "on")
    assert (one.generation.engine_processes, one.generation.mps) == ("auto", "on")
    assert {arm for stage, arm in arms if stage in ("prio", "balance")} == {
        "overlap-prio-mps", "overlap-cap-mps", "overlap-mps", "overlap-prio-ecap50-mps", "overlap-prio-ecap70-mps"
    }  # fmt: skip
    gen = (res / "gen.log").read_text()
    assert "--variants trl,lean,rescore" in gen and "usage:" not in gen
