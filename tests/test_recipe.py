"""Schema, YAML loading, overrides and cross-field checks: each bad recipe → its exact message."""

import json

import pytest
from conftest import CPU

from colocate_rl.errors import UserError
from colocate_rl.pipeline import resolve
from colocate_rl.plan.host import Gpu, Host
from colocate_rl.plan.trl_args import trl_field_names
from colocate_rl.recipe.load import apply_overrides, dump_recipe, format_sets, load_recipe, parse_recipe, parse_sets
from colocate_rl.recipe.schema import Recipe

GPU2 = Host(gpus=(Gpu("H200", 140.0),) * 2, has_vllm=True, cpu_count=32)
MINIMAL = {"rewards": [{"name": "digit_share"}]}


def with_(**sections):
    data = json.loads(json.dumps(MINIMAL))
    for key, value in sections.items():
        data[key] = value
    return data


def errors_of(data, host=CPU):
    with pytest.raises(UserError) as info:
        resolve(parse_recipe(data), host)
    return info.value.lines


@pytest.mark.parametrize(
    "data, expected",
    [
        ({}, "rewards: required key is missing; add it to the recipe"),
        (with_(trainer={"learnin_rate": 1e-3}), "trainer.learnin_rate: unknown key; did you mean 'learning_rate'?"),
        (
            with_(trainer={"num_generations": 1}),
            "trainer.num_generations: input should be greater than or equal to 2 (got 1)",
        ),
        (
            with_(trainer={"max_steps": "ten"}),
            "trainer.max_steps: input should be a valid integer, unable to parse string as an integer (got 'ten')",
        ),
        (
            with_(generation={"backend": "vlm"}),
            "generation.backend: input should be 'auto', 'vllm' or 'transformers' (got 'vlm')",
        ),
        (
            with_(generation={"vllm_gpu_memory_utilization": 1.5}),
            "generation.vllm_gpu_memory_utilization: input should be less than or equal to 1 or input should be 'auto' "
            "(got 1.5)",
        ),
        (
            with_(distributed={"nproc_per_node": "many"}),
            "distributed.nproc_per_node: input should be a valid integer, unable to parse string as an integer "
            "or input should be 'auto' (got 'many')",
        ),
        (with_(distributed={"zero_stage": 4}), "distributed.zero_stage: input should be 0, 1, 2, 3 or 'auto' (got 4)"),
        ({"rewards": [{"nam": "x"}]}, "rewards[0].nam: unknown key; did you mean 'name'?"),
        (
            {"rewards": [{"weight": 2}]},
            "rewards[0]: has neither name nor model; give one per list item: name (a reward function) or model "
            "(a reward model)",
        ),
        (
            with_(output={"report_to": ["tb"]}),
            "output.report_to[0]: input should be 'tensorboard', 'wandb', 'mlflow', 'trackio' or 'comet_ml' (got 'tb')",
        ),
        (with_(data=5), "data: must be a section (a mapping of keys), got 5"),
        (with_(name="my run"), "name: string should match pattern '^[A-Za-z0-9][A-Za-z0-9._-]*$' (got 'my run')"),
        (
            with_(bogus=1),
            "bogus: unknown key; known keys here: name, algorithm, model, data, rewards, trainer, "
            "generation, eval, distributed, checkpoint, watchdog, output, tools",
        ),
    ],
)
def test_schema_errors_name_the_dotted_key(data, expected):
    with pytest.raises(UserError) as info:
        parse_recipe(data)
    assert expected in info.value.lines


def test_all_schema_errors_are_listed_at_once():
    with pytest.raises(UserError) as info:
        parse_recipe({"rewards": "answer_match", "trainer": {"max_steps": 0, "beta": -1}, "oops": True})
    assert [line.split(":")[0] for line in info.value.lines] == ["rewards", "trainer.max_steps", "trainer.beta", "oops"]


@pytest.mark.parametrize(
    "data, host, expected",
    [
        (
            with_(trainer={"per_device_train_batch_size": 3, "num_generations": 4}),
            CPU,
            "trainer.num_generations: the generation batch (6 = per_device_train_batch_size 3 × 2 ranks × steps per "
            "generation) is not divisible by num_generations (4); change one of them",
        ),
        (
            with_(
                generation={"overlap": "one_step", "engine_processes": 3}, trainer={"per_device_train_batch_size": 2}
            ),
            CPU,
            "generation.engine_processes: 3 is more than the completions a rank generates at once (2: the generation "
            "batch 4 over 2 ranks), so some would only hold memory; set at most 2",
        ),
        (
            with_(generation={"backend": "vllm"}),
            CPU,
            "generation.backend: 'vllm' but vLLM is not installed here; install the GPU extra (pip install "
            "'colocate-rl[gpu]') or set generation.backend: transformers (or auto)",
        ),
        (
            with_(generation={"backend": "vllm"}),
            Host(gpus=(), has_vllm=True, cpu_count=2),
            "generation.backend: 'vllm' needs a CUDA GPU and none was found; set generation.backend: auto to generate "
            "with transformers on CPU",
        ),
        (
            with_(generation={"tensor_parallel_size": 4}),
            GPU2,
            "generation.tensor_parallel_size: 4 does not divide distributed.nproc_per_node (2); tensor-parallel groups "
            "must stay inside one node",
        ),
        (
            with_(distributed={"nproc_per_node": 4}),
            GPU2,
            "distributed.nproc_per_node: 4 ranks but this machine has 2 GPU(s); use auto or at most the GPU count",
        ),
        (
            with_(distributed={"nnodes": 2}),
            CPU,
            "distributed.rdzv_endpoint: required when nnodes > 1; set it to host:port of node 0",
        ),
        (
            with_(distributed={"zero_stage": 2}),
            CPU,
            "distributed.zero_stage: needs a DeepSpeed config; set distributed.deepspeed: zero3",
        ),
        (
            with_(distributed={"deepspeed": "zero9"}),
            CPU,
            "distributed.deepspeed: 'zero9' is neither a shipped config (zero3, zero3_offload_all, "
            "zero3_offload_optimizer) nor a JSON file",
        ),
        (
            with_(distributed={"deepspeed": "zero3", "zero_stage": 2, "offload_params": True}),
            CPU,
            "distributed.offload_params: parameter offload needs ZeRO stage 3 (stage is 2); set "
            "distributed.zero_stage: 3 or offload_params: false",
        ),
        (
            with_(distributed={"deepspeed": "zero3", "deepspeed_overrides": {"bf16": {"enabled": True}}}),
            CPU,
            "distributed.mixed_precision: the DeepSpeed config has bf16.enabled=true but the trainer runs with "
            "mixed_precision 'no'; set bf16.enabled to \"auto\" in the JSON (or in distributed.deepspeed_overrides) "
            "or change distributed.mixed_precision",
        ),
        (
            with_(trainer={"extra_args": {"loss_typ": "dr_grpo"}}),
            CPU,
            "trainer.extra_args.loss_typ: not a field of TRL GRPOConfig; did you mean 'loss_type'?",
        ),
        (
            with_(algorithm="rloo", trainer={"extra_args": {"loss_type": "dr_grpo"}}),
            CPU,
            "trainer.extra_args.loss_type: not a field of TRL RLOOConfig; see TRL's RLOOConfig for valid names",
        ),
        (
            with_(trainer={"extra_args": {"max_steps": 3}}),
            CPU,
            "trainer.extra_args.max_steps: set it as trainer.max_steps instead",
        ),
        (
            with_(trainer={"extra_args": {"use_vllm": True}}),
            CPU,
            "trainer.extra_args.use_vllm: colocate-rl sets this itself; use generation.backend",
        ),
        (
            with_(model={"name": "builtin:huge"}),
            CPU,
            "model.name: unknown built-in layout 'huge'; choose one of: builtin:tiny, builtin:qwen2.5-0.5b, "
            "builtin:qwen2.5-1.5b, builtin:qwen2.5-7b, builtin:tiny-calc",
        ),
        (
            with_(model={"name": "./no/such/model"}),
            CPU,
            "model.name: './no/such/model' is not a model directory (no config.json); give a local model directory, "
            "a hub id, or builtin:tiny",
        ),
        (
            with_(data={"source": "missing.jsonl"}),
            CPU,
            "data.source: file 'missing.jsonl' not found; check the path (relative paths in a recipe start from its directory)",
        ),
        (
            with_(generation={"max_model_length": 128}, trainer={"max_completion_length": 256}),
            CPU,
            "generation.max_model_length: 128 leaves no room for the prompt; make it larger than "
            "trainer.max_completion_length (256)",
        ),
    ],
)
def test_cross_field_errors(data, host, expected):
    assert expected in errors_of(data, host)


def test_unknown_builtin_reward_and_task_are_reported_together():
    lines = errors_of({"rewards": [{"name": "digit_shar"}], "data": {"source": "builtin:nope"}})
    assert any(line.startswith("rewards[0].name:") and "digit_share" in line for line in lines)
    assert any(line.startswith("data.source: unknown built-in task 'nope'") for line in lines)


def test_resolution_on_cpu_and_gpu():
    cpu = resolve(parse_recipe(with_()), CPU)
    assert (cpu.nproc_per_node, cpu.device, cpu.backend, cpu.precision, cpu.model_dtype) == (
        2,
        "cpu",
        "transformers",
        "no",
        "float32",
    )
    gpu = resolve(parse_recipe(with_(distributed={"deepspeed": "zero3"})), GPU2)
    assert (gpu.nproc_per_node, gpu.device, gpu.backend, gpu.precision, gpu.model_dtype) == (
        2,
        "cuda",
        "vllm",
        "bf16",
        "bfloat16",
    )
    assert gpu.deepspeed["bf16"]["enabled"] is True and gpu.deepspeed["fp16"]["enabled"] is False


def test_overrides_take_precedence_and_are_yaml_typed():
    sets = [
        "trainer.max_steps=3",
        "trainer.extra_args.scale_rewards=none",
        "generation.sleep_level=0",
        "model.name=builtin:tiny",
        "trainer.max_steps=7",  # a key given twice: the last value wins
    ]
    assert parse_sets(sets)["trainer.max_steps"] == 7 and list(parse_sets(sets))[-1] == "trainer.max_steps"
    assert format_sets(parse_sets(sets)) == [
        "trainer.extra_args.scale_rewards=none",
        "generation.sleep_level=0",
        "model.name=builtin:tiny",
        "trainer.max_steps=7",
    ]
    data = apply_overrides(MINIMAL, parse_sets(sets))
    recipe = parse_recipe(data)
    assert recipe.trainer.max_steps == 7 and recipe.generation.sleep_level == 0
    assert recipe.trainer.extra_args == {"scale_rewards": "none"}
    assert MINIMAL == {"rewards": [{"name": "digit_share"}]}  # the input is not mutated


@pytest.mark.parametrize("bad", ["trainer.max_steps", "=3", "trainer..x=1"])
def test_bad_override_syntax(bad):
    with pytest.raises(UserError) as info:
        parse_sets([bad])
    assert info.value.lines[0].startswith(f"--set {bad!r}: expected KEY=VALUE")


def test_override_through_a_value_that_is_not_a_section():
    with pytest.raises(UserError) as info:
        apply_overrides(MINIMAL, parse_sets(["rewards.name=x"]))
    assert info.value.lines == ["--set rewards.name=...: 'rewards' is not a section"]


def test_yaml_syntax_error_names_file_and_line(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("name: x\ntrainer:\n  max_steps: [1, 2\nrewards: []\n")
    with pytest.raises(UserError) as info:
        load_recipe(path)
    assert info.value.lines[0].startswith(f"{path}:4:")
    assert "invalid YAML" in info.value.lines[0]


def test_missing_and_non_mapping_files(tmp_path):
    with pytest.raises(UserError, match="recipe file not found"):
        load_recipe(tmp_path / "nope.yaml")
    (tmp_path / "list.yaml").write_text("- a\n- b\n")
    with pytest.raises(UserError, match="must be a YAML mapping"):
        load_recipe(tmp_path / "list.yaml")


def test_dumped_recipe_round_trips(tmp_path):
    recipe = parse_recipe(with_(trainer={"max_steps": 5, "extra_args": {"top_k": 5}}))
    path = tmp_path / "resolved.yaml"
    path.write_text(dump_recipe(recipe))
    assert load_recipe(path) == recipe


def test_trl_field_list_matches_installed_trl():
    """The shipped field list (used to validate extra_args without importing TRL) is TRL's own."""
    import dataclasses

    from trl import GRPOConfig, RLOOConfig

    assert trl_field_names("grpo") == {f.name for f in dataclasses.fields(GRPOConfig) if f.init}
    assert trl_field_names("rloo") == {f.name for f in dataclasses.fields(RLOOConfig) if f.init}


def test_every_schema_key_is_in_the_recipe_guide():
    """docs/guide/recipes.md's reference documents every key (generated by tools/recipe_reference.py)."""
    from pathlib import Path

    from colocate_rl.recipe.reference import recipe_reference

    guide = (Path(__file__).resolve().parent.parent / "docs" / "guide" / "recipes.md").read_text()
    assert recipe_reference() in guide, "docs/guide/recipes.md is stale: run python tools/recipe_reference.py"
    assert isinstance(Recipe.model_json_schema(), dict)


def test_trl_evaluation_options_are_refused_before_launch():
    """TRL's own evaluation (training temperature, a loss pass) is not run: its options are refused, pointing at the
    recipe's eval section."""
    from colocate_rl.plan.trl_args import EVALUATION_FIELDS, trl_field_names

    assert EVALUATION_FIELDS <= trl_field_names("grpo") and EVALUATION_FIELDS <= trl_field_names("rloo")
    recipe = parse_recipe(with_(trainer={"extra_args": {"eval_strategy": "steps", "eval_steps": 5}}))
    with pytest.raises(UserError) as info:
        resolve(recipe, CPU)
    assert info.value.lines == [
        f"trainer.extra_args.{key}: TRL's own evaluation is not used; remove it and evaluate with the recipe's eval "
        "section (eval.every_steps, eval.num_samples, eval.temperature, eval.source)"
        for key in ("eval_strategy", "eval_steps")
    ]
