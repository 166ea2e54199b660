"""LoRA on the rank side: the PEFT config from `model.lora`, the adapted model as the plain model vLLM serves, and the
merged copy of the final model.

vLLM gets base + adapter merged out of place, parameter by parameter (`AdapterMerge`): PEFT's own
`merge_adapter()`/`unmerge_adapter()` pair (what TRL's push uses) adds and subtracts the update in the base dtype, so
the frozen bf16 base weights drift by a rounding error at every push. Here the base is never written.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from colocate_rl.errors import UserError

if TYPE_CHECKING:
    from colocate_rl.recipe.schema import LoraSection

PEFT_PREFIX = "base_model.model."
# vLLM loads these trainer weights into one stacked parameter (Qwen2, Llama, Mistral layouts)
PACKED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def peft_config(lora: LoraSection):
    """PEFT's LoraConfig for the recipe's `model.lora`."""
    from peft import LoraConfig

    return LoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=lora.target_modules,
        task_type="CAUSAL_LM",
    )


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


def save_merged(adapter_dir: Path, base_model: str, out_dir: Path, dtype: str) -> None:
    """The base model with the adapter in `adapter_dir` merged in, saved to `out_dir` in `dtype`. Runs in a child
    process on the CPU: inside a rank, ZeRO-3 would turn the base model's load into a collective. Raises UserError
    when the child fails (its last output in the message)."""
    import subprocess

    args = [sys.executable, "-m", "colocate_rl.rank.lora", str(adapter_dir), base_model, str(out_dir), dtype]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    done = subprocess.run(args, capture_output=True, text=True, env={**env, "CUDA_VISIBLE_DEVICES": ""})
    if done.returncode:
        last = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        raise UserError(
            f"model.lora.save_merged: merging the adapter into {base_model} failed ({last[0]}); the adapter is in "
            f"{adapter_dir}: merge it yourself with peft's merge_and_unload, or set model.lora.save_merged: false"
        )


def _merge(adapter_dir: str, base_model: str, out_dir: str, dtype: str) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_model, dtype=getattr(torch, dtype))
    PeftModel.from_pretrained(base, adapter_dir).merge_and_unload().save_pretrained(out_dir)


def expected_tensors(merge: AdapterMerge, targets: dict[str, list[str]], gather: Any) -> dict[str, torch.Tensor]:
    """vLLM name → the merged weight it must hold, computed from the trainer's current base and adapter."""
    params = [merge.params[p] for parts in targets.values() for p in parts]
    with gather(params + merge.adapter_params(params)):
        return {
            name: torch.cat([merge.value(merge.params[p]) for p in parts]).detach().clone()
            for name, parts in targets.items()
        }


if __name__ == "__main__":  # save_merged's child process
    _merge(*sys.argv[1:])
