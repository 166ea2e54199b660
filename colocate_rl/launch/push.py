"""`output.push_to_hub`: once a run has finished and saved `<run_dir>/final`, the launcher of node 0 uploads that
folder (with LoRA: the adapter, and `merged/` when saved) to a Hub model repo, created private unless
`output.hub_private: false`.

The token is the one huggingface_hub finds in the launcher's environment (HF_TOKEN) or its cached login (`hf auth
login`). `check_push` asks for it before anything is written. It is never written to the run directory: the plan's
environment additions (launch.sh) are built without the launcher's environment, and a token in the recipe is
refused; the ranks inherit the environment at run time as always (a gated model needs it). The ranks'
HF_HUB_OFFLINE (a built-in model's run) is set in their environment only, not in this process's. Torch-free;
huggingface_hub is imported only when a recipe pushes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from colocate_rl.rundir import RunDir
from colocate_rl.telemetry.events import PUSH, emit

if TYPE_CHECKING:
    from colocate_rl.recipe.schema import Recipe

NO_TOKEN = "output.push_to_hub: no Hugging Face token; set HF_TOKEN or run `hf auth login`"
OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")  # either one keeps huggingface_hub from uploading


@dataclass(frozen=True)
class Pushed:
    """How a push ended: the repo's `url`, or the `error` (one short line) it failed with."""

    repo: str
    url: str | None = None
    error: str | None = None
    interrupted: bool = False


def hub_token() -> str | None:
    """The token huggingface_hub would send (HF_TOKEN, else the cached login), or None."""
    from huggingface_hub import get_token

    try:
        return get_token()
    except Exception:  # e.g. a failed OIDC exchange (HF_OIDC_RESOURCE): no usable token
        return None


def check_push(recipe: Recipe, env: Mapping[str, str]) -> list[str]:
    """Why this node's launcher could not push what `output.push_to_hub` asks for (only node 0 pushes)."""
    if recipe.output.push_to_hub is None or recipe.distributed.node_rank != 0:
        return []
    offline = [k for k in OFFLINE_VARIABLES if env.get(k, "").strip().upper() in ("1", "ON", "YES", "TRUE")]
    if offline:
        return [
            f"output.push_to_hub: {offline[0]} is set, which keeps huggingface_hub from uploading; unset it for "
            "`colocate-rl train` or drop output.push_to_hub"
        ]
    return [] if hub_token() else [NO_TOKEN]


def short_reason(exc: BaseException, endpoint: str) -> str:
    """One short line for a failed push: the HTTP status and the Hub's message, or what kept it from the Hub."""
    if isinstance(exc, KeyboardInterrupt):
        return "interrupted"
    response = getattr(exc, "response", None)
    status = getattr(response, "status_code", None)
    if isinstance(status, int):
        phrase = getattr(response, "reason_phrase", None) or ""
        detail = str(getattr(exc, "server_message", None) or "").strip()
        text = f"HTTP {status} {phrase}".strip() + (f" ({detail})" if detail else "")
    else:
        text = f"{type(exc).__name__}: {exc}"
        if isinstance(exc, (ConnectionError, TimeoutError)) or "connect" in type(exc).__name__.lower():
            text = f"cannot reach {endpoint} ({text})"
    text = " ".join(text.split())
    return text if len(text) <= 240 else text[:237] + "..."


def push_final(run_dir: Path, repo: str, private: bool) -> Pushed:
    """Create the model repo `repo` (when it does not exist; `private`) and upload `<run_dir>/final` to its root.
    Never raises: the outcome is returned and written as a `push` event to the run's events.jsonl."""
    from huggingface_hub import HfApi, constants

    final, token = RunDir(run_dir).final, hub_token()
    if not final.is_dir():
        pushed = Pushed(repo, error=f"{final} does not exist on this node")
    elif not token:
        pushed = Pushed(repo, error="no Hugging Face token (set HF_TOKEN or run `hf auth login`)")
    else:
        try:
            api = HfApi(token=token)
            url = api.create_repo(repo, private=private, exist_ok=True, repo_type="model")
            api.upload_folder(
                repo_id=getattr(url, "repo_id", None) or repo,  # `name` alone: the repo under the token's account
                folder_path=final,
                repo_type="model",
                commit_message=f"colocate-rl: final model of run {Path(run_dir).name}",
            )
            pushed = Pushed(repo, url=str(url))
        except (Exception, KeyboardInterrupt) as exc:
            reason = short_reason(exc, constants.ENDPOINT)
            pushed = Pushed(repo, error=reason, interrupted=isinstance(exc, KeyboardInterrupt))
    emit(run_dir, PUSH, repo=repo, url=pushed.url, error=pushed.error)
    return pushed
