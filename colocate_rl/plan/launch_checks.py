"""What a launch on this machine needs before anything is written, checked torch-free, each problem a UserError line
naming the path and what to do: a run directory name the file system takes and a cache directory it can write
(`check_launch_paths`); for `train --resume`, the newest complete checkpoint whose files are whole
(`newest_whole_checkpoint`: a file cut off by a full disk or a copy is found from its own header or directory,
without reading its data) and the run's deepspeed.json (`run_deepspeed`)."""

from __future__ import annotations

import json
import os
import zipfile
from pathlib import Path
from typing import Any

from colocate_rl.errors import UserError, one_line
from colocate_rl.plan.deepspeed import check_deepspeed_keys
from colocate_rl.plan.launch_spec import LaunchSpec
from colocate_rl.rundir import RunDir


def checkpoint_file_problem(path: Path) -> str | None:
    """Why the checkpoint file `path` cannot be whole, read without torch and without reading its data: a safetensors
    file shorter than its header says, a torch file (a zip archive, torch.save's format) whose directory at its end is
    cut off or that is shorter than the directory says, a JSON file that does not parse; None when it looks whole."""
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            head = f.read(8)
            if path.suffix == ".safetensors":
                length = int.from_bytes(head, "little") if len(head) == 8 else -1
                if not 0 <= length <= size - 8:
                    return f"cut off ({size} bytes, shorter than its header)"
                tensors = json.loads(f.read(length))
                end = (
                    8
                    + length
                    + max((t["data_offsets"][1] for k, t in tensors.items() if k != "__metadata__"), default=0)
                )
                return f"cut off ({size} of {end} bytes)" if size < end else None
        if path.suffix in (".pt", ".pth", ".bin") and head[:4] == b"PK\x03\x04":  # else an older pickle: not checked
            with zipfile.ZipFile(path) as archive:
                end = max((i.header_offset + i.compress_size for i in archive.infolist()), default=0)
            return f"cut off ({size} of at least {end} bytes)" if size < end else None
        if path.suffix == ".json":
            json.loads(path.read_text())
    except zipfile.BadZipFile:
        return f"cut off ({path.stat().st_size} bytes; the archive's directory at its end is missing)"
    except (OSError, ValueError, KeyError, TypeError, IndexError) as e:
        return f"unreadable ({e.strerror if isinstance(e, OSError) else one_line(e, 120)})"
    return None


def checkpoint_problem(checkpoint: Path) -> str | None:
    """`FILE: why` for the first file of `checkpoint` (a directory) that is not whole (`checkpoint_file_problem`)."""
    for path in sorted(checkpoint.rglob("*")):
        if path.is_file() and not path.is_symlink():
            problem = checkpoint_file_problem(path)
            if problem:
                return f"{path}: {problem}"
    return None


def newest_whole_checkpoint(complete: list[Path]) -> tuple[Path | None, list[str]]:
    """Of `complete` (oldest first, `RunDir.complete_checkpoints`): the newest whose files are whole, and a line for
    each newer one passed over (the file that is not)."""
    passed = []
    for checkpoint in reversed(complete):
        problem = checkpoint_problem(checkpoint)
        if problem is None:
            return checkpoint, passed
        passed.append(problem)
    return None, passed


def run_deepspeed(paths: RunDir, spec: LaunchSpec) -> dict[str, Any] | None:
    """The DeepSpeed config the run trained with (its deepspeed.json as written at its start), None for a run without
    DeepSpeed. UserError naming the file when the run needs it (launch.json names it) and it is missing, or when it is
    not a JSON object of keys DeepSpeed takes."""
    from colocate_rl.recipe.load import read_text_file

    path = paths.deepspeed
    if "deepspeed" not in spec.trl_args and not path.exists():
        return None
    fix = "restore the file the run started with (the checkpoints' ZeRO shards follow it), or start a new run"
    try:
        config = json.loads(read_text_file(path, "DeepSpeed config"))
    except UserError as e:
        raise UserError(*(f"{line}; {fix}" for line in e.lines))
    except ValueError as e:
        raise UserError(f"{path}: not valid JSON ({one_line(e, 120)}); {fix}")
    problems = check_deepspeed_keys(config, str(path), file=True)
    if problems:
        raise UserError(*(f"{line} ({fix})" for line in problems))
    return config


def _name_problem(run_dir: Path) -> str | None:
    """The line for a run directory path with a part longer than its file system takes (creating it would fail
    after its parents were made), or None."""
    base = Path(os.path.abspath(run_dir))
    while not os.path.lexists(base) and base != base.parent:  # never raises, unlike Path.exists on a long name
        base = base.parent
    try:
        name_max, path_max = os.pathconf(base, "PC_NAME_MAX"), os.pathconf(base, "PC_PATH_MAX")
    except (OSError, ValueError):
        name_max, path_max = 255, 4096
    long = next((part for part in run_dir.parts if len(part.encode()) > name_max), None)
    if long is None and len(str(run_dir).encode()) < path_max:
        return None
    what = f"a name of {len(long.encode())} bytes ('{long[:24]}...')" if long else f"{len(str(run_dir))} bytes"
    return (
        f"output.run_dir: '{str(run_dir)[:60]}...' has {what}, more than the file system takes ({name_max} a name, "
        f"{path_max} a path); pass a shorter --run-dir (or output.run_dir, or a shorter recipe name)"
    )


def _cache_problem(cache: Path) -> str | None:
    """The line for a cache directory that cannot be created or written (built-in models and compiled ops go there),
    or None."""
    base = cache
    while not os.path.lexists(base) and base != base.parent:
        base = base.parent
    found = [p for p in (cache, cache / "builtin-models", cache / "torch_extensions") if os.path.lexists(p)]
    for path in found or [base]:
        if not path.is_dir():
            why = f"'{path}' is not a directory"
        elif not os.access(path, os.W_OK | os.X_OK):
            why = f"'{path}' is not writable"
        else:
            continue
        return (
            f"XDG_CACHE_HOME: the cache '{cache}' cannot be used ({why}); built-in models and compiled DeepSpeed ops "
            "are kept there: fix its permissions, or set XDG_CACHE_HOME to a writable directory"
        )
    return None


def check_launch_paths(run_dir: Path, cache: Path, *, this_machine: bool) -> None:
    """UserError before anything is written: a run directory name too long for its file system; on `this_machine`
    (not when planning for another) a cache directory that cannot be created or written."""
    problems = [_name_problem(run_dir), _cache_problem(cache) if this_machine else None]
    if any(problems):
        raise UserError(*[p for p in problems if p])
