"""The launch plan is pure: exact argv, env and files for single- and multi-node layouts."""

import json
from pathlib import Path

import pytest
import yaml
from conftest import CPU, GPU8, H200_GIB, QWEN05
from conftest import resolved as resolved_for

from colocate_rl.errors import UserError
from colocate_rl.pipeline import resolve
from colocate_rl.plan.host import assumed_host
from colocate_rl.plan.launch_plan import extensions_dir, make_plan
from colocate_rl.plan.resolved import AUTO_KEYS, auto_keys
from colocate_rl.recipe.load import parse_recipe
from colocate_rl.resume import plan_resume

RUN = Path("/runs/r1")
CACHE = Path("/cache/colocate-rl")


def plan_for(data, host=CPU, base_env=None):
    resolved = resolve(parse_recipe({"rewards": [{"name": "digit_share"}], **data}), host)
    return make_plan(
        resolved, run_dir=RUN, python="/venv/bin/python", cwd=Path("/work"), cache_dir=CACHE, base_env=base_env or {}
    )


def test_single_node_cpu_plan():
    plan = plan_for({"distributed": {"deepspeed": "zero3"}})
    assert plan.argv == [
        "/venv/bin/python",
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "1",
        "--nproc-per-node",
        "2",
        "--standalone",
        "-m",
        "colocate_rl.worker",
        "/runs/r1",
    ]
    assert plan.env == {
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONUNBUFFERED": "1",
        "TORCH_EXTENSIONS_DIR": str(extensions_dir(CACHE, "/venv/bin/python")),
        "DS_ACCELERATOR": "cpu",
        "HF_HUB_OFFLINE": "1",
    }
    assert sorted(plan.files) == ["deepspeed.json", "launch.json", "launch.sh", "recipe.yaml"]
    assert plan.builtin_model == {
        "layout": "tiny",
        "out_dir": "/cache/colocate-rl/builtin-models/tiny-seed42-float32",
        "seed": 42,
        "dtype": "float32",
        "link": "/runs/r1/model",
    }
    launch = json.loads(plan.files["launch.json"])
    assert launch["model_path"] == "/runs/r1/model" and launch["world_size"] == 2
    args = launch["trl_args"]
    assert args["deepspeed"] == "/runs/r1/deepspeed.json"
    assert (args["use_cpu"], args["bf16"], args["fp16"], args["use_vllm"]) == (True, False, False, False)
    assert args["model_init_kwargs"] == {"dtype": "float32"} and args["report_to"] == "none"
    assert json.loads(plan.files["deepspeed.json"])["bf16"]["enabled"] is False
    assert yaml.safe_load(plan.files["recipe.yaml"])["output"]["run_dir"] == "/runs/r1"


def test_user_env_wins_and_plan_has_no_side_effects():
    plan = plan_for({}, base_env={"OMP_NUM_THREADS": "7", "TORCH_EXTENSIONS_DIR": "/mine"})
    assert "OMP_NUM_THREADS" not in plan.env and "TORCH_EXTENSIONS_DIR" not in plan.env
    assert "deepspeed.json" not in plan.files
    assert not RUN.exists()


def test_multi_node_c10d_plan():
    plan = plan_for(
        {"distributed": {"nnodes": 2, "node_rank": 1, "rdzv_endpoint": "node0:29500", "rdzv_id": "job42"}}, host=GPU8
    )
    assert plan.argv == [
        "/venv/bin/python",
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "2",
        "--nproc-per-node",
        "8",
        "--node-rank",
        "1",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        "node0:29500",
        "--rdzv-id",
        "job42",
        "--log-dir",
        "/runs/r1/nodes/1/ranks",
        "--tee",
        "3",
        "-m",
        "colocate_rl.worker",
        "/runs/r1",
    ]
    assert plan.env["OMP_NUM_THREADS"] == "16" and "DS_ACCELERATOR" not in plan.env
    assert json.loads(plan.files["launch.json"])["world_size"] == 16


def test_multi_node_static_plan():
    plan = plan_for(
        {"distributed": {"nnodes": 2, "node_rank": 0, "rdzv_backend": "static", "rdzv_endpoint": "10.0.0.1:29400"}},
        host=GPU8,
    )
    assert plan.argv[3:-7] == [
        "--nnodes",
        "2",
        "--nproc-per-node",
        "8",
        "--node-rank",
        "0",
        "--master-addr",
        "10.0.0.1",
        "--master-port",
        "29400",
    ]
    assert plan.argv[-7:-3] == ["--log-dir", "/runs/r1/nodes/0/ranks", "--tee", "3"]


def test_gpu_plan_turns_on_colocated_vllm():
    plan = plan_for(
        {
            "generation": {
                "vllm_gpu_memory_utilization": 0.4,
                "tensor_parallel_size": 2,
                "sleep_level": 2,
                "max_model_length": 1024,
            }
        },
        host=GPU8,
    )
    args = json.loads(plan.files["launch.json"])["trl_args"]
    assert {k: args[k] for k in args if k.startswith("vllm") or k in ("use_vllm", "bf16", "use_cpu")} == {
        "use_vllm": True,
        "vllm_mode": "colocate",
        "vllm_gpu_memory_utilization": 0.4,
        "vllm_tensor_parallel_size": 2,
        "vllm_enable_sleep_mode": True,
        "vllm_max_model_length": 1024,
        "bf16": True,
        "use_cpu": False,
    }


def test_launch_script_replays_the_plan():
    plan = plan_for({})
    script = plan.files["launch.sh"]
    assert script.startswith("#!/usr/bin/env bash\n")
    assert "cd /work\n" in script and "export DS_ACCELERATOR=cpu\n" in script
    owner = f"/venv/bin/python -m colocate_rl.launch.owner {RUN} -- "  # torchrun holds the run dir's owner lock
    assert script.rstrip().endswith("exec " + owner + " ".join(plan.argv))
    assert plan.command_line().endswith(" ".join(plan.argv))


def test_extra_args_pass_through():
    plan = plan_for({"trainer": {"extra_args": {"loss_type": "dr_grpo", "top_k": 5}}})
    args = json.loads(plan.files["launch.json"])["trl_args"]
    assert args["loss_type"] == "dr_grpo" and args["top_k"] == 5


def test_trl_args_build_the_config_without_deprecation_warnings():
    # The worker builds TRL's config from launch.json's trl_args. Newer transformers renamed gradient_checkpointing*
    # to activation_checkpointing* (the old names warn on every rank); older ones only have the old names.
    import dataclasses
    import warnings

    from trl import GRPOConfig

    from colocate_rl.rank.worker import config_args

    args = json.loads(plan_for({"trainer": {"gradient_checkpointing": True}}).files["launch.json"])["trl_args"]
    assert args["gradient_checkpointing"] is True
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        config = GRPOConfig(**config_args(GRPOConfig, args))
    assert config.gradient_checkpointing is True

    @dataclasses.dataclass
    class Older:
        gradient_checkpointing: bool = False
        gradient_checkpointing_kwargs: dict | None = None

    kept = {"gradient_checkpointing": True, "gradient_checkpointing_kwargs": {"use_reentrant": False}, "seed": 1}
    assert config_args(Older, kept) == kept
    renamed = config_args(GRPOConfig, kept)
    if "activation_checkpointing" in {f.name for f in dataclasses.fields(GRPOConfig)}:
        assert renamed == {
            "activation_checkpointing": True,
            "activation_checkpointing_kwargs": {"use_reentrant": False},
            "seed": 1,
        }


# Every key auto may decide, and QWEN05 with all of them auto: on an H200 it starts with 1 rank, ZeRO-2, sleep 0,
# one micro-batch of 64; on 16 GiB GPUs auto would now add checkpointing, sleep 2 and micro-batches of 16, on 12 GiB
# ZeRO-3 with optimizer offload and micro-batches of 16 (and 2 ranks on both).
ALL_AUTO = {
    **QWEN05,
    "trainer": {**QWEN05["trainer"], "gradient_checkpointing": "auto", "gradient_accumulation_steps": 4},
    "generation": {**QWEN05["generation"], "sleep_level": "auto"},
    "distributed": {"zero_stage": "auto"},
}


SAME = {"python": "python", "cache_dir": Path("/cache/colocate-rl")}  # the start's launch, as RESUME plans it
RESUME = {"python": "python", "env": {"XDG_CACHE_HOME": "/cache"}}


def decided(recipe):
    d, t = recipe.distributed, recipe.trainer
    return (d.nproc_per_node, d.zero_stage, d.offload_optimizer, t.gradient_checkpointing)


def started_run(tmp_path):
    from colocate_rl.rundir import CHECKPOINT_COMPLETE, write_run_dir

    run_dir = tmp_path / "run"
    started = resolved_for(ALL_AUTO, assumed_host(1, H200_GIB), "trainer.max_steps=4")
    plan = make_plan(started, run_dir=run_dir, cwd=tmp_path, base_env={}, **SAME)
    write_run_dir(run_dir, plan.files)
    (run_dir / "checkpoints" / "checkpoint-2").mkdir(parents=True)
    (run_dir / "checkpoints" / "checkpoint-2" / CHECKPOINT_COMPLETE).write_text("{}")
    return started, plan


@pytest.mark.parametrize("gib", [20.0, 10.0])
def test_resume_plans_with_what_the_run_recorded_and_decides_nothing(tmp_path, gib):
    """The run directory records every value auto decided when the run started; resumed on GPUs where auto would now
    decide otherwise, the run continues with the recorded values (the same files but the checkpoint to resume)."""
    started, plan = started_run(tmp_path)
    recorded = started.recorded_recipe()
    assert auto_keys(recorded) == [] and parse_recipe(yaml.safe_load(plan.files["recipe.yaml"])) == recorded.model_copy(
        update={"output": recorded.output.model_copy(update={"run_dir": str(tmp_path / "run")})}
    )
    now = resolved_for(ALL_AUTO, assumed_host(2, gib), "trainer.max_steps=4").recorded_recipe()
    assert decided(now) != decided(recorded) and now.trainer.micro_batch_size is None
    assert now.trainer.per_device_train_batch_size != recorded.trainer.per_device_train_batch_size
    r, resumed = plan_resume(tmp_path / "run", host=assumed_host(2, gib), cwd=tmp_path, **RESUME)
    assert r.choice_lines() == [] and r.world_size == 1
    assert {k: v for k, v in resumed.files.items() if k != "launch.json"} == {
        k: v for k, v in plan.files.items() if k != "launch.json"
    }
    checkpoint = str(tmp_path / "run" / "checkpoints" / "checkpoint-2")
    assert json.loads(resumed.files["launch.json"]) == {
        **json.loads(plan.files["launch.json"]),
        "resume_from": checkpoint,
    }


def test_resume_refuses_a_machine_that_cannot_run_what_was_recorded(tmp_path):
    started_run(tmp_path)  # generates with vLLM on a GPU: a CPU machine would have auto pick transformers
    with pytest.raises(UserError, match="generation.backend: 'vllm' but vLLM is not installed here"):
        plan_resume(tmp_path / "run", host=CPU, cwd=tmp_path, **RESUME)
    with pytest.raises(UserError, match="--set distributed.zero_stage: a resumed run keeps"):
        plan_resume(tmp_path / "run", {"distributed.zero_stage": "auto"}, host=GPU8, cwd=tmp_path, **RESUME)


def test_resume_of_a_run_dir_written_before_every_value_was_recorded(tmp_path):
    """An earlier version's run directory left ranks, precision, dtype, backend, checkpointing and the ZeRO layout
    `auto` in recipe.yaml: a resume takes them from its launch.json and deepspeed.json, never from auto again."""
    from colocate_rl.recipe.load import dump_recipe

    started, plan = started_run(tmp_path)
    run_dir = tmp_path / "run"
    written = started.recipe.model_copy(
        update={"output": started.recipe.output.model_copy(update={"run_dir": str(run_dir)})}
    )
    # sleep level, micro-batch, overlap (with the engine process), engine processes, MPS: resolved into the recipe;
    # vLLM's share: the recipe's
    assert set(auto_keys(written)) == set(AUTO_KEYS) - {
        "generation.vllm_gpu_memory_utilization",
        "generation.sleep_level",
        "trainer.micro_batch_size",
        "generation.overlap",
        "generation.engine_process",
        "generation.engine_processes",
        "generation.mps",
    }
    # a run directory older than engine_processes and mps has no such keys: it ran one engine process (launch.json
    # says so), without MPS
    written = written.model_copy(
        update={"generation": written.generation.model_copy(update={"engine_processes": "auto", "mps": "auto"})}
    )
    (run_dir / "recipe.yaml").write_text(dump_recipe(written))
    launch = json.loads(plan.files["launch.json"])
    earlier = {k: v for k, v in launch.items() if k not in ("builtin_model", "model_dtype", "held_out_rows")}
    (run_dir / "launch.json").write_text(json.dumps(earlier, indent=2) + "\n")
    r, resumed = plan_resume(run_dir, host=assumed_host(2, 12.0), cwd=tmp_path, **RESUME)
    assert r.choice_lines() == []
    assert resumed.files["recipe.yaml"] == plan.files["recipe.yaml"]
    assert resumed.files["deepspeed.json"] == plan.files["deepspeed.json"]


def test_auto_keys_name_every_recipe_key_that_may_be_auto():
    from pydantic import BaseModel

    from colocate_rl.recipe.schema import Recipe

    found = {
        f"{section}.{key}"
        for section, info in Recipe.model_fields.items()
        if isinstance(info.annotation, type) and issubclass(info.annotation, BaseModel)
        for key, field in info.annotation.model_fields.items()
        if "'auto'" in repr(field.annotation)
    }
    assert found == set(AUTO_KEYS)


def test_a_preflight_serves_only_the_recipe_it_read(tmp_path):
    from colocate_rl.plan.preflight import preflight
    from colocate_rl.plan.resolve import bind_to_host

    recipe = parse_recipe({"rewards": [{"name": "digit_share"}]})
    pre = preflight(recipe)
    assert bind_to_host(recipe.model_copy(update={"name": "other"}), CPU, pre).preflight is pre  # reads nothing more
    other = parse_recipe({"rewards": [{"name": "format_think"}]})
    with pytest.raises(ValueError, match="pre-flight was read for another recipe"):
        bind_to_host(other, CPU, pre)
