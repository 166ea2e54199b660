"""The run's final model: saved to `final.partial/` and renamed to `final/` once complete, in the training dtype
(`cast_saved_weights`), with LoRA the adapter (and on request the merged model)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from colocate_rl.errors import UserError
from colocate_rl.plan.launch_spec import LaunchSpec
from colocate_rl.rundir import FINAL, RunDir


def save_final(trainer, paths: RunDir, recipe, launch: LaunchSpec) -> None:
    """The final model (with LoRA: the adapter, and on request the merged model in `merged/`) and tokenizer, written
    to `final.partial/` and renamed to `final/` once complete: a save cut off (a full disk) never leaves a directory
    that looks like a model. Weights are stored in the training dtype."""
    import shutil

    import torch.distributed as dist

    partial = paths.path / f"{FINAL}.partial"
    dtype = launch.model_dtype
    try:
        trainer.save_model(str(partial))
        if trainer.is_world_process_zero():
            cast_saved_weights(
                partial, dtype, getattr(trainer.accelerator.unwrap_model(trainer.model), "all_tied_weights_keys", None)
            )
            trainer.processing_class.save_pretrained(str(partial))
            if recipe.model.lora and recipe.model.lora.save_merged:
                from colocate_rl.rank.lora import save_merged

                save_merged(partial, launch.model_path, partial / "merged", dtype)
                trainer.processing_class.save_pretrained(str(partial / "merged"))
    except OSError as e:
        raise UserError(
            f"{partial}: saving the final model failed ({e.strerror or e}); free space there and resume from the last "
            f"checkpoint: colocate-rl train --resume {paths.path}"
        )
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
    if trainer.is_world_process_zero():
        if paths.final.exists():
            shutil.rmtree(paths.final)
        os.replace(partial, paths.final)


def cast_saved_weights(directory: Path, dtype: str, tied: dict[str, str] | None = None) -> list[str]:
    """Rewrite the model's `model*.safetensors` files in `directory` whose floating tensors are not `dtype` (a trainer
    may hand back fp32 master weights of a bf16 model; a LoRA adapter keeps its own dtype), and drop the copies of
    tied weights (`tied`: the model's `all_tied_weights_keys`, copy → source) that a cloned state dict (DeepSpeed
    ZeRO-1/2) brings back; returns the files rewritten (and config.json's dtype with them, and the shard index)."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    want, rewritten, dropped, tied = getattr(torch, dtype), [], [], tied or {}
    stored = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
    files = sorted(Path(directory).glob("model*.safetensors"))
    sources = {}  # a tied weight's source tensor, wherever it is stored
    for path in files:
        with safe_open(str(path), "pt") as f:
            sources.update({k: f.get_tensor(k) for k in set(tied.values()) & set(f.keys())})
    for path in files:
        with safe_open(str(path), "pt") as f:
            copies = [k for k in f.keys() if tied.get(k) in sources and torch.equal(f.get_tensor(k), sources[tied[k]])]
            if not copies and all(stored.get(f.get_slice(k).get_dtype(), want) == want for k in f.keys()):
                continue
            metadata = f.metadata()
            tensors = {k: f.get_tensor(k) for k in f.keys() if k not in copies}
        save_file({k: t.to(want) if t.is_floating_point() else t for k, t in tensors.items()}, str(path), metadata)
        rewritten.append(path.name)
        dropped += copies
    config, index = Path(directory) / "config.json", Path(directory) / "model.safetensors.index.json"
    if rewritten and config.is_file():  # `dtype="auto"` loads what config.json says
        values = json.loads(config.read_text())
        values.update({key: dtype for key in ("dtype", "torch_dtype") if key in values} or {"dtype": dtype})
        config.write_text(json.dumps(values, indent=2, sort_keys=True) + "\n")
    if dropped and index.is_file():
        values = json.loads(index.read_text())
        values["weight_map"] = {k: v for k, v in values.get("weight_map", {}).items() if k not in dropped}
        index.write_text(json.dumps(values, indent=2) + "\n")
    return rewritten
