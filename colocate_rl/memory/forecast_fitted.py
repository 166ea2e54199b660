"""The step-time forecast's constants (`colocate_rl.memory.forecast`), as `benchmarks/fit_forecast.py` prints them:
fitted to the measured rows of docs/benchmarks/results/, and the errors measured with each row left out of the fit.
tests/test_forecast.py checks that they are what the script computes."""

# Fitted by benchmarks/fit_forecast.py (seconds; its docstring lists the rows: 49 of docs/benchmarks/results/
# {engine,layouts,generation,seam-ab,real-model,overlap}-results.jsonl, the mem-probe output and train runs of raw-*/)
FITTED = {
    "decode step": 0.002757,
    "decode step, per sequence": 7.684e-06,
    "decode step, per sequence and B params": 0.0,  # held at 0 (fitted below it): see the docstring
    "decode step, per sequence and 100k vocabulary": 1.262e-05,
    "decode step, per sequence and MB of KV read": 6.29e-07,
    "micro-batch, no DeepSpeed": 0.109,
    "micro-batch, ZeRO-0/1/2": 0.2631,
    "micro-batch, ZeRO-3": 0.8149,
    "micro-batch, DeepSpeed, per B params": 0.05193,
    "per B params and token trained": 1.585e-05,  # completion tokens; at 6 FLOPs per parameter: 379 TFLOP/s
    "per token trained": 6.121e-06,
    "DeepSpeed optimizer step": 0.06903,
    "push": 0.02485,
    "push, per B params woken from sleep": 0.04134,
    "push, per B params gathered (ZeRO-3)": 0.03057,
    "wake and sleep": 0.1101,
    "rest": 0.03671,
    "rest, per completion": 0.0001009,
    "rest, per micro-batch with DeepSpeed": 0.004605,
    "rest, per micro-batch under ZeRO-3": 0.3676,
    "rest, TRL's old-logprob forward per completion": 0.001961,
}
# |forecast − measured| / measured in %, each row left out of the fit in turn: (median, largest, rows)
LEAVE_ONE_OUT = {
    "s/step": (7.2, 44.7, 48),
    "generation": (9.1, 64.4, 48),
    "training": (12.1, 69.3, 43),
    "weight push": (18.5, 65.5, 48),
    "sleep/wake": (29.8, 76.2, 20),
    "rest": (42.6, 113.8, 42),
}
# Start-up: a run's time from `colocate-rl train` to its exit less steps × s/step (launch, vLLM start and CUDA graphs,
# the first step's warm-up, the end): median, smallest, largest of the 12 rows that recorded their wall time
STARTUP_S = (92.0, 76.4, 150.8)
# What the fitted rows span: a recipe beyond it is forecast with a note
COVERED = {
    "params_b": (0.135, 1.711),
    "tokens": (256, 256),
    "completions": (8, 256),
    "micro_batches": (1, 8),
    "gpus": (1, 2),
    "sleep_levels": (0, 2),
}
# Overlapped runs (`generation.overlap: one_step`), by how they share the GPU (`forecast.overlap_regime`): the factors
# on the in-turn forecast's training, rest and generation (the engine's batch, generated beside the rank's work) that
# fit the 22 overlapped rows of overlap-results.jsonl the script lists (SmolLM2-135M and the 1.7B shape at 256
# completions on one H200; the same configuration's c256 runs spread 1.57–2.84 s/step)
OVERLAP_FITTED = {
    "one engine process": {"training": 1.628, "rest": 4.702, "generation": 1.236},
    "2 engine processes": {"training": 2.205, "rest": 5.181, "generation": 0.8749},
    "one engine process under MPS": {"training": 1.23, "rest": 4.037, "generation": 1.781},
    "2 engine processes under MPS": {"training": 1.313, "rest": 3.855, "generation": 1.827},
}
# |forecast − measured| / measured in %, each overlapped row left out of its regime's fit in turn
OVERLAP_LEAVE_ONE_OUT = {"s/step": (5.5, 48.9, 22)}
# What each regime's overlapped rows span (beyond it: forecast with a note)
OVERLAP_COVERED = {
    "one engine process": {"params_b": (0.135, 1.711), "completions": (256, 256), "gpus": (1, 1)},
    "2 engine processes": {"params_b": (0.135, 0.135), "completions": (256, 256), "gpus": (1, 1)},
    "one engine process under MPS": {"params_b": (1.711, 1.711), "completions": (256, 256), "gpus": (1, 1)},
    "2 engine processes under MPS": {"params_b": (1.711, 1.711), "completions": (256, 256), "gpus": (1, 1)},
}
