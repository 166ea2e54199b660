#!/usr/bin/env python3
"""TRL's own GRPOTrainer with its colocated vLLM (`vllm_mode="colocate"`), written as a TRL user writes it, for the
side-by-side runs of benchmarks/bench_overlap.py: recipes/smollm2-135m-gsm8k.yaml's task (the system prompt, the
question as the user turn, math_verify + 0.5 × hash_answer_format, 8 completions of ≤ 256 tokens per prompt,
lr 1e-5, beta 0, bf16) with the micro-batch and accumulation set by hand (`--micro-batch`, `--grad-accum`).

    python benchmarks/trl_grpo.py --model DIR --data FILE.jsonl --out RUN --steps 12 --micro-batch 128 --grad-accum 2
        [--gradient-checkpointing]

Writes RUN/steps.jsonl: one line per optimizer step with its wall-clock time (`wall_s`, from the start of training),
TRL's logged metrics and torch's peak allocated GiB so far. Exit code: the trainer's.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

RECIPE = ROOT / "recipes" / "smollm2-135m-gsm8k.yaml"  # the task: its system prompt and question column


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--data", required=True, help="a JSONL file with question and answer")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--micro-batch", type=int, default=128, help="per_device_train_batch_size (completions)")
    p.add_argument("--grad-accum", type=int, default=2, help="gradient_accumulation_steps")
    p.add_argument("--share", type=float, default=0.3, help="vllm_gpu_memory_utilization")
    p.add_argument(
        "--gradient-checkpointing",
        action="store_true",
        help="TRL's default; off unless given: the 135M micro-batches fit without it, and it costs a forward",
    )
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)

    import torch
    from datasets import load_dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from colocate_rl.recipe.load import read_yaml
    from colocate_rl.rewards import hash_answer_format, math_verify

    task = read_yaml(RECIPE)["data"]
    system, field = task["system_prompt"], task["prompt_field"]
    data = load_dataset("json", data_files=a.data, split="train")
    data = data.map(
        lambda row: {"prompt": [{"role": "system", "content": system}, {"role": "user", "content": row[field]}]}
    )
    a.out.mkdir(parents=True, exist_ok=True)
    steps_file = (a.out / "steps.jsonl").open("w")

    class StepTimes(TrainerCallback):
        start = None

        def on_train_begin(self, args, state, control, **kwargs):
            self.start = time.time()

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs is None or "train_runtime" in logs:
                return
            row = {"step": state.global_step, "wall_s": round(time.time() - self.start, 4), **logs}
            row["torch_peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 3)
            steps_file.write(json.dumps(row) + "\n")
            steps_file.flush()

    config = GRPOConfig(
        output_dir=str(a.out / "trl"),
        max_steps=a.steps,
        per_device_train_batch_size=a.micro_batch,
        gradient_accumulation_steps=a.grad_accum,
        num_generations=8,
        max_completion_length=256,
        learning_rate=1e-5,
        beta=0.0,
        bf16=True,
        gradient_checkpointing=a.gradient_checkpointing,  # set by hand (TRL's GRPOConfig defaults to True)
        use_vllm=True,
        vllm_mode="colocate",
        vllm_gpu_memory_utilization=a.share,
        vllm_max_model_length=768,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=a.seed,
        reward_weights=[1.0, 0.5],
    )
    trainer = GRPOTrainer(
        model=a.model,
        reward_funcs=[math_verify, hash_answer_format],
        args=config,
        train_dataset=data,
        callbacks=[StepTimes()],
    )
    trainer.train()
    steps_file.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
