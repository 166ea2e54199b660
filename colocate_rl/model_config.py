"""A model's `config.json` as a mapping, for the checks before launch and the memory estimate: a local directory's
file, or a hub model's through transformers' `AutoConfig` (only the config is fetched, never weights). Without a
connection to the hub (or with HF_HUB_OFFLINE set) only the local Hugging Face cache is read, and a config that is
not there is one UserError line: nothing waits on the hub library's retries.
"""

from __future__ import annotations

import json
import os
from functools import lru_cache
from pathlib import Path
from typing import Any

from colocate_rl.errors import UserError, one_line

HUB_PROBE_TIMEOUT_S = 3.0  # a TCP connection to the hub's endpoint, before AutoConfig (which retries for ~25 s)
_TRUE = ("1", "on", "yes", "true")


def looks_local(name: str) -> bool:
    """A path rather than a hub id: written as one (`./`, `/`, `~`) or an existing file or directory."""
    return name.startswith((".", "/", "~")) or os.path.exists(os.path.expanduser(name))


def gguf_problem(name: str, key: str) -> str | None:
    """The line for a GGUF file named as a model (transformers trains from a model directory), or None."""
    if not name.lower().endswith(".gguf"):
        return None
    return (
        f"{key}: '{name}' is a GGUF file, which cannot be trained or loaded here; convert it to a transformers "
        "model directory once (AutoModelForCausalLM.from_pretrained(repo_or_dir, gguf_file=FILE).save_pretrained(OUT) "
        "and the tokenizer likewise) and name that directory"
    )


def local_config(name: str, key: str) -> dict[str, Any]:
    """`name/config.json` of a local model directory; UserError when it is missing or not a JSON object."""
    config = Path(name).expanduser() / "config.json"
    if not config.is_file():
        raise UserError(
            f"{key}: '{name}' is not a model directory (no config.json); give a local model directory or a hub id"
        )
    try:
        data = json.loads(config.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"{key}: cannot read {config} ({one_line(e)}); fix it or give another model directory")
    if not isinstance(data, dict):
        raise UserError(f"{key}: {config} is not a JSON object; fix it or give another model directory")
    return data


def hub_unreachable() -> str | None:
    """Why the hub cannot be reached now (HF_HUB_OFFLINE, or no TCP connection to HF_ENDPOINT within
    HUB_PROBE_TIMEOUT_S), or None. Behind a proxy the library is left to find out."""
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in _TRUE:
        return "HF_HUB_OFFLINE is set"
    if any(os.environ.get(k) for k in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return None
    return _probe(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")


@lru_cache(maxsize=4)
def _probe(endpoint: str) -> str | None:
    """Once per endpoint and process (an estimate asks for configs many times): why no TCP connection, or None."""
    import socket
    from urllib.parse import urlsplit

    url = urlsplit(endpoint)
    port = url.port or (80 if url.scheme == "http" else 443)
    try:
        socket.create_connection((url.hostname or "", port), timeout=HUB_PROBE_TIMEOUT_S).close()
    except OSError as e:
        return f"no connection to {url.scheme}://{url.netloc}: {e.strerror or e}"
    return None


@lru_cache(maxsize=32)
def hub_config(name: str, key: str) -> dict[str, Any]:
    """A hub model's config (every field, defaults included) through transformers' AutoConfig: fetched when the hub
    is reachable, else read from the local cache. UserError when it cannot be had either way."""
    reason = hub_unreachable()
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(name, local_files_only=reason is not None).to_dict()
    except Exception as e:
        if reason is not None:
            raise UserError(
                f"{key}: the config of '{name}' could not be fetched ({reason}) and is not in the local Hugging Face "
                "cache; give a local model directory, or fetch it once where the hub is reachable "
                f"(`hf download {name} config.json`) and set HF_HUB_OFFLINE=1"
            ) from e
        raise UserError(
            f"{key}: cannot load the config of '{name}' from the hub ({one_line(e, 200)}); check the id (a gated "
            "model needs HF_TOKEN) or give a local model directory"
        ) from e


def model_config(name: str, key: str) -> dict[str, Any]:
    """The config of a local model directory or a hub model (see `hub_config`); UserError naming `key` for a GGUF
    file, a directory without config.json, or a hub config that cannot be had."""
    problem = gguf_problem(name, key)
    if problem:
        raise UserError(problem)
    return local_config(name, key) if looks_local(name) else hub_config(name, key)
