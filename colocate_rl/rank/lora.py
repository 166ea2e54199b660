"""LoRA on the rank side: the PEFT config from `model.lora` and the merged copy of the final model. The adapted model
as vLLM serves it (base + adapter merged out of place) reads PEFT's LoRA layers: `colocate_rl.rank.adapter.peft`.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from colocate_rl.errors import UserError

if TYPE_CHECKING:
    from colocate_rl.recipe.schema import LoraSection


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


if __name__ == "__main__":  # save_merged's child process
    _merge(*sys.argv[1:])
