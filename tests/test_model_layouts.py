"""Any model's memory plan (colocate_rl/memory/shapes.py, colocate_rl/model_config.py): layouts from a model's own
config.json, local or fetched from the hub (offline: the Hugging Face cache, or one error line at once), checked
against published parameter counts and against transformers' own models; mixtures of experts estimated (Mixtral,
Qwen3-MoE) or refused with the reason; a GGUF file named as a model gets the conversion hint.

The configs below are the published config.json values of each model (the keys that shape it). Published counts:
Llama-3.2-1B 1.24B, Llama-3.1-8B 8.03B, Qwen3-8B 8.19B, Qwen3-0.6B 0.6B (0.44B without embeddings), Mistral-7B-v0.1
7.24B, gemma-2b 2.51B, gemma-2-2b 2.61B, gemma-3-1b 1.0B, Mixtral-8x7B 46.7B (12.9B active), Qwen3-30B-A3B 30.5B
(3.3B active)."""

import json
import time

import pytest
from conftest import GPU8, QWEN05, assert_user_error, cli, resolved, write_recipe

from colocate_rl.errors import UserError
from colocate_rl.memory import shapes as S
from colocate_rl.memory.estimate import GIB, estimate

LLAMA3 = {"model_type": "llama", "attention_bias": False, "mlp_bias": False, "hidden_act": "silu", "vocab_size": 128256}
CONFIGS = {
    "Llama-3.2-1B": {
        **LLAMA3,
        "hidden_size": 2048,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "intermediate_size": 8192,
        "max_position_embeddings": 131072,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "factor": 32.0,
            "high_freq_factor": 4.0,
            "low_freq_factor": 1.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
        "tie_word_embeddings": True,
    },
    "Llama-3.1-8B": {
        **LLAMA3,
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "intermediate_size": 14336,
        "max_position_embeddings": 131072,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "factor": 8.0,
            "high_freq_factor": 4.0,
            "low_freq_factor": 1.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
        "tie_word_embeddings": False,
    },
    "Qwen3-8B": {
        "model_type": "qwen3",
        "attention_bias": False,
        "hidden_size": 4096,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "intermediate_size": 12288,
        "vocab_size": 151936,
        "max_position_embeddings": 40960,
        "rope_theta": 1000000,
        "tie_word_embeddings": False,
    },
    "Qwen3-0.6B": {  # head_dim 128 with hidden 1024 / 16 heads (= 64): the explicit value counts
        "model_type": "qwen3",
        "attention_bias": False,
        "hidden_size": 1024,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "intermediate_size": 3072,
        "vocab_size": 151936,
        "max_position_embeddings": 40960,
        "tie_word_embeddings": True,
    },
    "Mistral-7B-v0.1": {
        "model_type": "mistral",
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "intermediate_size": 14336,
        "vocab_size": 32000,
        "max_position_embeddings": 32768,
        "sliding_window": 4096,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
    },
    "gemma-2b": {  # no tie_word_embeddings key: Gemma ties them (transformers' GemmaConfig default)
        "model_type": "gemma",
        "attention_bias": False,
        "hidden_act": "gelu",
        "hidden_size": 2048,
        "num_hidden_layers": 18,
        "num_attention_heads": 8,
        "num_key_value_heads": 1,
        "head_dim": 256,
        "intermediate_size": 16384,
        "vocab_size": 256000,
        "max_position_embeddings": 8192,
    },
    "gemma-2-2b": {
        "model_type": "gemma2",
        "hidden_activation": "gelu_pytorch_tanh",
        "hidden_size": 2304,
        "num_hidden_layers": 26,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "intermediate_size": 9216,
        "vocab_size": 256000,
        "max_position_embeddings": 8192,
        "sliding_window": 4096,
        "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0,
        "query_pre_attn_scalar": 256,
    },
    "gemma-3-1b": {
        "model_type": "gemma3_text",
        "hidden_size": 1152,
        "num_hidden_layers": 26,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 256,
        "intermediate_size": 6912,
        "vocab_size": 262144,
        "max_position_embeddings": 32768,
        "sliding_window": 512,
        "query_pre_attn_scalar": 256,
    },
    "Mixtral-8x7B": {
        "model_type": "mixtral",
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "intermediate_size": 14336,
        "vocab_size": 32000,
        "max_position_embeddings": 32768,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "tie_word_embeddings": False,
    },
    "Qwen3-30B-A3B": {
        "model_type": "qwen3_moe",
        "attention_bias": False,
        "hidden_size": 2048,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "vocab_size": 151936,
        "max_position_embeddings": 40960,
        "tie_word_embeddings": False,
    },
}
# (published total in billions, exact count of the layout, exact active count for MoE)
PUBLISHED = {
    "Llama-3.2-1B": (1.24, 1_235_814_400, None),
    "Llama-3.1-8B": (8.03, 8_030_261_248, None),
    "Qwen3-8B": (8.19, 8_190_735_360, None),
    "Qwen3-0.6B": (0.6, 596_049_920, None),
    "Mistral-7B-v0.1": (7.24, 7_241_732_096, None),
    "gemma-2b": (2.51, 2_506_172_416, None),
    "gemma-2-2b": (2.61, 2_614_341_888, None),
    "gemma-3-1b": (1.0, 999_885_952, None),
    "Mixtral-8x7B": (46.7, 46_702_792_704, 12_879_925_248),
    "Qwen3-30B-A3B": (30.5, 30_532_122_624, 3_353_032_704),
}


def model_dir(tmp_path, config: dict, name: str = "model"):
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("name", CONFIGS)
def test_layout_from_a_local_config_json_matches_the_published_count(tmp_path, name):
    published, exact, active = PUBLISHED[name]
    lay = S.layout_for(str(model_dir(tmp_path, CONFIGS[name])))
    assert lay.params == exact and abs(lay.params / 1e9 - published) / published < 0.01
    if active is not None:
        assert lay.active_params == active
    else:
        assert lay.active_params == lay.params and lay.active_intermediate == lay.intermediate


def test_qwen3_0_6b_without_embeddings_is_the_published_044b(tmp_path):
    lay = S.layout_for(str(model_dir(tmp_path, CONFIGS["Qwen3-0.6B"])))
    assert round((lay.params - lay.vocab * lay.hidden) / 1e9, 2) == 0.44 and lay.hd == 128


# Shapes transformers does not have a published count for: dense and MoE layers mixed, biases, few layers.
VARIANTS = {
    "qwen3-moe-mixed": {
        **CONFIGS["Qwen3-30B-A3B"],
        "num_hidden_layers": 6,
        "mlp_only_layers": [0],
        "decoder_sparse_step": 2,
        "num_experts": 4,
        "num_experts_per_tok": 2,
    },
    "qwen2-biases": {
        "model_type": "qwen2",
        "hidden_size": 896,
        "num_hidden_layers": 3,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "intermediate_size": 4864,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
    },
}


@pytest.mark.parametrize("name", [*CONFIGS, *VARIANTS])
def test_layout_counts_what_transformers_builds(name):
    """The model transformers builds from the same config (on the meta device: no memory) has exactly as many
    parameters as the layout counts."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = {**CONFIGS, **VARIANTS}[name]
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg))
    lay = S.layout_from_config(cfg, name)
    assert lay.params == sum(p.numel() for p in model.parameters())
    assert lay.largest_param == max(p.numel() for p in model.parameters())  # what one ZeRO-3 weight push gathers


def test_moe_weights_count_every_expert_and_activations_the_active_ones(tmp_path):
    mixtral = model_dir(tmp_path, CONFIGS["Mixtral-8x7B"], "mixtral")
    dense = {k: v for k, v in CONFIGS["Mixtral-8x7B"].items() if k not in ("num_local_experts", "num_experts_per_tok")}
    mistral = model_dir(tmp_path, {**dense, "model_type": "mistral"}, "mistral")
    moe, one = (
        estimate(resolved(QWEN05, GPU8, f"model.name={m}", "distributed.deepspeed=zero3"), 141)
        for m in (mixtral, mistral)
    )
    assert moe.layout.experts == 8 and moe.layout.active_intermediate == 2 * 14336
    assert moe.terms["vLLM weights"]["generation"] == 2 * 46_702_792_704 / GIB  # every expert, bf16
    assert moe.terms["trainer gradients"]["training"] == 2 * 46_702_792_704 / 8 / GIB  # ZeRO-3 over 8 ranks
    # a token goes through 2 experts: twice the MLP activations of the dense model of one expert's width
    assert one.terms["activations"]["training"] < moe.terms["activations"]["training"]
    assert moe.terms["activations"]["training"] < 2 * one.terms["activations"]["training"]


@pytest.mark.parametrize(
    "config, fragment",
    [
        (
            {**CONFIGS["Mixtral-8x7B"], "model_type": "deepseek_v3", "n_routed_experts": 256},
            "is a mixture of experts of model_type 'deepseek_v3', whose layout the memory estimate does not know",
        ),
        (
            {**CONFIGS["Qwen3-30B-A3B"], "model_type": "qwen2_moe", "shared_expert_intermediate_size": 5632},
            "is a mixture of experts of model_type 'qwen2_moe'",
        ),
        ({**CONFIGS["Llama-3.2-1B"], "model_type": "phi3"}, "is a model of model_type 'phi3', whose layout"),
        (
            {"model_type": "gemma3", "text_config": CONFIGS["gemma-3-1b"], "vision_config": {"hidden_size": 1152}},
            "is a multimodal model (vision_config); the memory estimate counts text decoders only",
        ),
    ],
)
def test_unknown_layouts_are_refused_with_the_reason(tmp_path, config, fragment):
    with pytest.raises(UserError, match="refused rather than estimated wrong|multimodal") as e:
        S.layout_for(str(model_dir(tmp_path, config)))
    assert fragment in str(e.value) and len(e.value.lines) == 1


def test_a_text_config_nested_without_other_parts_is_read(tmp_path):
    lay = S.layout_for(str(model_dir(tmp_path, {"model_type": "wrapper", "text_config": CONFIGS["gemma-3-1b"]})))
    assert lay.params == 999_885_952


# ----------------------------------------------------------------------------------------------- hub and GGUF


def test_hub_id_offline_is_one_line_at_once(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    start = time.monotonic()
    with pytest.raises(UserError) as e:
        S.layout_for("meta-llama/Llama-3.2-1B")
    assert time.monotonic() - start < 10  # the hub library alone retries for ~25 s
    assert e.value.lines == [
        "model.name: the config of 'meta-llama/Llama-3.2-1B' could not be fetched (HF_HUB_OFFLINE is set) and is not "
        "in the local Hugging Face cache; give a local model directory, or fetch it once where the hub is reachable "
        "(`hf download meta-llama/Llama-3.2-1B config.json`) and set HF_HUB_OFFLINE=1"
    ]


def test_hub_id_without_a_connection_is_one_line_at_once(monkeypatch):
    for key in ("HF_HUB_OFFLINE", "HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # the discard port: nothing listens
    start = time.monotonic()
    with pytest.raises(UserError, match=r"could not be fetched \(no connection to http://127.0.0.1:9: ") as e:
        S.layout_for("acme/not-cached-7b")
    assert time.monotonic() - start < 10 and len(e.value.lines) == 1


@pytest.mark.slow
def test_hub_config_from_the_cache_plans_the_model(tmp_path):
    """A hub id outside the shipped table, its config.json in the Hugging Face cache and the hub offline:
    `mem-probe --estimate` reads it through AutoConfig (transformers fills in the defaults) and plans the model."""
    snapshot = tmp_path / "hub" / "models--acme--llama-mini" / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps(CONFIGS["Llama-3.2-1B"]))
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "main").write_text("0" * 40)
    recipe = write_recipe(tmp_path / "r.yaml", {**QWEN05, "model": {"name": "acme/llama-mini"}})
    env = {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "hub")}
    result = cli("mem-probe", recipe, "--estimate", "--gpus", "1", "--gpu-memory", "80", "--json", env=env)
    assert result.returncode == 0, result.stderr
    model = json.loads(result.stdout)["model"]
    assert model["params"] == 1_235_814_400 and model["layout"]["head_dim"] == 64


@pytest.mark.slow
def test_gguf_file_as_model_gets_the_conversion_hint(tmp_path):
    gguf = tmp_path / "model-Q4_K_M.gguf"
    gguf.write_bytes(b"GGUF")
    recipe = write_recipe(tmp_path / "r.yaml", {**QWEN05, "model": {"name": str(gguf)}})
    result = cli("validate", recipe)
    assert_user_error(result, "model.name: ", "is a GGUF file", "gguf_file=", "save_pretrained", one_line=True)
    with pytest.raises(UserError, match="is a GGUF file"):
        S.layout_for(str(gguf))
