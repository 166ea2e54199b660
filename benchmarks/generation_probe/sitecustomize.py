"""Generation probe for benchmarks/bench_generation.py (not part of the package): in colocate-rl's worker processes,
when COLOCATE_BENCH_PROBE=1, record every `llm.generate` of the colocated engine, colocate-rl's or TRL's (prompt
token ids, SamplingParams, seconds in vLLM / the logprob extraction / the garbage collector) to
RUN/bench/generate_calls.rank<N>.jsonl, and torch-profile the calls COLOCATE_BENCH_PROFILE names; see
benchmarks/generation_vllm.py (PATCHES). Python loads it from PYTHONPATH at start-up, as tools/diag_memory does:

    PYTHONPATH=benchmarks/generation_probe COLOCATE_BENCH_PROBE=1 colocate-rl train ...
"""

import os
import sys

_ARGV = " ".join(getattr(sys, "orig_argv", sys.argv))
# a rank, or a process a rank spawned (its engine process; a reward pool's, which imports no engine and is left alone)
if os.environ.get("COLOCATE_BENCH_PROBE") == "1" and (
    "colocate_rl.worker" in _ARGV or "--multiprocessing-fork" in _ARGV
):
    import importlib.abc
    import importlib.machinery

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        import generation_vllm  # standard library only at import
    finally:
        sys.path.pop(0)

    class _Finder(importlib.abc.MetaPathFinder):
        def __init__(self):
            self.pending = set(generation_vllm.PATCHES)

        def find_spec(self, name, path, target=None):
            if name not in self.pending:
                return None
            self.pending.discard(name)
            if not self.pending:
                sys.meta_path.remove(self)
            spec = importlib.machinery.PathFinder.find_spec(name, path)
            run = spec.loader.exec_module

            def exec_module(module):
                run(module)
                generation_vllm.PATCHES[name](module)

            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, _Finder())
