"""Model shapes for the memory estimate: a decoder's `Layout` (and its exact parameter count) from a built-in layout
(`colocate_rl.builtin_model.LAYOUTS`), a local model directory's config.json, the HUB_LAYOUTS table of published
configs, or any other hub model's config.json (fetched through transformers' AutoConfig, config only: see
`colocate_rl.model_config`). Only the model types of DECODERS are counted; any other is refused, never estimated
as something it is not."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from colocate_rl.builtin_model import LAYOUTS, builtin_layout
from colocate_rl.errors import UserError
from colocate_rl.model_config import looks_local, model_config

if TYPE_CHECKING:
    from colocate_rl.recipe.schema import LoraSection


@dataclass(frozen=True)
class Layout:
    """A decoder of Llama's shape (Qwen2/3, Mistral, Gemma 1-3; Mixtral and Qwen3-MoE experts)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    tie: bool
    max_positions: int = 32768
    qkv_bias: bool = True  # Qwen2 has q/k/v biases, Llama none
    head_dim: int | None = None
    norms: int = 2  # RMSNorms of `hidden` per layer (Gemma 2 and 3: 4)
    qk_norm: bool = False  # RMSNorms of q and k over the head dim (Qwen3, Gemma 3)
    experts: int = 0  # mixture of experts: routed experts per MoE layer (0: a dense model)
    active_experts: int = 0  # experts each token goes through
    expert_intermediate: int = 0  # one expert's MLP width
    moe_layers: int = 0  # layers whose MLP is the experts (with a router); the others have a dense MLP

    @property
    def hd(self) -> int:
        return self.head_dim or self.hidden // self.heads

    def _count(self, experts: int) -> int:
        q, kv, h = self.heads * self.hd, self.kv_heads * self.hd, self.hidden
        attn = 2 * h * q + 2 * h * kv + ((q + 2 * kv) if self.qkv_bias else 0)
        norms = self.norms * h + (2 * self.hd if self.qk_norm else 0)
        moe = experts * 3 * h * self.expert_intermediate + h * self.experts  # the experts used, the router
        mlp = (self.layers - self.moe_layers) * 3 * h * self.intermediate + self.moe_layers * moe
        return self.vocab * h * (1 if self.tie else 2) + self.layers * (attn + norms) + mlp + h

    def saved_per_token_layer(self, width: int) -> float:
        """Bytes one token saves for backward in one layer at `width` bytes a value (SDPA: no seq² scores): 2 RMSNorms ×
        3h (fp32 input + 16-bit output), attention h + 3q + 2kv (input, q, output, o_proj input; k, v), MLP h + 4·ff
        (input, gate, up, silu, product). 3–5 % above what autograd saved on CPU at the 135M, 0.5B and 1.7B shapes
        (tests/test_estimate.py)."""
        q, kv = self.heads * self.hd, self.kv_heads * self.hd
        return width * (8 * self.hidden + 3 * q + 2 * kv + 4 * self.active_intermediate)

    @property
    def params(self) -> int:
        """Exact: embeddings (+ lm_head unless tied); per layer q/k/v/o (+ q/k/v biases), gated MLP (or every expert
        and the router), norms; final norm."""
        return self._count(self.experts)

    @property
    def active_params(self) -> int:
        """The parameters one token goes through: a MoE model's active experts instead of all (dense: params)."""
        return self._count(self.active_experts)

    @property
    def largest_param(self) -> int:
        """Elements of the largest tensor: the embedding, a dense MLP matrix, or a MoE layer's experts' fused gate
        and up projections (transformers stores each layer's experts as one tensor)."""
        return max(self.vocab, self.intermediate, 2 * self.experts * self.expert_intermediate) * self.hidden

    @property
    def active_intermediate(self) -> float:
        """MLP width a token goes through, per layer on average (a MoE layer: its active experts together)."""
        moe = self.moe_layers * self.active_experts * self.expert_intermediate
        return (moe + (self.layers - self.moe_layers) * self.intermediate) / self.layers


def _hub_table() -> dict[str, Layout]:
    """Published config.json values (keys lower case); every Qwen2.5 -Instruct lists 32768 positions."""
    qwen = {  # hidden, layers, heads, kv heads, intermediate, vocab, tied, max positions of the base model
        "0.5b": (896, 24, 14, 2, 4864, 151936, True, 32768),
        "1.5b": (1536, 28, 12, 2, 8960, 151936, True, 131072),
        "3b": (2048, 36, 16, 2, 11008, 151936, True, 32768),
        "7b": (3584, 28, 28, 4, 18944, 152064, False, 131072),
        "14b": (5120, 48, 40, 8, 13824, 152064, False, 131072),
        "32b": (5120, 64, 40, 8, 27648, 152064, False, 131072),
        "72b": (8192, 80, 64, 8, 29568, 152064, False, 131072),
    }
    table = {}
    for size, (*shape, positions) in qwen.items():
        table[f"qwen/qwen2.5-{size}"] = Layout(*shape, max_positions=positions)
        table[f"qwen/qwen2.5-{size}-instruct"] = Layout(*shape, max_positions=32768)
    for size, shape in {"8b": (4096, 32, 32, 8, 14336), "70b": (8192, 80, 64, 8, 28672)}.items():
        for suffix in ("", "-instruct"):
            table[f"meta-llama/meta-llama-3-{size}{suffix}"] = Layout(*shape, 128256, False, 8192, qkv_bias=False)
    smollm2 = {"135m": (576, 30, 9, 3, 1536), "360m": (960, 32, 15, 5, 2560), "1.7b": (2048, 24, 32, 32, 8192)}
    for size, shape in smollm2.items():
        for suffix in ("", "-instruct"):
            table[f"huggingfacetb/smollm2-{size}{suffix}"] = Layout(*shape, 49152, True, 8192, qkv_bias=False)
    return table


HUB_LAYOUTS = _hub_table()


# model_type → (tied embeddings when the config does not say, RMSNorms per layer, q/k norms): the decoders whose
# parameters Layout counts; transformers' class defaults. Biases other than Qwen2's q/k/v (attention_bias: q/k/v/o,
# mlp_bias) are counted only as q/k/v biases: the rest is < 0.1 % of a layer.
DECODERS = {
    "llama": (False, 2, False),
    "mistral": (False, 2, False),
    "qwen2": (False, 2, False),
    "qwen3": (False, 2, True),
    "gemma": (True, 2, False),
    "gemma2": (True, 4, False),
    "gemma3_text": (True, 4, True),
    "mixtral": (False, 2, False),
    "qwen3_moe": (False, 2, True),
}
EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


def _experts(cfg: dict[str, Any], kind: str) -> dict[str, int]:
    """Layout's expert fields of a Mixtral or Qwen3-MoE config (no experts: {})."""
    layers = cfg["num_hidden_layers"]
    if kind == "mixtral":
        experts, width, moe_layers = cfg.get("num_local_experts") or 0, cfg["intermediate_size"], layers
    elif kind == "qwen3_moe":
        experts, width = cfg.get("num_experts") or 0, cfg.get("moe_intermediate_size")
        step, dense = cfg.get("decoder_sparse_step") or 1, set(cfg.get("mlp_only_layers") or [])
        moe_layers = sum(1 for i in range(layers) if i not in dense and (i + 1) % step == 0)
    else:
        return {}
    if not experts:
        return {}
    return dict(
        experts=experts,
        active_experts=cfg.get("num_experts_per_tok") or 1,
        expert_intermediate=width,
        moe_layers=moe_layers,
    )


def layout_from_config(cfg: dict[str, Any], source: str, key: str = "model.name") -> Layout:
    """A Layout from a Hugging Face config.json mapping (its `text_config` when it has one and no other part).
    UserError naming `key` for a config that lacks the decoder's sizes, a multimodal model, a mixture of experts
    other than Mixtral's and Qwen3-MoE's, or a model type not in DECODERS: refused, never estimated as dense."""
    towers = [k for k in ("vision_config", "audio_config", "speech_config") if cfg.get(k)]
    if towers:
        raise UserError(
            f"{key}: {source} is a multimodal model ({', '.join(towers)}); the memory estimate counts text decoders "
            "only and would leave its encoders out: plan it by measuring (mem-probe without --estimate)"
        )
    cfg = cfg.get("text_config") or cfg
    missing = [
        k
        for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
        if not isinstance(cfg.get(k), int)
    ]
    if missing:
        raise UserError(
            f"{key}: {source} is not a decoder's config (no {', '.join(missing)}); mem-probe --estimate handles "
            f"decoders of the model types {', '.join(DECODERS)}"
        )
    kind = cfg.get("model_type")
    if kind not in DECODERS or (kind not in ("mixtral", "qwen3_moe") and any(cfg.get(k) for k in EXPERT_KEYS)):
        what = "a mixture of experts" if any(cfg.get(k) for k in EXPERT_KEYS) else "a model"
        raise UserError(
            f"{key}: {source} is {what} of model_type {kind!r}, whose layout the memory estimate does not know "
            f"(it knows {', '.join(DECODERS)}); refused rather than estimated wrong: plan it by measuring "
            "(mem-probe without --estimate)"
        )
    tied, norms, qk_norm = DECODERS[kind]
    tie = cfg.get("tie_word_embeddings")
    return Layout(
        cfg["hidden_size"],
        cfg["num_hidden_layers"],
        cfg["num_attention_heads"],
        cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
        cfg["intermediate_size"],
        cfg["vocab_size"],
        tied if tie is None else bool(tie),
        cfg.get("max_position_embeddings") or 32768,
        qkv_bias=kind == "qwen2" or bool(cfg.get("attention_bias", False)),
        head_dim=cfg.get("head_dim"),
        norms=norms,
        qk_norm=qk_norm,
        **_experts(cfg, kind),
    )


def layout_for(name: str, key: str = "model.name", config: dict[str, Any] | None = None) -> Layout:
    """`builtin:<layout>`, a local model directory (its config.json), a hub id of HUB_LAYOUTS, or another hub id
    (its config fetched, or read from the Hugging Face cache offline; once per process). `config`: the model's
    config.json as the pre-flight read it (`colocate_rl.plan.preflight`), then nothing is read. UserError as in
    `layout_from_config` and `colocate_rl.model_config.model_config` (a hub config that cannot be had, a GGUF
    file)."""
    layout = builtin_layout(name)
    if layout is not None:
        return layout_from_config(dict(LAYOUTS[layout], model_type="qwen2"), name)
    if not looks_local(name) and name.lower() in HUB_LAYOUTS:
        return HUB_LAYOUTS[name.lower()]
    return layout_from_config(config if config is not None else model_config(name, key), f"'{name}'", key)


def reward_model_params(name: str, key: str, config: dict[str, Any] | None = None) -> int:
    """Parameters of a sequence-classification reward model (checked before: one label; `config` as in
    `layout_for`): its decoder without the LM head, plus the score head (hidden × 1)."""
    lay = layout_for(name, key, config)
    return replace(lay, tie=True).params + lay.hidden


# The linear layers of a decoder layer: (input features, output features) as functions of the layout
LINEAR_SHAPES = {
    "q_proj": lambda lay: (lay.hidden, lay.heads * lay.hd),
    "k_proj": lambda lay: (lay.hidden, lay.kv_heads * lay.hd),
    "v_proj": lambda lay: (lay.hidden, lay.kv_heads * lay.hd),
    "o_proj": lambda lay: (lay.heads * lay.hd, lay.hidden),
    "gate_proj": lambda lay: (lay.hidden, lay.intermediate),
    "up_proj": lambda lay: (lay.hidden, lay.intermediate),
    "down_proj": lambda lay: (lay.intermediate, lay.hidden),
}


def lora_params(lay: Layout, r: int, target_modules: list[str] | str) -> int:
    """Trainable parameters of LoRA adapters of rank `r` on `target_modules` (all-linear: every layer's linear
    layers; names this layout does not have count nothing)."""
    return lay.layers * sum(r * sum(LINEAR_SHAPES[n](lay)) for n in _adapted(target_modules))


def _adapted(target_modules: list[str] | str) -> list[str]:
    """The LINEAR_SHAPES names LoRA's `target_modules` adapts (names this layout does not have: none)."""
    return list(LINEAR_SHAPES) if target_modules == "all-linear" else [n for n in target_modules if n in LINEAR_SHAPES]


def lora_saved_per_token_layer(lay: Layout, lora: LoraSection | None, fp32_adapters: bool) -> float:
    """Bytes one token saves for backward in one layer beyond `Layout.saved_per_token_layer(2)` with `lora`'s adapters
    (none without), per input feature of each adapted linear layer: 2 B with dropout (its mask and the dropped input
    the adapter keeps), without it 0.6 B where the adapters are fp32 (PEFT's default outside DeepSpeed, which casts
    them to bf16: the input's copy under bf16 autocast), else none. The frozen base layers' savings are not taken
    off, so this errs above: 0–15 % above what autograd saved on CPU for all-linear at 135M and 0.5B, more with fewer
    targets (tests/test_estimate.py)."""
    if lora is None:
        return 0.0
    per_feature = 2.0 if lora.dropout > 0 else 0.6 if fp32_adapters else 0.0
    return per_feature * sum(LINEAR_SHAPES[n](lay)[0] for n in _adapted(lora.target_modules))
