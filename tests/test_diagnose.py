"""Known GPU failures in a log → advice naming the recipe keys (log lines as vLLM/torch print them)."""

from colocate_rl.launch.failures import diagnose
from colocate_rl.recipe.load import parse_recipe

RECIPE = parse_recipe(
    {"rewards": [{"name": "digit_share"}], "generation": {"vllm_gpu_memory_utilization": 0.5, "sleep_level": 0}}
)


def test_vllm_startup_memory():
    log = (
        "ValueError: Free memory on device (40.1/139.8 GiB) on startup is less than desired GPU memory "
        "utilization (0.5, 69.9 GiB). Decrease GPU memory utilization or reduce GPU memory used by other processes."
    )
    [line] = diagnose(log, RECIPE)
    assert line.startswith("vLLM could not reserve generation.vllm_gpu_memory_utilization=0.5")
    assert "e.g. 0.4" in line and "mem-probe" in line


def test_kv_cache_too_small():
    log = "ValueError: To serve at least one request ... which is larger than the available KV cache memory (0.5 GiB)"
    [line] = diagnose(log, RECIPE)
    assert "generation.max_model_length" in line


def test_trainer_oom_names_the_keys():
    log = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB."
    [line] = diagnose(log, RECIPE)
    for key in (
        "generation.sleep_level: 2",
        "distributed.deepspeed: zero3",
        "trainer.gradient_checkpointing",
        "trainer.per_device_train_batch_size",
    ):
        assert key in line


def test_unrelated_failures_get_no_advice():
    assert diagnose("RuntimeError: boom", RECIPE) == []
