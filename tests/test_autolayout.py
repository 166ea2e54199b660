"""`distributed.zero_stage: auto` / `trainer.gradient_checkpointing: auto` (colocate_rl/memory/autolayout.py): the
choice per layout and GPU size (table-driven, real estimate arithmetic on test-local recipes), explicit settings
winning, no-GPU planning, the plan and CLI output reflecting the choice, the measured-mode hook, and the benchmark
script's dry run."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import DIGITS, H200_GIB, QWEN05, QWEN7_1GPU, QWEN15_ZERO3, ROOT, cli, import_benchmark, write_recipe
from conftest import resolved as resolved_for

from colocate_rl.memory import autolayout as A
from colocate_rl.memory.allowance import ALLOWANCE
from colocate_rl.plan.host import Host, assumed_host
from colocate_rl.plan.launch_plan import make_plan
from colocate_rl.plan.resolved import auto_keys
from colocate_rl.recipe.load import load_recipe, parse_recipe

GIB = 2**30
H200 = H200_GIB
AUTO = ("distributed.zero_stage=auto", "trainer.gradient_checkpointing=auto")
# recipes/qwen2.5-7b-grpo.yaml's shapes: Qwen2.5-7B-Instruct on 8 GPUs, 8 × 2 micro-batches of 1024-token completions
QWEN7_8GPU = {
    **DIGITS,
    "model": {"name": "Qwen/Qwen2.5-7B-Instruct"},
    "trainer": {
        "per_device_train_batch_size": 8,
        "gradient_accumulation_steps": 2,
        "num_generations": 8,
        "max_completion_length": 1024,
    },
    "generation": {"vllm_gpu_memory_utilization": 0.35, "sleep_level": 2, "max_model_length": 1536},
    "distributed": {"nproc_per_node": 8},
}


def resolved(recipe: dict, gpus: int, gib: float, *sets: str):
    """`recipe` with `sets` on `gpus` assumed GPUs of `gib` GiB."""
    return resolved_for(recipe, assumed_host(gpus, gib), *sets)


# recipe, GPUs per node, GiB per GPU, extra --set → chosen layout label (stage, offload, checkpointing)
@pytest.mark.parametrize(
    "recipe, gpus, gib, sets, chosen",
    [
        # the reference run of issue 8: 1.5B layout, 2 H200s, 32 completions per step → ZeRO-2, no checkpointing
        (
            QWEN15_ZERO3,
            2,
            H200,
            ["distributed.deepspeed=null", "trainer.per_device_train_batch_size=16"],
            "ZeRO-2",
        ),
        (QWEN05, 1, 80.0, [], "ZeRO-2"),
        # hand-checked below: the same 1.5B layout on 2 GPUs of 32 GiB needs checkpointing, and ZeRO-2 then fits; on
        # 24 GiB ZeRO-2 and ZeRO-3 with checkpointing are 22.89 GiB > 21.6 in generation, optimizer offload fits; on 4
        # GPUs of 18 GiB ZeRO-3's sharding is enough
        (QWEN15_ZERO3, 2, 32.0, ["distributed.deepspeed=null"], "ZeRO-2, checkpointing"),
        (QWEN15_ZERO3, 2, 24.0, ["distributed.deepspeed=null"], "ZeRO-3 + offload optimizer"),
        (
            QWEN15_ZERO3,
            4,
            18.0,
            ["distributed.deepspeed=null", "distributed.nproc_per_node=4"],
            "ZeRO-3, checkpointing",
        ),
        # 7B layout, 1024-token completions, 1 GPU: 14 GiB weights + 14 grads + 85 fp32 master/Adam never fit with
        # vLLM's share beside them, so ZeRO-2/3 without offload are out; the H200 fits optimizer offload with
        # checkpointing (127.7 GiB without it), 80 GiB needs parameter offload too
        (QWEN7_1GPU, 1, H200, [], "ZeRO-3 + offload optimizer, checkpointing"),
        (QWEN7_1GPU, 1, 80.0, [], "ZeRO-3 + offload optimizer and params, checkpointing"),
        # more ranks shard the optimizer states: 8 × 80 GiB takes ZeRO-2 again, with checkpointing
        (QWEN7_1GPU, 8, 80.0, ["distributed.nproc_per_node=8"], "ZeRO-2, checkpointing"),
        (QWEN7_8GPU, 8, H200, [], "ZeRO-2"),
        (QWEN05, 1, 12.0, [], "ZeRO-3 + offload optimizer, checkpointing"),
        # nothing fits: the last (most frugal) candidate, mem-probe explains the rest
        (QWEN05, 1, 4.0, [], "ZeRO-3 + offload optimizer and params, checkpointing"),
    ],
)
def test_choice_by_layout_and_gpu_memory(recipe, gpus, gib, sets, chosen):
    r = resolved(recipe, gpus, gib, *AUTO, *sets)
    c = r.layout_choice
    assert c.chosen.label == chosen, "\n".join(c.lines())
    assert c.limit_gib == pytest.approx(gib * (1 - A.LAYOUT_HEADROOM))
    # the chosen is the first that fits; every earlier candidate is estimated above the limit
    index = [t.candidate for t in c.tried].index(c.chosen)
    assert all(not t.fits for t in c.tried[:index])
    assert c.tried[index].fits or index == len(c.tried) - 1
    # the resolved recipe carries it: DeepSpeed JSON and the trainer's checkpointing
    zero = r.deepspeed["zero_optimization"]
    assert zero["stage"] == c.chosen.stage and ("offload_optimizer" in zero) == c.chosen.offload_optimizer
    assert ("offload_param" in zero) == c.chosen.offload_params
    assert r.gradient_checkpointing is c.chosen.gradient_checkpointing


def test_hand_checked_case():
    """1.5B layout (1,543,714,304 params), 2 GPUs of 32 GiB, bf16, micro-batch 8, completion 256 after builtin:digits'
    prompts (40 tokens at most, measured: 296 tokens per sequence), vLLM share 0.25, sleep on. Limit 32 × 0.9 = 28.8.
    ZeRO-2 without checkpointing, training phase (vLLM asleep):
      context 1.25 + NCCL (2 ranks) 2.7 + weights 2N = 2.875 + grads 2N/2 = 1.438 + fp32 master and Adam 12N/2 = 8.626
      + activations 8 × 296 tokens × 28 layers × 2 B × (8·1536 + 3·1536 + 2·256 + 4·8960) = 6.576
      + the training allowance (memory.allowance: shares of the activations, the gradients and one LM-head tile of
      4,096 × 151,936 × 4 B) + sleep residue 0.28 = 29.29 GiB > 28.8: too big.
    ZeRO-2 with checkpointing: training keeps layer inputs (28 × 2 × 1536 B/token) plus one layer; generation
      holds the trainer's 1.25 + 2.7 + 2.875 + 1.438 + 8.626 beside vLLM's share 0.25 × 32 = 8 → 24.89 GiB ≤ 28.8:
      fits."""
    c = resolved(QWEN15_ZERO3, 2, 32.0, *AUTO, "distributed.deepspeed=null").layout_choice
    n = 1_543_714_304
    state = 1.25 + 2.7 + (2 * n + n + 6 * n) / GIB
    act = 8 * 296 * 28 * 2 * (8 * 1536 + 3 * 1536 + 2 * 256 + 4 * 8960) / GIB
    k = ALLOWANCE
    allowance = act * k["activations"] + n / GIB * k["gradients"] + 4096 * 151_936 * 4 / GIB * k["per LM-head tile"]
    first, second = c.tried[:2]
    assert first.candidate.label == "ZeRO-2" and first.peak_phase == "training"
    assert first.peak_gib == pytest.approx(state + act + allowance + 0.28) and round(first.peak_gib, 2) == 29.29
    assert second.candidate.label == "ZeRO-2, checkpointing" and second.peak_phase == "generation"
    assert second.peak_gib == pytest.approx(state + 0.25 * 32) and round(second.peak_gib, 2) == 24.89
    assert c.chosen == second.candidate and "the first that fits (24.89 ≤ 28.8 GiB)" in c.reason


def test_candidate_order_is_by_speed_and_checkpointing_is_tried_within_a_stage():
    c = resolved(QWEN05, 1, 80.0, *AUTO).layout_choice
    assert [t.candidate.label for t in c.tried] == [
        "ZeRO-2",
        "ZeRO-2, checkpointing",
        "ZeRO-3",
        "ZeRO-3, checkpointing",
        "ZeRO-3 + offload optimizer",
        "ZeRO-3 + offload optimizer, checkpointing",
        "ZeRO-3 + offload optimizer and params",
        "ZeRO-3 + offload optimizer and params, checkpointing",
    ]
    only_stage = resolved(
        QWEN05, 1, 80.0, "distributed.zero_stage=auto", "trainer.gradient_checkpointing=false"
    ).layout_choice
    assert [t.candidate.label for t in only_stage.tried] == [
        "ZeRO-2",
        "ZeRO-3",
        "ZeRO-3 + offload optimizer",
        "ZeRO-3 + offload optimizer and params",
    ]
    assert only_stage.auto_keys == ("distributed.zero_stage",)


@pytest.mark.parametrize(
    "sets, labels, chosen",
    [
        # explicit stage: only checkpointing is chosen
        (
            ["distributed.deepspeed=zero3", "distributed.zero_stage=3", "trainer.gradient_checkpointing=auto"],
            ["ZeRO-3", "ZeRO-3, checkpointing"],
            "ZeRO-3, checkpointing",
        ),
        # explicit DDP with checkpointing auto
        (
            ["distributed.zero_stage=null", "trainer.gradient_checkpointing=auto"],
            ["DDP", "DDP, checkpointing"],
            "DDP, checkpointing",
        ),
        # explicit checkpointing on: every candidate has it
        (
            ["distributed.zero_stage=auto", "trainer.gradient_checkpointing=true"],
            [
                "ZeRO-2, checkpointing",
                "ZeRO-3, checkpointing",
                "ZeRO-3 + offload optimizer, checkpointing",
                "ZeRO-3 + offload optimizer and params, checkpointing",
            ],
            "ZeRO-3 + offload optimizer, checkpointing",
        ),
        # explicit optimizer offload: applied to every candidate (duplicates drop out)
        (
            [
                "distributed.zero_stage=auto",
                "trainer.gradient_checkpointing=false",
                "distributed.offload_optimizer=true",
            ],
            ["ZeRO-2 + offload optimizer", "ZeRO-3 + offload optimizer", "ZeRO-3 + offload optimizer and params"],
            "ZeRO-3 + offload optimizer and params",
        ),
        # explicit parameter offload: ZeRO-2 cannot, so it is not a candidate
        (
            ["distributed.zero_stage=auto", "trainer.gradient_checkpointing=false", "distributed.offload_params=true"],
            ["ZeRO-3 + offload params", "ZeRO-3 + offload optimizer and params"],
            "ZeRO-3 + offload optimizer and params",
        ),
        # a named config with optimizer offload keeps it (explicit)
        (
            [
                "distributed.zero_stage=auto",
                "trainer.gradient_checkpointing=false",
                "distributed.deepspeed=zero3_offload_optimizer",
            ],
            ["ZeRO-2 + offload optimizer", "ZeRO-3 + offload optimizer", "ZeRO-3 + offload optimizer and params"],
            "ZeRO-3 + offload optimizer and params",
        ),
    ],
)
def test_explicit_settings_win(sets, labels, chosen):
    # 0.5B layout on a 12 GiB GPU: tight enough that the choice moves down the list
    c = resolved(QWEN05, 1, 12.0, *sets).layout_choice
    assert [t.candidate.label for t in c.tried] == labels, "\n".join(c.lines())
    assert c.chosen.label == chosen, "\n".join(c.lines())


def test_nothing_auto_means_no_choice_and_the_recipe_as_written():
    r = resolved(QWEN15_ZERO3, 2, 80.0)
    assert r.layout_choice is None and r.deepspeed["zero_optimization"]["stage"] == 3
    assert r.gradient_checkpointing is False
    r = resolved(QWEN15_ZERO3, 2, 80.0, "trainer.gradient_checkpointing=true")
    assert r.layout_choice is None and r.gradient_checkpointing is True


def test_without_a_gpu_the_first_candidate_and_no_limit():
    r = resolved_for(QWEN05, Host(cpu_count=4), *AUTO)
    c = r.layout_choice
    assert r.device == "cpu" and c.gpu_gib is None and c.limit_gib is None
    assert c.chosen.label == "ZeRO-2" and not r.gradient_checkpointing
    assert r.deepspeed["zero_optimization"]["stage"] == 2 and r.deepspeed["bf16"]["enabled"] is False
    assert "no memory limit was assumed" in c.reason and all(t.peak_gib is None for t in c.tried)


def test_unknown_layout_on_a_gpu_takes_the_safe_zero3(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # a hub id outside the shipped table whose config cannot be had
    r = resolved(QWEN05, 1, 80.0, *AUTO, "model.name=someone/unknown-model")
    assert r.layout_choice.chosen.label == "ZeRO-3, checkpointing"
    assert (
        "no estimate (model.name: the config of 'someone/unknown-model' could not be fetched" in r.layout_choice.reason
    )


def test_plan_files_reflect_the_choice(tmp_path):
    r = resolved(QWEN15_ZERO3, 2, 32.0, *AUTO, "distributed.deepspeed=null")
    plan = make_plan(r, run_dir=tmp_path / "run", python="python", cwd=tmp_path, cache_dir=tmp_path, base_env={})
    ds = json.loads(plan.files["deepspeed.json"])
    assert ds["zero_optimization"]["stage"] == 2 and ds["bf16"]["enabled"] is True
    args = json.loads(plan.files["launch.json"])["trl_args"]
    assert args["gradient_checkpointing"] is True and args["deepspeed"].endswith("deepspeed.json")
    # the recipe written to the run holds what auto decided (the ranks and a resume read it; nothing decides again)
    written = yaml.safe_load(plan.files["recipe.yaml"])
    assert auto_keys(parse_recipe(written)) == []
    dist = written["distributed"]
    assert (dist["deepspeed"], dist["zero_stage"], dist["offload_optimizer"], dist["offload_params"]) == (
        "zero3",
        2,
        False,
        False,
    )
    assert dist["nproc_per_node"] == 2 and dist["mixed_precision"] == "bf16"
    assert written["trainer"]["gradient_checkpointing"] is True and written["generation"]["backend"] == "vllm"
    assert written["model"]["dtype"] == "bfloat16"


@pytest.fixture
def qwen7_file(tmp_path):
    return write_recipe(tmp_path / "qwen7.yaml", QWEN7_1GPU)


@pytest.mark.slow
def test_train_dry_run_and_validate_say_what_auto_chose(qwen7_file):
    result = cli("train", qwen7_file, "--dry-run", "--gpus", "1", "--gpu-memory", H200)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert (
        "# distributed.zero_stage and trainer.gradient_checkpointing auto: estimated peak per GPU vs 126.4 GiB "
        "(140.4 GiB less 10% margin), fastest first; peaks with vLLM asleep while training (sleep level 2)" in lines
    )
    assert any(x.startswith("#   ZeRO-2 ") and x.endswith("too big") for x in lines)
    assert any(x.startswith("#   ZeRO-3 + offload optimizer ") and x.endswith("too big") for x in lines)
    assert any(x.startswith("#   ZeRO-3 + offload optimizer, checkpointing ") and x.endswith("← chosen") for x in lines)
    assert "# chosen: ZeRO-3 + offload optimizer, checkpointing — the first that fits (79.11 ≤ 126.4 GiB)" in lines
    assert lines[-1].startswith("OMP_NUM_THREADS=")  # the command stays last
    shown = cli("validate", qwen7_file, "--gpus", "1", "--gpu-memory", "80")
    assert shown.returncode == 0, shown.stderr
    assert "ZeRO-3 + offload optimizer and params, checkpointing (auto)" in shown.stdout
    assert "chosen: ZeRO-3 + offload optimizer and params, checkpointing — the first that fits" in shown.stdout


@pytest.mark.slow
def test_mem_probe_shows_and_returns_the_choice(qwen7_file):
    shown = cli("mem-probe", qwen7_file, "--estimate", "--gpus", "1", "--gpu-memory", H200)
    assert shown.returncode == 0, shown.stderr
    assert "chosen: ZeRO-3 + offload optimizer, checkpointing — the first that fits" in shown.stdout
    data = json.loads(cli("mem-probe", qwen7_file, "--estimate", "--gpus", "1", "--gpu-memory", H200, "--json").stdout)
    choice = data["layout_choice"]
    assert choice["chosen"] == {
        "label": "ZeRO-3 + offload optimizer, checkpointing",
        "zero_stage": 3,
        "offload_optimizer": True,
        "offload_params": False,
        "gradient_checkpointing": True,
    }
    assert choice["margin"] == A.LAYOUT_HEADROOM and choice["limit_gib"] == pytest.approx(H200 * 0.9, abs=1e-3)
    assert [x["fits"] for x in choice["candidates"]][:6] == [False, False, False, False, False, True]
    # the estimate table is of the chosen layout: optimizer states and the step live on the CPU
    assert not [t for t in data["terms"] if t.startswith(("optimizer states", "optimizer step"))]


@pytest.mark.parametrize(
    "ram, chosen",
    [
        # H200 host of the 2-GPU machine (251 GiB): optimizer offload's 113.5 GiB fits in 90 % of it
        (251.0, "ZeRO-3 + offload optimizer, checkpointing"),
        # a 125 GiB host: 113.5 > 112.5 GiB, and parameter offload needs more still; nothing fits, the last is taken
        (125.0, "ZeRO-3 + offload optimizer and params, checkpointing"),
        (None, "ZeRO-3 + offload optimizer, checkpointing"),  # RAM unknown (--gpus planning): not checked
    ],
)
def test_offload_must_fit_in_host_memory(ram, chosen):
    from dataclasses import replace

    host = replace(assumed_host(1, H200), ram_gib=ram)
    c = resolved_for(QWEN7_1GPU, host).layout_choice
    assert c.chosen.label == chosen, "\n".join(c.lines())
    opt = next(t for t in c.tried if t.candidate.label == "ZeRO-3 + offload optimizer, checkpointing")
    assert opt.host_gib == pytest.approx(16 * 7_615_616_512 / GIB) and opt.host_fits is (ram != 125.0)
    line = next(x for x in c.lines() if x.strip().startswith("ZeRO-3 + offload optimizer, checkpointing "))
    assert "+ host 113.5 GiB" in line
    assert line.endswith("host RAM too small") if ram == 125.0 else line.endswith("fits  ← chosen")
    assert c.to_json()["candidates"][4]["host_gib"] == pytest.approx(113.482, abs=0.001)


def test_confirm_choice_for_the_measured_mode():
    c = resolved(QWEN15_ZERO3, 2, 32.0, *AUTO, "distributed.deepspeed=null").layout_choice
    ok, line = A.confirm_choice(c, 18.0)
    assert ok and line.startswith("ZeRO-2, checkpointing confirmed: measured peak 18.00 GiB (estimated 24.89")
    ok, line = A.confirm_choice(c, 30.0)
    assert not ok and "exceeds the limit 28.8 GiB" in line and line.endswith("set distributed.zero_stage: 3")


def test_shipped_gpu_recipes_use_auto_where_it_is_safe():
    for name in (
        "gpu-0.5b-layout",
        "gpu-7b-layout-1gpu",
        "qwen2.5-1.5b-grpo-gsm8k",
        "qwen2.5-1.5b-rloo-gsm8k",
        "qwen2.5-7b-grpo",
        "qwen2.5-72b-grpo-colocate",
    ):
        assert load_recipe(ROOT / "recipes" / f"{name}.yaml").distributed.zero_stage == "auto", name
    # the forced references stay forced
    assert load_recipe(ROOT / "recipes" / "gpu-1.5b-layout-zero3.yaml").distributed.zero_stage is None
    assert load_recipe(ROOT / "recipes" / "quickstart.yaml").distributed.deepspeed == "zero3"


@pytest.mark.slow
def test_bench_script_dry_run_prints_every_row(tmp_path):
    out = tmp_path / "bench"
    result = subprocess.run(
        [sys.executable, "benchmarks/bench_layouts.py", "--out", str(out), "--dry-run", "--steps", "12"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert not out.exists(), "a dry run writes nothing"
    text = result.stdout
    for row in ("auto", "zero3", "zero2", "ddp", "server", "auto-256", "zero3-256", "server-256"):
        assert f"# {row}\n" in text or f"# {row} (" in text
    common = (
        "--set trainer.max_steps=12 --set trainer.per_device_train_batch_size=16 --set trainer.num_generations=8 "
        "--set trainer.max_completion_length=256"
    )
    colocated = [x for x in text.splitlines() if " -m colocate_rl train " in x]
    assert len(colocated) == 6 and all(x.startswith("CUDA_VISIBLE_DEVICES=0,1 ") and common in x for x in colocated)
    assert "--set distributed.zero_stage=auto --set trainer.gradient_checkpointing=auto" in colocated[0]
    assert colocated[1].endswith("--set distributed.deepspeed=zero3 --set distributed.zero_stage=3")
    assert colocated[2].endswith("--set distributed.zero_stage=2")
    assert colocated[3].endswith("--set distributed.deepspeed=null --set distributed.zero_stage=null")
    assert colocated[4].endswith("--set trainer.gradient_accumulation_steps=8")  # 16 × 2 ranks × 8 = 256
    assert f"CUDA_VISIBLE_DEVICES=1 {Path(sys.executable).with_name('trl')} vllm-serve --model " in text
    assert "CUDA_VISIBLE_DEVICES=0 HF_HUB_OFFLINE=1 " in text and "--nproc-per-node 1" in text
    assert text.count("http://127.0.0.1:8765 12") == 2  # the server rows: 32 and 256 completions per step
    bad = subprocess.run(
        [sys.executable, "benchmarks/bench_layouts.py", "--out", str(out), "--rows", "zero5", "--dry-run"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert bad.returncode == 2 and "unknown rows ['zero5']" in bad.stderr


@pytest.mark.slow
def test_bench_script_takes_issue_19s_workload_b_shape(tmp_path):
    """--completion-length / --max-model-len reach the colocated recipe, vLLM's server and TRL's server-mode
    trainer (workload (b): 512 completion tokens); a length with no room for the prompt is refused."""
    B = import_benchmark("bench_layouts")
    argv, _ = B.colocated_command("auto-256", tmp_path / "run", 12, 512, 768)
    assert "trainer.max_completion_length=512" in argv and "generation.max_model_length=768" in argv
    (serve, _), _ = B.server_commands(tmp_path, tmp_path / "run", tmp_path / "model", 12, 8765, 768)
    assert serve[serve.index("--max-model-len") + 1] == "768"
    trainer = B.SERVER_TRAINER % dict(micro=16, accum=16, group=8, completion=512, seed=0)
    assert "max_completion_length=512" in trainer and "gradient_accumulation_steps=16" in trainer
    bad = subprocess.run(
        [sys.executable, "benchmarks/bench_layouts.py", "--out", str(tmp_path / "b"), "--dry-run"]
        + ["--completion-length", "512", "--max-model-len", "512"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert (
        bad.returncode == 2 and "--completion-length 512 must be positive and below --max-model-len 512" in bad.stderr
    )


def test_bench_results_from_metrics(tmp_path):
    """The s/step statistic: median of wall_s differences after the first step; time/* medians likewise."""
    B = import_benchmark("bench_layouts")
    run = tmp_path / "run"
    run.mkdir()
    walls = [10.0, 11.5, 13.0, 14.2, 15.9]
    (run / "metrics.jsonl").write_text(
        "".join(
            json.dumps({"step": i + 1, "wall_s": w, "time/train_s": 0.1 * (i + 1)}) + "\n" for i, w in enumerate(walls)
        )
        + json.dumps({"step": 5, "wall_s": 16.0, "train_runtime": 16.0})
        + "\n"
    )
    stats = B.step_stats(run)
    assert stats["median_s_per_step"] == pytest.approx(1.5)  # diffs 1.5, 1.5, 1.2, 1.7
    assert stats["times"] == {"time/train_s": 0.35} and stats["steps_logged"] == 5
    table = B.markdown(
        [
            {"row": "zero3", "completions_per_step": 32, "ok": True, "median_s_per_step": 3.0, "times": {}},
            {"row": "auto", "completions_per_step": 32, "ok": True, "median_s_per_step": 1.5, "times": {}},
        ]
    )
    assert "| auto | 32 |  | 1.500 | 2.00 |" in table and "auto vs forced ZeRO-3 (32 completions/step): 2.00×" in table

    def row(name, n, s):
        return {
            "row": name,
            "completions_per_step": n,
            "ok": True,
            "median_s_per_step": s,
            "times": {},
        }

    big = B.markdown(
        [row("auto-256", 256, 6.5), row("zero3-256", 256, 14.3), row("server-256", 256, 9.75), row("server", 32, 1.8)]
    )  # each batch size compares with its own references
    assert "| auto-256 | 256 |  | 6.500 | 2.20 | 1.50 |" in big and "(32 completions" not in big
    assert "auto vs forced ZeRO-3 (256 completions/step): 2.20×" in big
    assert "auto vs server mode (256 completions/step): 1.50×" in big


def test_engine_trainer_offload_keeps_only_layouts_it_supports():
    # generation.offload_trainer_during_generation needs the optimizer states on the GPU and, under ZeRO-3, an
    # optimizer block: auto keeps ZeRO-2 only (here nothing fits 12 GiB, so its last candidate)
    r = resolved(QWEN05, 1, 12.0, *AUTO, "generation.offload_trainer_during_generation=true")
    assert [t.candidate.label for t in r.layout_choice.tried] == ["ZeRO-2", "ZeRO-2, checkpointing"]
    from colocate_rl.errors import UserError

    with pytest.raises(UserError, match="the optimizer states already live on CPU"):
        resolved(
            QWEN05,
            1,
            12.0,
            *AUTO,
            "generation.offload_trainer_during_generation=true",
            "distributed.offload_optimizer=true",
        )
