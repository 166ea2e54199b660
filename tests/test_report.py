"""`colocate-rl report` on hand-made run directories: table numbers, PNGs with drawn data, comparison, errors."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import assert_user_error, cli_here
from rich.console import Console

from colocate_rl.errors import UserError
from colocate_rl.telemetry import plots
from colocate_rl.telemetry import report as rep
from colocate_rl.telemetry.plots import plot_memory_timeline
from colocate_rl.telemetry.timeline import innermost_spans

# One step, in order: (innermost phase, seconds, memory during it in GiB); generate wraps wake … sleep.
GPU_STEP = [
    ("wake", 0.2, 70.0),
    ("weight_sync", 0.3, 72.0),
    ("generate", 2.0, 75.0),
    ("sleep", 0.2, 22.0),
    ("reward", 0.1, 22.0),
    ("prepare", 0.2, 23.0),
    ("train", 1.0, 35.0),
    ("optimizer", 0.5, 40.0),
    ("other", 0.1, 21.0),
]
CPU_STEP = [
    ("generate", 1.5, 1.2),
    ("reward", 0.1, 1.2),
    ("train", 0.8, 1.6),
    ("optimizer", 0.4, 1.8),
    ("other", 0.2, 1.3),
]
WARMUP_GENERATE = 5.0  # step 1's generate seconds (the others take GPU_STEP's / CPU_STEP's)


def make_run(
    path: Path, *, gpu: bool = True, steps: int = 6, ranks: int = 2, sleep: bool = True, timeline: bool = True
) -> Path:
    """A run dir with metrics.jsonl (+ the final train_runtime line) and timeline/rank<N>.jsonl."""
    plan = [s for s in (GPU_STEP if gpu else CPU_STEP) if sleep or s[0] not in ("wake", "sleep")]
    if gpu and not sleep:  # vLLM keeps its memory all the time
        plan = [(p, s, max(m, 72.0)) for p, s, m in plan]
    path.mkdir(parents=True)
    (path / "timeline").mkdir()
    lines = {
        r: [json.dumps({"rank": r, "device": f"cuda:{r}" if gpu else "cpu", "unit": "GiB", "t0": 1000.0 + r})]
        for r in range(ranks)
    }
    metrics, t = [], 0.0
    for step in range(1, steps + 1):
        secs = {p: (WARMUP_GENERATE if step == 1 and p == "generate" else s) for p, s, _ in plan}
        for r in range(ranks):
            tt, in_gen = t, False
            for i, (p, _, mem) in enumerate(plan):
                nested = p in ("wake", "weight_sync", "generate", "sleep")  # inside generate
                if nested and not in_gen:
                    lines[r].append(json.dumps({"t": tt, "phase": "generate", "edge": "start", "mem": mem + 0.3 * r}))
                    in_gen = True
                if p not in ("generate", "other"):
                    lines[r].append(json.dumps({"t": tt, "phase": p, "edge": "start", "mem": mem + 0.3 * r}))
                lines[r] += [
                    json.dumps({"t": round(tt + 0.1 * k, 3), "mem": mem + 0.3 * r}) for k in range(round(secs[p] / 0.1))
                ]
                tt += secs[p]
                if p not in ("generate", "other"):
                    lines[r].append(json.dumps({"t": tt, "phase": p, "edge": "end", "mem": mem + 0.3 * r}))
                if in_gen and (
                    i + 1 == len(plan) or plan[i + 1][0] not in ("wake", "weight_sync", "generate", "sleep")
                ):
                    lines[r].append(json.dumps({"t": tt, "phase": "generate", "edge": "end", "mem": mem + 0.3 * r}))
                    in_gen = False
            lines[r].append(json.dumps({"t": tt, "step_end": step, "mem": plan[-1][2] + 0.3 * r}))
        t += sum(secs.values())
        record = {
            "step": step,
            "max_steps": steps,
            "wall_s": t,
            "reward": 0.1 * step,
            "loss": 0.5,
            "time/step_s": sum(secs.values()),
            **{f"time/{p}_s": s for p, s in secs.items()},
            "gen/tokens_per_s": 1000.0 + step,
            "telemetry/overhead_s": 0.046,
        }
        if gpu:
            record.update(
                {f"mem/{p}_end_gib": m for p, _, m in plan},
                **{
                    "mem/gpu_used_gib": plan[-1][2],
                    "mem/gpu_peak_gib": max(m for *_, m in plan) + step,
                    "mem/torch_allocated_gib": 15.0,
                    "mem/torch_reserved_gib": 18.0,
                },
            )
        else:
            record.update({"mem/rss_gib": 1.3, "mem/rss_peak_gib": 1.8})
        metrics.append(json.dumps(record))
    metrics.append(json.dumps({"step": steps, "wall_s": t, "train_runtime": t}))
    (path / "metrics.jsonl").write_text("\n".join(metrics) + "\n")
    if timeline:
        for r, rank_lines in lines.items():
            (path / "timeline" / f"rank{r}.jsonl").write_text("\n".join(rank_lines) + "\n")
    return path


def make_old_run(path: Path) -> Path:
    """A run from before telemetry: only step, reward, loss, wall_s; no timeline/."""
    path.mkdir(parents=True)
    lines = [
        json.dumps({"step": s, "max_steps": 4, "reward": 0.2 * s, "loss": 0.1, "wall_s": 3.0 * s}) for s in range(1, 5)
    ]
    (path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return path


def report(*args):
    return cli_here("report", *args)


def rendered(tables) -> str:
    console = Console(record=True, width=250)
    for table in tables:
        console.print(table)
    return console.export_text()


def drawn(path: Path) -> float:
    """Share of the PNG's pixels that are not background white (0 for an empty figure)."""
    import matplotlib.image

    pixels = matplotlib.image.imread(path)[..., :3]
    assert pixels.std() > 0.05
    return float((pixels.min(axis=-1) < 0.9).mean())


@pytest.fixture
def figures(monkeypatch):
    """The figures the plot functions save, kept open to inspect their artists."""
    saved = {}
    monkeypatch.setattr(plots, "_save", lambda fig, path: saved.setdefault(path.name, fig) and path)
    return saved


def test_time_shares_leave_out_the_warm_up_step(tmp_path):
    shares = rep.time_shares(rep.load_run(make_run(tmp_path / "run")))
    # steps 2-6 each: generate 2.0 + wake 0.2 + weight_sync 0.3 + sleep 0.2 + reward 0.1 + prepare 0.2 + train 1.0
    # + optimizer 0.5 + other 0.1 = 4.6 s (step 1 has generate 5.0 and is left out)
    assert shares["step"] == pytest.approx((4.6, 100.0))
    assert shares["generate"] == pytest.approx((2.0, 100 * 2.0 / 4.6))
    assert shares["optimizer"] == pytest.approx((0.5, 100 * 0.5 / 4.6))
    assert list(shares) == [
        "generate",
        "weight_sync",
        "wake",
        "sleep",
        "reward",
        "prepare",
        "train",
        "optimizer",
        "other",
        "step",
    ]
    assert sum(s for p, (s, _) in shares.items() if p != "step") == pytest.approx(4.6)


def test_memory_and_summary_gpu(tmp_path):
    run = rep.load_run(make_run(tmp_path / "run"))
    memory = rep.memory_stats(run)
    assert memory["end of sleep"] == (22.0, 22.0) and memory["end of generate"] == (75.0, 75.0)
    assert memory["peak during step (driver)"] == pytest.approx((78.5, 81.0))  # 75 + step, steps 1..6
    assert not any(label.startswith("RSS") for label in memory)
    summary = rep.run_summary(run)
    assert summary["steps"] == "6/6"
    assert (summary["reward (first step)"], summary["reward (last step)"]) == pytest.approx((0.1, 0.6))
    assert summary["median s/step"] == pytest.approx(4.6)
    assert summary["generated tokens/s (median)"] == pytest.approx(1003.5)
    assert summary["telemetry overhead (% of step time)"] == pytest.approx(100 * 6 * 0.046 / (7.6 + 5 * 4.6))
    assert [t.rank for t in run.timelines] == [0, 1] and run.timelines[1].device == "cuda:1"


def test_summary_of_an_overlapped_run_says_how_much_generation_overlap_hid(tmp_path):
    """Medians over steps 2-6: the engine process's seconds a batch, the share generated ahead, the part of it the
    ahead steps did not wait for (1 - wait / engine), and TRL's sampling metrics; a run without them has no rows."""
    path = make_run(tmp_path / "run", sleep=False)
    lines = (path / "metrics.jsonl").read_text().splitlines()
    fields = {  # step → (engine s, ahead, generate phase s = the wait, IS ratio mean, logprob gap mean, tokens vs TRL)
        1: (9.0, 0, 9.0, 0.9, 0.01, 1.0),
        2: (2.4, 1, 0.5, 0.80, 0.04, 0.8),
        3: (2.5, 1, 1.0, 0.82, 0.05, 0.9),
        4: (2.6, 1, 0.5, 0.70, 0.03, 0.86),
        5: (2.5, 0, 2.5, 0.90, 0.02, 0.7),
        6: (2.5, 1, 0.5, 0.75, 0.04, 0.95),
    }
    for i, (engine, ahead, wait, ratio, gap, kept) in fields.items():
        record = json.loads(lines[i - 1])
        record.update({
            "engine_process/generate_s": engine,
            "overlap/ahead": float(ahead),
            "time/generate_s": wait,
            "sampling/importance_sampling_ratio/mean": ratio,
            "sampling/sampling_logp_difference/mean": gap,
            "micro_batches/tokens_vs_trl": kept,
        })  # fmt: skip
        lines[i - 1] = json.dumps(record)
    (path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    summary = rep.run_summary(rep.load_run(path))
    assert summary["engine generation s/batch (median)"] == pytest.approx(2.5)
    assert summary["batches generated a step ahead (%)"] == pytest.approx(80.0)
    assert summary["generation hidden by overlap (%)"] == pytest.approx(80.0)  # wait 0.5 of 2.5 s
    assert summary["importance-sampling ratio (median)"] == pytest.approx(0.80)
    assert summary["|sampler − trainer| logprob (median)"] == pytest.approx(0.04)
    assert summary["trained tokens vs TRL's micro-batches (median)"] == pytest.approx(0.86)
    text = "".join(rendered(rep.tables([rep.load_run(path)])).replace("│", "").split())  # rows without spacing
    for row in (
        "s/batch(median)2.50",
        "ahead(%)80",
        "overlap(%)80",
        "ratio(median)0.800",
        "trainer|logprob(median)0.040",
    ):
        assert row in text
    plain = rep.run_summary(rep.load_run(make_run(tmp_path / "plain")))
    assert not any("engine" in k or "ahead" in k or "sampl" in k or "micro-batches" in k for k in plain)


def test_cpu_run_has_rss_only(tmp_path):
    run = rep.load_run(make_run(tmp_path / "cpu", gpu=False))
    assert rep.memory_stats(run) == {"RSS after optimizer step": (1.3, 1.3), "RSS peak during step": (1.8, 1.8)}
    assert set(rep.time_shares(run)) == {"generate", "reward", "train", "optimizer", "other", "step"}
    assert rep.time_shares(run)["generate"] == pytest.approx((1.5, 50.0))  # 1.5 of 3.0 s
    assert "process RSS (CPU run)" in rendered(rep.tables([run]))


def test_innermost_spans_of_nested_phases():
    edges = [
        (0, "generate", "start"),
        (0, "wake", "start"),
        (1, "wake", "end"),
        (3, "sleep", "start"),
        (4, "sleep", "end"),
        (4, "generate", "end"),
        (5, "optimizer", "start"),
        (6, "optimizer", "end"),
    ]
    assert innermost_spans(edges) == [(0, 1, "wake"), (1, 3, "generate"), (3, 4, "sleep"), (5, 6, "optimizer")]


def test_memory_timeline_draws_every_rank_phases_and_step_ends(tmp_path, figures):
    run = rep.load_run(make_run(tmp_path / "run"))
    plot_memory_timeline([run], tmp_path / "memory_timeline.png")
    axes = figures["memory_timeline.png"].axes
    assert len(axes) == 2 and axes[1].get_ylabel() == "rank 1 (cuda:1)\nGPU used (GiB)"
    memory, ends = axes[0].lines
    assert len(memory.get_xdata()) == len(run.timelines[0].points) and min(memory.get_ydata()) == 21.0
    assert list(ends.get_ydata()) == [21.0] * 6  # the step-end records' own memory
    assert len(axes[0].collections) == 8  # one shaded collection per phase that has edges ('other' has none)
    labels = [t.get_text() for t in figures["memory_timeline.png"].legends[0].get_texts()]
    assert labels[:4] == ["generate", "weight_sync", "wake", "sleep"] and "optimizer step end" in labels


def test_report_writes_pngs_with_drawn_data(tmp_path):
    run_dir = make_run(tmp_path / "run")
    written = rep.report([run_dir], console=Console(file=open(os.devnull, "w")))
    assert [p.name for p in written] == ["memory_timeline.png", "step_breakdown.png", "reward.png"]
    for path in written:
        assert path.parent == run_dir and path.stat().st_size > 10_000
        assert drawn(path) > 0.02


def test_two_runs_compare(tmp_path, figures):
    on, off = make_run(tmp_path / "sleep-on"), make_run(tmp_path / "sleep-off", sleep=False)
    text = rendered(rep.tables([rep.load_run(on), rep.load_run(off)]))
    assert "sleep-on: s/step" in text and "Δ s/step (sleep-off − sleep-on)" in text
    step_row = next(line for line in text.splitlines() if line.startswith("│ step "))
    assert "4.600" in step_row and "4.200" in step_row and "-0.400" in step_row
    sleep_row = next(line for line in text.splitlines() if "│ end of sleep " in line)
    assert "22.00" in sleep_row and "–" in sleep_row  # the run without sleep mode has no sleep phase
    after = next(line for line in text.splitlines() if "after optimizer step" in line)
    assert "+51.00" in after  # 72 GiB held by vLLM without sleep vs 21 GiB with it
    written = rep.report([on, off], out=tmp_path / "cmp", console=Console(file=open(os.devnull, "w")))
    assert [p.name for p in written] == [
        "compare_memory_timeline.png",
        "compare_step_breakdown.png",
        "compare_reward.png",
    ]
    # overlaid: one panel per rank with both runs' memory (and step ends) in their colours; one reward plot; the
    # step breakdown's bars of both runs side by side on one axis
    timeline = figures["compare_memory_timeline.png"]
    assert len(timeline.axes) == 2
    memory = [line for line in timeline.axes[0].lines if line.get_linestyle() == "-"]
    assert [line.get_color() for line in memory] == list(plots.RUN_COLORS)
    assert min(memory[0].get_ydata()) == 21.0 and min(memory[1].get_ydata()) == 72.0  # sleep on vs off
    assert not timeline.axes[0].collections  # no phase shading: two runs' phases would mix
    (reward,) = figures["compare_reward.png"].axes
    assert [line.get_label() for line in reward.lines] == [
        "sleep-on: training (reward)",
        "sleep-off: training (reward)",
    ]
    (bars,) = figures["compare_step_breakdown.png"].axes
    first, second = (
        sorted({round(p.get_x(), 2) for p in bars.patches if (p.get_hatch() or "") == h}) for h in ("", "//")
    )
    assert first == [0.6, 1.6, 2.6, 3.6, 4.6, 5.6] and second == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]


def test_cli_report_and_compare(tmp_path):
    on, off = make_run(tmp_path / "on"), make_run(tmp_path / "off", sleep=False)
    result = report(on)
    assert result.returncode == 0, result.stderr
    assert "time per step by phase" in result.stdout and "step 1 (warm-up) left out" in result.stdout
    assert f"wrote {on / 'memory_timeline.png'}" in result.stdout
    result = report(on, off, "--out", tmp_path / "cmp")
    assert result.returncode == 0, result.stderr
    for kind in ("memory_timeline", "step_breakdown", "reward"):
        assert drawn(tmp_path / "cmp" / f"compare_{kind}.png") > 0.02


def test_malformed_lines_are_skipped(tmp_path):
    run_dir = make_run(tmp_path / "run", steps=3)
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write('[1, 2]\n{"step": 4, "reward": "high"}\n{"step": 4, "max_steps": 3, "rew')  # half-written last line
    with open(run_dir / "timeline" / "rank0.jsonl", "a") as f:
        f.write('{"t": "soon", "mem": 3}\n\x00garbage\n{"t": 99.0, "mem": null}\n{"t": 99.5, "me')
    run = rep.load_run(run_dir)
    assert [r["step"] for r in run.steps] == [1, 2, 3]
    result = report(run_dir)
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr


def test_old_run_without_telemetry(tmp_path):
    run_dir = make_old_run(tmp_path / "old")
    result = report(run_dir)
    assert result.returncode == 0, result.stderr
    assert "reward.png" in result.stdout and "memory_timeline.png not written" in result.stdout
    assert not (run_dir / "step_breakdown.png").exists()
    assert rep.run_summary(rep.load_run(run_dir))["median s/step"] == 3.0  # from wall_s


def test_errors(tmp_path):
    assert_user_error(report(tmp_path / "missing"), "missing: does not exist", "colocate-rl train", one_line=True)
    assert_user_error(report(tmp_path), "no metrics.jsonl", "colocate-rl train", one_line=True)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "metrics.jsonl").write_text('{"step": 0, "wall_s": 1.0, "train_runtime": 1.0}\n{"st')
    assert_user_error(report(tmp_path / "empty"), "no training step logged yet", one_line=True)
    run_dir = make_old_run(tmp_path / "old")
    assert_user_error(report(run_dir, run_dir, run_dir), "pass one, or two", one_line=True)
    assert_user_error(report(run_dir, "--out", run_dir / "metrics.jsonl"), "is a file; pass a directory", one_line=True)
    with pytest.raises(UserError):
        rep.load_run(tmp_path / "empty")


@pytest.mark.slow
def test_cli_import_stays_light():
    probe = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, colocate_rl.cli; print(sorted(m for m in "
            "('matplotlib', 'numpy', 'colocate_rl.telemetry.report') if m in sys.modules))",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert probe.stdout.strip() == "[]"
