"""`generation.vllm_gpu_memory_utilization: auto`: the share one generation batch needs by the estimate plus the
margin, chosen before the layout, sleep level and micro-batch, which then get what the trainer has left."""

import json

from conftest import CPU, QWEN05, cli_here, resolved

from colocate_rl.memory.estimate import SHARE_MARGIN, estimate
from colocate_rl.plan.host import Gpu, Host

H200 = Host(gpus=(Gpu("NVIDIA H200", 140.0),), has_vllm=True, cpu_count=16)
# QWEN05 at 256 completions per step with the micro-batch and sleep level left to auto (its shape was measured)
BIG_STEP = {
    **QWEN05,
    "trainer": {**QWEN05["trainer"], "gradient_accumulation_steps": 16, "micro_batch_size": "auto"},
    "generation": {**QWEN05["generation"], "sleep_level": "auto", "vllm_gpu_memory_utilization": "auto"},
}


def test_auto_takes_what_one_generation_batch_needs_plus_the_margin():
    r = resolved(BIG_STEP, H200)
    share = r.recipe.generation.vllm_gpu_memory_utilization
    e = estimate(r, 140.0)
    assert share == e.chosen and abs(share - (e.lower + SHARE_MARGIN)) <= 0.01  # rounded up to 1/100
    assert e.lower * 140.0 >= e.kv["gib"]  # the batch's KV cache is inside it
    assert r.share_choice.share == share and f"({e.kv['gib']:.2f} GiB)" in r.share_choice.line()
    assert r.recorded_recipe().generation.vllm_gpu_memory_utilization == share  # ranks and --resume read it


def test_the_trainer_gets_the_rest_a_larger_micro_batch_than_at_the_fixed_share():
    # passes cost most under ZeRO-2: larger ones save most; generation and training in turn
    zero2 = ("distributed.deepspeed=zero3", "distributed.zero_stage=2", "generation.overlap=off")
    fixed = resolved(BIG_STEP, H200, "generation.vllm_gpu_memory_utilization=0.65", *zero2)
    auto = resolved(BIG_STEP, H200, *zero2)
    assert auto.recipe.generation.vllm_gpu_memory_utilization < 0.65
    micro = [r.recipe.trainer.per_device_train_batch_size for r in (fixed, auto)]  # the micro-batch, resolved
    levels = [r.recipe.generation.sleep_level for r in (fixed, auto)]
    # 256 completions: at share 0.65 awake only micro-batches of 32 fit, so vLLM sleeps to train in one of 256 (the
    # forecast's choice); at auto's share 2 of 128 fit awake
    assert (micro, levels) == ([256, 128], [2, 0])
    assert fixed.sleep_choice.reason.startswith("faster by the forecast: ")


def test_without_a_gpu_or_with_a_kv_budget_auto_is_the_default_share():
    cpu = resolved("quickstart", CPU, "generation.vllm_gpu_memory_utilization=auto")
    assert cpu.recipe.generation.vllm_gpu_memory_utilization == 0.3
    assert "no vLLM on a GPU here" in cpu.share_choice.reason
    budget = resolved(BIG_STEP, H200, "generation.kv_cache_memory=4GiB")
    assert budget.recipe.generation.vllm_gpu_memory_utilization == 0.3
    assert "kv_cache_memory" in budget.share_choice.reason


def test_validate_says_what_auto_chose_and_a_bad_share_is_one_line(tmp_path):
    ok = cli_here("validate", "gpu-0.5b-layout", "--gpus", "1", "--gpu-memory", "140", "--set",
                  "generation.vllm_gpu_memory_utilization=auto")  # fmt: skip
    assert ok.returncode == 0, ok.stderr
    assert "generation.vllm_gpu_memory_utilization auto: 0." in ok.stdout
    est = cli_here("mem-probe", "gpu-0.5b-layout", "--estimate", "--json", "--gpus", "1", "--gpu-memory", "140",
                   "--set", "generation.vllm_gpu_memory_utilization=auto")  # fmt: skip
    data = json.loads(est.stdout)
    assert data["share_choice"]["share"] == data["vllm_gpu_memory_utilization"] == data["window"]["chosen"]
    bad = cli_here("validate", "quickstart", "--set", "generation.vllm_gpu_memory_utilization=most")
    assert bad.returncode == 2
    assert bad.stderr.strip().count("\n") == 0 and "input should be 'auto'" in bad.stderr
