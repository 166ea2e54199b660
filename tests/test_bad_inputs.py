"""Every bad input is stopped before launch (issue 17, items 5 and 6): `train` exits 2 with one `error:` line per
problem naming the key or file and the fix, prints no traceback and writes nothing; `validate` says the same.

The matrix runs the CLI with no GPU visible (CPU planning). `train ... --gpus 0` plans like `validate` and can never
start torchrun: a recipe that passed validation would stop at "--gpus: only for planning", so each case's fragment
proves its check fired; those cases run in this process (`cli_here`). The run-directory cases run `train` without
`--gpus` (they pass validation by design) and must stop at the run directory, and the FIFO cases could block: both
run the CLI as users do, in a subprocess with a timeout (slow tier). Then the checks' parts in-process: the TRL
value kinds and the DeepSpeed keys against the installed TRL and DeepSpeed, good inputs that must pass (and load on
the ranks), the secret-key rule, and an OS error in the middle of writing the run directory."""

import dataclasses
import enum
import errno
import json
import os
import re
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml
from conftest import CPU, assert_user_error, cli, cli_here, write_recipe
from typer.testing import CliRunner

from colocate_rl.cli import app
from colocate_rl.errors import UserError
from colocate_rl.pipeline import resolve
from colocate_rl.recipe.load import load_yaml_text, parse_recipe, secret_keys

BASE = {
    "name": "bad",
    "model": {"name": "builtin:tiny"},
    "data": {"source": "builtin:digits"},
    "rewards": [{"name": "digit_share"}],
    "trainer": {"max_steps": 2, "per_device_train_batch_size": 4, "num_generations": 4},
}
BAD_JSONL = '{"prompt": "What is 1 + 1?"}\n{not json\n'
TWO_ROWS = '{"prompt": "What is 1 + 1?", "answer": "2"}\n{"prompt": "What is 2 + 2?", "answer": "4"}\n'
BOMB = "".join(
    f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 10) if i else ', '.join(['lol'] * 10)}]\n" for i in range(9)
)  # "billion laughs": 10**9 values from 90 aliases
RECIPE_YAML = yaml.safe_dump(BASE, sort_keys=False)


def with_(**sections) -> dict:
    """BASE with some sections replaced (or merged, for a section given as `{"+": {...}}`)."""
    data = json.loads(json.dumps(BASE))
    for key, value in sections.items():
        if isinstance(value, dict) and "+" in value:
            data[key] = {**data.get(key, {}), **value["+"]}
        else:
            data[key] = value
    return data


def reward_file(body: str) -> str:
    return f"def score(prompts, completions, **kwargs):\n{body}\n"


def fifo(name: str) -> Callable[[Path], None]:
    return lambda tmp: os.mkfifo(tmp / name)


def read_only_dir(tmp: Path) -> None:
    (tmp / "ro").mkdir()
    (tmp / "ro").chmod(0o555)


@dataclass
class Case:
    id: str
    recipe: dict | str | bytes  # written to recipe.yaml (a mapping as YAML, text or bytes as they are)
    expect: tuple[str, ...]  # fragments of the error line(s): the key or file, and the fix
    files: dict[str, str | bytes] = field(default_factory=dict)  # more files in the working directory
    sets: tuple[str, ...] = ()  # --set KEY=VALUE
    prepare: Callable[[Path], None] | None = None  # makes what a file cannot be (a FIFO, a directory, a link)
    lines: int = 1  # problems reported
    recipe_path: str = "recipe.yaml"  # the RECIPE argument
    run_dir: str = "RUN"  # the --run-dir argument (relative to the working directory)
    launches: bool = False  # valid for planning: run `train` without --gpus, it must stop at the run directory
    root_skips: bool = False  # root ignores permissions
    could_hang: bool = False  # reads a FIFO: validate runs in a subprocess with a timeout too
    env: dict[str, str] = field(default_factory=dict)  # more environment (relative paths: under the test's directory)


CASES = [
    # ------------------------------------------------------------------ data files, opened before launch
    Case(
        "jsonl-malformed",
        with_(data={"source": "d.jsonl"}),
        ("data.source: '", "/d.jsonl' line 2 is not valid JSON", "Fix: use one JSON object per line"),
        files={"d.jsonl": BAD_JSONL},
    ),
    Case(
        "jsonl-without-columns",
        with_(data={"source": "d.jsonl"}),
        ("data.prompt_field: column 'prompt' not found in '", "/d.jsonl'; columns found: none", "Fix: set data.prompt"),
        files={"d.jsonl": "{}\n{}\n"},
    ),
    Case(
        "jsonl-not-objects",
        with_(data={"source": "d.jsonl"}),
        ("data.source: '", "/d.jsonl' line 1 is a number, not a JSON object", "Fix: use one JSON object per line"),
        files={"d.jsonl": "5\n6\n"},
    ),
    Case(
        "json-list-not-closed",
        with_(data={"source": "d.json"}),
        ("data.source: '", "/d.json' line 3 is not valid JSON (the list is not closed with ']')", "Fix:"),
        files={"d.json": '[{"prompt": "a"},\n {"prompt": "b"}\n'},
    ),
    Case(
        "txt-data",
        with_(data={"source": "d.txt"}),
        (
            "data.source: file '",
            "/d.txt' has an unsupported type '.txt'",
            "Fix: convert it to .jsonl, .json or .parquet",
        ),
        files={"d.txt": "What is 1 + 1?\n"},
    ),
    Case(
        "data-not-found",
        with_(data={"source": "nope.jsonl"}),
        (
            "data.source: file '",
            "/nope.jsonl' not found; check the path",
        ),
    ),
    Case(
        "data-path-not-found",
        with_(data={"source": "./prompts/train"}),
        ("data.source: '", "/prompts/train' not found", "Fix: correct the path"),
    ),
    Case(
        "data-empty",
        with_(data={"source": "d.jsonl"}),
        ("data.source: file '", "/d.jsonl' is empty", "Fix: put at least one record in it"),
        files={"d.jsonl": "\n"},
    ),
    Case(
        "data-not-utf8",
        with_(data={"source": "d.jsonl"}),
        ("data.source: '", "/d.jsonl' line 2 is not UTF-8 text (byte 0xff)", "Fix: save the file as UTF-8"),
        files={"d.jsonl": b'{"prompt": "a"}\n{"prompt": "\xff"}\n'},
    ),
    Case(
        "data-fifo",
        with_(data={"source": "d.jsonl"}),
        ("data.source: '", "/d.jsonl' is not a regular file", "Fix: point data.source at a .jsonl"),
        prepare=fifo("d.jsonl"),
        could_hang=True,
    ),
    Case(
        "parquet-unreadable",
        with_(data={"source": "d.parquet"}),
        ("data.source: cannot read '", "/d.parquet' as parquet", "Fix:"),
        files={"d.parquet": "not parquet"},
    ),
    Case(
        "prompt-field-missing",
        with_(data={"source": "d.jsonl", "prompt_field": "promt"}),
        ("data.prompt_field: column 'promt' not found in '", "/d.jsonl' (did you mean 'prompt'?)", "columns found:"),
        files={"d.jsonl": TWO_ROWS},
    ),
    Case(
        "prompt-not-text",
        with_(data={"source": "d.jsonl"}),
        ("data.prompt_field: column 'prompt' holds a number at line 2", "Fix: point data.prompt_field at a text"),
        files={"d.jsonl": '{"prompt": "a"}\n{"prompt": 5}\n'},
    ),
    Case(
        "prompt-null",
        with_(data={"source": "d.jsonl"}),
        ("data.prompt_field: column 'prompt' holds null at line 1",),
        files={"d.jsonl": '{"question": "a"}\n{"prompt": "b"}\n'},
    ),
    Case(
        "json-object-of-columns",  # datasets reads one JSON object as one row, whose prompt is then a list
        with_(data={"source": "d.json"}),
        ("data.source: '", "/d.json' holds one JSON object, not rows", "Fix: write one JSON object per row"),
        files={"d.json": json.dumps({"prompt": ["a", "b"], "answer": ["1", "2"]}, indent=2)},
    ),
    Case(
        "json-one-object",
        with_(data={"source": "d.json"}),
        ("data.source: '", "/d.json' holds one JSON object, not rows", "(.jsonl) or a JSON list of row objects"),
        files={"d.json": '{"prompt": "What is 1 + 1?", "answer": "2"}\n'},
    ),
    Case(
        "chat-message-without-content",
        with_(data={"source": "d.jsonl"}),
        ("data.prompt_field: chat message 1 of column 'prompt' at line 1 has no content", "Fix: give every message"),
        files={
            "d.jsonl": json.dumps({"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user"}]}) + "\n"
        },
    ),
    Case(
        "prompt-text-and-messages",
        with_(data={"source": "d.jsonl"}),
        ("holds text (line 1) and chat messages (line 2)", "Fix: use one form for every row"),
        files={"d.jsonl": '{"prompt": "a"}\n{"prompt": [{"role": "user", "content": "b"}]}\n'},
    ),
    Case(
        "system-prompt-without-chat",
        with_(data={"source": "builtin:digits", "chat": False, "system_prompt": "Be brief."}),
        ("data.system_prompt: set while data.chat is false", "Fix: set data.chat: true"),
    ),
    Case(
        "num-samples-beyond-the-file",
        with_(data={"source": "d.jsonl", "num_samples": 100}),
        ("data.num_samples: 100 but '", "/d.jsonl' has 2 rows", "Fix: set it to at most 2"),
        files={"d.jsonl": TWO_ROWS},
    ),
    Case(
        "num-samples-float",
        "name: bad\ndata: {num_samples: 1.0e+9}\nrewards: [{name: digit_share}]\n",
        ("data.num_samples: input should be a valid integer: a whole number written without a decimal point",),
    ),
    Case(
        "num-samples-1e9-text",
        "name: bad\ndata: {num_samples: 1e9}\nrewards: [{name: digit_share}]\n",
        ("data.num_samples: input should be a valid integer, unable to parse string as an integer (got '1e9')",),
    ),
    Case(
        "num-samples-builtin-huge",
        with_(data={"source": "builtin:digits", "num_samples": 10**9}),
        ("data.num_samples: 1000000000 prompts of a built-in task", "Fix: use at most 1000000"),
    ),
    # ------------------------------------------------------------------ rewards, called once on a sample
    Case(
        "answer-match-without-answer-file",
        with_(data={"source": "d.jsonl"}, rewards=[{"name": "answer_match"}]),
        ("rewards[0].name: answer_match needs the column(s) answer", "use data with an answer column"),
        files={"d.jsonl": '{"prompt": "a"}\n'},
    ),
    Case(
        "answer-match-with-builtin-digits",
        with_(rewards=[{"name": "digit_share"}, {"name": "answer_match"}]),
        ("rewards[1].name: answer_match needs the column(s) answer and data.source 'builtin:digits'",),
    ),
    Case(
        "reward-raises",
        with_(rewards=[{"name": "r.py:score"}]),
        ("rewards[0].name: reward '", "/r.py:score' raised ZeroDivisionError", "Fix: return a list with one float"),
        files={"r.py": reward_file("    return [1 / 0 for _ in completions]")},
    ),
    Case(
        "reward-wrong-length",
        with_(rewards=[{"name": "r.py:score"}]),
        ("rewards[0].name: reward '", "/r.py:score' returned 1 value(s) for 2 sample completions", "Fix:"),
        files={"r.py": reward_file("    return [1.0]")},
    ),
    Case(
        "reward-returns-a-float",
        with_(rewards=[{"name": "r.py:score"}]),
        ("rewards[0].name: reward '", "/r.py:score' returned a number (0.5)", "not a list. Fix:"),
        files={"r.py": reward_file("    return 0.5")},
    ),
    Case(
        "reward-returns-text",
        with_(rewards=[{"name": "r.py:score"}]),
        ("rewards[0].name: reward '", "/r.py:score' returned a str ('good')", "not a finite number. Fix:"),
        files={"r.py": reward_file("    return ['good' for _ in completions]")},
    ),
    Case(
        "reward-returns-nan",
        with_(rewards=[{"name": "r.py:score"}]),
        (
            "rewards[0].name: reward '",
            "/r.py:score' returned a number (nan) for sample completion 0, not a finite",
        ),
        files={"r.py": reward_file("    return [float('nan') for _ in completions]")},
    ),
    Case(
        "reward-returns-inf",
        with_(rewards=[{"name": "r.py:score"}]),
        ("/r.py:score' returned a number (inf) for sample completion 0, not a finite number. Fix:",),
        files={"r.py": reward_file("    return [0.5, float('inf')][: len(completions)][::-1]")},
    ),
    Case(
        "reward-returns-bools",
        with_(rewards=[{"name": "r.py:score"}]),
        ("/r.py:score' returned true/false (True) for sample completion 0, not a finite number. Fix:",),
        files={"r.py": reward_file("    return ['4' in str(c) for c in completions]")},
    ),
    Case(
        "reward-file-exits-at-import",
        with_(rewards=[{"name": "r.py:score"}]),
        ("rewards[0].name: importing reward file '", "/r.py' failed: SystemExit: 0. Fix: correct it."),
        files={"r.py": "import sys\nsys.exit(0)\n" + reward_file("    return [1.0 for _ in completions]")},
    ),
    Case(
        "reward-exits-at-call",
        with_(rewards=[{"name": "r.py:score"}]),
        ("/r.py:score' raised SystemExit: 0 when called on a sample completion", "Fix:"),
        files={"r.py": "import sys\n" + reward_file("    sys.exit(0)")},
    ),
    Case(
        "reward-raises-a-base-exception",
        with_(rewards=[{"name": "r.py:score"}]),
        ("/r.py:score' raised Stop: enough when called on a sample completion", "Fix:"),
        files={"r.py": "class Stop(BaseException):\n    pass\n" + reward_file("    raise Stop('enough')")},
    ),
    Case(
        "reward-file-does-not-import",
        with_(rewards=[{"name": "r.py:score"}]),
        ("rewards[0].name: importing reward file '", "/r.py' failed: SyntaxError", "Fix: correct it"),
        files={"r.py": "def score(:\n"},
    ),
    Case(
        "reward-file-fifo",
        with_(rewards=[{"name": "r.py:score"}]),
        ("rewards[0].name: reward file '", "/r.py' is not a regular file", "Fix: point at a .py file"),
        prepare=fifo("r.py"),
        could_hang=True,
    ),
    # ------------------------------------------------------------------ numbers
    Case(
        "learning-rate-inf",
        "name: bad\nrewards: [{name: digit_share}]\ntrainer: {learning_rate: .inf}\n",
        ("trainer.learning_rate: input should be a finite number (got inf)",),
    ),
    Case(
        "reward-weight-nan",
        "name: bad\nrewards: [{name: digit_share, weight: .nan}]\n",
        ("rewards[0].weight: input should be a finite number",),
    ),
    Case(
        "seed-negative",
        with_(trainer={"+": {"seed": -1}}),
        ("trainer.seed: input should be greater than or equal to 0",),
    ),
    Case(
        "seed-too-large",
        with_(trainer={"+": {"seed": 2**32}}),
        ("trainer.seed: input should be less than or equal to 4294967295",),
    ),
    Case(
        "nproc-10000-on-cpu",
        with_(distributed={"nproc_per_node": 10000}),
        ("distributed.nproc_per_node: 10000 ranks, each a process on a CPU core", "use at most 32"),
    ),
    Case(
        "max-steps-true",
        with_(trainer={"+": {"max_steps": True}}),
        ("trainer.max_steps: input should be a valid integer, not true/false",),
    ),
    Case(
        "batch-size-quoted",
        with_(trainer={"+": {"per_device_train_batch_size": "8"}}),
        ("trainer.per_device_train_batch_size: input should be a valid integer, not text: remove the quotes",),
    ),
    Case(
        "kv-cache-memory-list",
        with_(generation={"kv_cache_memory": [1, 2]}),
        ("generation.kv_cache_memory: expected bytes or a size such as 12GiB", "(got a list)"),
    ),
    Case(
        "kv-cache-memory-mapping",
        with_(generation={"kv_cache_memory": {"gib": 12}}),
        ("generation.kv_cache_memory: expected bytes or a size such as 12GiB, 512MiB, 20GB",),
    ),
    Case(
        "max-steps-absurd",
        with_(trainer={"+": {"max_steps": 10**30}}),
        ("trainer.max_steps: input should be less than or equal to 10000000",),
    ),
    Case(
        "sleep-level-true",
        with_(generation={"sleep_level": True}),
        ("generation.sleep_level: must be written as a whole number such as 2, not true",),
    ),
    # ------------------------------------------------------------------ TRL values passed through extra_args
    Case(
        "extra-args-scale-rewards-5",
        with_(trainer={"+": {"extra_args": {"scale_rewards": 5}}}),
        (
            "trainer.extra_args.scale_rewards: TRL's GRPOConfig takes 'batch', 'group', 'none' or true/false here, got 5",
        ),
    ),
    Case(
        "extra-args-float-read-as-text",
        "name: bad\nrewards: [{name: digit_share}]\ntrainer: {extra_args: {adam_epsilon: 1e-8}}\n",
        ("trainer.extra_args.adam_epsilon: TRL's GRPOConfig takes a number here, got '1e-8'", "such as 1.0e-8"),
    ),
    Case(
        "extra-args-unknown-choice",
        with_(trainer={"+": {"extra_args": {"lr_scheduler_type": "cosin"}}}),
        ("trainer.extra_args.lr_scheduler_type: TRL's GRPOConfig takes 'constant'", "did you mean 'cosine'?"),
    ),
    Case(
        "extra-args-int-given-a-fraction",
        with_(trainer={"+": {"extra_args": {"num_iterations": 2.5}}}),
        ("trainer.extra_args.num_iterations: TRL's GRPOConfig takes a whole number here, got 2.5",),
    ),
    Case(
        "extra-args-bool-given-a-list",
        with_(algorithm="rloo", trainer={"+": {"extra_args": {"log_completions": [1]}}}),
        ("trainer.extra_args.log_completions: TRL's RLOOConfig takes true/false here, got a list",),
    ),
    Case(
        "extra-args-top-p-out-of-range",
        with_(trainer={"+": {"extra_args": {"top_p": 1.5}}}),
        ("trainer.extra_args.top_p: TRL's GRPOConfig takes more than 0 and at most 1 here, got 1.5",),
    ),
    Case(
        "extra-args-adam-beta-out-of-range",
        with_(algorithm="rloo", trainer={"+": {"extra_args": {"adam_beta2": 1.0}}}),
        ("trainer.extra_args.adam_beta2: TRL's RLOOConfig takes from 0 to below 1 here, got 1.0",),
    ),
    Case(
        "extra-args-generation-kwargs-text",
        with_(trainer={"+": {"extra_args": {"generation_kwargs": "top_p=0.9"}}}),
        ("trainer.extra_args.generation_kwargs: TRL's GRPOConfig reads text here only as a JSON object",),
    ),
    Case(
        "extra-args-generation-kwargs-values",
        with_(trainer={"+": {"extra_args": {"generation_kwargs": {"top_k": "ten", "min_p": 2, "n": 4}}}}),
        (
            "trainer.extra_args.generation_kwargs.top_k: the sampling takes a number here, got 'ten'",
            "trainer.extra_args.generation_kwargs.min_p: the sampling takes from 0 to 1 here, got 2",
            "trainer.extra_args.generation_kwargs.n: each prompt gets one completion per sample",
        ),
        lines=3,
    ),
    # ------------------------------------------------------------------ secrets never reach the run directory
    Case(
        "hub-token-in-recipe",
        with_(trainer={"+": {"extra_args": {"hub_token": "hf_abcdef"}}}),
        ("trainer.extra_args.hub_token: looks like a secret", "put it in the environment instead (HF_TOKEN"),
    ),
    Case(
        "api-key-by-set",
        RECIPE_YAML,
        ("distributed.deepspeed_overrides.wandb.api_key: looks like a secret", "WANDB_API_KEY"),
        sets=("distributed.deepspeed=zero3", "distributed.deepspeed_overrides.wandb.api_key=abc123"),
    ),
    Case(
        "secret-in-a-list",
        with_(trainer={"+": {"extra_args": {"hub_token": ["hf_abcdef"]}}}),
        ("trainer.extra_args.hub_token[0]: looks like a secret", "put it in the environment instead"),
    ),
    # ------------------------------------------------------------------ the model's config.json
    Case(
        "model-config-invalid-json",
        with_(model={"name": "./m"}),
        ("model.name: /", "/m/config.json:1:16: invalid JSON", "fix the file, or point model.name at a complete model"),
        files={"m/config.json": '{"model_type": }'},
    ),
    Case(
        "model-config-without-model-type",
        with_(model={"name": "./m"}),
        (
            "model.name: /",
            "/m/config.json names no model_type",
        ),
        files={"m/config.json": '{"hidden_size": 8}'},
    ),
    Case(
        "model-config-not-an-object",
        with_(model={"name": "./m"}),
        (
            "model.name: /",
            "/m/config.json holds a list, not a JSON object",
        ),
        files={"m/config.json": "[1, 2]"},
    ),
    Case(
        "model-config-not-utf8",
        with_(model={"name": "./m"}),
        (
            "model.name: /",
            "/m/config.json:1: not UTF-8 text (byte 0xfe); save the model config as UTF-8",
        ),
        files={"m/config.json": b'{"model_type": "\xfe"}'},
    ),
    Case(
        "model-unknown-model-type",
        with_(model={"name": "./m"}),
        ("model.name: /", "/m/config.json names model_type 'qwen9', which transformers ", "does not know"),
        files={"m/config.json": '{"model_type": "qwen9", "hidden_size": 8}'},
    ),
    Case(
        "lora-target-modules-empty",
        with_(model={"name": "builtin:tiny", "lora": {"target_modules": []}}),
        ("model.lora.target_modules: an empty list adapts nothing", "or write all-linear"),
    ),
    # ------------------------------------------------------------------ DeepSpeed keys
    Case(
        "deepspeed-override-zero-typo",
        with_(distributed={"deepspeed": "zero3", "deepspeed_overrides": {"zero_optimization": {"stag": 2}}}),
        ("distributed.deepspeed_overrides.zero_optimization.stag: not a DeepSpeed config key; did you mean 'stage'?",),
    ),
    Case(
        "deepspeed-override-top-level-typo",
        with_(distributed={"deepspeed": "zero3", "deepspeed_overrides": {"gradient_cliping": 1.0}}),
        (
            "distributed.deepspeed_overrides.gradient_cliping: not a DeepSpeed config key; did you mean 'gradient_clipping'?",
        ),
    ),
    Case(
        "deepspeed-override-offload-typo",
        with_(
            distributed={
                "deepspeed": "zero3",
                "deepspeed_overrides": {"zero_optimization": {"offload_optimizer": {"devise": "cpu"}}},
            }
        ),
        ("distributed.deepspeed_overrides.zero_optimization.offload_optimizer.devise: not a DeepSpeed config key",),
    ),
    Case(
        "deepspeed-override-removed-key",
        with_(distributed={"deepspeed": "zero3", "deepspeed_overrides": {"amp": {"enabled": True}}}),
        ("distributed.deepspeed_overrides.amp: removed in DeepSpeed 0.19, which refuses it; remove it",),
    ),
    Case(
        "deepspeed-override-section-not-a-mapping",
        with_(distributed={"deepspeed": "zero3", "deepspeed_overrides": {"zero_optimization": 3}}),
        ("distributed.deepspeed_overrides.zero_optimization: must be a mapping (a DeepSpeed config section), got 3",),
    ),
    Case(
        "deepspeed-override-stage-as-text",
        with_(distributed={"deepspeed": "zero3", "deepspeed_overrides": {"zero_optimization": {"stage": "3"}}}),
        ('distributed.deepspeed_overrides.zero_optimization.stage: DeepSpeed takes 0, 1, 2 or 3, or "auto" here',),
    ),
    Case(
        "deepspeed-override-wrong-kinds",
        with_(
            distributed={
                "deepspeed": "zero3",
                "deepspeed_overrides": {
                    "gradient_clipping": "high",
                    "zero_optimization": {"offload_optimizer": {"device": "gpu"}},
                },
            }
        ),
        (
            'distributed.deepspeed_overrides.gradient_clipping: DeepSpeed takes a number of 0 or more, or "auto"',
            'distributed.deepspeed_overrides.zero_optimization.offload_optimizer.device: DeepSpeed takes "cpu"',
        ),
        lines=2,
    ),
    Case(
        "deepspeed-file-wrong-kind",
        with_(distributed={"deepspeed": "ds.json"}),
        ("ds.json: zero_optimization.overlap_comm: DeepSpeed takes true/false, null, or \"auto\" here, got 'yes'",),
        files={"ds.json": '{"zero_optimization": {"stage": 2, "overlap_comm": "yes"}}'},
    ),
    Case(
        "deepspeed-file-unknown-key",
        with_(distributed={"deepspeed": "ds.json"}),
        ("ds.json: zero_optimisation: not a DeepSpeed config key; did you mean 'zero_optimization'?",),
        files={"ds.json": '{"zero_optimisation": {"stage": 2}}'},
    ),
    Case(
        "deepspeed-file-not-utf8",
        with_(distributed={"deepspeed": "ds.json"}),
        ("ds.json:1: not UTF-8 text (byte 0xff); save the DeepSpeed config as UTF-8",),
        files={"ds.json": b'{"x": "\xff"}'},
    ),
    # ------------------------------------------------------------------ the recipe file itself
    Case(
        "recipe-not-utf8",
        b'name: bad\nrewards: [{name: digit_share}]\ndata: {system_prompt: "caf\xe9"}\n',
        ("recipe.yaml:3: not UTF-8 text (byte 0xe9); save the recipe as UTF-8",),
    ),
    Case(
        "recipe-fifo",
        "",
        ("pipe.yaml: is not a regular file (a FIFO, socket or device); give the path of a recipe on disk",),
        prepare=fifo("pipe.yaml"),
        recipe_path="pipe.yaml",
        could_hang=True,
    ),
    Case(
        "recipe-is-a-directory",
        "",
        ("recipes.yaml: is a directory, not a recipe; give the file's path",),
        prepare=lambda tmp: (tmp / "recipes.yaml").mkdir(),
        recipe_path="recipes.yaml",
    ),
    Case(
        "recipe-too-large",
        RECIPE_YAML + "#" * (1 << 20) + "\n",
        ("recipe.yaml: larger than 1024 KiB, too large for a recipe",),
    ),
    Case(
        "yaml-alias-bomb",
        BOMB + RECIPE_YAML,
        ("recipe.yaml: expands to more than 100000 values through YAML aliases", "write the values out"),
    ),
    Case(
        "yaml-too-many-aliases",
        "a: &a 1\nb: [" + ", ".join(["*a"] * 101) + "]\n" + RECIPE_YAML,
        ("recipe.yaml:2: more than 100 YAML aliases (*name); write the values out instead",),
    ),
    Case(
        "yaml-recursive-alias",
        RECIPE_YAML + "x: &x [*x]\n",
        ("recipe.yaml: a YAML alias refers to a value that contains it", "remove it"),
    ),
    Case(
        "yaml-duplicate-section",
        RECIPE_YAML + "trainer:\n  max_steps: 3\n",
        ("recipe.yaml:12: duplicate key 'trainer' (first at line 8); keep one of them",),
    ),
    Case(
        "yaml-duplicate-nested-key",
        "name: bad\nrewards: [{name: digit_share}]\ntrainer:\n  max_steps: 2\n  max_steps: 3\n",
        ("recipe.yaml:5: duplicate key 'max_steps' (first at line 4)",),
    ),
    Case(
        "yaml-nested-too-deep",
        "name: bad\nrewards: [{name: digit_share}]\ntrainer: {extra_args: {x: " + "[" * 100 + "]" * 100 + "}}\n",
        ("recipe.yaml: nested deeper than 64 levels",),
    ),
    # ------------------------------------------------------------------ the run directory (`train` without --gpus)
    Case(
        "run-dir-below-a-file",
        RECIPE_YAML,
        ("output.run_dir: '", "is below '", "which is a file, not a directory; pass another --run-dir"),
        files={"afile": "x"},
        run_dir="afile/run",
        launches=True,
    ),
    Case(
        "run-dir-dangling-symlink",
        RECIPE_YAML,
        ("output.run_dir: '", "is a symbolic link to", "which does not exist", "pass another --run-dir"),
        prepare=lambda tmp: (tmp / "RUN").symlink_to(tmp / "gone"),
        launches=True,
    ),
    Case(
        "run-dir-below-a-dangling-symlink",
        RECIPE_YAML,
        ("output.run_dir: '", "a symbolic link to", "which does not exist; pass another --run-dir"),
        prepare=lambda tmp: (tmp / "out").symlink_to(tmp / "gone"),
        run_dir="out/run",
        launches=True,
    ),
    Case(
        "run-dir-name-too-long",  # mkdir would fail after making out/
        RECIPE_YAML,
        ("output.run_dir: '", "has a name of 300 bytes", "more than the file system takes", "pass a shorter --run-dir"),
        run_dir="out/" + "a" * 300,
        launches=True,
    ),
    Case(
        "cache-not-a-directory",  # what root sees of a read-only cache (it may write anywhere): a file in the way
        RECIPE_YAML,
        ("XDG_CACHE_HOME: the cache '", "/cache/colocate-rl' cannot be used", "is not a directory", "writable"),
        files={"cache": "not a directory"},
        env={"XDG_CACHE_HOME": "cache"},
        launches=True,
    ),
    Case(
        "run-dir-in-read-only-dir",
        RECIPE_YAML,
        ("output.run_dir: cannot create '", "is not writable (read-only or no permission); pass another"),
        prepare=read_only_dir,
        run_dir="ro/run",
        launches=True,
        root_skips=True,
    ),
]


def files_in(path: Path) -> list[Path]:
    """Everything under `path` but Python's bytecode cache (importing a reward file may write one beside it)."""
    return sorted(p.relative_to(path) for p in path.rglob("*") if "__pycache__" not in p.parts)


@pytest.mark.parametrize(
    "case", [pytest.param(c, id=c.id, marks=[pytest.mark.slow] if c.launches or c.could_hang else []) for c in CASES]
)
def test_bad_input_stops_before_launch(case, tmp_path, monkeypatch):
    if case.root_skips and os.geteuid() == 0:
        pytest.skip("root writes into read-only directories (the OS error itself is tested in-process below)")
    for name, content in case.files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
    recipe = case.recipe
    if isinstance(recipe, dict):
        write_recipe(tmp_path / "recipe.yaml", recipe)
    elif case.prepare is None or case.recipe_path == "recipe.yaml":
        (tmp_path / "recipe.yaml").write_bytes(recipe if isinstance(recipe, bytes) else recipe.encode())
    if case.prepare is not None:
        case.prepare(tmp_path)
    sets = [arg for item in case.sets for arg in ("--set", item)]
    run = tmp_path / case.run_dir
    before = files_in(tmp_path)

    plan = [] if case.launches else ["--gpus", "0"]
    env = {key: str(tmp_path / value) for key, value in case.env.items()}
    args = ("train", case.recipe_path, *sets, "--run-dir", case.run_dir, *plan)
    if case.launches or case.could_hang:  # could start torchrun or block this process: a subprocess with a timeout
        result = cli(*args, cwd=tmp_path, env=env, timeout=60)
    else:
        result = cli_here(*args, cwd=tmp_path, env=env)
    assert_user_error(result, *case.expect)
    assert len(result.stderr.strip().splitlines()) == case.lines, result.stderr
    assert not os.path.exists(run), f"{run} was created"
    assert files_in(tmp_path) == before, "train wrote something"

    if not case.launches:  # validate reports the same lines
        if case.could_hang:  # a regression would block this process: a subprocess with a timeout
            checked = cli("validate", case.recipe_path, *sets, "--gpus", "0", cwd=tmp_path, timeout=60)
            code = checked.returncode
        else:  # in-process: a subprocess's start would take most of the time
            monkeypatch.chdir(tmp_path)
            checked = CliRunner().invoke(app, ["validate", case.recipe_path, *sets, "--gpus", "0"], env=env)
            code = checked.exit_code
        assert (code, checked.stderr) == (2, result.stderr)
        assert files_in(tmp_path) == before


@pytest.mark.parametrize("case_id", ["jsonl-malformed", "reward-raises", "yaml-alias-bomb", "hub-token-in-recipe"])
def test_dry_run_stops_the_same_way(case_id, tmp_path, monkeypatch):
    case = next(c for c in CASES if c.id == case_id)
    for name, content in case.files.items():
        (tmp_path / name).write_bytes(content if isinstance(content, bytes) else content.encode())
    if isinstance(case.recipe, dict):
        write_recipe(tmp_path / "recipe.yaml", case.recipe)
    else:
        (tmp_path / "recipe.yaml").write_text(case.recipe)
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["train", "recipe.yaml", "--dry-run", "--gpus", "0", "--run-dir", "RUN"])
    assert result.exit_code == 2 and result.stdout == ""
    assert all(fragment in result.stderr for fragment in case.expect), result.stderr
    assert not (tmp_path / "RUN").exists()


def test_every_case_of_issue_17_is_in_the_matrix():
    ids = {c.id for c in CASES}
    assert len(ids) == len(CASES) >= 30
    required = {
        "jsonl-malformed", "jsonl-without-columns", "txt-data", "prompt-field-missing", "reward-wrong-length",
        "reward-raises", "answer-match-without-answer-file", "learning-rate-inf", "seed-negative",
        "extra-args-scale-rewards-5", "model-config-invalid-json", "deepspeed-override-zero-typo", "recipe-not-utf8",
        "run-dir-below-a-file", "run-dir-dangling-symlink", "run-dir-in-read-only-dir", "recipe-fifo",
        "yaml-alias-bomb", "yaml-duplicate-section", "nproc-10000-on-cpu", "num-samples-float", "hub-token-in-recipe",
    }  # fmt: skip
    assert required <= ids, required - ids


# ---------------------------------------------------------------------------------------------- good inputs pass


GOOD_FILES = {
    "lines.jsonl": TWO_ROWS,
    "list.json": json.dumps([{"prompt": "What is 1 + 1?", "answer": "2"}, {"prompt": "3 + 4?", "answer": "7"}]),
    "pretty.json": json.dumps(
        [{"prompt": "What is 1 + 1?", "answer": "2"}, {"prompt": "3 + 4?", "answer": "7"}], indent=2
    ),
    "chat.jsonl": "".join(
        json.dumps({"prompt": [{"role": "user", "content": q}], "answer": a}) + "\n"
        for q, a in (("1+1?", "2"), ("3+4?", "7"))
    ),
    "bom.jsonl": "\ufeff" + TWO_ROWS,
    "blank-lines.jsonl": "\n" + TWO_ROWS.replace("\n", "\n\n"),
}
GOOD_REWARDS = """
import asyncio
import numpy as np

def as_array(prompts, completions, answer=None, trainer_state=None, **kwargs):
    assert trainer_state.global_step == 0 and len(answer) == len(completions)
    return np.array([0.5 for _ in completions])

def with_none(prompts, completions, **kwargs):
    return [None, 1] [: len(completions)]

async def later(prompts, completions, **kwargs):
    await asyncio.sleep(0)
    return [1.0 for _ in completions]
"""


@pytest.mark.parametrize("name", sorted(GOOD_FILES) + ["table.parquet"])
def test_good_data_and_rewards_pass_and_load_on_the_ranks(name, tmp_path, monkeypatch):
    """What validation accepts, `load_prompts` (the ranks) loads: the formats `datasets` reads, rewards that return
    numpy arrays, None, or are async."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from colocate_rl.prompts import load_prompts

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    for file, content in GOOD_FILES.items():
        (tmp_path / file).write_text(content)
    pq.write_table(pa.table({"prompt": ["What is 1 + 1?", "3 + 4?"], "answer": ["2", "7"]}), tmp_path / "table.parquet")
    (tmp_path / "good_rewards.py").write_text(GOOD_REWARDS)
    rewards = [{"name": "answer_match"}] + [
        {"name": f"good_rewards.py:{f}"} for f in ("as_array", "with_none", "later")
    ]
    recipe = with_(data={"source": name}, rewards=rewards)
    resolve(parse_recipe(recipe), CPU)  # no UserError

    dataset = load_prompts(name)
    assert len(dataset) == 2 and "answer" in dataset.column_names


def test_good_recipe_passes_every_command(tmp_path):
    (tmp_path / "d.jsonl").write_text(TWO_ROWS)
    (tmp_path / "ds.json").write_text(json.dumps({"zero_optimization": {"stage": 2, "stage3_max_live_parameters": 1}}))
    recipe = with_(
        data={"source": "d.jsonl", "num_samples": 2},
        rewards=[{"name": "answer_match"}],
        distributed={"deepspeed": "ds.json", "deepspeed_overrides": {"gradient_clipping": 1.0}},
        trainer={"+": {"seed": 0, "extra_args": {"scale_rewards": False, "lr_scheduler_type": "cosine"}}},
    )
    write_recipe(tmp_path / "recipe.yaml", recipe)
    result = cli_here("validate", "recipe.yaml", "--gpus", "0", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    result = cli_here("train", "recipe.yaml", "--dry-run", "--gpus", "0", "--run-dir", "RUN", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert not (tmp_path / "RUN").exists()


# ---------------------------------------------------------------------------------------------- the parts


def test_yaml_merge_keys_may_be_overridden():
    data = load_yaml_text("base: &b {max_steps: 2, seed: 1}\ntrainer:\n  <<: *b\n  max_steps: 3\n", "r.yaml")
    assert data["trainer"] == {"max_steps": 3, "seed": 1}


@pytest.mark.parametrize(
    "data, found",
    [
        ({"trainer": {"extra_args": {"hub_token": "hf_x"}}}, ["trainer.extra_args.hub_token"]),
        ({"x": [{"WANDB_API_KEY": "k"}], "db-password": 1234}, ["x[0].WANDB_API_KEY", "db-password"]),
        (
            {"client_secret": "s", "aws_access_key_id": "a", "token": "t"},
            ["client_secret", "aws_access_key_id", "token"],
        ),
        # not secrets: token counts and ids, special tokens, true ("use the stored token"), nothing set
        ({"generation": {"max_num_batched_tokens": 4096}, "pad_token": "<pad>", "eos_token_id": 2}, []),
        ({"push_to_hub_token": True, "hub_token": None, "api_key": ""}, []),
        # inside a list or mapping under a secret's name
        ({"hub_token": ["hf_x"], "api_key": {"prod": "k", "dev": None}}, ["hub_token[0]", "api_key.prod"]),
    ],
)
def test_secret_keys(data, found):
    assert secret_keys(data) == found


def test_an_os_error_while_writing_the_run_dir_leaves_nothing(tmp_path, monkeypatch):
    from colocate_rl import rundir

    written = []
    real = Path.write_text

    def write_text(self, *args, **kwargs):
        if written:
            raise OSError(errno.ENOSPC, "No space left on device", str(self))
        written.append(self)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", write_text)
    run = tmp_path / "a" / "b" / "run"
    with pytest.raises(UserError) as info:
        rundir.write_run_dir(run, {"recipe.yaml": "x", "launch.json": "{}", "launch.sh": "echo"})
    assert info.value.lines == [
        f"output.run_dir: cannot write '{run / 'launch.json'}' (No space left on device); free space or fix the "
        "permissions, or pass another --run-dir (or output.run_dir)"
    ]
    assert written and not (tmp_path / "a").exists()


def test_an_unwritable_parent_is_found_before_writing(tmp_path, monkeypatch):
    """What root cannot see in the matrix (it may write anywhere): a directory this user may not write."""
    from colocate_rl import rundir

    monkeypatch.setattr(os, "access", lambda path, mode: Path(path) != tmp_path)
    with pytest.raises(UserError) as info:
        rundir.check_run_dir_free(tmp_path / "a" / "run")
    assert info.value.lines == [
        f"output.run_dir: cannot create '{tmp_path / 'a' / 'run'}': '{tmp_path}' is not writable (read-only or no "
        "permission); pass another --run-dir (or output.run_dir)"
    ]
    with pytest.raises(UserError, match="is not writable"):
        rundir.check_run_dir_free(tmp_path)  # an existing (empty) directory


def test_a_read_only_filesystem_is_one_line(tmp_path, monkeypatch):
    from colocate_rl import rundir

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system", str(tmp_path / "run"))

    monkeypatch.setattr(Path, "mkdir", read_only)
    with pytest.raises(UserError) as info:
        rundir.write_run_dir(tmp_path / "run", {"recipe.yaml": "x"})
    assert info.value.lines == [
        f"output.run_dir: cannot write '{tmp_path / 'run'}' (Read-only file system); free space or fix the "
        "permissions, or pass another --run-dir (or output.run_dir)"
    ]


# ---------------------------------------------------------------------------------------------- against the pins

KIND_OF = {bool: "bool", int: "int", float: "float", str: "str", type(None): "null", dict: "dict", list: "list"}
# What TRL takes beyond its annotation (GRPOConfig.__post_init__ maps true/false to "group"/"none") and the choices
# it checks only once training runs.
TRL_VALUE_NOTES = {"scale_rewards": {"kinds": ["bool", "str"], "choices": ["batch", "group", "none"]}}


def _kinds_of(tp) -> tuple[set[str], list[str]]:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        kinds, choices = set(), []
        for arg in typing.get_args(tp):
            k, c = _kinds_of(arg)
            kinds, choices = kinds | k, choices + c
        return kinds, choices
    if origin is typing.Literal:
        values = typing.get_args(tp)
        return {KIND_OF.get(type(v), "any") for v in values}, [v for v in values if isinstance(v, str)]
    tp = origin or tp
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return {"str"}, [m.value for m in tp]
    if tp in KIND_OF:
        return {KIND_OF[tp]}, []
    if isinstance(tp, type) and issubclass(tp, (dict, list, tuple)):
        return {"dict" if issubclass(tp, dict) else "list"}, []
    return {"any"}, []


def trl_value_types(config_cls) -> dict[str, dict]:
    """Field → {"kinds", "choices"} of a TRL config dataclass, as colocate_rl/recipe/trl_fields.json holds them."""
    hints = typing.get_type_hints(config_cls)
    out = {}
    for f in dataclasses.fields(config_cls):
        if not f.init:
            continue
        kinds, choices = _kinds_of(hints[f.name])
        if f.metadata.get("choices") is not None:
            choices = list(f.metadata["choices"])
        spec = {"kinds": ["any"]} if "any" in kinds else {"kinds": sorted(kinds)}
        if choices and "str" in kinds and "any" not in kinds:
            spec["choices"] = sorted({str(c) for c in choices})
        out[f.name] = TRL_VALUE_NOTES.get(f.name, spec)
    return out


def test_trl_value_kinds_match_installed_trl():
    from trl import GRPOConfig, RLOOConfig

    from colocate_rl.plan.trl_args import trl_value_kinds

    for algorithm, config_cls in (("grpo", GRPOConfig), ("rloo", RLOOConfig)):
        assert trl_value_kinds(algorithm) == trl_value_types(config_cls), (
            "colocate_rl/recipe/trl_fields.json's types are stale: regenerate them with "
            "tests/test_bad_inputs.py:trl_value_types"
        )


def test_deepspeed_keys_match_installed_deepspeed():
    """The top-level keys DeepSpeed's config reads (recorded by reading a config through a dict that notes every
    key asked for), and the fields and aliases of its ZeRO and offload models."""
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.config import _REMOVED_TOP_LEVEL_CONFIG_KEYS, _REMOVED_ZERO_CONFIG_KEYS, DeepSpeedConfig
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from deepspeed.runtime.zero.offload_config import (
        DeepSpeedZeroOffloadOptimizerConfig,
        DeepSpeedZeroOffloadParamConfig,
    )

    from colocate_rl.plan import deepspeed as ds

    asked = set()

    class Keys:
        def __init__(self, keys):
            self.keys = keys

        def __contains__(self, key):
            asked.add(key)
            return key in self.keys

        def __iter__(self):
            return iter(self.keys)

    class Recording(dict):
        def __getitem__(self, key):
            asked.add(key)
            return super().__getitem__(key)

        def get(self, key, default=None):
            asked.add(key)
            return super().get(key, default)

        def __contains__(self, key):
            asked.add(key)
            return super().__contains__(key)

        def keys(self):
            return Keys(list(dict.keys(self)))

    config = object.__new__(DeepSpeedConfig)
    params = Recording({"train_batch_size": 1, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1})
    config._param_dict, config.global_rank, config.world_size, config.mesh_device = params, 0, 1, None
    config.elasticity_enabled = False
    config._initialize_params(params)
    assert {k for k in asked if isinstance(k, str)} | {"vocabulary_size"} == ds.DEEPSPEED_KEYS
    assert set(_REMOVED_TOP_LEVEL_CONFIG_KEYS) == ds.DEEPSPEED_REMOVED_KEYS
    assert set(_REMOVED_ZERO_CONFIG_KEYS) == ds.ZERO_REMOVED_KEYS

    def names(model) -> set[str]:
        assert model.model_config.get("extra") == "forbid"  # DeepSpeed refuses unknown keys here
        return {n for name, f in model.model_fields.items() for n in (name, f.alias) if n}

    assert names(DeepSpeedZeroConfig) == ds.ZERO_KEYS
    assert names(DeepSpeedZeroOffloadOptimizerConfig) == ds.OFFLOAD_KEYS["offload_optimizer"]
    assert names(DeepSpeedZeroOffloadParamConfig) == ds.OFFLOAD_KEYS["offload_param"]


# ---------------------------------------------------------------------------------------------- issue 31: reward code


@pytest.mark.parametrize(
    "code, what",
    [
        ("import time\ntime.sleep(60)\n" + reward_file("    return [1.0 for _ in completions]"), "importing reward"),
        ("import time\n" + reward_file("    time.sleep(60)\n    return [1.0 for _ in completions]"), "called on a"),
        (  # a reward that swallows what it can: the limit is a BaseException
            "import time\n"
            + reward_file("    try:\n        time.sleep(60)\n    except Exception:\n        pass\n    return [1.0]"),
            "called on a",
        ),
    ],
    ids=["sleeps-at-import", "sleeps-at-call", "swallows-exceptions"],
)
def test_reward_code_that_does_not_return_is_stopped(code, what, tmp_path, monkeypatch):
    """The pre-flight runs reward code under a time limit (SIGALRM in the main thread), here 0.5 s instead of 60."""
    import signal
    import time

    from colocate_rl import rewards

    monkeypatch.setattr(rewards, "REWARD_TIME_LIMIT_S", 0.5)
    (tmp_path / "r.py").write_text(code)
    write_recipe(tmp_path / "recipe.yaml", with_(rewards=[{"name": "r.py:score"}]))
    handler, (delay, _) = signal.getsignal(signal.SIGALRM), signal.getitimer(signal.ITIMER_REAL)
    start = time.monotonic()
    result = cli_here("validate", "recipe.yaml", "--gpus", "0", cwd=tmp_path)
    assert_user_error(result, "rewards[0].name: ", what, "did not end within 0.5 s", one_line=True)
    assert time.monotonic() - start < 15
    # an earlier SIGALRM timer (pytest-timeout's) and handler are back, less the time taken
    assert signal.getsignal(signal.SIGALRM) == handler
    assert bool(signal.getitimer(signal.ITIMER_REAL)[0]) == bool(delay)


# ---------------------------------------------------------------------------------------------- issue 31: this machine


def cached_hub_model(home: Path, repo: str, files: tuple[str, ...]) -> None:
    """A hub model in a Hugging Face cache under `home` (HF_HOME), as `hf download` leaves it."""
    repo_dir = home / "hub" / f"models--{repo.replace('/', '--')}"
    snapshot = repo_dir / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text("0123abcd")
    for name in files:
        (snapshot / name).write_text('{"model_type": "llama"}' if name == "config.json" else "{}")


LOCAL_MODEL = {
    "config.json": '{"model_type": "llama"}',
    "tokenizer.json": "{}",
    "chat_template.jinja": "{{ messages }}",
    "model.safetensors": "x",
}
LAUNCH_CASES = {  # id: (recipe changes, files, the line)
    "hub-model-offline": (
        {"model": {"name": "org/NoSuchModel"}},
        {},
        "model.name: 'org/NoSuchModel' cannot be fetched (HF_HUB_OFFLINE is set) and is not in the local Hugging "
        "Face cache; download it once where the hub is reachable (`hf download org/NoSuchModel`)",
    ),
    "hub-model-cached-without-weights": (
        {"model": {"name": "org/Cached"}},
        {"cache": ("org/Cached", ("config.json", "tokenizer.json"))},
        "model.name: 'org/Cached' (cached at ",
    ),
    "hub-dataset-offline": (
        {"data": {"source": "someone/SomeData"}},
        {},
        "data.source: hub dataset 'someone/SomeData' cannot be fetched (HF_HUB_OFFLINE is set) and is not in the "
        "local datasets cache",
    ),
    "model-without-tokenizer": (
        {"model": {"name": "./m"}},
        {k: v for k, v in LOCAL_MODEL.items() if k != "tokenizer.json"},
        "/m' has no tokenizer (tokenizer.json, tokenizer_config.json, tokenizer.model, vocab.json)",
    ),
    "model-without-weights": (
        {"model": {"name": "./m"}},
        {k: v for k, v in LOCAL_MODEL.items() if k != "model.safetensors"},
        "/m' holds no weights (no *.safetensors or pytorch_model*.bin)",
    ),
    "model-without-chat-template": (  # a tokenizer copied without its chat_template.jinja (transformers 5 saves one)
        {"model": {"name": "./m"}},
        {k: v for k, v in LOCAL_MODEL.items() if k != "chat_template.jinja"},
        "/m' has no chat template and data.chat is true; TRL formats every prompt with the model's chat template: "
        "set model.chat_template",
    ),
}


def launch_case(case_id: str, tmp_path: Path) -> dict[str, str]:
    """Write the case's recipe and files; returns the environment (offline, a cache of its own)."""
    changes, files, _ = LAUNCH_CASES[case_id]
    for name, content in files.items():
        if name == "cache":
            cached_hub_model(tmp_path / "hf", *content)
        else:
            (tmp_path / "m").mkdir(exist_ok=True)
            (tmp_path / "m" / name).write_text(content)
    write_recipe(tmp_path / "recipe.yaml", with_(**changes))
    return {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"), "HF_HUB_CACHE": "", "HF_DATASETS_CACHE": ""}


@pytest.mark.parametrize("case_id", sorted(LAUNCH_CASES))
def test_what_the_ranks_would_miss_here_stops_validate_and_train(case_id, tmp_path):
    """Validated for this machine (no --gpus), a model or dataset the ranks could not load here is one line; planned
    for another machine (--gpus N), which reads them itself, it is not."""
    env = launch_case(case_id, tmp_path)
    before = files_in(tmp_path)
    for args in (("validate", "recipe.yaml"), ("train", "recipe.yaml", "--dry-run", "--run-dir", "RUN")):
        result = cli_here(*args, cwd=tmp_path, env=env)
        assert_user_error(result, LAUNCH_CASES[case_id][2], one_line=True)
    assert files_in(tmp_path) == before
    planned = cli_here("validate", "recipe.yaml", "--gpus", "0", cwd=tmp_path, env=env)
    assert planned.returncode == 0, planned.stderr


def test_a_hub_model_and_dataset_in_the_cache_pass_offline(tmp_path):
    env = launch_case("hub-model-offline", tmp_path)
    cached_hub_model(tmp_path / "hf", "org/NoSuchModel", ("config.json", "tokenizer.json", "model.safetensors"))
    (tmp_path / "hf" / "datasets" / "someone___some_data" / "default" / "0.0.0" / "abc").mkdir(parents=True)
    write_recipe(
        tmp_path / "recipe.yaml",
        with_(
            model={"name": "org/NoSuchModel"}, data={"source": "someone/SomeData"}, rewards=[{"name": "digit_share"}]
        ),
    )
    result = cli_here("validate", "recipe.yaml", cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stderr


def test_a_cache_that_cannot_be_written_stops_train_before_anything(tmp_path, monkeypatch):
    """What a user (not root) sees of a read-only cache, and a file in its way, in the dry run of this machine."""
    from colocate_rl.plan.launch_checks import check_launch_paths

    write_recipe(tmp_path / "recipe.yaml", BASE)
    (tmp_path / "afile").write_text("x")
    result = cli_here(
        "train", "recipe.yaml", "--dry-run", "--run-dir", "RUN", cwd=tmp_path, env={"XDG_CACHE_HOME": "afile"}
    )
    assert_user_error(result, "XDG_CACHE_HOME: the cache 'afile/colocate-rl' cannot be used", one_line=True)
    cache = tmp_path / "ro" / "colocate-rl"
    cache.mkdir(parents=True)
    monkeypatch.setattr(os, "access", lambda path, mode: Path(path) != cache)
    with pytest.raises(UserError, match=f"'{cache}' is not writable\\); built-in models and compiled"):
        check_launch_paths(tmp_path / "run", cache, this_machine=True)
    check_launch_paths(tmp_path / "run", cache, this_machine=False)  # planning for another machine


def test_recipes_out_into_a_missing_directory(tmp_path):
    result = cli_here("recipes", "quickstart", "--out", "missing/dir/file.yaml", cwd=tmp_path)
    assert_user_error(
        result, "--out missing/dir/file.yaml: the directory 'missing/dir' does not exist; create it", one_line=True
    )
    assert files_in(tmp_path) == []
    (tmp_path / "mine").mkdir()
    result = cli_here("recipes", "quickstart", "--out", "mine", cwd=tmp_path)
    assert result.returncode == 0 and (tmp_path / "mine" / "quickstart.yaml").is_file(), result.stderr


# ---------------------------------------------------------------------------------------------- issue 31: resume


def zip_file(path: Path, size: int = 4096) -> None:
    """A file in torch.save's format as far as the check reads it: a zip archive."""
    import zipfile

    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("archive/data/0", os.urandom(size))


def safetensors_file(path: Path) -> None:
    import numpy as np
    from safetensors.numpy import save_file

    save_file({"w": np.zeros((32, 32), dtype=np.float32)}, str(path))


def stopped_run(tmp_path: Path, *sets: str, steps: tuple[int, ...] = (2, 4)) -> Path:
    """A run directory as `train` writes it (BASE on this CPU machine) with whole checkpoints at `steps`, stopped."""
    from conftest import resolved

    from colocate_rl.pipeline import plan_run
    from colocate_rl.rundir import CHECKPOINT_COMPLETE, write_run_dir

    run_dir = tmp_path / "run"
    plan = plan_run(resolved(BASE, CPU, *sets), run_dir, env={}, now=None, cwd=tmp_path)
    write_run_dir(run_dir, plan.files)
    for step in steps:
        checkpoint = run_dir / "checkpoints" / f"checkpoint-{step}"
        checkpoint.mkdir(parents=True)
        safetensors_file(checkpoint / "model.safetensors")
        zip_file(checkpoint / "optimizer.pt")
        (checkpoint / "trainer_state.json").write_text(json.dumps({"global_step": step}))
        (checkpoint / CHECKPOINT_COMPLETE).write_text("{}")
    return run_dir


def cut(path: Path) -> None:
    os.truncate(path, path.stat().st_size // 2)


def test_resume_passes_over_a_checkpoint_cut_off(tmp_path, capsys):
    from colocate_rl.resume import plan_resume

    run_dir = stopped_run(tmp_path)
    cut(run_dir / "checkpoints" / "checkpoint-4" / "optimizer.pt")
    _, plan = plan_resume(run_dir, {"trainer.max_steps": 6}, host=CPU, env={}, cwd=tmp_path)
    assert plan.resume_from == str(run_dir / "checkpoints" / "checkpoint-2")
    assert json.loads(plan.files["launch.json"])["resume_from"] == plan.resume_from  # what every rank takes
    note = capsys.readouterr().err
    assert note.startswith(f"note: {run_dir}/checkpoints/checkpoint-4/optimizer.pt: cut off (")
    assert note.rstrip().endswith("resuming from checkpoint-2, the newest whole checkpoint")

    cut(run_dir / "checkpoints" / "checkpoint-2" / "model.safetensors")
    result = cli_here("train", "--resume", run_dir, "--set", "trainer.max_steps=6", "--dry-run", cwd=tmp_path)
    assert_user_error(
        result,
        "--resume ",
        "no checkpoint is whole (",
        "checkpoint-4/optimizer.pt: cut off",
        "checkpoint-2/model.safetensors: cut off",
        "restore the file from a copy, or start the run again",
        one_line=True,
    )


def test_checkpoint_files_are_checked_from_their_own_headers(tmp_path):
    import torch

    from colocate_rl.plan.launch_checks import checkpoint_file_problem

    torch.save({"state": torch.zeros(256)}, tmp_path / "optimizer.pt")
    torch.save({"state": torch.zeros(256)}, tmp_path / "old.bin", _use_new_zipfile_serialization=False)
    safetensors_file(tmp_path / "model.safetensors")
    (tmp_path / "trainer_state.json").write_text('{"global_step": 2}')
    assert [checkpoint_file_problem(tmp_path / n) for n in sorted(os.listdir(tmp_path))] == [None] * 4
    for name in ("optimizer.pt", "model.safetensors", "trainer_state.json"):
        cut(tmp_path / name)
        assert checkpoint_file_problem(tmp_path / name).startswith(("cut off", "unreadable")), name
    assert checkpoint_file_problem(tmp_path / "old.bin") is None  # an older pickle: not checked
    os.truncate(tmp_path / "model.safetensors", 4)
    assert checkpoint_file_problem(tmp_path / "model.safetensors").startswith("cut off (4 bytes")


def test_resume_with_a_broken_deepspeed_json_is_one_line(tmp_path):
    run_dir = stopped_run(tmp_path, "distributed.deepspeed=zero3")
    resume = ("train", "--resume", run_dir, "--set", "trainer.max_steps=6", "--dry-run")
    assert cli_here(*resume, cwd=tmp_path).returncode == 0
    (run_dir / "deepspeed.json").write_text('{"zero_optimization": {"stage": 3,')
    assert_user_error(
        cli_here(*resume, cwd=tmp_path),
        f"{run_dir}/deepspeed.json: not valid JSON (",
        "restore the file the run started with",
        one_line=True,
    )
    (run_dir / "deepspeed.json").write_text('{"zero_optimization": {"stage": "three"}}')
    assert_user_error(cli_here(*resume, cwd=tmp_path), "deepspeed.json: zero_optimization.stage: DeepSpeed takes")
    (run_dir / "deepspeed.json").unlink()  # launch.json names it: the run trained with DeepSpeed
    assert_user_error(cli_here(*resume, cwd=tmp_path), "deepspeed.json: DeepSpeed config not found", one_line=True)


def test_resume_refuses_a_recipe_edited_by_hand(tmp_path):
    """The run directory's recipe.yaml edited between the stop and the resume (the learning rate): launch.json's
    recipe hash was made for the recipe as written."""
    run_dir = stopped_run(tmp_path)
    resume = ("train", "--resume", run_dir, "--set", "trainer.max_steps=6", "--dry-run")
    assert cli_here(*resume, cwd=tmp_path).returncode == 0  # as written, with a change a resume may make
    text = (run_dir / "recipe.yaml").read_text()
    edited = re.sub(r"learning_rate: .*", "learning_rate: 0.5", text)
    assert edited != text
    (run_dir / "recipe.yaml").write_text(edited)
    assert_user_error(
        cli_here(*resume, cwd=tmp_path),
        f"{run_dir}/recipe.yaml: edited since the run wrote it (its recipe hash is ",
        "undo the edit",
        "or start a new run from the edited recipe",
        one_line=True,
    )


@pytest.mark.slow
def test_a_cut_off_newest_checkpoint_resumes_from_the_one_before(tmp_path):
    """End to end: the ranks continue from the checkpoint the launcher checked (launch.json's resume_from), not from
    the newest complete one, whose optimizer file is cut in half."""
    from colocate_rl.rundir import RunDir, step_records
    from colocate_rl.telemetry import events

    write_recipe(tmp_path / "recipe.yaml", with_(trainer={"+": {"max_steps": 4}}, checkpoint={"every_steps": 1}))
    run_dir = tmp_path / "run"
    first = cli("train", "recipe.yaml", "--run-dir", run_dir, cwd=tmp_path, timeout=240)
    assert first.returncode == 0, first.stdout + first.stderr
    paths = RunDir(run_dir)
    assert [p.name for p in paths.complete_checkpoints()] == ["checkpoint-2", "checkpoint-3"]
    paths.done.unlink()  # as if it had stopped after step 4
    cut(paths.checkpoints / "checkpoint-3" / "optimizer.pt")
    resumed = cli("train", "--resume", run_dir, "--set", "trainer.max_steps=6", cwd=tmp_path, timeout=240)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "checkpoint-3/optimizer.pt: cut off" in resumed.stderr and "resuming from checkpoint-2" in resumed.stderr
    assert f"resuming from {paths.checkpoints / 'checkpoint-2'}" in resumed.stdout
    [event] = events.read_events(run_dir, events.RESUMED)
    assert event["step"] == 2
    assert [r["step"] for r in step_records(run_dir)] == list(range(1, 7))


# ---------------------------------------------------------------------------------------------- issue 31: the pins


def test_trl_ranges_name_trl_fields():
    from colocate_rl.plan.trl_args import JSON_TEXT_FIELDS, TRL_RANGES, trl_value_kinds

    kinds = trl_value_kinds("grpo")
    assert set(TRL_RANGES) - {"max_tokens"} <= set(kinds)  # max_tokens: vLLM's, inside generation_kwargs
    assert all(set(kinds[k]["kinds"]) & {"int", "float"} for k in TRL_RANGES if k in kinds)
    assert all(set(kinds[k]["kinds"]) >= {"dict", "str"} for k in JSON_TEXT_FIELDS)


def test_deepspeed_value_forms_match_installed_deepspeed():
    """DEEPSPEED_VALUES of `zero_optimization` and its offload blocks are the fields of DeepSpeed's pydantic models:
    bool / int with its bound / a fraction / the stage / the device, optional or not (each takes "auto")."""
    pytest.importorskip("deepspeed")
    from annotated_types import Ge, Gt, Le
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from deepspeed.runtime.zero.offload_config import (
        DeepSpeedZeroOffloadOptimizerConfig,
        DeepSpeedZeroOffloadParamConfig,
    )

    from colocate_rl.plan import deepspeed as ds

    def forms(info) -> set[str] | None:
        args = typing.get_args(info.annotation) or (info.annotation,)
        kind = next(a for a in args if a is not type(None))
        bounds = {type(m): m for m in info.metadata}
        form = {bool: "bool", str: "text", Path: "text"}.get(kind)
        if kind is int:
            form = "int>=0" if Ge in bounds else "int>0" if Gt in bounds else "int"
        elif kind is float and Ge in bounds and Le in bounds:
            form = "0..1"
        elif isinstance(kind, type) and issubclass(kind, enum.Enum):
            form = "stage" if "Stage" in kind.__name__ else "device"
        if form is None:
            return None  # a section (offload blocks, zenflow, leaf_module)
        return {form, "auto"} | ({"null"} if type(None) in args else set())

    for model, prefix in (
        (DeepSpeedZeroConfig, "zero_optimization."),
        (DeepSpeedZeroOffloadOptimizerConfig, "zero_optimization.offload_optimizer."),
        (DeepSpeedZeroOffloadParamConfig, "zero_optimization.offload_param."),
    ):
        for name, info in model.model_fields.items():
            expected = forms(info)
            for key in {name, info.alias} - {None}:
                got = ds.DEEPSPEED_VALUES.get(prefix + key)
                assert (set(got.split("|")) if got else None) == expected, prefix + key


def test_model_types_read_from_transformers_source_are_its_own():
    """The model types `model_config` reads from transformers' source (no import: it pulls in torch) are among those
    AutoConfig knows, and nearly all of them; a type missing from the file list is confirmed through the import."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    from colocate_rl.model_config import _listed_model_types, model_type_known

    listed = _listed_model_types()
    assert listed <= set(CONFIG_MAPPING_NAMES) and len(listed) > 0.95 * len(CONFIG_MAPPING_NAMES)
    assert model_type_known("gpt-sw3") and not model_type_known("qwen9")  # gpt-sw3: added at import only
