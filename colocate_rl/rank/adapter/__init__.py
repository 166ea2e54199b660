"""The one place colocate-rl touches the libraries' internals: TRL (`trl.py`), vLLM (`vllm.py`), DeepSpeed and
accelerate (`deepspeed.py`). Each symbol used is listed there with what it relies on; a TRL or vLLM upgrade changes
these files and `PINNED`.

`verify_installed` (before the trainer is built) and `verify_trainer` (once it is, before step 1) check every one of
them and raise `AdapterError` (exit 2) with one line naming the first symbol that moved and the installed versions.
"""

from __future__ import annotations

from importlib import metadata

from colocate_rl.errors import UserError
from colocate_rl.rank.adapter.trl import engine_trainer

__all__ = ["AdapterError", "PINNED", "engine_trainer", "verify_installed", "verify_trainer", "versions"]

PINNED = {"trl": "1.16.0", "vllm": "0.26.0", "deepspeed": "0.19.8"}  # what the adapter was written against


class AdapterError(UserError):
    """An installed library no longer has what colocate-rl relies on."""


def versions() -> str:
    """`trl 1.16.0, vllm 0.26.0, ...` of the libraries installed here (absent ones left out)."""
    found = []
    for name in ("trl", "vllm", "deepspeed", "transformers", "accelerate", "peft"):
        try:
            found.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            continue
    return ", ".join(found)


def _raise(problems: list[str]) -> None:
    if not problems:
        return
    more = f" (and {len(problems) - 1} more: {'; '.join(problems[1:])})" if len(problems) > 1 else ""
    pinned = ", ".join(f"{k} {v}" for k, v in PINNED.items())
    raise AdapterError(
        f"{problems[0]}{more}: colocate-rl relies on it (installed: {versions()}; written for {pinned}); install the "
        "pinned versions (pip install -e '.[gpu]'), or port colocate_rl/rank/adapter/ to the new release"
    )


def verify_installed(trainer_cls: type, *, vllm: bool, deepspeed_offload: bool, lora: bool = False) -> None:
    """Check TRL's trainer class (and vLLM / DeepSpeed where the run uses them) before anything starts."""
    from colocate_rl.rank.adapter import deepspeed as ds
    from colocate_rl.rank.adapter import peft, trl
    from colocate_rl.rank.adapter import vllm as vl

    problems = trl.check_trainer_class(trainer_cls)
    if lora:
        problems += peft.check()
    if vllm:
        problems += vl.check()
    if deepspeed_offload:
        problems += ds.check()
    _raise(problems)


def verify_trainer(trainer) -> None:
    """Check a built trainer: the engine in place, the private attributes read, the started vLLM's internals."""
    from colocate_rl.rank.adapter import trl
    from colocate_rl.rank.adapter import vllm as vl

    problems = trl.check_trainer(trainer)
    llm = getattr(getattr(trainer, "engine", None), "llm", None)
    if llm is not None:
        problems += vl.check_engine(llm)
    _raise(problems)
