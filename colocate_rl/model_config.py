"""A model's `config.json` as a mapping, for the checks before launch and the memory estimate: a local directory's
file, or a hub model's through transformers' `AutoConfig` (only the config is fetched, never weights). Without a
connection to the hub (or with HF_HUB_OFFLINE set) only the local Hugging Face cache is read, and a config that is
not there is one UserError line: nothing waits on the hub library's retries. Also what a launch needs beyond the
config (`model_type_problem`, `model_files_problems`, `hub_model_problems`: a model type transformers knows, the
tokenizer and weights, a hub model cached when the hub cannot be reached) and a reward model's files
(`check_reward_model`). Torch-free: transformers is imported only to confirm a model type its file list lacks.
"""

from __future__ import annotations

import json
import os
import re
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


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
WEIGHT_FILES = re.compile(r"(.*\.safetensors|pytorch_model.*\.bin)(\.index\.json)?")  # what from_pretrained loads


@lru_cache(maxsize=1)
def _listed_model_types() -> frozenset[str]:
    """The model types of transformers' CONFIG_MAPPING_NAMES as its source file lists them, read without importing
    transformers (which imports torch: seconds); empty when the file is not where transformers 5 keeps it."""
    import importlib.util

    spec = importlib.util.find_spec("transformers")
    try:
        folder = next(iter(spec.submodule_search_locations or ())) if spec else None
        text = open(os.path.join(folder, "models", "auto", "auto_mappings.py"), encoding="utf-8").read()
    except (OSError, StopIteration, TypeError):
        return frozenset()
    block = text.partition("CONFIG_MAPPING_NAMES = OrderedDict(")[2].partition("\n)\n")[0]
    return frozenset(re.findall(r'\(\s*"([^"]+)",\s*"\w+"\s*\)', block))


def model_type_known(model_type: str) -> bool:
    """Whether transformers' AutoConfig knows `model_type` (its file list first, its import only for the rest)."""
    if model_type in _listed_model_types():
        return True
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    return model_type in CONFIG_MAPPING_NAMES


def model_type_problem(config: dict[str, Any], where: str, key: str, trust_remote_code: bool = False) -> str | None:
    """The line for a config.json (at `where`) whose model_type transformers does not know, or None. A model with its
    own code (`auto_map`) passes when trainer.extra_args.trust_remote_code lets transformers run it."""
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or model_type_known(model_type):
        return None
    if config.get("auto_map") and trust_remote_code:
        return None
    from importlib.metadata import version

    custom = (
        "; it has its own code (auto_map): set trainer.extra_args.trust_remote_code: true to run it"
        if config.get("auto_map")
        else ""
    )
    return (
        f"{key}: {where} names model_type '{model_type}', which transformers {version('transformers')} does not "
        f"know{custom}; fix model_type, or use a model transformers supports"
    )


def model_files_problems(folder: str | Path, label: str, key: str) -> list[str]:
    """What the ranks load from a model directory besides config.json and is not there: the tokenizer, the weights
    (`label` names the model in the lines). A directory of config.json alone can be planned, not trained."""
    names = os.listdir(folder) if os.path.isdir(folder) else []
    problems = []
    if not any(n in names for n in TOKENIZER_FILES):
        problems.append(
            f"{key}: {label} has no tokenizer ({', '.join(TOKENIZER_FILES)}); every rank loads it from the model "
            "directory: save it there (tokenizer.save_pretrained(DIR))"
        )
    if not any(WEIGHT_FILES.fullmatch(n) for n in names):
        problems.append(
            f"{key}: {label} holds no weights (no *.safetensors or pytorch_model*.bin); config.json alone can be "
            "planned (validate --gpus N, mem-probe --estimate) but not trained: save the model there "
            "(model.save_pretrained(DIR))"
        )
    return problems


def hf_home() -> Path:
    """The Hugging Face cache root as the hub library and datasets find it: HF_HOME, else
    $XDG_CACHE_HOME/huggingface, else ~/.cache/huggingface."""
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    return Path(home).expanduser()


def cached_snapshot(repo_id: str) -> Path | None:
    """A hub model's snapshot in the local Hugging Face cache (`main`'s, else the newest), or None."""
    hub = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    repo = (Path(hub).expanduser() if hub else hf_home() / "hub") / f"models--{repo_id.replace('/', '--')}"
    try:
        main = repo / "snapshots" / (repo / "refs" / "main").read_text().strip()
        if main.is_dir():
            return main
    except OSError:
        pass
    snapshots = sorted((p for p in repo.glob("snapshots/*") if p.is_dir()), key=lambda p: p.stat().st_mtime)
    return snapshots[-1] if snapshots else None


def hub_model_problems(name: str, key: str) -> list[str]:
    """What a launch would miss of the hub model `name`: nothing while the hub can be reached (the ranks download
    it); else its config, tokenizer and weights must be in the local cache, and one line says what is not."""
    reason = hub_unreachable()
    if reason is None:
        return []
    snapshot = cached_snapshot(name)
    if snapshot is None or not (snapshot / "config.json").is_file():
        return [
            f"{key}: '{name}' cannot be fetched ({reason}) and is not in the local Hugging Face cache; download it "
            f"once where the hub is reachable (`hf download {name}`), or give a local model directory"
        ]
    return model_files_problems(snapshot, f"'{name}' (cached at {snapshot})", key)


def check_reward_model(name: str, *, key: str, chat: bool) -> dict:
    """A reward model TRL can load and score with: a sequence classifier with one label (`...ForSequenceClassification`,
    num_labels 1) and, in a local directory, its own tokenizer (with a chat template for `chat` data). Reads config
    files only (a hub model's config through AutoConfig; nothing else is downloaded, no model is loaded). Returns its
    config; UserError naming `key` otherwise, also for a hub id whose config cannot be had (offline and not cached)."""
    if name.startswith("builtin:"):
        raise UserError(
            f"{key}: '{name}': the built-in models are causal LMs, not reward models; give the directory or hub id "
            "of a sequence-classification model, or a reward function as `name`"
        )
    cfg = model_config(name, key)
    architectures = [str(a) for a in cfg.get("architectures") or []]
    if not any(a.endswith("ForSequenceClassification") for a in architectures):
        found = f"its config names {', '.join(architectures)}" if architectures else "its config names no architecture"
        raise UserError(
            f"{key}: '{name}' is not a sequence-classification model ({found}); TRL scores completions with a "
            "...ForSequenceClassification model's one output: give such a model, or a reward function as `name`"
        )
    labels = len(cfg["id2label"]) if isinstance(cfg.get("id2label"), dict) else cfg.get("num_labels", 2)
    if labels != 1:
        raise UserError(
            f"{key}: '{name}' has {labels} labels; TRL reads one score per completion (num_labels 1): give a reward "
            "model with a single output"
        )
    folder = os.path.expanduser(name)
    if looks_local(name) and not any(os.path.isfile(os.path.join(folder, f)) for f in TOKENIZER_FILES):
        raise UserError(
            f"{key}: '{name}' has no tokenizer ({', '.join(TOKENIZER_FILES[:2])}); TRL tokenizes prompt + completion "
            "with the reward model's own tokenizer: save it into that directory (tokenizer.save_pretrained)"
        )
    if looks_local(name) and chat and not has_chat_template(folder):
        raise UserError(
            f"{key}: '{name}' has no chat template and data.chat is true; TRL formats prompt + completion with the "
            "reward model's chat template: add one to its tokenizer_config.json, or set data.chat: false"
        )
    return cfg


def has_chat_template(folder: str) -> bool:
    """A tokenizer's chat template: in tokenizer_config.json or a chat_template.jinja/.json file beside it."""
    if any(os.path.isfile(os.path.join(folder, f)) for f in ("chat_template.jinja", "chat_template.json")):
        return True
    try:
        with open(os.path.join(folder, "tokenizer_config.json"), encoding="utf-8") as f:
            return bool(json.load(f).get("chat_template"))
    except (OSError, ValueError, AttributeError):
        return False
