"""`output.push_to_hub`: the recipe keys, the token check before anything is written, the token kept out of the run
directory, and the launcher's upload of final/ after a successful run — for real against unreachable or refusing
endpoints (a closed local port, a local HTTP server answering 401/404), and through a test double of `HfApi` for the
successful upload: the Hub itself cannot be reached from the machines these tests run on."""

import json
import os
import subprocess
import sys
import threading
from datetime import datetime
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest
from conftest import CPU, ROOT, assert_user_error, clean_env, resolved
from rich.console import Console

from colocate_rl.cli.train import push_to_hub
from colocate_rl.errors import UserError
from colocate_rl.launch.push import NO_TOKEN, check_push, push_final
from colocate_rl.pipeline import plan_run, resolve
from colocate_rl.recipe.load import parse_recipe
from colocate_rl.telemetry.events import PUSH, read_events

TOKEN = "hf_FakeTokenForTests0123456789abcdef"  # never valid anywhere; searched for in every run-dir file
CLOSED_PORT = "http://127.0.0.1:9"  # the discard port: nothing listens there on a test machine
DIGITS = {"rewards": [{"name": "digit_share"}]}
HF_VARIABLES = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_TOKEN_PATH", "HF_OIDC_RESOURCE", "HF_HUB_OFFLINE")


def hub_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """The CLI's environment without any Hugging Face token or login: HF_HOME is an empty directory."""
    home = tmp_path / "hf-home"
    home.mkdir(exist_ok=True)
    env = {k: v for k, v in clean_env(CUDA_VISIBLE_DEVICES="").items() if k not in HF_VARIABLES}
    return {**env, "HF_HOME": str(home), **extra}


def run_cli(args: list[str], env: dict[str, str], code: str | None = None) -> subprocess.CompletedProcess:
    """`python -m colocate_rl ARGS`, or `code` (a driver script) with ARGS, in a subprocess with exactly `env`."""
    head = ["-c", code] if code else ["-m", "colocate_rl"]
    return subprocess.run(
        [sys.executable, *head, *args], capture_output=True, text=True, cwd=ROOT, env=env, timeout=300
    )


def files_of(run_dir: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}


# ---------------------------------------------------------------------------------------------- the recipe keys


@pytest.mark.parametrize(
    "value, problem",
    [
        ("https://huggingface.co/me/model", "must be a Hub repo id such as your-name/my-model or my-model"),
        ("me/team/model", "must be a Hub repo id such as your-name/my-model or my-model"),
        ("-model", "must be a Hub repo id"),
        ("me/my--model", "must be a Hub repo id"),
        ("me/" + "m" * 97, "at most 96 characters a part"),
        ("me/model.git", "must not end in .git"),
        (True, "must name the repo to push to, such as your-name/my-model (got True)"),
    ],
)
def test_a_bad_repo_id_is_one_line_naming_the_key(value, problem):
    with pytest.raises(UserError) as info:
        parse_recipe({**DIGITS, "output": {"push_to_hub": value}})
    [line] = info.value.lines
    assert line.startswith("output.push_to_hub: ") and problem in line, line


def test_repo_ids_and_defaults():
    assert parse_recipe(DIGITS).output.push_to_hub is None
    for repo in ("me/model", "model", "My-Org/Qwen2.5-1.5B_grpo.v2"):
        output = parse_recipe({**DIGITS, "output": {"push_to_hub": repo}}).output
        assert (output.push_to_hub, output.hub_private) == (repo, True)  # private unless said otherwise
    assert not parse_recipe({**DIGITS, "output": {"push_to_hub": "m", "hub_private": False}}).output.hub_private


def test_pushing_needs_save_model():
    with pytest.raises(UserError) as info:
        parse_recipe({**DIGITS, "output": {"push_to_hub": "me/model", "save_model": False}})
    assert info.value.lines == [
        "output.push_to_hub: needs output.save_model: true (the launcher uploads <run_dir>/final once the run has "
        "saved it); set it, or drop output.push_to_hub (got 'me/model')"
    ]


def test_trls_own_push_options_point_at_output_push_to_hub():
    """TRL would push from the ranks (offline with a built-in model); the launcher pushes instead."""
    recipe = parse_recipe({**DIGITS, "trainer": {"extra_args": {"push_to_hub": True, "hub_model_id": "me/m"}}})
    with pytest.raises(UserError) as info:
        resolve(recipe, CPU)
    assert info.value.lines == [
        f"trainer.extra_args.{key}: colocate-rl sets this itself; use output.push_to_hub (and output.hub_private)"
        for key in ("push_to_hub", "hub_model_id")
    ]


# ---------------------------------------------------------------------------------------------- the token


@pytest.mark.slow
def test_no_token_is_one_line_before_anything_is_written(tmp_path):
    """HF_TOKEN unset and HF_HOME an empty directory (no cached login): validate, train --dry-run (the real run would
    fail) and train each stop with the same line, exit 2, and create no run directory."""
    env = hub_env(tmp_path)
    run_dir = tmp_path / "run"
    sets = ["--set", "output.push_to_hub=me/model"]
    for args in (
        ["validate", "quickstart", *sets],
        ["train", "quickstart", *sets, "--dry-run", "--run-dir", str(run_dir)],
        ["train", "quickstart", *sets, "--run-dir", str(run_dir)],
    ):
        result = run_cli(args, env)
        assert_user_error(result, one_line=True)
        assert result.stderr.strip() == f"error: {NO_TOKEN}"
        assert not run_dir.exists()
    # with a token, the dry run says that it will push, in one line
    result = run_cli(["train", "quickstart", *sets, "--dry-run", "--run-dir", str(run_dir)], {**env, "HF_TOKEN": TOKEN})
    assert result.returncode == 0, result.stderr
    assert "# pushes final/ to me/model on the Hub after the run (node 0; a new repo is private)" in (
        result.stdout.splitlines()
    )
    assert TOKEN not in result.stdout and not run_dir.exists()


def test_an_offline_switch_is_refused_and_other_nodes_need_no_token():
    recipe = parse_recipe({**DIGITS, "output": {"push_to_hub": "me/model"}})
    assert check_push(recipe, {"HF_HUB_OFFLINE": "1", "HF_TOKEN": TOKEN}) == [
        "output.push_to_hub: HF_HUB_OFFLINE is set, which keeps huggingface_hub from uploading; unset it for "
        "`colocate-rl train` or drop output.push_to_hub"
    ]
    node1 = parse_recipe(
        {
            **DIGITS,
            "output": {"push_to_hub": "me/model"},
            "distributed": {"nnodes": 2, "node_rank": 1, "rdzv_endpoint": "node0:29500"},
        }
    )
    assert check_push(node1, {"HF_HUB_OFFLINE": "1"}) == []  # only node 0 pushes
    assert check_push(parse_recipe(DIGITS), {"HF_HUB_OFFLINE": "1"}) == []


def test_the_token_is_not_in_the_plan(tmp_path):
    """The ranks' environment additions, launch.sh, launch.json and recipe.yaml are built without the launcher's
    environment: the token in it reaches none of them."""
    env = {**os.environ, "HF_TOKEN": TOKEN, "HUGGING_FACE_HUB_TOKEN": TOKEN}
    res = resolved("quickstart", CPU, "output.push_to_hub=me/model")
    plan = plan_run(res, tmp_path / "run", env=env, now=datetime(2026, 1, 1), cwd=tmp_path)
    assert plan.files and not any(TOKEN in text for text in plan.files.values())
    assert TOKEN not in plan.command_line() and not {"HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"} & set(plan.env)
    assert "push_to_hub: me/model" in plan.files["recipe.yaml"] and "hub_private: true" in plan.files["recipe.yaml"]


# ---------------------------------------------------------------------------------------------- the launcher's push

# `train` as a user runs it, except that torchrun's ranks are a stand-in that does what rank 0 does at the end of a
# run (final/ saved, DONE written), noting the environment the ranks got.
RANKS = """
import json, os, pathlib, sys
run = pathlib.Path(sys.argv[1])
(run / "final").mkdir()
(run / "final" / "config.json").write_text("{}")
(run / "final" / "model.safetensors").write_bytes(b"weights")
seen = {"HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE"), "has_token": "HF_TOKEN" in os.environ}
(run / "ranks-env.json").write_text(json.dumps(seen))
(run / "DONE").write_text(json.dumps({"global_step": 1, "world_size": 1}) + "\\n")
"""
DRIVER = f"""
import dataclasses, sys
import colocate_rl.launch.execute as execute
real_run = execute.run
def run(plan, **kwargs):
    return real_run(dataclasses.replace(plan, argv=[sys.executable, "-c", {RANKS!r}, str(plan.run_dir)]), **kwargs)
execute.run = run
from colocate_rl.cli import app
app(sys.argv[1:], prog_name="colocate-rl")
"""


@pytest.mark.slow
def test_a_failed_push_keeps_the_run_and_ends_with_one_line_and_exit_1(tmp_path):
    """HF_ENDPOINT is a closed local port and the token a fake: the run finishes, final/ and DONE stay, `train`
    ends with one line saying how to retry and exits 1. The ranks run offline (a built-in model), the launcher's
    push does not: it fails on the connection, not on offline mode. No file of the run directory holds the token."""
    run_dir = tmp_path / "run"
    env = hub_env(tmp_path, HF_TOKEN=TOKEN, HF_ENDPOINT=CLOSED_PORT, COLUMNS="80")
    result = run_cli(
        ["train", "quickstart", "--set", "output.push_to_hub=me/model", "--run-dir", str(run_dir)], env, DRIVER
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    final = run_dir / "final"
    last = result.stdout.strip().splitlines()[-1]
    assert last == (
        f"error: push to me/model failed: cannot reach {CLOSED_PORT} (ConnectError: [Errno 111] Connection refused); "
        f"the model is in {final} — retry with: hf upload me/model {final} --private"
    )
    assert sum("push to" in line for line in (result.stdout + result.stderr).splitlines()) == 1
    assert (final / "model.safetensors").read_bytes() == b"weights" and (run_dir / "DONE").is_file()
    assert json.loads((run_dir / "ranks-env.json").read_text()) == {"HF_HUB_OFFLINE": "1", "has_token": True}
    [event] = read_events(run_dir, PUSH)
    assert event["repo"] == "me/model" and event["url"] is None and "Connection refused" in event["error"]
    leaked = [name for name, data in files_of(run_dir).items() if TOKEN.encode() in data]
    assert leaked == [] and {"recipe.yaml", "launch.json", "launch.sh", "train.log"} <= set(files_of(run_dir))


class FakeHub(BaseHTTPRequestHandler):
    """A local HTTP server standing in for the Hub: it refuses the token (401), or has no such repo (404)."""

    status = 401

    def _reply(self):
        if self.status == 401 or self.path != "/api/repos/create":
            body = {401: "Invalid username or password.", 404: "Repository not found"}[self.status]
            code = self.status
        else:  # 404: the repo is "created", the upload finds it missing
            body, code = None, 200
        data = json.dumps({"error": body} if body else {"url": f"{self.endpoint}/me/model"}).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = _reply

    def log_message(self, *args):
        pass


@pytest.mark.parametrize(
    "status, reason",
    [
        (401, "HTTP 401 Unauthorized (Invalid username or password.)"),
        (404, "HTTP 404 Not Found (Repository not found)"),
    ],
)
def test_a_refused_token_or_missing_repo_is_one_short_reason(status, reason, tmp_path, monkeypatch):
    import huggingface_hub.constants

    handler = type("Hub", (FakeHub,), {"status": status})
    server = HTTPServer(("127.0.0.1", 0), handler)
    handler.endpoint = f"http://127.0.0.1:{server.server_port}"
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", handler.endpoint)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    (tmp_path / "final").mkdir()
    (tmp_path / "final" / "config.json").write_text("{}")
    console = Console(record=True, width=80)
    try:
        assert push_to_hub(tmp_path, "me/model", False, console) == 1
    finally:
        server.shutdown()
    final = tmp_path / "final"
    assert console.export_text() == (
        f"error: push to me/model failed: {reason}; the model is in {final} — retry with: hf upload me/model {final}\n"
    )
    assert [e["error"] for e in read_events(tmp_path, PUSH)] == [reason]


class RecordingHfApi:
    """Stands in for huggingface_hub.HfApi: the Hub cannot be reached from the test machines, so the calls are
    recorded instead, and create_repo answers as the Hub does (the full repo id, under the token's account)."""

    calls: list = []

    def __init__(self, token=None, **kwargs):
        self.calls.append(("HfApi", {"token": token, **kwargs}))

    def create_repo(self, repo_id, **kwargs):
        from huggingface_hub import RepoUrl

        self.calls.append(("create_repo", {"repo_id": repo_id, **kwargs}))
        full = repo_id if "/" in repo_id else f"alice/{repo_id}"
        return RepoUrl(f"https://huggingface.co/{full}", endpoint="https://huggingface.co")

    def upload_folder(self, **kwargs):
        self.calls.append(("upload_folder", kwargs))


@pytest.mark.parametrize("repo, private, full", [("me/model", True, "me/model"), ("model", False, "alice/model")])
def test_a_successful_push_uploads_final_and_says_where(repo, private, full, tmp_path, monkeypatch):
    """With LoRA, final/ holds the adapter (and merged/ on request): the whole folder is uploaded as it is."""
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "HfApi", RecordingHfApi)
    monkeypatch.setattr(RecordingHfApi, "calls", [])
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    final = tmp_path / "run" / "final"
    (final / "merged").mkdir(parents=True)
    for name in ("adapter_config.json", "adapter_model.safetensors", "merged/config.json"):
        (final / name).write_text("{}")
    console = Console(record=True, width=80)
    assert push_to_hub(tmp_path / "run", repo, private, console) == 0
    assert console.export_text() == f"pushed {final} to https://huggingface.co/{full}\n"
    assert RecordingHfApi.calls == [
        ("HfApi", {"token": TOKEN}),
        ("create_repo", {"repo_id": repo, "private": private, "exist_ok": True, "repo_type": "model"}),
        (
            "upload_folder",
            {
                "repo_id": full,
                "folder_path": final,
                "repo_type": "model",
                "commit_message": "colocate-rl: final model of run run",
            },
        ),
    ]
    [event] = read_events(tmp_path / "run", PUSH)
    assert (event["repo"], event["url"], event["error"]) == (repo, f"https://huggingface.co/{full}", None)


def test_no_final_model_is_a_failed_push_without_contacting_the_hub(tmp_path, monkeypatch):
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "HfApi", RecordingHfApi)
    monkeypatch.setattr(RecordingHfApi, "calls", [])
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    pushed = push_final(tmp_path, "me/model", True)
    assert pushed.error == f"{tmp_path / 'final'} does not exist on this node" and RecordingHfApi.calls == []


@pytest.mark.slow
def test_a_real_run_trains_saves_and_reports_the_failed_push(tmp_path):
    """quickstart through real torchrun on CPU for 2 steps (plain DDP, which starts faster than ZeRO-3), pushing to an
    unreachable endpoint: the model is trained and saved, the run counts, `train` exits 1 with the retry line."""
    run_dir = tmp_path / "run"
    env = hub_env(tmp_path, HF_TOKEN=TOKEN, HF_ENDPOINT=CLOSED_PORT)
    sets = ["--set", "output.push_to_hub=me/model", "--set", "trainer.max_steps=2"]
    sets += ["--set", "distributed.deepspeed=null", "--set", "distributed.deepspeed_overrides={}"]
    result = run_cli(["train", "quickstart", *sets, "--run-dir", str(run_dir)], env)
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    final = run_dir / "final"
    assert (
        result.stdout.strip().splitlines()[-1].startswith(f"error: push to me/model failed: cannot reach {CLOSED_PORT}")
    )
    assert (final / "config.json").is_file() and json.loads((run_dir / "DONE").read_text())["global_step"] == 2
    assert "reward first → last" in result.stdout
    assert not [name for name, data in files_of(run_dir).items() if TOKEN.encode() in data]
