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
        "trainer.micro_batch_size: 4; now 8",  # the step of 8 completions in micro-batches of 4
        "trainer.max_completion_length",
    ):
        assert key in line


def test_oom_after_auto_raised_the_micro_batch_names_a_smaller_one():
    """The run directory's recipe holds what micro_batch_size auto chose (here 48 of a step of 96): the advice names
    the next smaller divisor; a micro-batch of 1 cannot be split."""
    log = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB."
    chosen = parse_recipe(
        {
            "rewards": [{"name": "digit_share"}],
            "trainer": {"per_device_train_batch_size": 48, "gradient_accumulation_steps": 2, "micro_batch_size": None},
        }
    )
    [line] = diagnose(log, chosen)
    assert "split the step into smaller micro-batches (trainer.micro_batch_size: 32; now 48)" in line
    single = parse_recipe({"rewards": [{"name": "digit_share"}], "trainer": {"per_device_train_batch_size": 1}})
    [line] = diagnose(log, single)
    assert "micro_batch_size" not in line and "the completions per step" in line


def test_unrelated_failures_get_no_advice():
    assert diagnose("RuntimeError: boom", RECIPE) == []
