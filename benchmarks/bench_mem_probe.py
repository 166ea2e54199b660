#!/usr/bin/env python3
"""Accuracy benchmark of `colocate-rl mem-probe` on a GPU machine (issue #6): for each case, run the measuring
probe (short trials), then find by bisection the largest vLLM share that really runs `--verify-steps` steps
(20) without running out of memory, starting from the probe's largest passing share ± `--band`. Writes
`results.jsonl` (one object per case) and `benchmarks.md` (estimate vs measured per phase, % error; recommended
share vs the true largest) to `--out`.

    python benchmarks/bench_mem_probe.py --out runs/bench-mem-probe [--cases 0.5b-sleep,1.5b-zero3]
        [--set generation.enforce_eager=true] [--steps 3] [--verify-steps 20] [--dry-run]

`--set` overrides go to every trial (probe and verification). A case's finished probe is kept in
`OUT/CASE/probe.json` and reused when the script runs again (e.g. `--skip-verify` first, the verification later).
`--dry-run` prints the commands and runs nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from colocate_rl.launch.failures import TOO_HIGH  # noqa: E402
from colocate_rl.memory import probe as P  # noqa: E402
from colocate_rl.memory.bisect import ProbeAborted, TrialResult, bisect  # noqa: E402
from colocate_rl.pipeline import load_resolved  # noqa: E402
from colocate_rl.plan.host import detect_host  # noqa: E402
from colocate_rl.recipe.load import format_sets, parse_sets  # noqa: E402

CASES = {  # name → recipe, visible GPUs, overrides
    "0.5b-sleep": ("recipes/gpu-0.5b-layout.yaml", "0", []),
    "0.5b-nosleep": ("recipes/gpu-0.5b-layout.yaml", "0", ["generation.sleep_level=0"]),
    "1.5b-zero3": ("recipes/gpu-1.5b-layout-zero3.yaml", "0,1", []),
}


def probe_command(recipe: str, sets: list[str], probe_dir: Path, args) -> list[str]:
    argv = [
        sys.executable,
        "-m",
        "colocate_rl",
        "mem-probe",
        recipe,
        "--json",
        "--probe-dir",
        str(probe_dir),
        "--steps",
        str(args.steps),
        "--resolution",
        f"{args.resolution:g}",
        "--margin",
        f"{args.margin:g}",
        "--trial-timeout",
        f"{args.trial_timeout:g}",
    ]
    for item in sets:
        argv += ["--set", item]
    return argv


def verify(
    recipe: str, sets: list[str], gpus: str, start: float, out_dir: Path, args, probe_trials: list[dict] = ()
) -> dict:
    """Bisection with long trials around the probe's result: the largest share that runs verify_steps steps.
    Every finished trial is appended to `out_dir/trials.jsonl` and reused when the script runs again (a device
    session can end mid-bisection). A share the probe saw fail as too high (start-up refused, out of memory) within
    its shorter trials cannot run verify_steps steps either, so it counts as too high without a rerun, and so does any
    share above one that failed as too high."""
    log = out_dir / "trials.jsonl"
    done = {}
    for t in probe_trials:
        if t["outcome"] in TOO_HIGH:
            done[round(t["util"], 6)] = TrialResult(
                t["util"],
                t["outcome"],
                steps=t.get("steps", 0),
                detail=f"probe trial ({args.steps} steps): {t.get('detail', '')}",
            )
    if log.exists():
        for line in log.read_text().splitlines():
            row = json.loads(line)
            done[round(row["util"], 6)] = TrialResult(**row)
    lower, upper = max(args.resolution, start - args.band), min(1.0, start + args.band)
    count = len([p for p in out_dir.glob("trial-*") if p.is_dir()]) if out_dir.exists() else 0

    def trial(util: float) -> TrialResult:
        nonlocal count
        if round(util, 6) in done:
            result = done[round(util, 6)]
            print(
                f"  verify: share {util:g} → {result.outcome} (earlier: {result.detail or result.run_dir})",
                file=sys.stderr,
                flush=True,
            )
            return result
        failed_below = [u for u, r in done.items() if r.outcome in TOO_HIGH and u < util]
        if failed_below:  # a larger share leaves the trainer less memory still: not worth a trial
            u = min(failed_below)
            print(f"  verify: share {util:g} → too high ({u:g} failed: {done[u].outcome})", file=sys.stderr, flush=True)
            return TrialResult(util, done[u].outcome, detail=f"implied: {u:g} failed ({done[u].outcome})")
        count += 1
        print(f"  verify trial {count}: share {util:g} ({args.verify_steps} steps) ...", file=sys.stderr, flush=True)
        os.environ["CUDA_VISIBLE_DEVICES"] = gpus  # the trial's ranks and the host it is planned for
        overrides = {**parse_sets(sets), **P.trial_overrides(util, args.verify_steps)}
        resolved = load_resolved(ROOT / recipe, overrides, host=detect_host(), env={})[0]  # one node, no Slurm layering
        plan = P.plan_trial(resolved, out_dir / P.trial_name(count, util))
        result = P.run_trial(plan, util, args.verify_steps, args.trial_timeout)
        print(
            f"  → {result.outcome} ({result.seconds:.0f} s, {result.steps} steps) {result.detail}",
            file=sys.stderr,
            flush=True,
        )
        with log.open("a") as f:
            f.write(json.dumps(result.record()) + "\n")
        return result

    try:
        result = bisect(trial, lower, upper, args.resolution, start=start, margin=0.0)
    except ProbeAborted as e:
        return {"error": f"{e.trial.outcome}: {e.trial.detail}", "trials": len(e.trials)}
    bound = (
        "≥" if result.largest is not None and result.largest >= result.upper else "≤" if result.largest is None else ""
    )
    return {
        "true_largest": result.largest,
        "bound": bound,
        "window": [result.lower, result.upper],
        "trials": [
            {"util": t.util, "outcome": t.outcome, "seconds": t.seconds, "steps": t.steps, "detail": t.detail}
            for t in result.trials
        ],
        "notes": result.notes,
    }


def markdown(rows: list[dict]) -> str:
    lines = ["| case | phase | estimate (GiB) | measured (GiB) | estimate error |", "|---|---|---:|---:|---:|"]
    for row in rows:
        for ph in row.get("phases", []):

            def fmt(v):
                return "" if v is None else f"{v:.2f}"

            err = "" if ph["error_pct"] is None else f"{ph['error_pct']:+.1f} %"
            lines.append(
                f"| {row['case']} | {ph['phase']} | {fmt(ph['estimate_gib'])} | {fmt(ph['measured_gib'])} | {err} |"
            )
    lines += [
        "",
        "| case | estimate's share | probe: largest passing | probe: recommended | true largest "
        f"({rows[0]['verify_steps'] if rows else 20} steps) | recommended − true | probe trials / minutes |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        v = row.get("verify", {})
        true = v.get("true_largest")
        diff = f"{row['recommended'] - true:+.3f}" if row.get("recommended") is not None and true is not None else ""
        lines.append(
            f"| {row['case']} | {row.get('estimate_chosen', '')} | {row.get('largest_passing', '')} | "
            f"{row.get('recommended', '')} | {v.get('bound', '')}{'' if true is None else true} "
            f"{v.get('error', '')} | {diff} | {row.get('probe_trials', '')} / "
            f"{row.get('probe_s', 0) / 60:.1f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="directory for results.jsonl, benchmarks.md, trials")
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated subset of {', '.join(CASES)}")
    parser.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override for every trial, e.g. generation.enforce_eager=true",
    )
    parser.add_argument("--gpus", help="CUDA_VISIBLE_DEVICES for every case (default: the case's own, e.g. 0)")
    parser.add_argument("--steps", type=int, default=3, help="steps per probe trial")
    parser.add_argument("--verify-steps", type=int, default=20, help="steps per verification trial")
    parser.add_argument("--band", type=float, default=0.05, help="verification window: probe's largest ± band")
    parser.add_argument("--resolution", type=float, default=0.01)
    parser.add_argument("--margin", type=float, default=0.02)
    parser.add_argument("--trial-timeout", type=float, default=900)
    parser.add_argument("--skip-verify", action="store_true", help="probe only (no 20-step bisection)")
    parser.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    args = parser.parse_args(argv)
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        parser.error(f"unknown case(s) {', '.join(unknown)}; choose from {', '.join(CASES)}")

    if args.dry_run:
        for name in cases:
            recipe, gpus, sets = CASES[name]
            gpus, sets = args.gpus or gpus, [*sets, *args.sets]
            probe = probe_command(recipe, sets, args.out / name / "probe", args)
            print(f"# {name}: probe ({args.steps}-step trials)")
            print(f"CUDA_VISIBLE_DEVICES={gpus} {shlex.join(probe)}")
            if not args.skip_verify:
                # what a verification trial runs, as the equivalent `train` command
                trial = [sys.executable, "-m", "colocate_rl", "train", recipe, "--run-dir"]
                trial.append(str(args.out / name / "verify" / "trial-K-utilU"))
                for item in [*sets, *format_sets(P.trial_overrides(0.0, args.verify_steps))]:
                    trial += ["--set", item]
                util_set = "generation.vllm_gpu_memory_utilization="
                shown = shlex.join([f"{util_set}U" if a.startswith(util_set) else a for a in trial])
                print(
                    f"# {name}: verification, bisection over U in the probe's largest passing share ± {args.band:g} "
                    "(plus the probe's pinned layout, `pinned_sets` in its JSON)"
                )
                print(f"CUDA_VISIBLE_DEVICES={gpus} {shown}")
        return 0

    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in cases:
        recipe, gpus, sets = CASES[name]
        gpus, sets = args.gpus or gpus, [*sets, *args.sets]
        row: dict = {
            "case": name,
            "recipe": recipe,
            "gpus": gpus,
            "sets": sets,
            "steps": args.steps,
            "verify_steps": args.verify_steps,
        }
        saved = args.out / name / "probe.json"  # a finished probe is reused: the verification can run later
        if saved.exists():
            probe, returncode = json.loads(saved.read_text()), 0
            row["probe_s"] = probe.pop("bench_probe_s")
            print(f"== {name}: probe reused from {saved}", file=sys.stderr, flush=True)
        else:
            print(f"== {name}: probe", file=sys.stderr, flush=True)
            begin = time.monotonic()
            done = subprocess.run(
                probe_command(recipe, sets, args.out / name / "probe", args),
                cwd=ROOT,
                stdout=subprocess.PIPE,
                text=True,
                env={**os.environ, "CUDA_VISIBLE_DEVICES": gpus, "COLUMNS": "200"},
            )
            row["probe_s"], returncode = round(time.monotonic() - begin, 1), done.returncode
            try:
                probe = json.loads(done.stdout.strip().splitlines()[-1])
            except (IndexError, json.JSONDecodeError):
                probe = None
            if returncode == 0 and probe is not None:
                saved.write_text(json.dumps({**probe, "bench_probe_s": row["probe_s"]}))
        if returncode != 0 or probe is None:
            row["error"] = f"mem-probe exited {returncode}"
        else:
            row.update(
                estimate_chosen=probe["estimate"]["chosen"],
                largest_passing=probe["largest_passing"],
                recommended=probe["recommended"],
                phases=probe.get("phases", []),
                probe_trials=len(probe["trials"]),
                layout_check=probe.get("layout_check"),
                probe=probe,
            )
            if not args.skip_verify and probe["largest_passing"] is not None:
                print(f"== {name}: verification ({args.verify_steps} steps)", file=sys.stderr, flush=True)
                begin = time.monotonic()
                row["verify"] = verify(
                    recipe,
                    [*sets, *probe.get("pinned_sets", [])],
                    gpus,
                    probe["largest_passing"],
                    args.out / name / "verify",
                    args,
                    probe["trials"],
                )  # the probe's layout
                row["verify_s"] = round(time.monotonic() - begin, 1)
        rows.append(row)
        with (args.out / "results.jsonl").open("a") as f:
            f.write(json.dumps(row) + "\n")
        (args.out / "benchmarks.md").write_text(markdown(rows))
    print((args.out / "benchmarks.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
