"""The recipe schema: one typed pydantic model per section, `extra="forbid"` everywhere.

Loading and `--set` overrides are in `colocate_rl.recipe.load`; validation errors become one line per problem in
`colocate_rl.recipe.messages`; shared value types in `colocate_rl.recipe.values`; algorithms in
`colocate_rl.algorithms`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeFloat,
    PositiveFloat,
    Strict,
    field_validator,
    model_validator,
)

from colocate_rl import algorithms
from colocate_rl.recipe.generation import GenerationSection
from colocate_rl.recipe.tools import ToolsSection
from colocate_rl.recipe.values import MAX_STEPS, SEED_MAX, Count, Index, check_repo_id, some_modules, whole


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class LoraSection(_Section):
    """LoRA adapters (PEFT) instead of training every weight: the base model stays frozen."""

    r: Count = Field(16, description="Rank of the adapter matrices.")
    alpha: Count = Field(32, description="Scaling numerator: the update is scaled by alpha / r.")
    dropout: float = Field(0.05, ge=0, lt=1, description="Dropout on the adapter input.")
    target_modules: list[Annotated[str, Field(min_length=1)]] | Literal["all-linear"] = Field(
        "all-linear",
        description="Module names that get adapters (e.g. [q_proj, v_proj]), or all-linear: every linear layer "
        "but the output head.",
    )
    _targets_given = field_validator("target_modules", mode="before")(some_modules)
    save_merged: bool = Field(
        False, description="Also save the base model with the adapter merged in to <run_dir>/final/merged."
    )

    def summary(self) -> str:
        """`r 16, alpha 32 on all-linear`, for the run summary and the estimate's note."""
        targets = self.target_modules if isinstance(self.target_modules, str) else ", ".join(self.target_modules)
        return f"r {self.r}, alpha {self.alpha} on {targets}"


class ModelSection(_Section):
    """What to train."""

    name: str = Field(
        "builtin:tiny",
        description="`builtin:<layout>` (offline model: tiny, qwen2.5-0.5b, qwen2.5-1.5b, qwen2.5-7b random-init; "
        "tiny-calc taught to call the calculator), a local model directory, or a hub id such as Qwen/Qwen2.5-1.5B.",
    )
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        "auto", description="Weights dtype; auto = bfloat16 on GPU, float32 on CPU."
    )
    lora: LoraSection | None = Field(None, description="Train LoRA adapters instead of the full model (null: full).")
    chat_template: str | None = Field(
        None,
        description="Replace the model's chat template: a .jinja file, or one TRL ships by name (qwen2_5 ...).",
    )

    @field_validator("lora", mode="before")
    @classmethod
    def _lora_switch(cls, value):
        """`lora: true` is LoRA with the defaults, `lora: false` full fine-tuning."""
        return {} if value is True else None if value is False else value


class DataSection(_Section):
    """Where the prompts come from."""

    source: str = Field(
        "builtin:digits",
        description="`builtin:<task>` (digits, arithmetic), a local .jsonl/.json/.parquet file, or a hub dataset id.",
    )
    split: str = Field("train", description="Dataset split (hub datasets).")
    subset: str | None = Field(None, description="Dataset configuration name (hub datasets), e.g. `main` for gsm8k.")
    prompt_field: str = Field("prompt", description="Column holding the prompt text.")
    chat: bool = Field(True, description="Wrap each prompt as a chat user message (the chat template is applied).")
    system_prompt: str | None = Field(None, description="System message prepended to chat prompts.")
    num_samples: Count | None = Field(None, description="Use only the first N prompts (all when null).")


class RewardSpec(_Section):
    """One reward: a function (`name`) or a reward model (`model`)."""

    name: str | None = Field(
        None,
        description="A reward function: built-in name (digit_share, answer_match, math_verify, format_think, "
        "hash_answer_format, length_penalty, tool_call_ok), `package.module:function` or `path/to/file.py:function`. Give `name` or `model`.",
    )
    model: str | None = Field(
        None,
        description="A reward model instead: a local directory or hub id of a sequence-classification model with "
        "one label (`...ForSequenceClassification`, num_labels 1), loaded on every rank; its score of prompt + "
        "completion is the reward, logged under the last part of the path or id.",
    )
    weight: float = Field(1.0, description="Weight of this reward in the sum.")
    processes: Count | Literal["auto"] = Field(
        "auto",
        description="Processes per rank that score this function's completions, each a slice of the batch (spawned "
        "once per rank). auto: math_verify on up to 8 of the rank's spare CPU cores, any other reward in the trainer's "
        "process. On more than one process a function gets prompts, completions, completion_ids, the dataset columns "
        "and trainer_state's plain fields (global_step, max_steps, ...; no log_history), not log_metric, log_extra "
        "or environments, and must not be async.",
    )

    @model_validator(mode="after")
    def _name_or_model(self):
        if (self.name is None) == (self.model is None):
            which = "both name and model" if self.name is not None else "neither name nor model"
            raise ValueError(f"has {which}; give one per list item: name (a reward function) or model (a reward model)")
        if self.model is not None and self.processes not in ("auto", 1):
            raise ValueError(
                f"processes: {self.processes} with a reward model, which scores on the GPU; drop processes "
                "(it applies to reward functions)"
            )
        return self


class TrainerSection(_Section):
    """The TRL trainer's most used knobs; `extra_args` passes any other GRPOConfig/RLOOConfig field."""

    learning_rate: PositiveFloat = Field(1e-6, description="Optimizer learning rate.")
    per_device_train_batch_size: Count = Field(8, description="Completions per rank per micro-batch.")
    gradient_accumulation_steps: Count = Field(1, description="Micro-batches per optimizer step.")
    micro_batch_size: Count | Literal["auto"] | None = Field(
        "auto",
        description="Split each rank's per_device_train_batch_size × gradient_accumulation_steps completions of a "
        "step into micro-batches of this size instead (it must divide them; the step and the generation batch stay "
        "the same); auto = the largest that fits by the memory estimate, never smaller than "
        "per_device_train_batch_size (as written without a GPU, or when extra_args sets steps_per_generation or "
        "generation_batch_size); null = per_device_train_batch_size as written. The run directory's recipe.yaml "
        "holds the result as per_device_train_batch_size and gradient_accumulation_steps.",
    )
    num_generations: Annotated[int, Strict()] = Field(
        8, ge=2, description="Completions sampled per prompt (the group size)."
    )
    max_completion_length: Count = Field(256, description="Maximum generated tokens per completion.")
    max_steps: Count = Field(100, le=MAX_STEPS, description=f"Optimizer steps to run (at most {MAX_STEPS:,}).")
    beta: NonNegativeFloat = Field(0.0, description="KL coefficient against the reference model (0 = no reference).")
    temperature: PositiveFloat = Field(1.0, description="Sampling temperature.")
    seed: Annotated[int, Strict()] = Field(
        42, ge=0, le=SEED_MAX, description="Random seed (model init for built-in models, data order, sampling)."
    )
    gradient_checkpointing: bool | Literal["auto"] = Field(
        False,
        description="Recompute activations in backward to save memory; auto = off when the estimated "
        "activations fit in GPU memory, else on (tried per ZeRO stage before the next stage; see "
        "distributed.zero_stage).",
    )
    logging_steps: Count = Field(1, description="Log metrics every N steps.")
    length_grouping: bool = Field(
        True,
        description="Form a step's micro-batches from completions of similar length and train each without the "
        "padding none of them needs: less compute where a step has several micro-batches, the same loss. Where "
        "the loss depends on the grouping (loss_type bnpo, an entropy mask or bonus) the micro-batches are only "
        "trimmed; false = TRL's micro-batches as they are.",
    )
    extra_args: dict[str, Any] = Field(
        default_factory=dict,
        description="Any other field of TRL's GRPOConfig/RLOOConfig, passed through (names checked).",
    )

    @property
    def step_completions(self) -> int:
        """Completions one rank trains on per optimizer step."""
        return self.per_device_train_batch_size * self.gradient_accumulation_steps

    @model_validator(mode="after")
    def _micro_batch(self):
        m, step = self.micro_batch_size, self.step_completions
        if m is None:
            return self
        fixed = [k for k in ("steps_per_generation", "generation_batch_size") if k in self.extra_args]
        if fixed and "micro_batch_size" not in self.model_fields_set:  # the default auto yields to them
            self.micro_batch_size = None
            return self
        if fixed:
            raise ValueError(
                f"micro_batch_size: cannot be combined with extra_args.{fixed[0]}, which fixes the generation batch "
                "by the micro-batch; drop one of them"
            )
        if m != "auto" and step % m:
            raise ValueError(
                f"micro_batch_size: {m} does not divide the {step} completions a rank trains on per step "
                f"(per_device_train_batch_size {self.per_device_train_batch_size} × gradient_accumulation_steps "
                f"{self.gradient_accumulation_steps}); pick a divisor of {step}"
            )
        return self


class EvalSection(_Section):
    """Held-out evaluation during training: one completion per held-out prompt, scored by every reward."""

    every_steps: Count | None = Field(
        None,
        description="Evaluate every N optimizer steps and after the last step; null = no evaluation "
        "(the other eval keys are then unused).",
    )
    source: str | None = Field(
        None,
        description="Prompts to evaluate on; null = a held-out part of data.source (a built-in task: prompts from "
        "another seed, none that training uses; a local file: its last eval.num_samples rows, which training then "
        "leaves out; a hub dataset: its eval.split). Else builtin:<task>, a local .jsonl/.json/.parquet file or a "
        "hub dataset id other than data.source, read with data.prompt_field, data.chat and data.system_prompt.",
    )
    split: str = Field("test", description="Split evaluated on, of a hub dataset (must differ from data.split).")
    subset: str | None = Field(None, description="Dataset configuration of a hub dataset; null = data.subset.")
    num_samples: Count = Field(
        64, description="Held-out prompts per evaluation (the first N of eval.source), spread over the ranks."
    )
    temperature: NonNegativeFloat = Field(0.0, description="Sampling temperature of the evaluation; 0 = greedy.")
    before_training: bool = Field(
        True,
        description="Also evaluate once before the first step (logged as step 0): the baseline the later "
        "evaluations compare with. A resumed run does not repeat it.",
    )


class DistributedSection(_Section):
    """Processes, nodes and DeepSpeed."""

    nnodes: Count = Field(1, description="Number of nodes.")
    nproc_per_node: Count | Literal["auto"] = Field(
        "auto", description="Ranks per node; auto = the GPUs present, or 2 on a machine without GPU."
    )
    node_rank: Index = Field(0, description="This node's rank (multi-node).")
    rdzv_backend: Literal["c10d", "static"] = Field(
        "c10d", description="torchrun rendezvous: c10d (elastic) or static (MASTER_ADDR/node rank)."
    )
    rdzv_endpoint: str | None = Field(None, description="host:port of the rendezvous (required when nnodes > 1).")
    rdzv_id: str = Field(
        "colocate-rl", coerce_numbers_to_str=True, description="Rendezvous id shared by all nodes of one job."
    )
    deepspeed: str | None = Field(
        None,
        description="Shipped DeepSpeed config name (zero3, zero3_offload_optimizer, zero3_offload_all) "
        "or a path to a JSON file; null = plain DDP (with zero_stage auto: the shipped zero3 JSON).",
    )
    zero_stage: Literal[0, 1, 2, 3, "auto"] | None = Field(
        None,
        description="Override the DeepSpeed config's ZeRO stage. auto = the fastest layout whose estimated "
        "peak fits in GPU memory with a 10% margin: ZeRO-2, ZeRO-3, ZeRO-3 + optimizer offload, ZeRO-3 + "
        "optimizer and parameter offload (explicit offload keys constrain them; with distributed.deepspeed null "
        "the shipped zero3 JSON is the base). `train --dry-run` and `mem-probe --estimate` show the choice.",
    )
    offload_optimizer: bool | None = Field(None, description="Override: optimizer states on CPU (ZeRO).")
    offload_params: bool | None = Field(None, description="Override: parameters on CPU (ZeRO-3).")
    deepspeed_overrides: dict[str, Any] = Field(
        default_factory=dict, description="Deep-merged into the DeepSpeed JSON."
    )
    mixed_precision: Literal["auto", "bf16", "fp16", "no"] = Field(
        "auto", description="auto = bf16 on GPU, no on CPU; applied to the trainer and DeepSpeed alike."
    )

    _zero_stage_whole = field_validator("zero_stage", mode="before")(whole)


class CheckpointSection(_Section):
    """Checkpoints that `colocate-rl train --resume RUN_DIR` continues from: model, optimizer, scheduler, RNG and
    the position in the data. A stop request (Ctrl-C, SIGTERM, SIGHUP, Slurm's pre-timeout signal) also saves one."""

    every_steps: Count | None = Field(None, description="Save every N optimizer steps (null: by time only).")
    every_minutes: PositiveFloat | None = Field(
        30.0, description="Save at the first step end this many minutes after the last save (null: by steps only)."
    )
    keep_last: Count = Field(2, description="Checkpoints kept in <run_dir>/checkpoints; older ones are deleted.")


class WatchdogSection(_Section):
    """Stops a job whose ranks make no progress, naming the rank that is stuck."""

    step_timeout_minutes: PositiveFloat | None = Field(
        30.0, description="Longest a rank may go between two step ends (null: no watchdog)."
    )
    start_timeout_minutes: PositiveFloat = Field(
        60.0, description="Longest until a rank ends its first step (model load, engine start, compilation)."
    )


class OutputSection(_Section):
    """Where results go."""

    run_dir: str | None = Field(None, description="Run directory; default runs/<name>-<date>-<time>.")
    report_to: list[Literal["tensorboard", "wandb", "mlflow", "trackio", "comet_ml"]] = Field(
        default_factory=list, description="Extra metric backends (metrics.jsonl is always written)."
    )
    save_model: bool = Field(True, description="Save the final model to <run_dir>/final.")
    push_to_hub: str | None = Field(
        None,
        description="Hub model repo (`owner/name`, or `name` under the token's account) that `train` uploads "
        "<run_dir>/final to once the run has finished, from node 0, with the token of HF_TOKEN or `hf auth login` "
        "(needs save_model); null: no upload.",
    )
    hub_private: bool = Field(
        True, description="Create the push_to_hub repo private (a repo that exists keeps its visibility)."
    )

    @field_validator("push_to_hub", mode="before")
    @classmethod
    def _repo_id(cls, value, info):
        if value is None:
            return value
        check_repo_id(value)
        if info.data.get("save_model") is False:
            raise ValueError(
                "needs output.save_model: true (the launcher uploads <run_dir>/final once the run has saved it); "
                "set it, or drop output.push_to_hub"
            )
        return value


class Recipe(_Section):
    """A whole recipe."""

    name: str = Field("run", pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$", description="Run name (used in run_dir).")
    algorithm: str = Field(
        "grpo",
        description="The RL algorithm by name (see Algorithms above): grpo and rloo are TRL's GRPOTrainer and "
        "RLOOTrainer as shipped; the others run on GRPOTrainer with their paper's settings preset.",
    )
    model: ModelSection = Field(default_factory=ModelSection)
    data: DataSection = Field(default_factory=DataSection)
    rewards: list[RewardSpec] = Field(description="Reward functions and models (none: the environment's get_reward).")
    trainer: TrainerSection = Field(default_factory=TrainerSection)
    generation: GenerationSection = Field(default_factory=GenerationSection)
    eval: EvalSection = Field(default_factory=EvalSection)
    distributed: DistributedSection = Field(default_factory=DistributedSection)
    checkpoint: CheckpointSection = Field(default_factory=CheckpointSection)
    watchdog: WatchdogSection = Field(default_factory=WatchdogSection)
    output: OutputSection = Field(default_factory=OutputSection)
    tools: ToolsSection = Field(default_factory=ToolsSection)

    _algorithm = field_validator("algorithm")(algorithms.check_name)
