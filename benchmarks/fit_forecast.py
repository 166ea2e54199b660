"""Fit the step-time forecast (`colocate_rl.memory.forecast`) to the measured rows, and measure its error.

    python benchmarks/fit_forecast.py            # the rows, the fit, the errors; FITTED etc. as Python to paste

No GPU needed: it reads docs/benchmarks/results/*.jsonl. Each row is resolved as the run was planned (the recipe
as it was shipped then, the `--set` options of the row's own command, on H200s), so that the forecast's features
come from `forecast.shape_of`, as they do for a user's recipe. Each phase's constants are fitted by least squares on
the relative error (every row counts alike, whatever its size) over the rows that measured that phase; the rest
is the row's s/step less the four timed phases. The error of s/step is taken with each row left out of every
phase's fit in turn (leave one out), and with each results file left out (leave one file out).

The rows (colocate-rl's engine, alone on one H200 or two, CUDA graphs), by file:
- engine-results: the three rows of colocate-rl's engine (0.5B sleep 2 and 0; 1.5B ZeRO-3 on 2 GPUs).
- layouts-results: the colocated rows (1.5B, 2 GPUs, 32 and 256 completions; auto/ZeRO-2, ZeRO-3, DDP).
- generation-results: the `colocated` part of the unprofiled invocations (a16, a128, c256, with and without
  micro-batch auto; not the engine process's, which the forecast does not model); the first a16 row measured its
  generate phase only.
- seam-ab-results: the four 256-completion SmolLM2 rows (no optimizer figure: generation, weight push, s/step).
- real-model-results: `mode: timing`, full fine-tuning (s/step and weight push only).
- overlap-results: the `off` runs (colocate-rl without overlap, alone on one H200, SmolLM2-135M at 256 completions;
  not B-mps, which ran under MPS); F ran after e3de169 (GRPO without TRL's old-logprob forward), the others before.
- mem-probe (raw-*/mp17-probe.json, raw-*/mp05-probe.json): the timed trials of the measuring probe that completed
  (the 1.7B shape and the 0.5B layout at 256 completions; sleep level × micro-batch, CUDA graphs).
- train runs (raw-2026-12-04b/ab17-*): the 1.7B shape's A-B-A-B, sleep 0 × 32 against sleep 2 × 64; (raw-2026-12-04c/)
  the 1.5B layout at 256 completions (sleep 0 × 64, 2 × 64, 0 × 32) and the 0.5B layout at full auto (0 × 128).
Every row before e3de169 ran TRL's old-logprob forward (`Shape.old_forward`); F, the probe's and the train runs not. A
row whose plan `auto` would now settle by the forecast itself (sleep level 2 for a larger micro-batch) is refused: the
fit must not move the rows it fits. Left out, and why: TRL's engine (engine `*-trl-*`, generation `+trl` and
`trl_engine`, same-learning `engine: trl`) and TRL's server mode (layouts `server*`): another engine, which gets no
forecast; the profiled invocations (generation `profiled`: the torch profiler ran, and the machine drifted, README
"Speed"); runs sharing a GPU (real-model `matrix`, same-learning, tools) and eager vLLM (tools, mem-probe-results: no
step times either); the LoRA timing row (LoRA is not modelled; its error is printed apart). The overlapped runs of
overlap-results fit the overlap factors apart (`OVERLAP_INVOCATIONS`; `forecast.OVERLAP_FITTED`), over the in-turn
constants.
"""

from __future__ import annotations

import json
import shlex
import statistics
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from colocate_rl.memory import forecast as fc  # noqa: E402
from colocate_rl.memory.probe import trial_timing  # noqa: E402
from colocate_rl.pipeline import resolve  # noqa: E402
from colocate_rl.plan.host import Gpu, Host  # noqa: E402
from colocate_rl.recipe.load import apply_overrides, parse_recipe, parse_sets  # noqa: E402
from colocate_rl.rundir import read_metrics  # noqa: E402

RESULTS = ROOT / "docs" / "benchmarks" / "results"
H200_GIB = 143_771 / 1024
# The shipped recipes the rows ran, as they were then (unchanged since but for comments): kept here so that editing a
# shipped recipe does not move the fit.
DIGITS = {"algorithm": "grpo", "data": {"source": "builtin:digits"}, "rewards": [{"name": "digit_share"}]}
GEN = {"backend": "auto", "vllm_gpu_memory_utilization": 0.25, "sleep_level": 2, "max_model_length": 512}
TRAINER = {"learning_rate": 1e-6, "num_generations": 8, "max_completion_length": 256, "max_steps": 20, "seed": 0}
RECIPES = {
    "gpu-0.5b-layout": {
        "name": "gpu-0.5b-layout",
        **DIGITS,
        "model": {"name": "builtin:qwen2.5-0.5b"},
        "trainer": {**TRAINER, "per_device_train_batch_size": 16, "gradient_checkpointing": "auto"},
        "generation": GEN,
        "distributed": {"nproc_per_node": "auto", "zero_stage": "auto"},
    },
    "gpu-1.5b-layout-zero3": {
        "name": "gpu-1.5b-layout-zero3",
        **DIGITS,
        "model": {"name": "builtin:qwen2.5-1.5b"},
        "trainer": {**TRAINER, "per_device_train_batch_size": 8},
        "generation": GEN,
        "distributed": {"nproc_per_node": "auto", "deepspeed": "zero3"},
    },
    "smollm2-135m-gsm8k": {  # the model by its hub id (the runs named a local copy), the data as shipped
        "name": "smollm2-135m-gsm8k",
        "algorithm": "grpo",
        "model": {"name": "HuggingFaceTB/SmolLM2-135M-Instruct"},
        "data": {"source": "openai/gsm8k", "subset": "main", "split": "train", "prompt_field": "question"},
        "rewards": [{"name": "math_verify"}, {"name": "hash_answer_format", "weight": 0.5}],
        "trainer": {
            "learning_rate": 1e-5,
            "per_device_train_batch_size": 32,
            "num_generations": 8,
            "max_completion_length": 256,
            "max_steps": 100,
            "beta": 0.0,
            "seed": 0,
        },
        "eval": {"every_steps": 20, "num_samples": 200, "temperature": 0.0},
        "generation": {"vllm_gpu_memory_utilization": 0.3, "sleep_level": "auto", "max_model_length": 768},
        "distributed": {"nproc_per_node": "auto", "zero_stage": "auto"},
    },
}
AS_WRITTEN = "trainer.micro_batch_size=null"  # rows measured before `micro_batch_size: auto` existed
# overlap-results' `off` runs (colocate-rl without overlap, alone on the GPU): what their plans chose, from the
# benchmarks README (share and micro-batch; the prompts' measured length is not known here); B-mps ran under MPS
PLANNED = ("generation.sleep_level=0", "distributed.deepspeed=zero3", "distributed.zero_stage=2")  # as they ran
SHARE_03 = (*PLANNED, "generation.vllm_gpu_memory_utilization=0.3", "trainer.micro_batch_size=128")
SHARE_AUTO = (*PLANNED, "generation.vllm_gpu_memory_utilization=0.09", "trainer.micro_batch_size=256")
OVERLAP_OFF = {"A2": SHARE_03, "C": SHARE_03, "D": SHARE_AUTO, "D2": SHARE_AUTO, "F": SHARE_AUTO}
# generation-results' rows with micro_batch_size auto: the micro-batch auto chose then (the benchmarks README), pinned
# because the memory estimate has changed since
MB_AUTO_RAN = {"c256+mbauto": 128, "a128+mbauto": 64}
MACHINE_PATHS = ("model.name", "data.source")  # the run's local copies: the recipe's hub names instead
# Every row ran before `overlap: auto` became the default (25636d8); a row's own command may set it. A row measured
# since runs overlapped unless its command says otherwise: add it to the overlapped rows (`overlap_rows`), not here.
EARLIER_DEFAULTS = "generation.overlap=off"
# Raw `mem-probe --json` output (docs/benchmarks/results/raw-*/): its timed trials that completed, each a row. The
# probe ran the recipe with these `--set` options (the model a random-init copy of the hub model's shape, built by
# bench_overlap.py; the data the local GSM8K-style file), then its own pinned sets, the trial's share and config.
SMOL17 = ("HuggingFaceTB/SmolLM2-1.7B-Instruct", ["eval.every_steps=null", "trainer.gradient_accumulation_steps=8"])
PROBES = {
    "raw-2026-12-04/mp17-probe.json": ("smollm2-135m-gsm8k", *SMOL17),
    "raw-2026-12-04b/mp05-probe.json": ("gpu-0.5b-layout", None, ["trainer.gradient_accumulation_steps=16"]),
}
# Run directories of `colocate-rl train` (raw-*/: metrics.jsonl, forecast.json), timed as the probe times a trial
# (medians over the steps after the first): the 1.7B shape's A-B-A-B at share 0.24, ZeRO-2
AB17 = ["generation.vllm_gpu_memory_utilization=0.24", "distributed.deepspeed=zero3", "distributed.zero_stage=2"]
# and the 1.5B layout at share 0.1 (ZeRO-2, as auto chose it) and the 0.5B layout at full auto (share 0.08), pinned
# as their plans chose
ZERO2 = ["distributed.deepspeed=zero3", "distributed.zero_stage=2", "trainer.gradient_checkpointing=false"]
B15 = ["trainer.per_device_train_batch_size=16", "trainer.gradient_accumulation_steps=16", *ZERO2,
       "generation.vllm_gpu_memory_utilization=0.1"]  # fmt: skip
RUNS = {
    **{
        f"raw-2026-12-04b/ab17-{arm}{k}": ("smollm2-135m-gsm8k", SMOL17[0], [*SMOL17[1], *AB17, *sets])
        for k in (1, 2)
        for arm, sets in (
            ("a", ["generation.sleep_level=0", "trainer.micro_batch_size=32"]),
            ("b", ["generation.sleep_level=2", "trainer.micro_batch_size=64"]),
        )
    },
    **{
        f"raw-2026-12-04c/b15-{arm}": (
            "gpu-1.5b-layout-zero3",
            None,
            [*B15, f"generation.sleep_level={s}", f"trainer.micro_batch_size={m}"],
        )
        for arm, s, m in (("auto", 0, 64), ("s2m64", 2, 64), ("s0m32", 0, 32))
    },
    "raw-2026-12-04c/o05-auto": (
        "gpu-0.5b-layout",
        None,
        [
            "trainer.gradient_accumulation_steps=16",
            *ZERO2,
            "generation.vllm_gpu_memory_utilization=0.08",
            "generation.sleep_level=0",
            "trainer.micro_batch_size=128",
        ],
    ),
}


@dataclass
class Row:
    source: str  # results file
    key: str  # which row of it
    resolved: object
    shape: fc.Shape  # forecast.shape_of(resolved)
    measured: dict[str, float]  # phase (forecast.PHASES) and "s/step" → seconds, those the row has
    lora: bool = False
    mean_tokens: float | None = None  # the completions' measured mean length, where the row has it


def h200(gpus: int) -> Host:
    return Host(gpus=(Gpu("NVIDIA H200", H200_GIB),) * gpus, has_vllm=True, cpu_count=16 * gpus, mps_control=True)


def resolved_row(recipe: str, sets: list[str], gpus: int, model: str | None = None):
    """The row's plan on `gpus` H200s; `model`: the hub model whose shape the run's local model had."""
    sets = [EARLIER_DEFAULTS, *(s for s in sets if s.split("=")[0] not in MACHINE_PATHS)]
    sets += [f"distributed.nproc_per_node={gpus}"]
    sets += [f"model.name={model}"] * (model is not None)
    return resolve(parse_recipe(apply_overrides(RECIPES[recipe], parse_sets(sets))), h200(gpus))


def command_sets(command: str) -> tuple[str, list[str]]:
    """The recipe name and the `--set` options of a `colocate-rl train` command line."""
    words = shlex.split(command)
    recipe = next(Path(w).stem for w in words if w.endswith(".yaml"))
    return recipe, [b for a, b in zip(words, words[1:]) if a == "--set"]


def phases(times: dict[str, float | None], total: float | None, sleep_level: int) -> dict[str, float]:
    """A row's phases from its timed phases (name → s; None or absent: not measured). A phase counts when its
    metrics were measured: the weight check, which older rows do not list, counts as 0 (it is then in the rest),
    wake and sleep are 0 at sleep level 0; the rest counts when the four other phases do."""
    optional = {"weight_check"} | ({"wake", "sleep"} if sleep_level == 0 else set())
    out: dict[str, float] = {}
    for phase, metrics in fc.PHASE_METRICS.items():
        if metrics and all(times.get(m) is not None for m in metrics if m not in optional):
            out[phase] = sum(times.get(m) or 0.0 for m in metrics)
    if total is not None:
        out["s/step"] = total
        if all(p in out for p in fc.PHASES if p != "rest"):
            out["rest"] = total - sum(out[p] for p in fc.PHASES if p != "rest")
    return out


def _jsonl(name: str) -> list[dict]:
    return [json.loads(line) for line in (RESULTS / name).read_text().splitlines() if line.strip()]


def probe_trials(probe: dict) -> list[tuple[str, list[str], dict[str, float], float]]:
    """(key, --set options, phase → s, s/step) of each trial of a `mem-probe --json` output that completed its steps
    with a timing: the bisection's trials with the pinned sets, the sweep's with its configuration instead."""
    pinned = probe["pinned_sets"]
    swept = ("generation.sleep_level", "trainer.micro_batch_size")
    out = [
        (
            f"share {t['util']:g}",
            [*pinned, f"generation.vllm_gpu_memory_utilization={t['util']}"],
            t["phase_s"],
            t["s_per_step"],
        )
        for t in probe["trials"]
        if t["outcome"] == "ok" and t.get("s_per_step")
    ]
    sweep = probe.get("sweep") or {"configs": []}
    for c in sweep["configs"]:
        if c["outcome"] == "ok" and c["s_per_step"]:
            sets = [s for s in pinned if s.split("=")[0] not in swept]
            sets += [
                f"generation.vllm_gpu_memory_utilization={sweep['share']}",
                f"generation.sleep_level={c['sleep_level']}",
                f"trainer.micro_batch_size={c['micro_batch']}",
            ]
            out.append(
                (
                    f"share {sweep['share']:g} sleep {c['sleep_level']} x {c['micro_batch']}",
                    sets,
                    c["phase_s"],
                    c["s_per_step"],
                )
            )
    return out


def load_rows() -> list[Row]:
    """The rows of the fit (see the module docstring), the LoRA timing row last."""
    rows = []

    def add(source, key, recipe, sets, gpus, times, total, lora=False, mean_tokens=None, old_forward=True, model=None):
        r = resolved_row(recipe, sets, gpus, model)
        if r.sleep_choice is not None and r.sleep_choice.awake_micro_batch is not None:
            raise SystemExit(f"{source} {key}: its plan would now be the forecast's choice; pin its sleep level")
        measured = phases(times, total, r.recipe.generation.sleep_level)
        shape = replace(fc.shape_of(r), old_forward=old_forward)  # GRPO's, measured before e3de169 unless said
        rows.append(Row(source, key, r, shape, measured, lora, mean_tokens))

    for x in _jsonl("engine-results.jsonl"):
        if "-trl-" not in x["row"]:
            times = {k[5:-2]: v for k, v in x.items() if k.startswith("time/")}
            recipe, sets = command_sets(x["command"])
            add(
                "engine-results",
                x["row"],
                recipe,
                [*sets, AS_WRITTEN],
                2 if "2gpu" in x["row"] else 1,
                times,
                x["s_per_step"],
            )
    for x in _jsonl("layouts-results.jsonl"):
        if not x["row"].startswith("server"):
            recipe, sets = command_sets(x["command"])
            times = {k[5:-2]: v for k, v in x["times"].items()}
            key = f"{x['row']} ({x.get('session', '2026-11-30 #1')})"
            add("layouts-results", key, recipe, [*sets, AS_WRITTEN], 2, times, x["median_s_per_step"])
    for x in _jsonl("generation-results.jsonl"):
        if "+trl" not in x["workload"] and not x.get("profiled") and "engine_process=true" not in x["commands"][0]:
            c, (recipe, sets) = x["colocated"], command_sets(x["commands"][0])
            first_session = x.get("session") is None and "micro_batch_size" not in x["commands"][0]
            times = {
                "generate": c["s_per_batch"],
                **{k: c.get(f"{k}_s") for k in ("train", "optimizer", "weight_sync", "wake", "sleep")},
            }
            key = f"{x['workload']} ({x.get('session', '2026-12-02')})"
            sets += [AS_WRITTEN] * first_session
            if x["workload"] in MB_AUTO_RAN:
                sets += [f"trainer.micro_batch_size={MB_AUTO_RAN[x['workload']]}"]
            add(
                "generation-results",
                key,
                recipe,
                sets,
                1,
                times,
                c.get("s_per_step"),
                False,
                c["completion_mean_length"],
            )
    for x in _jsonl("seam-ab-results.jsonl"):
        times = {k: x[f"{k}_s"] for k in ("generate", "train", "weight_sync", "prepare")}
        sets = ["eval.every_steps=null", "trainer.gradient_accumulation_steps=8", "trainer.max_steps=12"]
        add(
            "seam-ab-results",
            f"{x['order']}: {x['code']}",
            "smollm2-135m-gsm8k",
            sets,
            1,
            times,
            x["median_s_per_step_from_3"],
        )
    for x in _jsonl("overlap-results.jsonl"):
        if x.get("arm") == "off" and x["invocation"] in OVERLAP_OFF:
            sets = [*OVERLAP_OFF[x["invocation"]], "eval.every_steps=null", "trainer.gradient_accumulation_steps=8"]
            add(
                "overlap-results",
                f"off ({x['invocation']})",
                "smollm2-135m-gsm8k",
                sets,
                1,
                x["phases_s"],
                x["s_per_step"],
                old_forward=x["invocation"] != "F",  # F ran e3de169: GRPO's old log-probabilities from the loss
            )
    for path, (recipe, model, base) in PROBES.items():
        for key, sets, times, total in probe_trials(json.loads((RESULTS / path).read_text())):
            name = f"{Path(path).parent.name} {key}"
            add("mem-probe", name, recipe, base + sets, 1, times, total, old_forward=False, model=model)
    for path, (recipe, model, sets) in RUNS.items():
        records = [r for r in read_metrics(RESULTS / path) if isinstance(r.get("step"), int) and "loss" in r]
        total, times, _ = trial_timing(RESULTS / path, records)
        add("train runs", path.split("/")[-1], recipe, sets, 1, times, total, old_forward=False, model=model)
    lora_rows = []
    for x in _jsonl("real-model-results.jsonl"):
        if x["mode"] == "timing":
            sets = [f"trainer.max_steps={x['steps_asked']}", *["model.lora=true"] * x["lora"]]
            add(
                "real-model-results",
                f"timing {x['row']}",
                "smollm2-135m-gsm8k",
                sets,
                1,
                {"weight_sync": x["weight_sync_s"]},
                x["s_per_step"],
                x["lora"],
            )
            if x["lora"]:
                lora_rows.append(rows.pop())
    return rows + lora_rows


def startup() -> tuple[float, float, float, int]:
    """Start-up of the engine and layouts rows that recorded their wall time: wall − steps × s/step; (median, min,
    max, rows). The real-model rows are left out: their wall time holds three held-out evaluations."""
    values = [
        x["wall_s"] - x["steps"] * x["s_per_step"] for x in _jsonl("engine-results.jsonl") if "-trl-" not in x["row"]
    ]
    values += [
        x["elapsed_s"] - x["steps_logged"] * x["median_s_per_step"]
        for x in _jsonl("layouts-results.jsonl")
        if not x["row"].startswith("server") and "elapsed_s" in x
    ]
    return statistics.median(values), min(values), max(values), len(values)


def fit_phase(phase: str, rows: list[Row]) -> dict[str, float]:
    """Least squares of the relative error over the rows that measured `phase` (and have a term for it), no constant
    below 0. Training's
    micro-batches take the longer of floor and compute (`forecast.FLOOR`, `forecast.COMPUTE`): each row is fitted
    by the part that is longer for it, from the additive fit on, until no row changes sides."""
    terms = fc.TERMS[phase]
    data = [(r, [float(x(r.shape)) for _, x in terms]) for r in rows if phase in r.measured]
    data = [(r, xs) for r, xs in data if any(xs)]
    X = np.array([xs for _, xs in data])
    y = np.array([r.measured[phase] for r, _ in data])

    def solve(design: np.ndarray) -> np.ndarray:
        """Least squares with every constant ≥ 0 (each is a cost): the most negative term is dropped (0) and the
        rest fitted again until none is negative."""
        kept = np.ones(design.shape[1], dtype=bool)
        while True:
            coef = np.zeros(design.shape[1])
            coef[kept] = np.linalg.lstsq(design[:, kept] / y[:, None], np.ones(len(y)), rcond=None)[0]
            if (coef >= 0).all():
                return coef
            kept[np.argmin(coef)] = False

    coef = solve(X)
    if phase == "training":
        names = [name for name, _ in terms]
        floor, compute = (np.isin(names, group) for group in (fc.FLOOR, fc.COMPUTE))
        sides = None
        for _ in range(50):
            floor_bound = (X[:, floor] @ coef[floor]) >= (X[:, compute] @ coef[compute])
            if sides is not None and (floor_bound == sides).all():
                break
            sides = floor_bound
            design = X.copy()
            design[np.ix_(~sides, floor)] = 0
            design[np.ix_(sides, compute)] = 0
            coef = solve(design)
        else:
            raise SystemExit("training: the rows keep changing sides between floor and compute")
    return {name: float(c) for (name, _), c in zip(terms, coef)}


def fit(rows: list[Row]) -> dict[str, float]:
    fitted: dict[str, float] = {}
    for phase in fc.PHASES:
        fitted.update(fit_phase(phase, [r for r in rows if not r.lora]))
    return fitted


def errors(rows: list[Row], fitted_without) -> dict[str, list[tuple[Row, float]]]:
    """Per phase and for s/step: (row, relative error in %) of each non-LoRA row, the constants fitted by
    `fitted_without(row)`."""
    out: dict[str, list[tuple[Row, float]]] = {k: [] for k in ("s/step", *fc.PHASES)}
    for row in (r for r in rows if not r.lora):
        got = fc.phase_seconds(row.shape, fitted_without(row))
        for k, measured in row.measured.items():
            predicted = sum(got.values()) if k == "s/step" else got[k]
            if measured > 0:  # a phase the row did not spend time in (sleep/wake at sleep 0) has no relative error
                out[k].append((row, 100 * (predicted - measured) / measured))
    return out


def summary(errs: dict[str, list[tuple[Row, float]]]) -> dict[str, tuple[float, float, int]]:
    return {
        k: (round(statistics.median(abs(e) for _, e in v), 1), round(max(abs(e) for _, e in v), 1), len(v))
        for k, v in errs.items()
    }


def spans(shapes: list[fc.Shape], attrs: tuple[str, ...]) -> dict[str, tuple]:
    """(lowest, highest) of each attribute over `shapes`, parameters rounded to 3 digits."""

    def span(attr: str) -> tuple:
        values = [getattr(s, attr) for s in shapes]
        low, high = min(values), max(values)
        return (round(low, 3), round(high, 3)) if attr == "params_b" else (low, high)

    return {a: span(a) for a in attrs}


def covered(rows: list[Row]) -> dict[str, tuple]:
    shapes = [r.shape for r in rows if not r.lora]
    ranges = spans(shapes, ("params_b", "tokens", "completions", "micro_batches", "gpus"))
    return {**ranges, "sleep_levels": tuple(sorted({s.sleep_level for s in shapes}))}


def with_mean_length(rows: list[Row]) -> list[Row]:
    """The rows with L = the completions' measured mean length instead of max_completion_length: where a row did not
    record it, the mean of the rows of the same model that did (SmolLM2: 216 of 256; the random-init layouts: 256)."""
    by_model: dict[float, list[float]] = {}
    for r in rows:
        if r.mean_tokens is not None:
            by_model.setdefault(r.shape.params_b, []).append(r.mean_tokens)
    means = {n: statistics.mean(v) for n, v in by_model.items()}
    return [
        replace(r, shape=replace(r.shape, tokens=r.mean_tokens or means.get(r.shape.params_b, r.shape.tokens)))
        for r in rows
    ]


def analysis(mean_length: bool = False) -> dict:
    """The fit and its errors (`mean_length`: with the measured mean completion length as L, to compare)."""
    rows = with_mean_length(load_rows()) if mean_length else load_rows()
    fitted = fit(rows)
    loo = errors(rows, lambda row: fit([r for r in rows if r is not row]))
    lofo = errors(rows, lambda row: fit([r for r in rows if r.source != row.source]))
    in_sample = errors(rows, lambda row: fitted)
    lora = [r for r in rows if r.lora]
    return dict(
        overlap=overlap_analysis(fitted),
        rows=rows,
        fitted=fitted,
        in_sample=in_sample,
        loo=loo,
        lofo=lofo,
        leave_one_out=summary(loo),
        leave_one_file_out=summary(lofo),
        startup=startup(),
        covered=covered(rows),
        lora=[
            (r, 100 * (sum(fc.phase_seconds(r.shape, fitted).values()) - r.measured["s/step"]) / r.measured["s/step"])
            for r in lora
        ],
    )


# overlap-results' overlapped runs of the configurations colocate-rl plans (invocations H on: expandable segments on,
# vLLM's engine core inside the engine process), pinned as they ran: ZeRO-2, sleep 0, c256 in one micro-batch of 256
# (the plan then), d256 (the 1.7B shape) in 32 × 8; c256 with two engine processes in L's `overlap-2e` and M's
# `overlap` (the default by then), the others one; `overlap-mps` under MPS (O: the driver's daemon; P, R, S:
# `generation.mps`), `overlap-2e-mps` two engine processes under it (R). Not: `overlap-plain` (no DeepSpeed),
# `overlap-mp` (vLLM's engine core apart), `overlap-nogroup`, `overlap-4e`, and I (d256 with checkpointing).
OVERLAP_INVOCATIONS = ("H", "J", "L", "M", "N", "O", "P", "R", "S")
OVERLAP_ARMS = ("overlap", "overlap-2e", "overlap-mps", "overlap-2e-mps")
OVERLAP_PINNED = [
    *PLANNED,
    "eval.every_steps=null",
    "trainer.gradient_accumulation_steps=8",
    "generation.overlap=one_step",
]


@dataclass
class OverlapRow:
    key: str
    shape: fc.Shape
    measured: dict[str, float]  # training, rest, s/step as the rank timed them; generation: the engine's batch


def overlap_rows() -> list[OverlapRow]:
    rows = []
    for x in _jsonl("overlap-results.jsonl"):
        if x.get("invocation") not in OVERLAP_INVOCATIONS or x.get("arm") not in OVERLAP_ARMS:
            continue
        c256 = x["workload"] == "c256"
        engines = 2 if x["arm"].startswith("overlap-2e") or (x["invocation"] == "M" and c256) else 1
        sets = [*OVERLAP_PINNED, f"generation.engine_processes={engines}"]
        sets += [f"generation.mps={'on' if x['arm'].endswith('-mps') else 'off'}"]
        sets += [f"trainer.micro_batch_size={256 if c256 else 32}"]
        r = resolved_row("smollm2-135m-gsm8k", sets, 1, None if c256 else SMOL17[0])
        p = x["phases_s"]
        training = p["train"] + p["optimizer"]
        rest = x["s_per_step"] - training - p["generate"] - p["weight_sync"]
        measured = {"training": training, "rest": rest, "generation": x["engine_generate_s"], "s/step": x["s_per_step"]}
        rows.append(
            OverlapRow(f"{x['invocation']} {x['arm']} {x['workload']} ({x['order']})", fc.shape_of(r), measured)
        )
    return rows


def fit_overlap(rows: list[OverlapRow], fitted: dict[str, float]) -> dict[str, dict[str, float]]:
    """Per regime, the factor on each in-turn phase that fits its rows (least squares of the relative error: f =
    Σ(x/y) / Σ(x/y)²)."""
    out: dict[str, dict[str, float]] = {}
    for regime in dict.fromkeys(r.shape.overlap for r in rows):
        mine = [r for r in rows if r.shape.overlap == regime]
        factors = {}
        for phase in ("training", "rest", "generation"):
            q = [fc.phase_seconds(replace(r.shape, overlap=None), fitted)[phase] / r.measured[phase] for r in mine]
            factors[phase] = sum(q) / sum(v * v for v in q)
        out[regime] = factors
    return out


def overlap_errors(rows: list[OverlapRow], fitted: dict[str, float], factors_without) -> list[tuple[OverlapRow, float]]:
    """(row, relative error of s/step in %) with the factors `factors_without(row)`."""
    out = []
    for row in rows:
        got = sum(fc.phase_seconds(row.shape, fitted, factors_without(row)).values())
        out.append((row, 100 * (got - row.measured["s/step"]) / row.measured["s/step"]))
    return out


def overlap_analysis(fitted: dict[str, float]) -> dict:
    rows = overlap_rows()
    factors = fit_overlap(rows, fitted)
    loo = overlap_errors(rows, fitted, lambda row: fit_overlap([r for r in rows if r is not row], fitted))
    return dict(
        rows=rows,
        fitted=factors,
        in_sample=overlap_errors(rows, fitted, lambda row: factors),
        loo=loo,
        leave_one_out=summary({"s/step": loo}),
        covered={
            regime: spans([r.shape for r in rows if r.shape.overlap == regime], ("params_b", "completions", "gpus"))
            for regime in factors
        },
    )


def main() -> None:
    a = analysis()
    mean = analysis(mean_length=True)
    fits, loos, lofos = ({id(r): e for r, e in a[k]["s/step"]} for k in ("in_sample", "loo", "lofo"))
    print(f"{'row':58} {'N':>5} {'C':>4} {'M':>2} {'layout':>6} {'sleep':>5}  s/step  forecast  fit %  LOO %  LOFO %")
    for r in a["rows"]:
        s, m = r.shape, r.measured.get("s/step")
        got = sum(fc.phase_seconds(s, a["fitted"]).values())
        cells = (
            (
                f"{m:7.3f}",
                f"{got:8.3f}",
                *(f"{d[id(r)]:+6.1f}" if id(r) in d else "     –" for d in (fits, loos, lofos)),
            )
            if m
            else ("      –",) * 5
        )
        print(
            f"{r.source + ': ' + r.key:58} {s.params_b:5.2f} {s.completions:4} {s.micro_batches:2} {s.layout:>6} {s.sleep_level:5}  "
            + "  ".join(cells)
            + ("  (LoRA: not in the fit)" if r.lora else "")
        )
    print("\nFITTED = {")
    for name, value in a["fitted"].items():
        print(f'    "{name}": {value:.4g},')
    print("}\nLEAVE_ONE_OUT = {")
    for name, value in a["leave_one_out"].items():
        print(f'    "{name}": {value},')
    print("}")
    print(f"STARTUP_S = {tuple(round(v, 1) for v in a['startup'][:3])}  # {a['startup'][3]} rows")
    print(f"COVERED = {a['covered']}")
    print(f"leave one file out: {a['leave_one_file_out']}")
    print(f"fit, in sample: {summary(a['in_sample'])}")
    for r, e in a["lora"]:
        print(f"LoRA row {r.key}: forecast {e:+.1f} %")
    print(
        f"with the mean completion length as L: leave one out {mean['leave_one_out']['s/step']}, leave one file out {mean['leave_one_file_out']['s/step']}"
    )
    o = a["overlap"]
    loo, fit_in = ({id(r): e for r, e in o[k]} for k in ("loo", "in_sample"))
    print(f"\noverlapped rows{'':44}  s/step  forecast  fit %  LOO %")
    for r in o["rows"]:
        got = sum(fc.phase_seconds(r.shape, a["fitted"], o["fitted"]).values())
        print(f"{r.key:58}  {r.measured['s/step']:6.3f}  {got:8.3f}  {fit_in[id(r)]:+5.1f}  {loo[id(r)]:+5.1f}")
    print("OVERLAP_FITTED = {")
    for regime, factors in o["fitted"].items():
        print(f'    "{regime}": {{' + ", ".join(f'"{k}": {v:.4g}' for k, v in factors.items()) + "},")
    print(f"}}\nOVERLAP_LEAVE_ONE_OUT = {o['leave_one_out']}\nOVERLAP_COVERED = {{")
    for regime, spans in o["covered"].items():
        print(f'    "{regime}": {spans},')
    print("}")


if __name__ == "__main__":
    main()
