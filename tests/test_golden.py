"""Behaviour pinned across refactors: `train --dry-run`, the run-dir files of the plan (launch.sh, launch.json,
recipe.yaml, deepspeed.json, forecast.json, the node files), the argv and environment of the launch,
`mem-probe --estimate --json` of every shipped recipe are identical to the copies recorded in tests/golden/ (recorded before the package was
restructured). The tables of `validate` and `mem-probe --estimate` are compared by what they say, not how rich draws
them (rich is not pinned): borders dropped, each line's cells joined by one space.

A deliberate change of any of these outputs re-records them: `COLOCATE_RL_RECORD_GOLDEN=1 pytest tests/test_golden.py`
and review the diff of tests/golden/."""

import json
import os
import re
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from colocate_rl.cli import app
from colocate_rl.pipeline import forecast_file, load_resolved
from colocate_rl.plan.host import planning_host
from colocate_rl.plan.launch_plan import extensions_dir, make_plan
from colocate_rl.plan.sources import parse_node_flags
from colocate_rl.recipe.load import parse_sets

GOLDEN = Path(__file__).resolve().parent / "golden"
RECORD = os.environ.get("COLOCATE_RL_RECORD_GOLDEN") == "1"
PLAN_CASES = sorted(p.stem for p in (GOLDEN / "plan").glob("*.json"))
CLI_CASES = sorted(p.stem for p in (GOLDEN / "cli").glob("*.json"))
RANK_ENV = (
    "OMP_NUM_THREADS",
    "TOKENIZERS_PARALLELISM",
    "PYTHONUNBUFFERED",
    "TORCH_EXTENSIONS_DIR",
    "DS_ACCELERATOR",
    "HF_HUB_OFFLINE",
    "MASTER_PORT",
)
BOX = re.compile(r"[\u2500-\u257f]")  # rich's table borders, in any box style


def content_lines(text: str) -> list[str]:
    """What printed text says without rich's layout: box characters dropped, each line's words joined by one space,
    blank lines dropped (a border line becomes blank)."""
    lines = (" ".join(BOX.sub(" ", line).split()) for line in text.splitlines())
    return [line for line in lines if line]


@pytest.fixture
def clean_env(monkeypatch, tmp_path):
    for key in list(os.environ):
        if key.startswith("SLURM_") or key in RANK_ENV:
            monkeypatch.delenv(key)
    monkeypatch.setenv("XDG_CACHE_HOME", "/cache")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _options(args: list[str]) -> tuple[str, dict[str, str | list[str]]]:
    name, options = args[0], {"--set": []}
    for flag, value in zip(args[1::2], args[2::2]):
        if flag == "--set":
            options["--set"].append(value)
        else:
            options[flag] = value
    return name, options


def _compare(path: Path, got: dict) -> None:
    if RECORD:
        path.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
        return
    want = json.loads(path.read_text())
    for key in want:
        assert got.get(key) == want[key], f"{path.name}: {key} differs from the recorded copy"


@pytest.mark.parametrize("case", PLAN_CASES)
def test_dry_run_and_run_dir_files_are_unchanged(case, clean_env):
    path = GOLDEN / "plan" / f"{case}.json"
    args = json.loads(path.read_text())["args"]
    run_dir = f"/runs/{case}"
    result = CliRunner().invoke(app, ["train", *args, "--dry-run", "--run-dir", run_dir])
    got = {
        "args": args,
        "exit": result.exit_code,
        "stdout": result.stdout.replace(sys.executable, "<python>")
        .replace(
            extensions_dir(Path("/cache/colocate-rl"), sys.executable).name, extensions_dir(Path(), "<python>").name
        )
        .replace(str(clean_env), "<cwd>"),
        "stderr": result.stderr.replace(sys.executable, "<python>"),
    }
    if result.exit_code == 0:
        name, opts = _options(args)
        flags = parse_node_flags(
            opts.get("--nnodes"), opts.get("--node-rank"), opts.get("--rdzv-endpoint"), opts.get("--rdzv-id")
        )
        host = planning_host(
            int(opts["--gpus"]) if "--gpus" in opts else None,
            float(opts["--gpu-memory"]) if "--gpu-memory" in opts else None,
        )
        resolved, _ = load_resolved(name, parse_sets(opts["--set"]), host=host, flags=flags, env=os.environ)
        plan = make_plan(
            resolved,
            run_dir=Path(run_dir),
            python="<python>",
            cwd=Path("/cwd"),
            cache_dir=Path("/cache/colocate-rl"),
            base_env={},
            forecast=forecast_file(resolved),
        )
        got.update(files=plan.files, env=plan.env, argv=plan.argv, builtin_model=plan.builtin_model)
    _compare(path, got)


@pytest.mark.parametrize("case", CLI_CASES)
def test_validate_and_estimate_say_the_same(case, clean_env):
    path = GOLDEN / "cli" / f"{case}.json"
    args = json.loads(path.read_text())["args"]
    result = CliRunner().invoke(app, args, env={"COLUMNS": "1000"})  # wide: no cell is wrapped
    got = {"args": args, "exit": result.exit_code, "stderr": result.stderr}
    if "--json" in args:
        got["stdout"] = result.stdout
    else:
        got["lines"] = content_lines(result.stdout)
    _compare(path, got)


@pytest.mark.parametrize("case", PLAN_CASES)
def test_launch_json_reads_back_unchanged_also_from_earlier_versions(case, tmp_path):
    """A run directory's launch.json (recorded above) is read by the ranks as a LaunchSpec and written back to the
    same bytes; one written before it held what the ranks derived themselves (built-in model, dtype, held-out rows)
    still reads, those derived from what it holds (the held-out rows: not recorded)."""
    from dataclasses import replace

    from colocate_rl.plan.launch_spec import LaunchSpec

    files = json.loads((GOLDEN / "plan" / f"{case}.json").read_text()).get("files")
    if not files:
        pytest.skip("the dry run of this case failed by design")
    path = tmp_path / "launch.json"
    path.write_text(files["launch.json"])
    spec = LaunchSpec.read(path)
    assert spec.to_json() == files["launch.json"]
    earlier = {
        k: v
        for k, v in json.loads(files["launch.json"]).items()
        if k not in ("builtin_model", "model_dtype", "held_out_rows")
    }
    path.write_text(json.dumps(earlier, indent=2) + "\n")
    assert LaunchSpec.read(path) == replace(spec, held_out_rows=None)
