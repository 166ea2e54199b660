"""What a user reads (issue 31, items 3-6), in process: the live progress line at 80 columns, the rank processes'
warning filter, validate's two peaks labelled, `recipes` one line each, readable help metavars, `--version`, the
did-you-mean for a shipped recipe, the run directory printed once with the next command at the end."""

import io
import json
import re
import warnings

import pytest
from conftest import QWEN05, assert_user_error, cli_here, write_recipe
from rich.console import Console

from colocate_rl.cli import train as cli_train
from colocate_rl.cli.progress import live_progress, live_status, step_count
from colocate_rl.rank import worker
from colocate_rl.recipe.shipped import recipe_summary, shipped_recipes, shipped_scripts

# Three steps as the ranks log them: phases come and go (sync, check and score only in some steps), memory on a GPU.
STEPS = [
    {"step": 3, "max_steps": 40, "reward": 0.5, "time/step_s": 0.33, "time/generate_s": 0.14, "time/train_s": 0.15},
    {
        "step": 20,
        "max_steps": 40,
        "reward": 0.963,
        "time/step_s": 0.4,
        "time/generate_s": 0.11,
        "time/weight_sync_s": 0.1,
        "time/weight_check_s": 0.02,
        "time/reward_s": 0.03,
        "time/train_s": 0.12,
        "time/optimizer_s": 0.02,
    },
    {"step": 21, "max_steps": 40, "reward": 0.97, "time/step_s": 0.29, "time/generate_s": 0.12, "time/train_s": 0.15},
]


def live_lines(width: int) -> list[str]:
    """The live line as a terminal of `width` columns shows it before the first step and after each of STEPS."""
    console = Console(file=io.StringIO(), width=width, force_terminal=True, color_system=None)
    progress = live_progress(console)
    task = progress.add_task("train", total=None, steps="step –", status="starting ranks ...")
    phases: dict[str, None] = {}
    console.print(progress.get_renderable())
    for r in STEPS:
        for i, key in enumerate(("mem/gpu_used_gib", "mem/gpu_peak_gib")):
            r[key] = 14.5 + 27 * i
        status = live_status(r, phases)
        progress.update(task, completed=r["step"], total=40, steps=step_count(r["step"], 40), status=status)
        console.print(progress.get_renderable())
    return console.file.getvalue().splitlines()


def test_live_line_at_80_columns_keeps_the_step_count_and_its_width():
    lines = live_lines(80)
    assert [len(line) for line in lines] == [80] * 4
    assert [line.split()[1] for line in lines[1:]] == ["3/40", "20/40", "21/40"]
    assert all(line.startswith("step ") for line in lines)
    # the mean reward at the same column every step, named once; the reward phase is "score"
    assert len({line.index("reward 0.") for line in lines[1:]}) == 1
    assert all(line.count("reward") == 1 for line in lines[1:])


def test_live_line_phases_keep_their_places_as_they_come_and_go():
    wide = live_lines(200)
    assert "gen 0.11s sync 0.10s check 0.02s score 0.03s train 0.12s opt 0.02s" in wide[2]
    # step 21 ran no sync, check, score or optimizer step: shown at 0.00s, every field where it was
    assert "gen 0.12s sync 0.00s check 0.00s score 0.00s train 0.15s opt 0.00s" in wide[3]
    assert wide[2].index(" train ") == wide[3].index(" train ")
    assert "GPU 14.5 GiB peak 41.5" in wide[3]


def test_rank_processes_silence_only_the_repeated_deprecations():
    """The three FutureWarnings that filled a ZeRO-3 train.log (6,084 of 6,128 lines) are silenced by `main`; any other
    warning, also another FutureWarning from torch.distributed, still shows."""
    sent = [
        ("`torch.distributed.reduce_scatter_tensor` is deprecated. Please use `x` instead.", FutureWarning),
        ("`torch.distributed.all_gather_into_tensor` is deprecated. Please use `x` instead.", FutureWarning),
        ("`is_gradient_checkpointing` is deprecated and will be removed in v6.", FutureWarning),
        ("`torch.distributed.broadcast` is deprecated.", FutureWarning),
        ("`is_gradient_checkpointing` is deprecated", UserWarning),
        ("a warning of the run's own", UserWarning),
    ]
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert worker.main([]) == 2  # a usage error, after the filters are installed
        for message, category in sent:
            warnings.warn(message, category, stacklevel=1)
    assert [str(w.message) for w in seen] == [
        "`torch.distributed.broadcast` is deprecated.",
        "`is_gradient_checkpointing` is deprecated",
        "a warning of the run's own",
    ]


def test_validate_labels_which_peak_assumes_vllm_asleep_and_which_awake(tmp_path):
    recipe = {
        **QWEN05,
        "generation": {**QWEN05["generation"], "sleep_level": "auto"},
        "distributed": {"zero_stage": "auto"},
    }
    result = cli_here("validate", write_recipe(tmp_path / "r.yaml", recipe), "--gpus", "1")
    assert result.returncode == 0, result.stderr
    head = next(line for line in result.stdout.splitlines() if line.startswith("distributed.zero_stage"))
    sleep = next(line for line in result.stdout.splitlines() if line.startswith("generation.sleep_level"))
    assert head.endswith("; peaks with vLLM asleep while training (sleep level 2)")
    assert sleep.endswith("; peak with vLLM awake while training")
    awake = cli_here("validate", tmp_path / "r.yaml", "--gpus", "1", "--set", "generation.sleep_level=0")
    assert "; peaks with vLLM awake while training (sleep level 0)" in awake.stdout


def test_recipes_lists_one_whole_sentence_per_line_at_80_columns():
    result = cli_here("recipes", env={"COLUMNS": "80"})
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert max(map(len, lines)) <= 80
    for name, path in {**shipped_recipes(), **shipped_scripts()}.items():
        summary = recipe_summary(path)
        assert summary.endswith("."), f"{path.name}: its opening comment should start with one short sentence"
        assert [line for line in lines if line.startswith(name + " ")] == [
            line for line in lines if line.split()[:1] == [name] and line.endswith(summary)
        ], name
    assert "colocate-rl on several machines without Slurm." in result.stdout  # not its second sentence's first half


def test_recipe_summary_is_the_first_sentence_of_the_opening_comment(tmp_path):
    path = tmp_path / "x.sh"
    path.write_text("#!/bin/bash\n# Runs it on one node, e.g. a laptop. Then more\n# of the same.\n#\n# Usage\n")
    assert recipe_summary(path) == "Runs it on one node, e.g."  # a period before a space ends the sentence
    path.write_text("# A recipe without a period\nname: x\n")
    assert recipe_summary(path) == "A recipe without a period"


@pytest.mark.parametrize("command", ["", "train", "validate", "mem-probe", "recipes", "env", "report"])
def test_help_names_values_by_metavar(command):
    result = cli_here(*command.split(), "--help", env={"COLUMNS": "80"})
    assert result.returncode == 0, result.stderr
    assert not re.search(r"<(bool|int|float|str|path|list)", result.stdout), result.stdout
    if command == "train":
        assert re.search(r"--gpus +N ", result.stdout) and re.search(r"--run-dir +DIR ", result.stdout)
        assert re.search(r"--dry-run +Print", result.stdout)  # a flag takes no value
    if command == "report":
        assert re.search(r"RUN_DIR\.*  +Run directory", result.stdout)


def test_version():
    from colocate_rl import __version__

    result = cli_here("--version")
    assert result.returncode == 0 and result.stdout == f"colocate-rl {__version__}\n"


def test_a_misspelled_shipped_recipe_gets_a_did_you_mean(tmp_path):
    assert_user_error(cli_here("validate", "quikstart"), "did you mean 'quickstart'?", one_line=True)
    assert_user_error(cli_here("train", "quickstart-lroa"), "did you mean 'quickstart-lora'?", one_line=True)
    assert_user_error(cli_here("recipes", "slurm.sbach", cwd=tmp_path), "did you mean 'slurm.sbatch'?", one_line=True)
    assert_user_error(cli_here("validate", "zzz"), "shipped: gpu-0.5b-layout, ", one_line=True)  # nothing close


def test_train_prints_the_run_dir_once_and_the_report_command_at_the_end(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"

    code = 0

    def ran(plan, console, verbose=False, watchdog=None):  # the run itself: two logged steps
        plan.run_dir.mkdir(exist_ok=True)  # the owner lock made it already
        steps = [{"step": s, "max_steps": 2, "wall_s": s * 0.5, "reward": s / 4} for s in (1, 2)]
        (plan.run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in steps))
        return code

    monkeypatch.setattr(cli_train, "run_with_progress", ran)
    result = cli_here("train", "quickstart", "--run-dir", run_dir, "--set", "trainer.max_steps=2")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert [line.split() for line in lines if str(run_dir) in line] == [
        ["run", "dir", str(run_dir)],
        ["log", str(run_dir / "train.log")],
        ["next:", "colocate-rl", "report", str(run_dir)],
    ]
    assert lines[-1] == f"next: colocate-rl report {run_dir}"
    code = 3  # a failed run ends on its error (printed by run_with_progress), not on a next step
    result = cli_here("train", "quickstart", "--run-dir", tmp_path / "failed", "--set", "trainer.max_steps=2")
    assert result.returncode == 3 and "next:" not in result.stdout
