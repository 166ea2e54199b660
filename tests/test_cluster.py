"""Several nodes: Slurm detection, precedence, run-dir layout, recipe hash check, cluster scripts, and two
simulated nodes (two `colocate-rl train` processes) refusing to train from different recipes. Two nodes training,
stopping and resuming together: test_long_runs.py::test_two_nodes_train_stop_together_and_resume."""

import json
import os
import re
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from conftest import CPU, GPU8, NO_GPU, ROOT, assert_user_error, clean_env, cli

from colocate_rl.errors import UserError
from colocate_rl.pipeline import resolve
from colocate_rl.plan.host import Host
from colocate_rl.plan.identity import mismatch_message, recipe_identity
from colocate_rl.plan.launch_plan import make_plan
from colocate_rl.plan.slurm import expand_hostlist, slurm_settings
from colocate_rl.plan.sources import layer_distributed, parse_node_flags
from colocate_rl.recipe.load import parse_recipe
from colocate_rl.rundir import check_run_dir_free, write_run_dir

VENV_BIN = Path(sys.executable).parent
MINIMAL = {"rewards": [{"name": "digit_share"}]}
SLURM = {
    "SLURM_JOB_ID": "4242",
    "SLURM_STEP_ID": "0",
    "SLURM_NNODES": "2",
    "SLURM_NTASKS": "2",
    "SLURM_JOB_NODELIST": "gpu[07-08]",
    "SLURM_NODEID": "1",
}


def env_of(**extra):
    """A subprocess's environment: no Slurm or launcher variables from outside, one OpenMP thread, plus `extra`."""
    return clean_env(OMP_NUM_THREADS="1", **extra)


def script_env(**extra):
    """A launch script's dry run: as `env_of`, with this venv's colocate-rl on PATH and no GPU visible (2 CPU ranks
    per node)."""
    return env_of(**NO_GPU, **{"PATH": f"{VENV_BIN}:{os.environ['PATH']}", **extra})


def resolved_for(distributed=None, host=CPU, **sections):
    data = {**MINIMAL, **sections, "distributed": {"deepspeed": "zero3", **(distributed or {})}}
    return resolve(parse_recipe(data), host)


def plan_for(run_dir, distributed=None, host=CPU, **sections):
    return make_plan(
        resolved_for(distributed, host, **sections),
        run_dir=Path(run_dir),
        python="/venv/bin/python",
        cwd=Path("/work"),
        cache_dir=Path("/cache"),
        base_env={},
    )


TWO_NODES = {"nnodes": 2, "rdzv_endpoint": "node0:29500", "rdzv_id": "job7"}


# ------------------------------------------------------------------------------------------- Slurm


@pytest.mark.parametrize(
    "text, hosts",
    [
        ("node01", ["node01"]),
        ("node[01-03,07],gpu5", ["node01", "node02", "node03", "node07", "gpu5"]),
        ("n[8-10]", ["n8", "n9", "n10"]),
        ("n[098-101]", ["n098", "n099", "n100", "n101"]),
        ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
        ("a[1,3],b,c[2-3]", ["a1", "a3", "b", "c2", "c3"]),
    ],
)
def test_expand_hostlist(text, hosts):
    assert expand_hostlist(text) == hosts


@pytest.mark.parametrize("bad", ["", "n[1-", "n[3-1]", "n[a-b]", "n1]", "n[1-2]]"])
def test_expand_hostlist_rejects_bad_syntax(bad):
    with pytest.raises(ValueError):
        expand_hostlist(bad)


def test_slurm_settings_under_srun():
    got = {s.key: (s.value, s.source) for s in slurm_settings(SLURM)}
    assert got == {
        "nnodes": (2, "Slurm SLURM_NNODES"),
        "node_rank": (1, "Slurm SLURM_NODEID"),
        "rdzv_endpoint": ("gpu07:29500", "Slurm first host of SLURM_JOB_NODELIST, default port 29500"),
        "rdzv_id": ("4242", "Slurm SLURM_JOB_ID"),
    }
    # The step's own node list and count win over the job's; MASTER_PORT sets the port.
    step = {
        **SLURM,
        "SLURM_STEP_NUM_NODES": "3",
        "SLURM_STEP_NODELIST": "b[2-4]",
        "SLURM_STEP_NUM_TASKS": "3",
        "MASTER_PORT": "31000",
    }
    got = {s.key: s.value for s in slurm_settings(step)}
    assert (got["nnodes"], got["rdzv_endpoint"]) == (3, "b2:31000")


@pytest.mark.parametrize(
    "env",
    [
        {k: v for k, v in SLURM.items() if k != "SLURM_STEP_ID"},  # the batch script itself, not srun
        {**SLURM, "SLURM_STEP_ID": "4294967291"},  # the batch step
        {**SLURM, "SLURM_NNODES": "1", "SLURM_NTASKS": "1"},  # one node: plain single-node run
        {},
    ],
)
def test_slurm_settings_only_in_a_multi_node_srun_step(env):
    assert slurm_settings(env) == []


def test_slurm_settings_refuse_several_tasks_per_node_and_bad_lists():
    with pytest.raises(UserError, match=r"SLURM_NTASKS: srun started 16 tasks on 2 nodes.*--ntasks-per-node=1"):
        slurm_settings({**SLURM, "SLURM_NTASKS": "16"})
    with pytest.raises(UserError, match=r"SLURM_JOB_NODELIST: cannot read the Slurm node list 'gpu\[07-'"):
        slurm_settings({**SLURM, "SLURM_JOB_NODELIST": "gpu[07-"})


def test_precedence_defaults_recipe_slurm_set_flags():
    recipe = {**MINIMAL, "distributed": {"nnodes": 4, "rdzv_id": "from-recipe", "rdzv_backend": "static"}}
    data, sources = layer_distributed(recipe, {}, {}, SLURM)
    assert {k: data["distributed"][k] for k in ("nnodes", "node_rank", "rdzv_id", "rdzv_backend")} == {
        "nnodes": 2,
        "node_rank": 1,
        "rdzv_id": "4242",
        "rdzv_backend": "static",
    }
    assert sources["nnodes"] == "Slurm SLURM_NNODES" and sources["rdzv_backend"] == "recipe"
    assert recipe["distributed"]["nnodes"] == 4  # the caller's mapping is not changed

    data, sources = layer_distributed(recipe, {"distributed.node_rank": 0}, {"rdzv_id": "flag"}, SLURM)
    assert (data["distributed"]["node_rank"], data["distributed"]["rdzv_id"]) == (0, "flag")
    assert (sources["node_rank"], sources["rdzv_id"]) == ("--set distributed.node_rank", "--rdzv-id")
    # a flag beats --set for the same key
    data, sources = layer_distributed(recipe, {"distributed.nnodes": 3}, {"nnodes": 5}, {})
    assert (data["distributed"]["nnodes"], sources["nnodes"]) == (5, "--nnodes")
    # --nnodes takes over the node layout: Slurm's values are not applied at all
    data, sources = layer_distributed(MINIMAL, {}, {"nnodes": 1}, SLURM)
    assert data["distributed"] == {"nnodes": 1} and sources["rdzv_id"] == "default"
    # Slurm's numeric job id stays a string and validates (a number from --set too)
    assert parse_recipe(layer_distributed(MINIMAL, {}, {}, SLURM)[0]).distributed.rdzv_id == "4242"
    assert (
        parse_recipe(layer_distributed(MINIMAL, {"distributed.rdzv_id": "99"}, {}, {})[0]).distributed.rdzv_id == "99"
    )


@pytest.mark.parametrize(
    "flags, fragment",
    [
        (("0", None, None, None), "--nnodes: expected a whole number ≥ 1, got '0'"),
        (("two", None, None, None), "--nnodes: expected a whole number ≥ 1, got 'two'"),
        ((None, "-1", None, None), "--node-rank: expected a whole number ≥ 0, got '-1'"),
        ((None, None, None, " "), "--rdzv-id: must not be empty"),
    ],
)
def test_bad_node_flags(flags, fragment):
    with pytest.raises(UserError, match=fragment):
        parse_node_flags(*flags)


# ------------------------------------------------------------------------------------------- layout rules


@pytest.mark.parametrize("tp, ok", [(1, True), (4, True), (8, True), (3, False), (16, False)])
def test_tensor_parallel_groups_never_span_nodes(tp, ok):
    """Ranks are numbered node by node, so a group of tp contiguous ranks stays on one node iff tp divides the
    ranks per node; 16 on 2 × 8 GPUs would span both nodes and is refused."""
    if ok:
        resolved = resolved_for(TWO_NODES, GPU8, generation={"tensor_parallel_size": tp})
        assert resolved.world_size == 16
        plan = plan_for("/runs/r", TWO_NODES, GPU8, generation={"tensor_parallel_size": tp})
        assert json.loads(plan.files["launch.json"])["trl_args"]["vllm_tensor_parallel_size"] == tp
    else:
        with pytest.raises(UserError) as info:
            resolved_for(TWO_NODES, GPU8, generation={"tensor_parallel_size": tp})
        assert info.value.lines == [
            f"generation.tensor_parallel_size: {tp} does not divide "
            "distributed.nproc_per_node (8); tensor-parallel groups must stay inside one node"
        ]


@pytest.mark.slow
def test_cli_node_errors_name_their_source(tmp_path):
    assert_user_error(
        cli(
            "train",
            "recipes/quickstart.yaml",
            "--dry-run",
            "--gpus",
            "0",
            "--nnodes",
            "2",
            "--node-rank",
            "2",
            "--rdzv-endpoint",
            "h:1",
        ),
        "distributed.node_rank: 2 must be below nnodes (2) (from --node-rank)",
    )
    assert_user_error(
        cli(
            "train", "recipes/quickstart.yaml", "--dry-run", "--gpus", "0", "--nnodes", "2", "--rdzv-endpoint", "node0"
        ),
        "distributed.rdzv_endpoint: 'node0' must be host:port with a port number",
    )
    assert_user_error(
        cli("train", "recipes/quickstart.yaml", "--dry-run", "--gpus", "0", "--nnodes", "0"), "--nnodes: expected"
    )
    assert_user_error(
        cli("validate", "recipes/quickstart.yaml", "--gpus", "0", "--nnodes", "2"),
        "distributed.rdzv_endpoint: required when nnodes > 1",
    )
    assert_user_error(
        cli("train", "recipes/quickstart.yaml", "--dry-run", "--gpus", "0", env={**SLURM, "SLURM_NTASKS": "4"}),
        "SLURM_NTASKS: srun started 4 tasks on 2 nodes",
    )


# ------------------------------------------------------------------------------------------- plan and run dir


def test_multi_node_plan_layout_and_hash():
    node0 = plan_for("/runs/r", {**TWO_NODES, "node_rank": 0})
    node1 = plan_for("/runs/r", {**TWO_NODES, "node_rank": 1})
    assert sorted(node1.files) == [
        "deepspeed.json",
        "launch.json",
        "nodes/1/launch.sh",
        "nodes/1/recipe-identity.json",
        "recipe.yaml",
    ]
    assert node1.node_dir == "nodes/1"
    # the shared files are byte-identical on every node; the shared recipe has no node rank
    for name in ("recipe.yaml", "launch.json", "deepspeed.json"):
        assert node0.files[name] == node1.files[name]
    assert "node_rank" not in yaml.safe_load(node1.files["recipe.yaml"])["distributed"]
    assert node0.recipe_hash == node1.recipe_hash == json.loads(node1.files["launch.json"])["recipe_hash"]
    assert node1.env["COLOCATE_RL_RECIPE_HASH"] == node1.recipe_hash and node1.env["COLOCATE_RL_NODE_RANK"] == "1"
    assert "--node-rank 1" in node1.files["nodes/1/launch.sh"]
    # the run dir is not part of the hash (local run dirs may differ); any training key is
    assert plan_for("/elsewhere", {**TWO_NODES, "node_rank": 1}).recipe_hash == node1.recipe_hash
    assert plan_for("/runs/r", TWO_NODES, trainer={"learning_rate": 0.5}).recipe_hash != node1.recipe_hash
    # auto values are hashed as what they resolved to: 8 GPUs on one node, 4 on another differ
    half = Host(gpus=GPU8.gpus[:4], has_vllm=True, cpu_count=64)
    assert recipe_identity(resolved_for(TWO_NODES, GPU8))["distributed.nproc_per_node"] == 8
    assert plan_for("/r", TWO_NODES, half).recipe_hash != plan_for("/r", TWO_NODES, GPU8).recipe_hash
    # single node: unchanged layout, no multi-node environment
    single = plan_for("/runs/r")
    assert sorted(single.files) == ["deepspeed.json", "launch.json", "launch.sh", "recipe.yaml"]
    assert single.node_dir is None and "COLOCATE_RL_RECIPE_HASH" not in single.env


def test_nodes_share_one_run_dir(tmp_path):
    run = tmp_path / "run"
    node0 = plan_for(run, {**TWO_NODES, "node_rank": 0})
    node1 = plan_for(run, {**TWO_NODES, "node_rank": 1})
    assert write_run_dir(node0.run_dir, node0.files, node0.node_dir) == []
    (run / "model").mkdir()
    (run / ".model.tmp-abc").mkdir()  # node 0 still building the built-in model
    check_run_dir_free(run, "nodes/1")  # node 1 joins the directory node 0 just created
    assert write_run_dir(node1.run_dir, node1.files, node1.node_dir) == []
    assert sorted(p.name for p in (run / "nodes").iterdir()) == ["0", "1"]
    assert (run / "nodes/1/launch.sh").stat().st_mode & stat.S_IXUSR
    assert (run / "recipe.yaml").read_text() == node1.files["recipe.yaml"]
    # a node rank that already started here, or a second node with the same rank, is refused
    with pytest.raises(UserError, match=r"already has nodes/1/ \(this node rank already started"):
        check_run_dir_free(run, "nodes/1")
    # a node started with another recipe: the shared files are left as node 0 wrote them, and reported
    other = tmp_path / "other"
    first = plan_for(other, {**TWO_NODES, "node_rank": 0})
    write_run_dir(first.run_dir, first.files, first.node_dir)
    before = (other / "launch.json").read_text()
    second = plan_for(other, {**TWO_NODES, "node_rank": 1}, trainer={"learning_rate": 0.5})
    assert write_run_dir(second.run_dir, second.files, second.node_dir) == [
        "recipe.yaml",
        "launch.json",
    ]
    assert (other / "launch.json").read_text() == before


@pytest.mark.parametrize(
    "leftover, fragment",
    [
        ("DONE", "holds a finished run (DONE)"),
        ("train.log", "holds another run (train.log)"),
        ("metrics.jsonl", "holds another run (metrics.jsonl)"),
        ("final", "holds another run (final)"),
    ],
)
def test_multi_node_run_dir_refuses_other_runs(tmp_path, leftover, fragment):
    (tmp_path / "recipe.yaml").write_text("x")
    (tmp_path / leftover).mkdir() if leftover == "final" else (tmp_path / leftover).write_text("x")
    with pytest.raises(UserError, match=re.escape(fragment)):
        check_run_dir_free(tmp_path, "nodes/1")
    with pytest.raises(UserError, match="already exists and is not empty"):
        check_run_dir_free(tmp_path)  # single node: any content


# ------------------------------------------------------------------------------------------- hash check


def entry(node, h, file_hash=None, lr=0.01, host="h"):
    return {
        "node_rank": str(node),
        "host": f"{host}{node}",
        "hash": h,
        "file_hash": file_hash or h,
        "identity": {"trainer.learning_rate": lr, "trainer.max_steps": 3},
    }


def test_mismatch_message():
    assert mismatch_message([entry(0, "aa"), entry(0, "aa"), entry(1, "aa")]) is None
    message = mismatch_message([entry(0, "aa"), entry(1, "bb", lr=0.02), entry(2, "aa"), entry(3, "bb", lr=0.02)])
    assert message.startswith(
        "recipe mismatch between nodes: node 1 (h1), node 3 (h3) differ from node 0 (h0) in "
        "trainer.learning_rate (0.01 on node 0, 0.02 on node 1); start every node with the same "
        "recipe file and the same --set flags"
    )
    assert "node 0, 2: aa, node 1, 3: bb" in message
    # ranks without the identity (only local rank 0 sends it): still names the nodes
    bare = [{**entry(0, "aa"), "identity": None}, {**entry(1, "bb"), "identity": None}]
    assert mismatch_message(bare).startswith("recipe mismatch between nodes: node 1 (h1) differs from node 0 (h0);")
    # same recipe everywhere, but the run dir's shared files were written for another one
    stale = mismatch_message([entry(0, "aa"), entry(1, "aa", file_hash="cc")])
    assert stale.startswith("recipe mismatch: the run directory's recipe.yaml/launch.json that node 1 (h1) read")
    assert "pass a new --run-dir on every node" in stale


def test_rank_errors_are_reported_once_from_the_events_file(tmp_path, monkeypatch):
    from colocate_rl.telemetry import events

    for rank in ("0", "1"):  # every rank stops on the same mismatch
        monkeypatch.setenv("RANK", rank)
        events.emit(tmp_path, events.USER_ERROR, lines=["recipe mismatch X"])
    events.emit(tmp_path, events.ENGINE_MEMORY, awake_gib=1.0, asleep_gib=None, sleep_level=0, config={})
    events.emit(tmp_path, events.STALE_WEIGHTS, message="vLLM is not generating from the trainer's weights")
    with (tmp_path / "events.jsonl").open("a") as f:
        f.write('{"kind": "user_error", "lines": ["cut off')  # a rank killed mid-write
    assert events.user_errors(tmp_path) == ["recipe mismatch X", "vLLM is not generating from the trainer's weights"]
    assert [e["rank"] for e in events.read_events(tmp_path, events.USER_ERROR)] == [0, 1]


# ------------------------------------------------------------------------------------------- scripts


def write_fake_srun(bin_dir: Path, log: Path) -> None:
    """`srun` as Slurm runs a one-task-per-node step: the command once per node of SLURM_JOB_NODELIST, with
    SLURM_NODEID and the step variables set (here one after the other, on this machine)."""
    bin_dir.mkdir()
    srun = bin_dir / "srun"
    srun.write_text(f"""#!/usr/bin/env bash
set -euo pipefail
while [ "$#" -gt 0 ] && [ "${{1#-}}" != "$1" ]; do echo "$1" >> {log}; shift; done
hosts=$({sys.executable} -c 'import sys; from colocate_rl.plan.slurm import expand_hostlist; print(*expand_hostlist(sys.argv[1]))' "$SLURM_JOB_NODELIST")
i=0
for host in $hosts; do
  SLURM_NODEID=$i SLURM_PROCID=$i SLURM_STEP_ID=0 SLURMD_NODENAME=$host SLURM_STEP_NODELIST=$SLURM_JOB_NODELIST \\
    SLURM_STEP_NUM_NODES=$SLURM_NNODES SLURM_STEP_NUM_TASKS=$SLURM_NNODES "$@"
  i=$((i + 1))
done
""")
    srun.chmod(0o755)


def test_slurm_script_literal_sbatch_header():
    lines = (ROOT / "scripts/slurm.sbatch").read_text().splitlines()
    sbatch = [i for i, line in enumerate(lines) if line.startswith("#SBATCH")]
    assert sbatch and all("$" not in lines[i] and "`" not in lines[i] for i in sbatch)
    # sbatch stops reading #SBATCH at the first command: only comments and blank lines before the last one
    assert all(not line.strip() or line.startswith("#") for line in lines[: sbatch[-1]])
    assert "#SBATCH --ntasks-per-node=1" in lines


@pytest.mark.slow
def test_slurm_script_dry_run_prints_each_node_command(tmp_path):
    log = tmp_path / "srun-options"
    write_fake_srun(tmp_path / "bin", log)
    env = script_env(
        PATH=f"{tmp_path / 'bin'}:{VENV_BIN}:{os.environ['PATH']}",
        DRY_RUN="1",
        SLURM_JOB_ID="4242",
        SLURM_NNODES="2",
        SLURM_JOB_NODELIST="gpu[07-08]",
        SLURM_CPUS_PER_TASK="4",
    )
    result = subprocess.run(
        ["bash", str(ROOT / "scripts/slurm.sbatch"), "quickstart", "--set", "trainer.max_steps=3"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert log.read_text().split() == ["--nodes=2", "--ntasks-per-node=1", "--kill-on-bad-exit=1", "--cpus-per-task=4"]
    hashes = set()
    for node in (0, 1):
        block = out.split(f"# node {node} (")[1].split("# node ")[0]
        assert block.split("\n")[0].endswith(
            "colocate-rl train quickstart --set trainer.max_steps=3 --dry-run --run-dir runs/quickstart-4242"
        )
        assert "# distributed.nnodes = 2  (Slurm SLURM_STEP_NUM_NODES)" in block
        assert f"# distributed.node_rank = {node}  (Slurm SLURM_NODEID)" in block
        assert "# distributed.rdzv_endpoint = gpu07:29500  (Slurm first host of SLURM_STEP_NODELIST" in block
        assert "# distributed.rdzv_id = 4242  (Slurm SLURM_JOB_ID)" in block
        assert f"# run dir (not created): {tmp_path}/runs/quickstart-4242" in block
        assert (
            f"-m torch.distributed.run --nnodes 2 --nproc-per-node 2 --node-rank {node} --rdzv-backend c10d "
            f"--rdzv-endpoint gpu07:29500 --rdzv-id 4242 --log-dir {tmp_path}/runs/quickstart-4242/nodes/{node}/ranks "
            f"--tee 3 -m colocate_rl.worker {tmp_path}/runs/quickstart-4242" in block
        )
        hashes.add(block.split("# recipe hash: ")[1].split()[0])
    assert len(hashes) == 1  # both nodes computed the same recipe
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow
def test_slurm_script_requeues_after_a_stop_and_resumes_when_started_again(tmp_path):
    """Slurm's pre-timeout SIGTERM reaches the script: it passes it to srun (here a stand-in whose task exits 143, as
    `train` does after its ranks saved a checkpoint) and requeues the job; started again with the same job id and a
    complete checkpoint in the run dir, it resumes instead of starting over."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(
        "#!/usr/bin/env bash\n"
        f'echo "$*" >> {tmp_path / "srun-args"}\n'
        "trap 'exit 143' TERM\n"
        f"touch {tmp_path / 'started'}\n"
        "while true; do sleep 0.1; done\n"
    )
    (bin_dir / "scontrol").write_text(f'#!/usr/bin/env bash\necho "$*" >> {tmp_path / "scontrol-args"}\n')
    for tool in ("srun", "scontrol"):
        (bin_dir / tool).chmod(0o755)
    env = script_env(PATH=f"{bin_dir}:{VENV_BIN}:{os.environ['PATH']}", SLURM_JOB_ID="77", SLURM_NNODES="2")
    script = str(ROOT / "scripts/slurm.sbatch")
    proc = subprocess.Popen(["bash", script, "quickstart"], cwd=tmp_path, env=env, stdout=subprocess.PIPE, text=True)
    hang_guard = time.monotonic() + 60  # not a speed check: only ends a hung test
    while not (tmp_path / "started").exists():
        assert proc.poll() is None and time.monotonic() < hang_guard, proc.stdout.read()
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 143, out
    assert (tmp_path / "scontrol-args").read_text() == "requeue 77\n"
    assert "stopped with a checkpoint in runs/quickstart-77; requeueing" in out
    assert (tmp_path / "srun-args").read_text().split("\n")[0].endswith("train quickstart --run-dir runs/quickstart-77")
    checkpoint = tmp_path / "runs" / "quickstart-77" / "checkpoints" / "checkpoint-6"
    checkpoint.mkdir(parents=True)
    (checkpoint / "colocate_rl_complete.json").write_text("{}")
    (tmp_path / "started").unlink()
    again = subprocess.Popen(["bash", script, "quickstart"], cwd=tmp_path, env=env, stdout=subprocess.PIPE, text=True)
    while not (tmp_path / "started").exists():
        assert again.poll() is None and time.monotonic() < hang_guard, again.stdout.read()
        time.sleep(0.05)
    again.send_signal(signal.SIGTERM)
    again.communicate(timeout=60)
    assert (
        (tmp_path / "srun-args").read_text().splitlines()[1].endswith("colocate-rl train --resume runs/quickstart-77")
    )


@pytest.mark.slow
def test_slurm_script_outside_slurm_fails_clearly(tmp_path):
    result = subprocess.run(
        ["bash", str(ROOT / "scripts/slurm.sbatch"), "recipes/quickstart.yaml"],
        cwd=tmp_path,
        env=script_env(),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 2 and result.stderr.startswith("error: SLURM_JOB_ID: not inside a Slurm job")


@pytest.mark.slow
def test_multinode_script_dry_run_commands_agree(tmp_path):
    env = script_env(MASTER_ADDR="10.0.0.1", NNODES="2", RDZV_ID="job9")
    script = str(ROOT / "scripts/multinode.sh")
    result = subprocess.run(
        ["bash", script, "recipes/quickstart.yaml", "--set", "trainer.max_steps=3", "--dry-run"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines == [
        f"# node {k}: colocate-rl train recipes/quickstart.yaml --set trainer.max_steps=3 --nnodes 2 "
        f"--node-rank {k} --rdzv-endpoint 10.0.0.1:29500 --rdzv-id job9 "
        for k in (0, 1)
    ]
    # what each node would run, planned here: the same recipe hash, its own node rank
    hashes = set()
    for k, line in enumerate(lines):
        plan = subprocess.run(
            ["bash", "-c", line.split(": ", 1)[1] + " --dry-run"],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert plan.returncode == 0, plan.stderr
        assert f"--node-rank {k} --rdzv-backend c10d --rdzv-endpoint 10.0.0.1:29500 --rdzv-id job9" in plan.stdout
        hashes.add(plan.stdout.split("# recipe hash: ")[1].split()[0])
    assert len(hashes) == 1
    missing = subprocess.run(
        ["bash", script, "recipes/quickstart.yaml"],
        cwd=ROOT,
        env={**env, "NNODES": "2"},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert missing.returncode == 2 and missing.stderr.startswith("error: NODE_RANK: not set")


@pytest.mark.slow
def test_single_node_script_ignores_slurm(tmp_path):
    env = script_env(DRY_RUN="1", **SLURM)
    result = subprocess.run(
        ["bash", str(ROOT / "scripts/single-node.sh"), "recipes/quickstart.yaml"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("# node 0: colocate-rl train recipes/quickstart.yaml --dry-run --nnodes 1\n")
    assert "--nnodes 1 --nproc-per-node 2 --standalone -m colocate_rl.worker" in result.stdout


# ------------------------------------------------------------------------------------------- two nodes, one machine


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_nodes(run_dirs, per_node_sets, tmp_path):
    """Two `colocate-rl train` processes, node ranks 0 and 1, one CPU rank each, rendezvous on 127.0.0.1."""
    port = free_port()
    procs = []
    for node, (run_dir, sets) in enumerate(zip(run_dirs, per_node_sets)):
        args = [
            sys.executable,
            "-m",
            "colocate_rl",
            "train",
            "recipes/quickstart.yaml",
            "--nnodes",
            "2",
            "--node-rank",
            str(node),
            "--rdzv-endpoint",
            f"127.0.0.1:{port}",
            "--rdzv-id",
            f"test-{port}",
            "--set",
            "distributed.nproc_per_node=1",
            "--set",
            "trainer.max_steps=3",
            *sets,
            "--run-dir",
            str(run_dir),
        ]
        out = (tmp_path / f"node{node}.out").open("w")
        procs.append((subprocess.Popen(args, cwd=ROOT, env=env_of(), stdout=out, stderr=subprocess.STDOUT), out))
    results = []
    for proc, out in procs:
        try:
            code = proc.wait(timeout=300)
        finally:
            if proc.poll() is None:
                proc.kill()
            out.close()
        results.append((code, Path(out.name).read_text()))
    return results


@pytest.mark.slow
@pytest.mark.parametrize("shared", [False, True], ids=["own-run-dirs", "shared-run-dir"])
def test_node_with_another_recipe_fails_fast_on_every_node(tmp_path, shared):
    runs = [tmp_path / "run"] * 2 if shared else [tmp_path / "run0", tmp_path / "run1"]
    start = time.perf_counter()
    results = start_nodes(runs, [[], ["--set", "trainer.learning_rate=0.02"]], tmp_path)
    elapsed = time.perf_counter() - start
    for code, out in results:
        # the ranks stopped on the mismatch (a user error: exit 2) after the launcher started them
        assert code == 2 and "error: training failed (exit code 2)" in out, out
        assert (
            "error: recipe mismatch between nodes: node 1 (" in out
            and "in trainer.learning_rate (0.01 on node 0, 0.02 on node 1); start every node with the same "
            "recipe file and the same --set flags"
            in out
        ), out
    if shared:  # the later node found the shared files written from the other recipe and left them alone
        assert any("were written by another node from a different recipe" in out for _, out in results)
    for run in set(runs):  # fast: both nodes stopped before their first step, however slow the machine
        assert not (run / "metrics.jsonl").exists() and not (run / "DONE").exists()
    print(f"mismatch ({'shared' if shared else 'own'} run dir) stopped both nodes in {elapsed:.1f} s")
