"""`model.lora.target_modules` checked before launch against the model's own layers, built from its config on the
meta device (no weight is read; a hub model's config is fetched when the hub is reachable). TRL refuses `lm_head`
as a target (it computes the log-probabilities from the head's weight directly), so it is refused here first."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from colocate_rl.builtin_model import LAYOUTS, builtin_layout
from colocate_rl.errors import UserError
from colocate_rl.model_config import model_config

if TYPE_CHECKING:
    from colocate_rl.recipe.schema import Recipe


def check_lora_targets(recipe: Recipe, config: dict[str, Any] | None = None) -> list[str]:
    """One line per name of a `model.lora.target_modules` list that matches no module of the model (as PEFT matches:
    the module's name is the target or ends with `.<target>`), or that matches a module PEFT cannot adapt (it raises on
    any but linear, embedding, convolution and multi-head attention layers), and `lm_head`. The model is built from its config on the
    meta device: no weight is read. [] without LoRA, for all-linear, and when the config cannot be had (a hub model
    neither reachable nor cached) or transformers cannot build the model: the ranks then fail in PEFT as before.
    `config`: the model's config.json when the caller has read it already."""
    lora = recipe.model.lora
    if lora is None or isinstance(lora.target_modules, str):
        return []
    if "lm_head" in lora.target_modules:
        return [
            "model.lora.target_modules: lm_head cannot be adapted (TRL computes the log-probabilities from its weight "
            "directly, so its adapter would never train); remove lm_head"
        ]
    modules = _meta_modules(recipe.model.name, config)
    if modules is None:
        return []
    from torch import nn
    from transformers.pytorch_utils import Conv1D

    linear = (nn.Linear, Conv1D)
    adaptable = (*linear, nn.Embedding, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.MultiheadAttention)
    targets = list(dict.fromkeys(lora.target_modules))
    leaves = dict.fromkeys(name.rpartition(".")[2] for name, module in modules if isinstance(module, linear))
    layers = ", ".join(leaf for leaf in leaves if leaf != "lm_head")
    problems = []
    for target in targets:
        matched = [(name, module) for name, module in modules if name == target or name.endswith(f".{target}")]
        other = next(((name, module) for name, module in matched if not isinstance(module, adaptable)), None)
        if not matched:
            problems.append(
                f"model.lora.target_modules: '{target}' matches no module of {recipe.model.name}; its linear layers "
                f"are: {layers}"
            )
        elif other is not None:
            problems.append(
                f"model.lora.target_modules: '{target}' matches {other[0]} ({type(other[1]).__name__}), which LoRA "
                f"cannot adapt (only linear, embedding and convolution layers); its linear layers are: {layers}"
            )
    return problems


def _meta_modules(name: str, config: dict[str, Any] | None) -> list[tuple[str, Any]] | None:
    """(name, module) of every module of the causal LM `name` (builtin layout, local directory or hub id; `config`
    when read already) built on the meta device; None when its config cannot be had or transformers cannot build the
    model from it."""
    if config is None:
        try:
            layout = builtin_layout(name)
            config = {"model_type": "qwen2", **LAYOUTS[layout]} if layout else model_config(name, "model.name")
        except UserError:
            return None
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config))
    except Exception:  # an unknown model type, custom code, a config transformers refuses
        return None
    return list(model.named_modules())
