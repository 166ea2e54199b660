"""LoRA on CPU with real PEFT on a random-init tiny Qwen2 (built from its config, nothing downloaded): the PEFT config
from `model.lora`, the merged weights vLLM gets (`AdapterMerge`), the weight check's stacked tensors, the final
model's dtype (`cast_saved_weights`), and `model.lora.target_modules` checked before launch."""

import contextlib
import json
import os

import pytest
import torch
from conftest import assert_user_error, cli_here, write_recipe
from peft import get_peft_model
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, GPT2Config, Qwen2Config
from typer.testing import CliRunner

from colocate_rl.builtin_model import LAYOUTS
from colocate_rl.cli import app
from colocate_rl.plan.lora import check_lora_targets
from colocate_rl.rank.adapter.peft import AdapterMerge, expected_tensors
from colocate_rl.rank.final_model import cast_saved_weights
from colocate_rl.rank.lora import peft_config
from colocate_rl.recipe.load import parse_recipe
from colocate_rl.recipe.schema import LoraSection

R, ALPHA = 4, 12  # scaling 3: neither alpha nor r alone
LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def tiny(dtype=torch.float32):
    """The builtin tiny layout (hidden 64, 2 layers, tied head), random init."""
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(Qwen2Config(**LAYOUTS["tiny"]), dtype=dtype)


def adapted(dtype=torch.float32, targets=("q_proj", "v_proj", "o_proj", "gate_proj")):
    """tiny with LoRA adapters whose B is non-zero (PEFT starts B at zero: the update would be nothing)."""
    lora = LoraSection(r=R, alpha=ALPHA, dropout=0.0, target_modules=targets if targets == "all-linear" else [*targets])
    model = get_peft_model(tiny(dtype), peft_config(lora))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_B." in name:
                param.copy_(torch.randn_like(param))
    return model


def layer(model, i: int, name: str):
    """Decoder layer i's linear layer `name` (q_proj ... down_proj) in the PEFT model."""
    block = model.base_model.model.model.layers[i]
    return getattr(block.self_attn if name in LINEAR[:4] else block.mlp, name)


def merged_by_hand(module) -> torch.Tensor:
    """W + (alpha / r) · B @ A in fp32, cast to W's dtype; W itself for a module without adapter."""
    if not hasattr(module, "base_layer"):
        return module.weight.data
    w, a, b = module.base_layer.weight, module.lora_A["default"].weight, module.lora_B["default"].weight
    return (w.float() + (ALPHA / R) * (b.float() @ a.float())).to(w.dtype)


# ---------------------------------------------------------------------------------------------- PEFT config


def test_peft_config_maps_the_recipe_section():
    config = peft_config(LoraSection(r=8, alpha=16, dropout=0.1, target_modules=["q_proj", "v_proj"]))
    assert (config.r, config.lora_alpha, config.lora_dropout) == (8, 16, 0.1)
    assert set(config.target_modules) == {"q_proj", "v_proj"} and config.task_type == "CAUSAL_LM"
    assert peft_config(LoraSection()).target_modules == "all-linear"
    model = get_peft_model(tiny(), config)  # and PEFT builds what the config says
    q = layer(model, 0, "q_proj")
    assert q.lora_A["default"].weight.shape == (8, 64) and q.scaling["default"] == 2.0
    assert q.lora_dropout["default"].p == 0.1 and not hasattr(layer(model, 0, "k_proj"), "base_layer")


# ---------------------------------------------------------------------------------------------- AdapterMerge


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_value_is_base_plus_scaled_update_and_base_is_untouched(dtype):
    model = adapted(dtype)
    merge = AdapterMerge(model)
    before = {name: p.detach().clone() for name, p in merge.named_params()}
    for i in range(2):
        for name in LINEAR:
            module = layer(model, i, name)
            param = module.base_layer.weight if hasattr(module, "base_layer") else module.weight
            value = merge.value(param)
            assert value.dtype == dtype and torch.equal(value, merged_by_hand(module)), (i, name)
            if hasattr(module, "base_layer"):
                assert not torch.equal(value, param.data)  # the adapter does change it
    if dtype == torch.bfloat16:  # the update added in bf16 rounds twice: the test tells the two apart
        q = layer(model, 0, "q_proj")
        in_base_dtype = q.base_layer.weight.data + q.get_delta_weight("default").to(dtype)
        assert not torch.equal(in_base_dtype, merge.value(q.base_layer.weight))
    for name, param in merge.named_params():
        assert torch.equal(param, before[name]) and param.dtype == before[name].dtype, name


def test_named_params_are_the_plain_models():
    plain = {name: p.shape for name, p in tiny().named_parameters()}
    for targets in (("q_proj", "v_proj"), "all-linear"):
        merge = AdapterMerge(adapted(targets=targets))
        names = dict(merge.named_params())
        assert set(names) == set(plain) and all(names[n].shape == plain[n] for n in plain)
    renamed = AdapterMerge(adapted(), fix_name=lambda n: "vllm." + n)
    assert {n for n, _ in renamed.named_params()} == {"vllm." + n for n in plain}


def test_disabled_adapters_give_the_base_value():
    model = adapted()
    merge, q = AdapterMerge(model), layer(model, 1, "q_proj")
    assert not torch.equal(merge.value(q.base_layer.weight), q.base_layer.weight)
    with model.disable_adapter():
        assert torch.equal(merge.value(q.base_layer.weight), q.base_layer.weight)
    assert torch.equal(merge.value(q.base_layer.weight), merged_by_hand(q))


def test_adapter_params_only_for_adapted_weights():
    model = adapted()
    merge, q, k = AdapterMerge(model), layer(model, 0, "q_proj"), layer(model, 0, "k_proj")
    got = merge.adapter_params([q.base_layer.weight])
    assert [id(p) for p in got] == [id(q.lora_A["default"].weight), id(q.lora_B["default"].weight)]
    assert merge.adapter_params([k.weight, q.base_layer.bias, model.base_model.model.model.norm.weight]) == []
    both = merge.adapter_params([q.base_layer.weight, layer(model, 0, "v_proj").base_layer.weight])
    assert len(both) == 4


# ---------------------------------------------------------------------------------------------- the weight check


def test_check_targets_name_the_last_layers_vllm_tensors():
    p = "model.layers.1."
    merge = AdapterMerge(adapted())  # q, v, o, gate
    assert merge.check_targets(1) == {
        p + "self_attn.qkv_proj.weight": [p + f"self_attn.{n}.weight" for n in ("q_proj", "k_proj", "v_proj")],
        p + "self_attn.o_proj.weight": [p + "self_attn.o_proj.weight"],
        p + "mlp.gate_up_proj.weight": [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"],
    }
    assert merge.check_targets(2) == {}  # vLLM shards them under tensor parallelism
    assert set(AdapterMerge(adapted(targets="all-linear")).check_targets(1)) == {
        p + "self_attn.qkv_proj.weight",
        p + "self_attn.o_proj.weight",
        p + "mlp.gate_up_proj.weight",
        p + "mlp.down_proj.weight",
    }
    assert AdapterMerge(adapted(targets=("lm_head",))).check_targets(1) == {}  # no adapted layer weight


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_expected_tensors_are_the_merged_parts_stacked(dtype):
    model = adapted(dtype)
    merge = AdapterMerge(model)
    gathered = []

    @contextlib.contextmanager
    def gather(params):
        gathered.extend(id(p) for p in params)
        yield

    expected = expected_tensors(merge, merge.check_targets(1), gather)
    parts = {n: layer(model, 1, n) for n in LINEAR}
    qkv = torch.cat([merged_by_hand(parts[n]) for n in ("q_proj", "k_proj", "v_proj")])
    gate_up = torch.cat([merged_by_hand(parts["gate_proj"]), merged_by_hand(parts["up_proj"])])
    p = "model.layers.1."
    assert qkv.shape == (64 + 32 + 32, 64) and torch.equal(expected[p + "self_attn.qkv_proj.weight"], qkv)
    assert torch.equal(expected[p + "mlp.gate_up_proj.weight"], gate_up)
    assert torch.equal(expected[p + "self_attn.o_proj.weight"], merged_by_hand(parts["o_proj"]))
    assert all(t.dtype == dtype for t in expected.values())
    adapters = [parts[n].lora_A["default"].weight for n in ("q_proj", "v_proj", "o_proj", "gate_proj")]
    assert {id(a) for a in adapters} <= set(gathered)  # gathered with the bases under ZeRO-3
    assert id(parts["k_proj"].weight) in gathered


# ---------------------------------------------------------------------------------------------- the final model


def test_cast_saved_weights_to_the_training_dtype(tmp_path):
    model = tiny(torch.float32)
    model.save_pretrained(tmp_path)
    fp32 = load_file(tmp_path / "model.safetensors")
    save_file({"a": torch.randn(3).bfloat16(), "ids": torch.arange(3)}, tmp_path / "model-extra.safetensors")
    save_file({"lora_A": torch.randn(2, 2)}, tmp_path / "adapter_model.safetensors")  # an adapter keeps its dtype
    untouched = {
        n: ((tmp_path / n).read_bytes(), (tmp_path / n).stat().st_mtime_ns)
        for n in ("model-extra.safetensors", "adapter_model.safetensors")
    }

    assert cast_saved_weights(tmp_path, "bfloat16") == ["model.safetensors"]
    bf16 = load_file(tmp_path / "model.safetensors")
    assert set(bf16) == set(fp32)
    for name, tensor in fp32.items():
        assert bf16[name].dtype == torch.bfloat16 and torch.equal(bf16[name], tensor.to(torch.bfloat16)), name
    for name, (data, mtime) in untouched.items():
        assert (tmp_path / name).read_bytes() == data and (tmp_path / name).stat().st_mtime_ns == mtime, name
    (tmp_path / "model-extra.safetensors").unlink()
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        assert f.metadata() == {"format": "pt"}  # as transformers wrote it
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert torch.equal(loaded.model.norm.weight, bf16["model.norm.weight"])
    assert AutoModelForCausalLM.from_pretrained(tmp_path, dtype="auto").dtype == torch.bfloat16  # config.json says so
    mtime = (tmp_path / "model.safetensors").stat().st_mtime_ns
    assert (
        cast_saved_weights(tmp_path, "bfloat16") == [] and (tmp_path / "model.safetensors").stat().st_mtime_ns == mtime
    )


@pytest.mark.parametrize("shard", ["50GB", "100KB"])
def test_tied_weights_cloned_by_deepspeed_are_saved_once(tmp_path, shard):
    """Under DeepSpeed ZeRO-1/2 the trainer saves a cloned state dict (accelerate's get_state_dict calls DeepSpeed's
    clone_tensors_for_torch_save), so transformers can no longer see that lm_head is the embedding and writes both
    (SmolLM2-135M's final/ measured 314 MiB for 257 MiB of weights). The copy is dropped; the model loads back tied,
    with the same logits; a sharded model's index follows."""
    from deepspeed.checkpoint.utils import clone_tensors_for_torch_save

    model = tiny(torch.float32)
    assert model.all_tied_weights_keys == {"lm_head.weight": "model.embed_tokens.weight"}
    model.save_pretrained(tmp_path, state_dict=clone_tensors_for_torch_save(model.state_dict()), max_shard_size=shard)
    files = sorted(p.name for p in tmp_path.glob("model*.safetensors"))
    assert len(files) == (1 if shard == "50GB" else 6)
    stored = lambda: {k for name in files for k in load_file(tmp_path / name)}  # noqa: E731
    assert "lm_head.weight" in stored()  # what the trainer hands back
    assert cast_saved_weights(tmp_path, "float32", model.all_tied_weights_keys)
    assert "lm_head.weight" not in stored() and "model.embed_tokens.weight" in stored()
    if len(files) > 1:
        index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
        assert set(index["weight_map"]) == stored()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    ids = torch.tensor([[1, 2, 3, 4]])
    assert torch.equal(loaded(ids).logits, model(ids).logits)
    assert cast_saved_weights(tmp_path, "float32", model.all_tied_weights_keys) == []  # nothing left to do


def test_an_untied_head_equal_to_nothing_is_kept(tmp_path):
    """A head that is not tied (or differs from its source) is a weight of its own: kept."""
    model = tiny(torch.float32)
    model.save_pretrained(tmp_path, state_dict=clone_tensors(model.state_dict(), head=lambda t: t + 1))
    assert cast_saved_weights(tmp_path, "float32", model.all_tied_weights_keys) == []
    assert "lm_head.weight" in load_file(tmp_path / "model.safetensors")
    assert cast_saved_weights(tmp_path, "float32", {}) == []


def clone_tensors(state: dict, head) -> dict:
    return {k: head(v.clone()) if k == "lm_head.weight" else v.clone() for k, v in state.items()}


def test_cast_saved_weights_of_a_sharded_model_loads_back(tmp_path):
    model = tiny(torch.float32)
    model.save_pretrained(tmp_path, max_shard_size="100KB")
    shards = sorted(p.name for p in tmp_path.glob("model-*.safetensors"))
    assert len(shards) > 1
    assert cast_saved_weights(tmp_path, "bfloat16") == shards
    stored = {k: v for shard in shards for k, v in load_file(tmp_path / shard).items()}
    assert {t.dtype for t in stored.values()} == {torch.bfloat16}
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)  # the index still fits
    for (name, got), want in zip(loaded.named_parameters(), model.parameters()):
        assert torch.equal(got, want.to(torch.bfloat16)), name


# ---------------------------------------------------------------------------------------------- before launch

RECIPE = {
    "name": "lora",
    "model": {"name": "builtin:tiny"},
    "data": {"source": "builtin:digits"},
    "rewards": [{"name": "digit_share"}],
    "trainer": {"max_steps": 2, "per_device_train_batch_size": 4, "num_generations": 4},
}
TYPO = (
    "model.lora.target_modules: 'q_prj' matches no module of builtin:tiny; its linear layers are: q_proj, k_proj, "
    "v_proj, o_proj, gate_proj, up_proj, down_proj"
)


def lora_recipe(target_modules, name: str = "builtin:tiny"):
    model = {"name": name, "lora": {"target_modules": target_modules}}
    return parse_recipe({**RECIPE, "model": model})


def test_validate_refuses_a_target_typo(tmp_path):
    recipe = write_recipe(
        tmp_path / "r.yaml", {**RECIPE, "model": {"name": "builtin:tiny", "lora": {"target_modules": ["q_prj"]}}}
    )
    result = cli_here("validate", recipe, "--gpus", "0", cwd=tmp_path)
    assert_user_error(result, one_line=True)
    assert result.stderr.strip() == f"error: {TYPO}"


def test_train_refuses_a_target_typo_and_writes_nothing(tmp_path, monkeypatch):
    write_recipe(
        tmp_path / "r.yaml",
        {**RECIPE, "model": {"name": "builtin:tiny", "lora": {"target_modules": ["q_proj", "q_prj"]}}},
    )
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["train", "r.yaml", "--run-dir", "RUN", "--gpus", "0"])
    assert (result.exit_code, result.stderr.strip()) == (2, f"error: {TYPO}")
    assert os.listdir(tmp_path) == ["r.yaml"]


@pytest.mark.parametrize(
    "targets", [["q_proj", "v_proj"], list(LINEAR), "all-linear", ["self_attn.q_proj"], ["embed_tokens"]]
)
def test_validate_passes_real_targets(tmp_path, monkeypatch, targets):
    write_recipe(
        tmp_path / "r.yaml", {**RECIPE, "model": {"name": "builtin:tiny", "lora": {"target_modules": targets}}}
    )
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["validate", "r.yaml", "--gpus", "0"])
    assert result.exit_code == 0 and "recipe is valid" in result.stdout, result.stderr


def test_targets_peft_cannot_adapt_are_refused():
    assert check_lora_targets(lora_recipe(["q_proj", "mlp"])) == [
        "model.lora.target_modules: 'mlp' matches model.layers.0.mlp (Qwen2MLP), which LoRA cannot adapt (only "
        "linear, embedding and convolution layers); its linear layers are: " + ", ".join(LINEAR)
    ]
    problems = check_lora_targets(lora_recipe(["q_prj", "0", "proj"]))
    assert [p.split("'")[1] for p in problems] == ["q_prj", "0", "proj"]  # a name's end, not a part of it
    assert problems[0].endswith(", ".join(LINEAR)) and "(Qwen2DecoderLayer)" in problems[1]
    with pytest.raises(ValueError, match="not supported"):  # what PEFT itself does with it
        get_peft_model(tiny(), peft_config(LoraSection(target_modules=["q_proj", "mlp"])))


def test_lm_head_is_refused_before_launch():
    """TRL raises on an adapted lm_head inside every rank; the plan says it first, without building the model."""
    assert check_lora_targets(lora_recipe(["q_proj", "lm_head"], "/no/such/model")) == [
        "model.lora.target_modules: lm_head cannot be adapted (TRL computes the log-probabilities from its weight "
        "directly, so its adapter would never train); remove lm_head"
    ]


def test_targets_of_a_local_model_directory(tmp_path):
    """Another architecture from its config.json alone (GPT-2: Conv1D layers, no weights on disk)."""
    GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64).save_pretrained(tmp_path)
    assert check_lora_targets(lora_recipe(["c_attn", "c_fc"], str(tmp_path))) == []
    assert check_lora_targets(lora_recipe(["q_proj"], str(tmp_path))) == [
        f"model.lora.target_modules: 'q_proj' matches no module of {tmp_path}; its linear layers are: c_attn, "
        "c_proj, c_fc"
    ]


def test_no_config_to_be_had_skips_the_check(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert check_lora_targets(lora_recipe(["q_prj"], "colocate-rl-test/not-cached-model")) == []
    assert check_lora_targets(parse_recipe(RECIPE)) == []  # no LoRA
