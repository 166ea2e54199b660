"""The weight push's and weight check's parts that need no engine: buckets of parameters by bytes, the trainer's
weights bucket by bucket as an engine loads them, the names vLLM gives the trainer's parameters, which tensors are
compared after a push and how. Used by `colocate_rl.rank.vllm_engine` and `colocate_rl.rank.engine_process`."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch


def full_numel(param: torch.Tensor) -> int:
    """Elements of the whole parameter, also when ZeRO-3 holds only a shard (`ds_numel`)."""
    return int(getattr(param, "ds_numel", param.numel()))


def weight_buckets(
    named_params: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Consecutive groups of parameters of at most `bucket_bytes` each (a larger parameter gets its own group)."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, param in named_params:
        nbytes = full_numel(param) * param.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, param))
        size += nbytes
    if bucket:
        yield bucket


def trainer_buckets(model, bucket_bytes: int, gather, merge=None) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The trainer's weights named as vLLM names them, in buckets of at most `bucket_bytes`, each bucket whole
    (gathered by `gather(params)` under ZeRO-3) until the consumer asks for the next. With LoRA (`merge`: an
    `adapter.peft.AdapterMerge`) the base weights with the adapter merged in, out of place."""
    if merge is not None:
        for bucket in weight_buckets(merge.named_params(), bucket_bytes):
            params = [p for _, p in bucket]
            with gather(params + merge.adapter_params(params)):
                yield [(name, merge.value(p)) for name, p in bucket]
        return
    named = ((vllm_name(n), p) for n, p in model.named_parameters())
    for bucket in weight_buckets(named, bucket_bytes):
        with gather([p for _, p in bucket]):
            yield [(name, p.data) for name, p in bucket]


def expected_weights(
    model, gather, tensor_parallel_size: int, merge=None, fused: bool = True
) -> dict[str, torch.Tensor]:
    """Copies of the trainer's tensors that the weight check compares with the engine's (`check_names`; with LoRA
    also the last layer's adapted weights merged again, under vLLM's fused names unless `fused` is False: an engine
    with transformers' own module names), gathered under ZeRO-3 independently of the push."""
    named = ((vllm_name(n), p) for n, p in model.named_parameters())
    params = dict(merge.named_params() if merge is not None else named)
    names = check_names(list(params), tensor_parallel_size)
    with gather([params[n] for n in names]):
        expected = {n: params[n].data.detach().clone() for n in names}
    if merge is not None:
        from colocate_rl.rank.adapter.peft import expected_tensors

        targets = merge.check_targets(tensor_parallel_size)
        if not fused:  # each part under its own name
            targets = {part: [part] for parts in targets.values() for part in parts}
        expected.update(expected_tensors(merge, targets, gather))
    return expected


def adapter_merge(model):
    """With LoRA: the adapted model as vLLM names it (`adapter.peft.AdapterMerge`: base + adapter); else None."""
    from accelerate.utils import is_peft_model

    if not is_peft_model(model):
        return None
    from colocate_rl.rank.adapter.peft import AdapterMerge

    return AdapterMerge(model, vllm_name)


def vllm_name(name: str) -> str:
    """The trainer's parameter name as vLLM's model names it (activation-checkpoint wrappers dropped)."""
    return name.replace("_checkpoint_wrapped_module.", "")


def check_names(names: list[str], tensor_parallel_size: int) -> list[str]:
    """Parameters compared after each push: the final norm and the first and last layers' input norms (replicated
    under tensor parallelism), plus the last layer's MLP down projection when vLLM does not shard it."""
    layers = sorted(
        {int(n.split(".")[2]) for n in names if n.startswith("model.layers.") and n.split(".")[2].isdigit()}
    )
    wanted = ["model.norm.weight"]
    if layers:
        wanted += [
            f"model.layers.{layers[0]}.input_layernorm.weight",
            f"model.layers.{layers[-1]}.input_layernorm.weight",
        ]
        if tensor_parallel_size == 1:
            wanted.append(f"model.layers.{layers[-1]}.mlp.down_proj.weight")
    present = set(names)
    return [n for n in wanted if n in present]


def compare_weights(pushed: dict[str, torch.Tensor], engine_params: dict[str, torch.Tensor]) -> list[str]:
    """Problems found comparing pushed tensors with the engine's (missing or different), as text."""
    problems = []
    for name, expected in pushed.items():
        actual = engine_params.get(name)
        if actual is None:
            problems.append(f"{name} not found in vLLM's model")
            continue
        expected = expected.to(device=actual.device, dtype=actual.dtype)
        if actual.shape != expected.shape:
            problems.append(f"{name} has shape {tuple(actual.shape)} in vLLM, {tuple(expected.shape)} in the trainer")
        elif not torch.equal(actual, expected):
            diff = (actual.float() - expected.float()).abs().max().item()
            problems.append(f"{name} differs (max abs difference {diff:.3g})")
    return problems


# ---------------------------------------------------------------------------------------------- staging

ALIGN = 256  # bytes: each staged tensor starts at a multiple (a view of the buffer as any dtype must be aligned)


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def staging_bytes(named_params, bucket_bytes: int) -> int:
    """Bytes of the staging buffer: the largest bucket `trainer_buckets` makes, each tensor aligned."""
    sizes = [
        sum(aligned(full_numel(p) * p.element_size()) for _, p in bucket)
        for bucket in weight_buckets(named_params, bucket_bytes)
    ]
    return max(sizes, default=ALIGN)


def stage(buffer: torch.Tensor, tensors: list[tuple[str, torch.Tensor]]) -> list[tuple[str, str, tuple, int]]:
    """Copy `tensors` into `buffer` (uint8) one after another; their places as (name, dtype, shape, offset)."""
    specs, offset = [], 0
    for name, tensor in tensors:
        flat = tensor.detach().contiguous().view(-1).view(torch.uint8)
        if offset + flat.numel() > buffer.numel():
            raise ValueError(f"the engine's staging buffer ({buffer.numel()} bytes) cannot hold {name}")
        buffer[offset : offset + flat.numel()].copy_(flat)
        specs.append((name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), offset))
        offset = aligned(offset + flat.numel())
    if buffer.is_cuda:
        torch.cuda.synchronize(buffer.device)  # the child reads on its own stream, in its own process
    return specs


def fitting(tensors: list[tuple[str, torch.Tensor]], capacity: int) -> list[list[tuple[str, torch.Tensor]]]:
    """`tensors` in consecutive groups that `stage` fits into `capacity` bytes each."""
    groups: list[list[tuple[str, torch.Tensor]]] = [[]]
    used = 0
    for name, tensor in tensors:
        size = aligned(tensor.numel() * tensor.element_size())
        if groups[-1] and used + size > capacity:
            groups.append([])
            used = 0
        groups[-1].append((name, tensor))
        used += size
    return [g for g in groups if g]


def staged(buffer: torch.Tensor, specs: list[tuple[str, str, tuple, int]]) -> list[tuple[str, torch.Tensor]]:
    """The child's views of what `stage` copied (no copy)."""
    out = []
    for name, dtype, shape, offset in specs:
        dt = getattr(torch, dtype)
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dt).element_size()
        out.append((name, buffer[offset : offset + nbytes].view(dt).view(shape)))
    return out


def shared_handle(buffer: torch.Tensor) -> bytes:
    """A CUDA tensor as bytes that any process on the same GPU opens with `open_shared` (CUDA IPC; relied on: torch's
    `reduce_tensor` returns `rebuild_cuda_tensor` and its picklable arguments, the device index 7th, as verl uses
    them). The tensor must outlive every opener's use."""
    import pickle

    from torch.multiprocessing.reductions import reduce_tensor

    _, args = reduce_tensor(buffer)
    return pickle.dumps(args)


def open_shared(handle: bytes, device_index: int) -> torch.Tensor:
    """The tensor `shared_handle` gave, opened on this process's GPU number `device_index` (a process with other
    CUDA_VISIBLE_DEVICES numbers the same GPU differently)."""
    import pickle

    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    args = list(pickle.loads(handle))
    args[6] = device_index
    return rebuild_cuda_tensor(*args)
