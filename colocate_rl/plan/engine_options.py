"""Options of colocate-rl's colocated vLLM engine (`colocate_rl.rank.vllm_engine`): one typed object, built from the
recipe's `generation` section by the plan, written into `launch.json` and read back by every rank. The recipe schema
holds the defaults; this module holds the mapping from recipe keys to engine options. Torch-free."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from colocate_rl.recipe.generation import GenerationSection

# engine option → the `generation.*` recipe key it comes from
RECIPE_KEYS = {
    "sleep_level": "sleep_level",
    "kv_cache_memory_bytes": "kv_cache_memory",
    "enforce_eager": "enforce_eager",
    "max_num_seqs": "max_num_seqs",
    "max_num_batched_tokens": "max_num_batched_tokens",
    "enable_prefix_caching": "enable_prefix_caching",
    "bucket_bytes": "weight_sync_bucket_mb",
    "offload_trainer": "offload_trainer_during_generation",
    "check_weights": "check_weights",
    "multiprocessing": "vllm_multiprocessing",
    "processes": "engine_processes",
}
# recipe keys only colocate-rl's engine honours (TRL's engine has fixed settings; it sleeps at level 0 or 2)
ENGINE_ONLY_KEYS = tuple(key for option, key in RECIPE_KEYS.items() if option != "sleep_level")


@dataclass(frozen=True)
class EngineOptions:
    sleep_level: int  # 0 off, 1 weights to CPU + KV freed, 2 weights and KV freed
    kv_cache_memory_bytes: int | None  # vLLM's KV budget instead of sizing it from the share
    enforce_eager: bool
    max_num_seqs: int | None
    max_num_batched_tokens: int
    enable_prefix_caching: bool
    bucket_bytes: int  # weight sync: bytes gathered and loaded into vLLM at a time
    offload_trainer: bool  # DeepSpeed states to CPU while vLLM generates
    check_weights: bool  # compare vLLM's tensors with the trainer's after each push
    multiprocessing: bool  # engine process only: vLLM's engine core in a process of its own
    processes: int  # engine process only: how many engine processes share each generation batch

    @classmethod
    def from_generation(cls, gen: GenerationSection) -> EngineOptions:
        from colocate_rl.recipe.values import parse_size

        return cls(
            sleep_level=gen.sleep_level,
            kv_cache_memory_bytes=parse_size(gen.kv_cache_memory) if gen.kv_cache_memory is not None else None,
            enforce_eager=gen.enforce_eager,
            max_num_seqs=gen.max_num_seqs,
            max_num_batched_tokens=gen.max_num_batched_tokens,
            enable_prefix_caching=gen.enable_prefix_caching,
            bucket_bytes=gen.weight_sync_bucket_mb * 2**20,
            offload_trainer=gen.offload_trainer_during_generation,
            check_weights=gen.check_weights,
            multiprocessing=gen.vllm_multiprocessing,
            processes=gen.engine_processes,
        )

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> EngineOptions:
        """Raises ValueError on unknown or missing options (a launch.json of another colocate-rl version)."""
        # written before they existed: vLLM's engine core ran in-process, one engine process
        data = {"multiprocessing": False, "processes": 1, **data}
        names = {f.name for f in fields(cls)}
        if set(data) != names:
            raise ValueError(
                f"engine options: unknown {sorted(set(data) - names)}, missing {sorted(names - set(data))}"
            )
        return cls(**data)
