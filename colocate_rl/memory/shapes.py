"""Model shapes for the memory estimate: a dense decoder's `Layout` (and its exact parameter count) from a built-in
layout (`colocate_rl.builtin_model.LAYOUTS`), a local model directory's config.json, or the HUB_LAYOUTS table of
published configs. No torch, transformers or network."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from colocate_rl.builtin_model import LAYOUTS, builtin_layout
from colocate_rl.errors import UserError


@dataclass(frozen=True)
class Layout:
    """A dense decoder (Qwen2 / Llama shapes)."""

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

    @property
    def hd(self) -> int:
        return self.head_dim or self.hidden // self.heads

    @property
    def params(self) -> int:
        """Exact: embeddings (+ lm_head unless tied); per layer q/k/v/o (+ biases), SwiGLU MLP, 2 norms; final norm."""
        q, kv, h = self.heads * self.hd, self.kv_heads * self.hd, self.hidden
        attn = 2 * h * q + 2 * h * kv + ((q + 2 * kv) if self.qkv_bias else 0)
        return self.vocab * h * (1 if self.tie else 2) + self.layers * (attn + 3 * h * self.intermediate + 2 * h) + h


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
    return table


HUB_LAYOUTS = _hub_table()


def layout_from_config(cfg: dict[str, Any], source: str) -> Layout:
    """A Layout from a Hugging Face config.json mapping (its `text_config` when it has one)."""
    cfg = cfg.get("text_config") or cfg
    missing = [
        k
        for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
        if not isinstance(cfg.get(k), int)
    ]
    if missing or any(k in cfg for k in ("num_experts", "num_local_experts", "n_routed_experts")):
        raise UserError(
            f"model.name: {source} is not a dense decoder's config ("
            + (f"no {', '.join(missing)}" if missing else "mixture of experts")
            + "); mem-probe --estimate handles dense decoders only"
        )
    return Layout(
        cfg["hidden_size"],
        cfg["num_hidden_layers"],
        cfg["num_attention_heads"],
        cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
        cfg["intermediate_size"],
        cfg["vocab_size"],
        bool(cfg.get("tie_word_embeddings", False)),
        cfg.get("max_position_embeddings") or 32768,
        qkv_bias=cfg.get("model_type") == "qwen2" or bool(cfg.get("attention_bias", False)),
        head_dim=cfg.get("head_dim"),
    )


def layout_for(name: str) -> Layout:
    """`builtin:<layout>`, a local model directory (its config.json) or a hub id of HUB_LAYOUTS."""
    layout = builtin_layout(name)
    if layout is not None:
        return layout_from_config(dict(LAYOUTS[layout], model_type="qwen2"), name)
    config = Path(name).expanduser() / "config.json"
    if config.is_file():
        try:
            return layout_from_config(json.loads(config.read_text()), str(config))
        except (OSError, ValueError) as e:
            raise UserError(f"model.name: cannot read {config} ({e}); fix it or pass another model directory")
    if name.lower() in HUB_LAYOUTS:
        return HUB_LAYOUTS[name.lower()]
    raise UserError(
        f"model.name: no layout known for '{name}'; pass a local model directory (with config.json), "
        "or add the layout to HUB_LAYOUTS in colocate_rl/memory/shapes.py"
    )
