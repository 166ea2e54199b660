"""Memory diagnostic (GPU, not part of the package): in colocate-rl's worker processes, print GPU memory, every live
CUDA tensor's size and ZeRO-3 parameter state just before each of the first 4 weight pushes of colocate-rl's engine
(`VLLMEngine.push_weights`; `[diag] {json}`); with DIAG_RELEASE=1, from the second push on, also call DeepSpeed's
engine.empty_partition_cache() and print again.
Python loads it from PYTHONPATH at start-up (docs/benchmarks/README.md, mem-probe accuracy, session 4):

    PYTHONPATH=tools/diag_memory DIAG_RELEASE=1 colocate-rl train recipes/gpu-1.5b-layout-zero3.yaml -v \
      --set generation.vllm_gpu_memory_utilization=0.86 --set generation.enforce_eager=true \
      --set trainer.max_steps=4 --set output.save_model=false
"""

import os
import sys

if "colocate_rl.worker" in " ".join(getattr(sys, "orig_argv", sys.argv)):
    import importlib.abc
    import importlib.machinery

    def _patch(E):
        import gc
        import json

        import torch

        from colocate_rl.rank.adapter.deepspeed import deepspeed_engine

        orig = E.VLLMEngine.push_weights

        def report(self, tag):
            torch.cuda.synchronize()
            E.empty_cache()
            free, total = torch.cuda.mem_get_info()
            status, gathered, shard = {}, 0, 0
            for p in self.model.parameters():
                st = getattr(p, "ds_status", None)
                if st is None:
                    continue
                status[str(st)] = status.get(str(st), 0) + 1
                gathered += p.data.numel() * p.data.element_size()
                shard += p.ds_tensor.numel() * p.ds_tensor.element_size()
            seen, big = set(), []
            for o in gc.get_objects():
                try:
                    if torch.is_tensor(o) and o.is_cuda and o.untyped_storage().data_ptr() not in seen:
                        seen.add(o.untyped_storage().data_ptr())
                        big.append((o.untyped_storage().nbytes(), tuple(o.shape), str(o.dtype)))
                except Exception:
                    pass
            big.sort(reverse=True)
            G = 2**30
            print(
                "[diag] "
                + json.dumps(
                    dict(
                        tag=tag,
                        rank=int(os.environ.get("RANK", 0)),
                        sync=self._diag_n,
                        used_gib=round((total - free) / G, 3),
                        allocated_gib=round(torch.cuda.memory_allocated() / G, 3),
                        reserved_gib=round(torch.cuda.memory_reserved() / G, 3),
                        gathered_gib=round(gathered / G, 3),
                        shard_gib=round(shard / G, 3),
                        status=status,
                        tensors_gib=round(sum(b[0] for b in big) / G, 3),
                        n_tensors=len(big),
                        big=[(round(b / G, 3), s, d) for b, s, d in big[:14]],
                    )
                ),
                flush=True,
            )

        def push_weights(self):
            self._diag_n = getattr(self, "_diag_n", -1) + 1
            if self._diag_n < 4:
                report(self, "before sync")
                eng = deepspeed_engine(self.accelerator)
                if os.environ.get("DIAG_RELEASE") == "1" and self._diag_n >= 1 and eng is not None:
                    eng.empty_partition_cache()
                    report(self, "after empty_partition_cache")
            return orig(self)

        E.VLLMEngine.push_weights = push_weights
        print("[diag] patched VLLMEngine.push_weights", flush=True)

    class _Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name != "colocate_rl.rank.vllm_engine":
                return None
            sys.meta_path.remove(self)
            spec = importlib.machinery.PathFinder.find_spec(name, path)
            run = spec.loader.exec_module

            def exec_module(module):
                run(module)
                _patch(module)

            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, _Finder())
