"""The per-rank program: `python -m colocate_rl.worker RUN_DIR`, started by torchrun on every rank.

Reads everything from the run directory (`recipe.yaml`, `launch.json`, `deepspeed.json`; `colocate_rl.rundir`),
builds the tokenizer, dataset, rewards and TRL config, trains with GRPOTrainer or RLOOTrainer, saves the final
model and tears the process group down. Rank 0 appends one JSON object per logged step to `metrics.jsonl` and
writes `DONE` once the final model is saved. A rank that stops on a UserError (exit 2) or stale weights (exit 3)
prints `error: ...` lines to the log and reports them in `events.jsonl`.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

from colocate_rl.errors import EngineProcessError, RewardProcessError, StaleWeightsError, UserError
from colocate_rl.plan.launch_spec import LaunchSpec
from colocate_rl.rundir import CHECKPOINT_COMPLETE, RunDir, read_jsonl
from colocate_rl.telemetry import events


def make_metrics_callback(path: Path, telemetry):
    """A TrainerCallback that drives `telemetry` at step edges and appends every log record (TRL's values,
    telemetry, step, wall seconds) to `path` on rank 0."""
    from transformers import TrainerCallback

    class MetricsCallback(TrainerCallback):
        def __init__(self):
            self.start = time.time()
            self.trainer = None  # set once the trainer exists

        def on_train_begin(self, args, state, control, **kwargs):
            # a resumed run continues the wall clock of the steps it keeps (those up to its checkpoint)
            kept = [
                r.get("wall_s", 0)
                for r in read_jsonl(path)
                if isinstance(r.get("step"), int)
                and r["step"] <= state.global_step
                and isinstance(r.get("wall_s"), (int, float))
            ]
            self.start = time.time() - (max(kept) if kept and state.global_step else 0)
            telemetry.instrument_optimizer(self.trainer)

        def on_step_begin(self, args, state, control, **kwargs):
            telemetry.step_begin()

        def on_step_end(self, args, state, control, **kwargs):
            telemetry.pending = telemetry.step_end(state.global_step)

        def on_train_end(self, args, state, control, **kwargs):
            telemetry.close()

        def on_log(self, args, state, control, logs=None, **kwargs):
            loss = (logs or {}).get("loss")
            if isinstance(loss, float) and not math.isfinite(loss):  # the same gathered value on every rank
                raise UserError(
                    f"trainer: the loss is {loss} at step {state.global_step}; training on it would only corrupt the "
                    "model: lower trainer.learning_rate, check the rewards, or resume from an earlier checkpoint"
                )
            if not state.is_world_process_zero or not logs:
                return
            record: dict[str, Any] = {
                "step": state.global_step,
                "max_steps": state.max_steps,
                "wall_s": round(time.time() - self.start, 3),
            }
            record.update({k: v for k, v in logs.items() if isinstance(v, (int, float, str))})
            with path.open("a") as f:
                f.write(json.dumps(record) + "\n")

    return MetricsCallback()


def telemetry_extras(telemetry):
    """`log_extras(trainer, logs)` for colocate-rl's trainer: the step's telemetry (and generation tokens/s) merged
    into the step's log record, so it reaches every log backend."""
    from colocate_rl.rank.adapter.trl import step_metric

    def extras(trainer, logs):
        if not telemetry.pending:
            return logs
        extra, telemetry.pending = telemetry.pending, {}
        lengths = step_metric(trainer, "completions/mean_length")
        generate_s = extra.get("time/generate_s", 0.0)
        if lengths and generate_s > 0:
            tokens = sum(lengths) / len(lengths) * trainer.args.generation_batch_size
            extra["gen/tokens_per_s"] = round(tokens / generate_s, 1)
        return {**logs, **extra}

    return extras


def engine_factory(launch: LaunchSpec, run_dir: Path, seed: int, generation, step_timeout_minutes: float | None = None):
    """`factory(trainer) -> GenerationEngine` for the run's backend, and whether TRL builds its own vLLM engine
    (`generation`: the recipe's section, whose engine options an engine process without vLLM takes too). An engine
    process reports an answer awaited for half the watchdog's step timeout (`step_timeout_minutes`)."""
    if launch.engine_process:
        from colocate_rl.plan.engine_options import EngineOptions
        from colocate_rl.rank.engine_process import process_engine

        options = launch.engine or EngineOptions.from_generation(generation)
        long_wait_s = step_timeout_minutes * 60 / 2 if step_timeout_minutes is not None else float("inf")
        return (lambda trainer: process_engine(trainer, launch, options, run_dir, seed, long_wait_s)), False
    if launch.backend != "vllm":
        from colocate_rl.rank.hf_engine import transformers_engine

        return transformers_engine, False
    if launch.engine is None:  # generation.engine: trl
        from colocate_rl.rank.hf_engine import TRLEngine

        return (lambda trainer: TRLEngine(trainer.vllm_generation)), True
    from colocate_rl.rank.vllm_engine import from_trainer

    return (lambda trainer: from_trainer(trainer, launch.engine, run_dir, seed)), False


def held_out_rows(launch: LaunchSpec, paths: RunDir) -> int:
    """Rows at the end of the data file that evaluation holds out, as the plan recorded them."""
    if launch.held_out_rows is None:
        raise UserError(
            f"{paths.launch_spec}: written by an earlier colocate-rl without the held-out rows; continue the run with "
            f"`colocate-rl train --resume {paths.path}` (it records them), or start a new run"
        )
    return launch.held_out_rows


def load_tokenizer(model_path: str, builtin: bool):
    """The trainer's tokenizer; a built-in model's tokenizer is loaded the way it was saved."""
    if builtin:
        from colocate_rl.builtin_model import load_tokenizer as load_builtin

        return load_builtin(model_path)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path, padding_side="left")


def build_trainer(run_dir: Path):
    """Construct the TRL trainer for this rank from the run directory's files."""
    from colocate_rl.prompts import load_prompts
    from colocate_rl.rank import adapter
    from colocate_rl.rank.checkpoints import make_checkpoint_callback
    from colocate_rl.rank.evaluation import make_eval_callback
    from colocate_rl.rank.lora import peft_config
    from colocate_rl.rank.rewards import reward_functions
    from colocate_rl.rank.same_recipe import check_same_recipe
    from colocate_rl.rank.telemetry import Telemetry
    from colocate_rl.rank.tools import ToolGuard, trainer_tools
    from colocate_rl.recipe.load import load_recipe

    paths = RunDir(run_dir)
    recipe = load_recipe(paths.recipe)
    launch = LaunchSpec.read(paths.launch_spec)
    if paths.done.exists():
        raise UserError(f"{run_dir}: the run already finished ({paths.done}); start a new run in another directory")
    if launch.resume_from is None and (paths.metrics.exists() or paths.complete_checkpoints()):
        # e.g. an interrupted run's launch.sh run again: starting over would mix two runs' steps and checkpoints
        raise UserError(
            f"{run_dir}: this run directory already holds trained steps; continue them with "
            f"`colocate-rl train --resume {run_dir}`, or start a new run in another directory"
        )
    data = recipe.data
    dataset = load_prompts(
        data.source,
        split=data.split,
        subset=data.subset,
        prompt_field=data.prompt_field,
        chat=data.chat,
        system_prompt=data.system_prompt,
        num_samples=data.num_samples,
        seed=recipe.trainer.seed,
        held_out=held_out_rows(launch, paths),
    )
    rewards, reward_pool = reward_functions(recipe)  # a pool's processes start now, beside the model's loading
    tokenizer = load_tokenizer(launch.model_path, launch.builtin_model)
    if recipe.model.chat_template is not None:
        from colocate_rl.plan.tools import read_chat_template

        tokenizer.chat_template = read_chat_template(recipe.model.chat_template)
    telemetry = Telemetry(run_dir, resume=launch.resume_from is not None)
    callback = make_metrics_callback(paths.metrics, telemetry)
    checkpoints = make_checkpoint_callback(run_dir, recipe.checkpoint.every_steps, recipe.checkpoint.every_minutes)
    evaluation = make_eval_callback(recipe)  # None unless eval.every_steps

    from colocate_rl.algorithms import trainer_classes

    if recipe.tools.environment is not None:
        os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # TRL warns that environment_factory is experimental

    Config, Trainer = trainer_classes(launch.algorithm)
    if "deepspeed" in launch.trl_args:
        # DeepSpeed reads the world size from its own comm layer: bring it up before HF builds the config
        # (accelerate alone leaves it unset on CPU, and ZeRO-3 then sees a world of 1).
        import deepspeed

        if launch.device == "cpu":
            from colocate_rl.rank.adapter.deepspeed import skip_shm_comm_build

            skip_shm_comm_build()
        deepspeed.init_distributed(dist_backend="gloo" if launch.device == "cpu" else "nccl")
    own_vllm = launch.backend == "vllm" and launch.engine is not None
    adapter.verify_installed(
        Trainer,
        vllm=launch.backend == "vllm",
        deepspeed_offload=own_vllm and launch.engine.offload_trainer,
        lora=recipe.model.lora is not None and own_vllm,
    )
    config = Config(**config_args(Config, launch.trl_args))
    # The process group is up now (DeepSpeed or accelerate): all nodes must run the same recipe.
    check_same_recipe(run_dir, launch.recipe_hash)
    factory, trl_builds_vllm = engine_factory(
        launch, run_dir, recipe.trainer.seed, recipe.generation, recipe.watchdog.step_timeout_minutes
    )
    trainer = adapter.engine_trainer(Trainer)(
        model=launch.model_path,
        reward_funcs=rewards,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[c for c in (callback, checkpoints, evaluation) if c is not None],
        peft_config=peft_config(recipe.model.lora) if recipe.model.lora else None,
        engine_factory=factory,
        trl_builds_vllm=trl_builds_vllm,
        **trainer_tools(recipe.tools),
    )
    adapter.verify_trainer(trainer)  # before step 1: every hook in place, the engine colocate-rl's
    callback.trainer = trainer
    if evaluation is not None:
        evaluation.trainer = trainer
    telemetry.instrument(trainer)
    if recipe.tools.active:
        trainer.tool_guard = ToolGuard(recipe.tools, telemetry.phase)
    trainer.log_extras = telemetry_extras(telemetry)
    trainer.overlap = launch.overlap
    trainer.length_grouping = recipe.trainer.length_grouping
    trainer.reward_pool = reward_pool
    return recipe, launch, trainer, checkpoints


def run(run_dir: Path) -> None:
    """Train, save, and leave the process group cleanly (ZeRO-3 on CPU may abort at exit otherwise)."""
    import torch.distributed as dist

    paths = RunDir(run_dir)
    recipe, launch, trainer, checkpoints = build_trainer(run_dir)
    resume_from = launch.resume_from
    if resume_from is not None:  # the one the launcher checked whole (plan_resume): every rank takes the same
        if not (Path(resume_from) / CHECKPOINT_COMPLETE).is_file():
            raise UserError(f"{resume_from}: no longer complete; resume with `colocate-rl train --resume {run_dir}`")
        if trainer.is_world_process_zero():
            step = int(Path(resume_from).name.rpartition("-")[2])
            events.emit(run_dir, events.RESUMED, step=step, checkpoint=resume_from)
    try:
        trainer.train(resume_from_checkpoint=resume_from)
    finally:
        trainer.engine.stop()  # an engine process (and a generation it still runs for overlap) ends here
        if trainer.reward_pool is not None:
            trainer.reward_pool.close()
    if checkpoints.stopped_at is not None:  # a stop request: the checkpoint is the result, no final model
        if trainer.is_world_process_zero():
            saved = paths.checkpoints / f"checkpoint-{checkpoints.stopped_at}"
            events.emit(run_dir, events.STOPPED, step=checkpoints.stopped_at, checkpoint=str(saved))
        if dist.is_available() and dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
        return
    if recipe.output.save_model:
        from colocate_rl.rank.final_model import save_final

        save_final(trainer, paths, recipe, launch)
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
    if trainer.is_world_process_zero():
        done = {"global_step": trainer.state.global_step, "world_size": trainer.accelerator.num_processes}
        RunDir(run_dir).done.write_text(json.dumps(done) + "\n")
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def config_args(config_cls: type, args: dict[str, Any]) -> dict[str, Any]:
    """args for TRL's config_cls. Newer transformers renamed `gradient_checkpointing*` to `activation_checkpointing*`
    (the old names still work, with a FutureWarning on every rank): pass the new names where the config has them."""
    import dataclasses

    if "activation_checkpointing" not in {f.name for f in dataclasses.fields(config_cls)}:
        return args
    return {
        ("activation" + k.removeprefix("gradient") if k.startswith("gradient_checkpointing") else k): v
        for k, v in args.items()
    }


# FutureWarnings the libraries raise against each other on every collective or step (DeepSpeed's ZeRO-3 calls torch's
# renamed collectives, TRL transformers' renamed property): 6,084 of the 6,128 lines of a ZeRO-3 quickstart's
# train.log, nothing a user can change. Only these are silenced; every other warning still reaches train.log.
QUIET_WARNINGS = (
    r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated",
    r"`is_gradient_checkpointing` is deprecated",
)


def main(argv: list[str] | None = None) -> int:
    import warnings

    for message in QUIET_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=FutureWarning)
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m colocate_rl.worker RUN_DIR (started by `colocate-rl train`)", file=sys.stderr)
        return 2
    run_dir = Path(args[0])
    try:
        run(run_dir)
    except UserError as e:
        events.emit(run_dir, events.USER_ERROR, lines=e.lines)
        for line in e.lines:  # one write per line: ranks share the pipe, lines must not interleave
            sys.stderr.write(f"error: {line}\n")
            sys.stderr.flush()
        return 2
    except StaleWeightsError as e:  # colocate_rl.rank.vllm_engine's guard: its message says it all
        events.emit(run_dir, events.STALE_WEIGHTS, message=str(e))
        sys.stderr.write(f"error: {e}\n")
        sys.stderr.flush()
        return 3
    except (EngineProcessError, RewardProcessError) as e:  # a process of the rank's (engine, reward) failed or ended
        kind = events.ENGINE_FAILED if isinstance(e, EngineProcessError) else events.REWARD_FAILED
        events.emit(run_dir, kind, message=str(e))
        sys.stderr.write(f"error: {e}\n")
        sys.stderr.flush()
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
