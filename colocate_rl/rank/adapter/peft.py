"""PEFT's LoRA-layer internals (pinned range: peft>=0.17,<1), each with what it relies on: the trainer's PEFT model
as vLLM sees it, base + adapter merged out of place, parameter by parameter (`AdapterMerge`). PEFT's own
`merge_adapter()`/`unmerge_adapter()` pair (what TRL's push uses) adds and subtracts the update in the base dtype, so
the frozen bf16 base weights drift by a rounding error at every push. Here the base is never written.

Relied on: `peft.tuners.lora.LoraLayer` modules with `base_layer`, `active_adapters`, `lora_A[name]`/`lora_B[name]`,
`disable_adapters` and `get_delta_weight(name)`; parameter names under `base_model.model.` with `.base_layer`,
`.lora_*`, `.modules_to_save.default` and `original_module` parts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

PEFT_PREFIX = "base_model.model."
# vLLM loads these trainer weights into one stacked parameter (Qwen2, Llama, Mistral layouts)
PACKED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


class AdapterMerge:
    """The trainer's PEFT model as vLLM sees it: base parameter names, adapted weights as base + delta."""

    def __init__(self, model, fix_name: Callable[[str], str] = lambda n: n):
        from peft.tuners.lora import LoraLayer

        self.model, self.fix_name = model, fix_name
        self.adapted = {  # base weight → its LoRA layer
            id(m.base_layer.weight): m for m in model.modules() if isinstance(m, LoraLayer) and hasattr(m, "base_layer")
        }
        self.params = dict(self._named_params())

    def _named_params(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, param in self.model.named_parameters():
            if ".lora_" in name or "original_module" in name:
                continue  # adapter weights are merged into their base; a module-to-save replaces its original
            name = name.removeprefix(PEFT_PREFIX).replace(".base_layer", "").replace(".modules_to_save.default", "")
            yield self.fix_name(name), param

    def named_params(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(vLLM name, base parameter) of every weight vLLM holds, not gathered."""
        yield from self.params.items()

    def adapter_params(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        """The adapter weights the merged value of `params` needs (to gather them together under ZeRO-3)."""
        extra = []
        for p in params:
            layer = self.adapted.get(id(p))
            if layer is not None:
                for name in layer.active_adapters:
                    extra += [layer.lora_A[name].weight, layer.lora_B[name].weight]
        return extra

    def value(self, param: torch.Tensor) -> torch.Tensor:
        """The weight vLLM must hold for `param` (gathered): base + the active adapters' delta, in the base dtype."""
        layer = self.adapted.get(id(param))
        if layer is None or layer.disable_adapters:
            return param.data
        merged = param.data.float()
        for name in layer.active_adapters:
            merged = merged + layer.get_delta_weight(name).float()
        return merged.to(param.dtype)

    def check_targets(self, tensor_parallel_size: int) -> dict[str, list[str]]:
        """vLLM parameter → the trainer parameters it is made of, for the adapted weights of the last layer (one
        tensor each: o_proj, down_proj; stacked: qkv_proj, gate_up_proj). Empty under tensor parallelism (vLLM
        shards these)."""
        adapted = [n for n, p in self.params.items() if id(p) in self.adapted]
        layers = sorted({int(n.split(".")[2]) for n in adapted if n.startswith("model.layers.")})
        if tensor_parallel_size != 1 or not layers:
            return {}
        targets: dict[str, list[str]] = {}
        prefix = f"model.layers.{layers[-1]}."
        for name in (n for n in adapted if n.startswith(prefix) and n.endswith(".weight")):
            module = name.removesuffix(".weight").rpartition(".")[2]
            stacked = next(((s, parts) for s, parts in PACKED.items() if module in parts), None)
            if stacked is None:
                targets[name] = [name]
            else:
                parts = [name.replace(f".{module}.", f".{part}.") for part in stacked[1]]
                if all(p in self.params for p in parts):
                    targets[name.replace(f".{module}.", f".{stacked[0]}.")] = parts
        return targets


def expected_tensors(merge: AdapterMerge, targets: dict[str, list[str]], gather: Any) -> dict[str, torch.Tensor]:
    """vLLM name → the merged weight it must hold, computed from the trainer's current base and adapter."""
    params = [merge.params[p] for parts in targets.values() for p in parts]
    with gather(params + merge.adapter_params(params)):
        return {
            name: torch.cat([merge.value(merge.params[p]) for p in parts]).detach().clone()
            for name, parts in targets.items()
        }


def check() -> list[str]:
    """What is missing in the installed PEFT for the merge, one problem a line."""
    try:
        from peft.tuners.lora import Linear, LoraLayer
    except ImportError as e:
        return [f"peft: {e}"]
    wanted = [(LoraLayer, "active_adapters"), (LoraLayer, "disable_adapters"), (Linear, "get_delta_weight")]
    return [f"peft {cls.__name__}.{name} is missing" for cls, name in wanted if not hasattr(cls, name)]
