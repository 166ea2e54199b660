"""The run directory: every file name in it, typed paths, the one JSONL reader, and the rules for creating it.

`colocate-rl train` writes the plan's files here, every rank reads them, rank 0 appends `metrics.jsonl` and writes
`DONE`, each rank writes `timeline/rank<N>.jsonl` and `events.jsonl` records; `report`, `mem-probe` and the
benchmarks read them back. Layout (several nodes add `nodes/<node_rank>/` for each node's own files):

    recipe.yaml  launch.json  launch.sh  deepspeed.json  forecast.json  model -> built-in model  train.log  .owner.lock
    metrics.jsonl  events.jsonl  timeline/rank<N>.jsonl  final/  DONE  mps/ (generation.mps: the MPS daemon's logs)
    nodes/<node_rank>/{launch.sh, recipe-identity.json, train.log, ranks/, mps/}

Torch-free. Fails with UserError only when a run directory cannot be used (`check_run_dir_free`, `write_run_dir`).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from colocate_rl.errors import UserError

RECIPE = "recipe.yaml"  # the resolved recipe every rank reads
LAUNCH_SPEC = "launch.json"  # colocate_rl.plan.launch_spec.LaunchSpec
LAUNCH_SCRIPT = "launch.sh"  # the same launch, runnable by hand
DEEPSPEED = "deepspeed.json"
FORECAST = "forecast.json"  # the step-time forecast of the plan (colocate_rl.memory.forecast), read by `report`
MODEL_LINK = "model"  # link to the built-in model, when model.name is builtin:<layout>
LOG = "train.log"  # torchrun's combined output of this node
METRICS = "metrics.jsonl"  # rank 0: one record per logged step
EVENTS = "events.jsonl"  # every rank: structured events (colocate_rl.telemetry.events)
TIMELINE_DIR = "timeline"  # timeline/rank<N>.jsonl (colocate_rl.telemetry.timeline)
FINAL = "final"  # the saved model
CHECKPOINTS = "checkpoints"  # checkpoints/checkpoint-<step>/ (TRL's output_dir)
CHECKPOINT_COMPLETE = "colocate_rl_complete.json"  # written into a checkpoint once every rank saved its part
STOP_REQUEST = "STOP"  # written by the launcher: every rank saves a checkpoint at the next step end and exits
DONE = "DONE"  # rank 0, once the final model is saved
NODES_DIR = "nodes"  # nodes/<node_rank>/: one node's own files when several nodes share the run dir
IDENTITY = "recipe-identity.json"  # nodes/<node_rank>/recipe-identity.json
RANK_LOGS = "ranks"  # nodes/<node_rank>/ranks/: torchrun's per-rank logs
MPS_LOGS = "mps"  # the CUDA MPS daemon's logs (colocate_rl.launch.mps), per node
OWNER_LOCK = ".owner.lock"  # flock'd by the launcher or launch.sh that runs it (colocate_rl.launch.owner)

# What other nodes of the same multi-node run may already have put into a shared run directory.
SHARED_BEFORE_START = {RECIPE, LAUNCH_SPEC, DEEPSPEED, FORECAST, MODEL_LINK, NODES_DIR}


@dataclass(frozen=True)
class RunDir:
    """Typed paths of one run directory."""

    path: Path

    @property
    def recipe(self) -> Path:
        return self.path / RECIPE

    @property
    def launch_spec(self) -> Path:
        return self.path / LAUNCH_SPEC

    @property
    def deepspeed(self) -> Path:
        return self.path / DEEPSPEED

    @property
    def forecast(self) -> Path:
        return self.path / FORECAST

    @property
    def model(self) -> Path:
        return self.path / MODEL_LINK

    @property
    def metrics(self) -> Path:
        return self.path / METRICS

    @property
    def events(self) -> Path:
        return self.path / EVENTS

    @property
    def timeline_dir(self) -> Path:
        return self.path / TIMELINE_DIR

    def timeline(self, rank: int) -> Path:
        return self.timeline_dir / f"rank{rank}.jsonl"

    def timelines(self) -> list[Path]:
        return sorted(self.timeline_dir.glob("rank*.jsonl"))

    @property
    def final(self) -> Path:
        return self.path / FINAL

    @property
    def done(self) -> Path:
        return self.path / DONE

    @property
    def checkpoints(self) -> Path:
        return self.path / CHECKPOINTS

    @property
    def stop_request(self) -> Path:
        return self.path / STOP_REQUEST

    def complete_checkpoints(self) -> list[Path]:
        """Checkpoints every rank finished saving, oldest first (one cut off by a crash or a full disk is left out)."""
        found = [p for p in self.checkpoints.glob("checkpoint-*") if (p / CHECKPOINT_COMPLETE).is_file()]
        return sorted(
            found, key=lambda p: int(p.name.rpartition("-")[2]) if p.name.rpartition("-")[2].isdigit() else -1
        )

    def node_dir(self, node_rank: int | str) -> Path:
        return self.path / node_dir_name(node_rank)

    def identity(self, node_rank: int | str) -> Path:
        return self.node_dir(node_rank) / IDENTITY

    def log(self, node_dir: str | None = None) -> Path:
        """This node's log: `train.log`, or `nodes/<node_rank>/train.log` on several nodes."""
        return self.path / (node_dir or "") / LOG


def owner_lock_name(node_dir: str | None = None) -> str:
    """`.owner.lock`; on several nodes one per node, `.owner-nodes-<node_rank>.lock` (the run dir may be shared)."""
    return OWNER_LOCK if node_dir is None else f".owner-{node_dir.replace('/', '-')}.lock"


def node_dir_name(node_rank: int | str) -> str:
    """`nodes/<node_rank>`, relative to the run directory."""
    return f"{NODES_DIR}/{node_rank}"


def default_run_dir(name: str, now: datetime, rdzv_id: str | None = None) -> Path:
    """runs/<name>-<date>-<time>; on several nodes runs/<name>-<rdzv_id>, the same on every node (the nodes
    start at different seconds), e.g. the Slurm job id."""
    if rdzv_id is not None:
        return Path("runs") / f"{name}-{re.sub(r'[^A-Za-z0-9._-]', '_', rdzv_id)}"
    return Path("runs") / f"{name}-{now:%Y%m%d-%H%M%S}"


# ---------------------------------------------------------------------------------------------- reading


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The JSON objects of a jsonl file ([] when it is missing); malformed lines (a half-written last line while a
    run is in progress, a line cut off by a crash) and non-objects are skipped, never raised."""
    if not path.is_file():
        return []
    records = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """The records of `metrics.jsonl`."""
    return read_jsonl(RunDir(Path(run_dir)).metrics)


def step_records(run_dir: Path) -> list[dict[str, Any]]:
    """One record per logged training step, in step order: a step redone after a resume (the run stopped past its
    last checkpoint) replaces its earlier record."""
    by_step: dict[int, dict[str, Any]] = {}
    for record in read_metrics(run_dir):
        if "reward" in record and isinstance(record.get("step"), int) and not isinstance(record["step"], bool):
            by_step[record["step"]] = record
    return [by_step[step] for step in sorted(by_step)]


def summarize(run_dir: Path) -> dict[str, Any]:
    """Steps, reward first → last and training wall time from `metrics.jsonl`."""
    records = step_records(run_dir)
    if not records:
        return {"steps": 0}
    return {
        "steps": records[-1]["step"],
        "reward_first": records[0]["reward"],
        "reward_last": records[-1]["reward"],
        "train_s": records[-1]["wall_s"],
    }


# ---------------------------------------------------------------------------------------------- writing


RUN_DIR_FIX = "pass another --run-dir (or output.run_dir)"


def _first_existing(path: Path) -> Path:
    """`path` or the nearest ancestor that exists (as a name: a dangling link counts)."""
    path = Path(os.path.abspath(path))
    while not os.path.lexists(path) and path != path.parent:
        path = path.parent
    return path


def _check_can_create(run_dir: Path) -> None:
    """Fail (one line naming the path) when `run_dir`, which does not exist, cannot be created: a dangling link, a
    file on the way, a directory this user may not write."""
    if run_dir.is_symlink():
        raise UserError(
            f"output.run_dir: '{run_dir}' is a symbolic link to '{os.readlink(run_dir)}', which does not exist; "
            f"create its target, remove the link or {RUN_DIR_FIX}"
        )
    base = _first_existing(run_dir)
    if base.is_symlink() and not base.exists():
        raise UserError(
            f"output.run_dir: '{run_dir}' is below '{base}', a symbolic link to '{os.readlink(base)}', which does "
            f"not exist; {RUN_DIR_FIX}"
        )
    if not base.is_dir():
        raise UserError(
            f"output.run_dir: '{run_dir}' is below '{base}', which is a file, not a directory; {RUN_DIR_FIX}"
        )
    if not os.access(base, os.W_OK | os.X_OK):
        raise UserError(
            f"output.run_dir: cannot create '{run_dir}': '{base}' is not writable (read-only or no permission); "
            f"{RUN_DIR_FIX}"
        )


def check_run_dir_free(run_dir: Path, node_dir: str | None = None) -> None:
    """Fail if `run_dir` holds another run (results of two runs must never mix), or cannot be created or written.

    One node (`node_dir` None): the directory must be missing or empty. Several nodes sharing one directory:
    the other nodes' files of this run are expected, so it fails only when this node's own `node_dir` exists,
    the run finished (`DONE`), or it holds anything a starting run does not write (a log, metrics, a model).
    Every failure, an OS error included, is one line naming the path."""
    try:
        _check_run_dir_free(run_dir, node_dir)
    except OSError as e:
        raise UserError(
            f"output.run_dir: cannot use '{e.filename or run_dir}' ({e.strerror or e}); fix its permissions or "
            f"{RUN_DIR_FIX}"
        )


def _check_run_dir_free(run_dir: Path, node_dir: str | None) -> None:
    if not os.path.exists(run_dir):
        _check_can_create(run_dir)
        return
    fix = "pass another --run-dir (the same on every node, or a local one each) or remove it"
    if not run_dir.is_dir():
        raise UserError(f"output.run_dir: '{run_dir}' exists and is not a directory; {fix}")
    if not os.access(run_dir, os.W_OK | os.X_OK):
        raise UserError(
            f"output.run_dir: '{run_dir}' is not writable (read-only or no permission); fix its permissions or "
            f"{RUN_DIR_FIX}"
        )
    entries = sorted(p.name for p in run_dir.iterdir() if p.name != OWNER_LOCK)
    if node_dir is None:
        if entries:
            raise UserError(
                f"output.run_dir: '{run_dir}' already exists and is not empty; pass another --run-dir or remove it"
            )
        return
    if DONE in entries:
        raise UserError(f"output.run_dir: '{run_dir}' holds a finished run ({DONE}); {fix}")
    if (run_dir / node_dir).exists():
        raise UserError(
            f"output.run_dir: '{run_dir}' already has {node_dir}/ (this node rank already started "
            f"a run there); {fix}, and give each node its own --node-rank"
        )
    foreign = [name for name in entries if name not in SHARED_BEFORE_START and not name.startswith(".")]
    if foreign:
        raise UserError(f"output.run_dir: '{run_dir}' holds another run ({', '.join(foreign[:3])}); {fix}")


def write_shared(path: Path, content: str) -> bool:
    """Write a file all nodes write with the same bytes: the first writer wins, nothing is overwritten or seen
    half-written. Returns whether the file now holds `content` (False: another node wrote something else). An OS
    error (a full disk, no permission) is raised as it is, after the temporary file is removed."""
    if not path.exists():
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        try:
            tmp.write_text(content)
            try:
                os.link(tmp, path)
            except FileExistsError:
                pass
            except OSError:  # a filesystem without hard links
                if not path.exists():
                    os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
    return path.read_text() == content


def replace_file(path: Path, content: str) -> None:
    """Write `path` whole or not at all (a temporary file renamed over it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(content)
        if path.suffix == ".sh":
            tmp.chmod(0o755)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_run_dir(run_dir: Path, files: dict[str, str], node_dir: str | None = None) -> list[str]:
    """Create the run directory and write `files` (relative name → content) into it. Several nodes: this node's
    files go to its `node_dir`, created exclusively; the shared ones are written unless present. Returns the shared
    files that another node wrote differently (the ranks' recipe check then stops the run). Fails (UserError, one
    line naming the path) when the directory is taken or an OS error (no space, no permission) stops the writing;
    then whatever this call created is removed again."""
    check_run_dir_free(run_dir, node_dir)
    created: list[Path] = []  # what this call made, removed again if it fails
    first_new = first_missing(run_dir)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        if first_new is not None:
            created.append(first_new)
        differ = []
        if node_dir is not None:
            try:
                (run_dir / node_dir).mkdir(parents=True)
            except FileExistsError:
                raise UserError(
                    f"output.run_dir: '{run_dir}' already has {node_dir}/ (another node started "
                    "with the same node rank?); give each node its own --node-rank"
                )
            created.append(run_dir / node_dir)
        for name, content in files.items():
            path = run_dir / name
            if node_dir is not None and not name.startswith(node_dir + "/"):
                existed = path.exists()
                if not write_shared(path, content):
                    differ.append(name)
                if not existed:
                    created.append(path)
                continue
            created.append(path)
            path.write_text(content)
            if name.endswith(".sh"):
                path.chmod(0o755)
        return differ
    except OSError as e:
        for path in reversed(created):
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                try:
                    path.unlink(missing_ok=True)
                except OSError:
                    pass
        raise UserError(
            f"output.run_dir: cannot write '{e.filename or run_dir}' ({e.strerror or e}); free space or fix the "
            f"permissions, or {RUN_DIR_FIX}"
        )


def first_missing(path: Path) -> Path | None:
    """The outermost directory `mkdir(parents=True)` of `path` would create, or None when `path` exists."""
    path = Path(os.path.abspath(path))
    missing = None
    while not os.path.lexists(path) and path != path.parent:
        missing, path = path, path.parent
    return missing
