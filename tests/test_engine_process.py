"""The generation engine in a process of its own (colocate_rl/rank/engine_process.py), on CPU.

Everything here is real: a spawned child process running transformers on its own copy of a tiny model, the pipe,
weights staged in shared memory (on a GPU it is a CUDA IPC handle instead; the GPU tests run that path with vLLM).
The tests that start the child process are in the slow tier (`slow`: a test that starts a process).
"""

import contextlib
import os
import signal
import time

import pytest
import torch
from test_engine import tiny_model
from transformers import GenerationConfig

from colocate_rl.errors import EngineProcessError, StaleWeightsError, UserError
from colocate_rl.rank import engine_process as P
from colocate_rl.rank import weights as W
from colocate_rl.rank.engine import Generation, Sampling
from colocate_rl.rank.hf_engine import generate_with

GREEDY = Sampling(max_tokens=6, temperature=0.0)
PROMPTS = [[1, 2, 3], [4, 5], [7, 8, 9, 10]]
EOS = 63


def config() -> GenerationConfig:
    return GenerationConfig(eos_token_id=EOS, pad_token_id=0)


def spec(path, **changes):
    return {
        "kind": "transformers",
        "model_path": str(path),
        "dtype": "float32",
        "device": "cpu",
        "generation_config": config(),
        "pad_token_id": 0,
        "max_batch": None,
        "seed": 0,
        **changes,
    }


def here(model, prompts=PROMPTS):
    """What the rank's own model generates (greedy)."""
    return generate_with(model, prompts, GREEDY, config(), 0, [EOS], "cpu").completion_ids


def no_gather(params):
    return contextlib.nullcontext()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    tiny_model(seed=0).save_pretrained(path)
    return path


@pytest.fixture
def engine(saved):
    model = tiny_model(seed=0)
    eng = P.ProcessEngine(spec(saved), model, no_gather, bucket_bytes=4096, check_weights=True, device="cpu")
    eng.start()
    yield eng, model
    eng.stop()


@pytest.fixture(scope="module")
def _serving_engines(saved):
    """The engine processes `serving` started in this module (stopped at its end; stopping twice does nothing)."""
    engines: list = []
    yield engines
    for eng, _ in engines:
        eng.stop()


@pytest.fixture
def serving(saved, _serving_engines):
    """An engine process shared by the tests that leave it serving, or stop it last (a start is ~3.5 s on 2 cores):
    the one before while it runs, else a new one. Each test checks against the shared model as it then is. The test
    that kills it takes `engine`, its own."""
    if not _serving_engines or _serving_engines[-1][0].process is None:
        model = tiny_model(seed=0)
        eng = P.ProcessEngine(spec(saved), model, no_gather, bucket_bytes=4096, check_weights=True, device="cpu")
        _serving_engines.append((eng, model))
        eng.start()
    return _serving_engines[-1]


def test_staging_places_tensors_aligned_and_the_child_views_them_without_a_copy():
    buffer = torch.zeros(4096, dtype=torch.uint8)
    tensors = [("a", torch.arange(5, dtype=torch.float32)), ("b", torch.ones(2, 3, dtype=torch.bfloat16))]
    specs = W.stage(buffer, tensors)
    assert specs == [("a", "float32", (5,), 0), ("b", "bfloat16", (2, 3), 256)]
    views = W.staged(buffer, specs)
    assert all(torch.equal(v, t) for (_, v), (_, t) in zip(views, tensors))
    buffer[256:258].zero_()  # a view, not a copy
    assert views[1][1][0, 0].item() == 0
    with pytest.raises(ValueError, match="cannot hold big"):
        W.stage(torch.zeros(16, dtype=torch.uint8), [("big", torch.zeros(8))])
    groups = W.fitting([("x", torch.zeros(100)), ("y", torch.zeros(100)), ("z", torch.zeros(10))], 800)
    assert [[n for n, _ in g] for g in groups] == [["x"], ["y", "z"]]


def test_the_staging_buffer_holds_the_largest_bucket():
    model = tiny_model()
    sizes = [p.numel() * p.element_size() for p in model.parameters()]
    assert W.staging_bytes(model.named_parameters(), 1) == max(W.aligned(s) for s in sizes)  # one tensor a bucket
    assert W.staging_bytes(model.named_parameters(), 2**30) == sum(W.aligned(s) for s in sizes)  # one bucket


@pytest.mark.slow  # starts the engine process
def test_the_engine_process_generates_what_the_rank_would_and_takes_every_push(serving):
    eng, model = serving
    assert eng.process.is_alive() and eng.process.pid != os.getpid()
    first = eng.generate(PROMPTS, GREEDY)
    assert first.completion_ids == here(model)
    usage = first.engine_usage  # measured where it ran
    assert usage["generate_s"] > 0 and usage["cpu_s"] > 0 and isinstance(usage["preempted"], int)
    with torch.no_grad():  # an optimizer step, as far as the engine can tell
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    assert here(model) != here(tiny_model(seed=0)), "the change must change greedy completions for this test"
    eng.push_weights()  # several buckets of 4 KiB through the staging buffer, then the weight check
    assert eng.last_check and "model.norm.weight" in eng.last_check
    assert eng.generate(PROMPTS, GREEDY).completion_ids == here(model)
    # submit returns a pending generation; answers come back by id, whichever is waited for first
    first, second = eng.submit(PROMPTS[:1], GREEDY), eng.submit(PROMPTS[1:], GREEDY)
    assert second.result().completion_ids == here(model, PROMPTS[1:])
    assert first.result().completion_ids == here(model, PROMPTS[:1])
    with eng.hold():
        assert len(eng.generate(PROMPTS, GREEDY).completion_ids) == 3


@pytest.mark.slow  # starts the engine process
def test_a_hold_does_not_wait_for_the_generation_in_flight(serving):
    """Overlap submits the next step's batch inside TRL's hold of the engine: leaving the hold must not wait for that
    generation (it did, and the trainer sat idle while vLLM generated: found on the H200). An error in a command
    nobody waits for comes up at the next wait."""
    eng, model = serving
    long = Sampling(max_tokens=200, temperature=0.0)
    with eng.hold():
        pending = eng.submit(PROMPTS * 8, long)
    assert not any(c.answers for c in eng.children), "leaving the hold waited for the generation"
    assert len(pending.result().completion_ids) == 24
    assert eng.generate(PROMPTS, GREEDY).completion_ids == here(model)
    assert not any(c.unawaited for c in eng.children)  # the hold's answers were read, in order, behind the generation's
    eng._send_only("hold_end")  # no hold to end: the child answers with an error
    with pytest.raises(EngineProcessError, match="the generation engine process failed: IndexError"):
        eng.generate(PROMPTS, GREEDY)


@pytest.mark.slow  # starts the engine process
def test_stop_reads_an_answer_too_big_for_the_pipe_that_nobody_waits_for(serving, capsys):
    """The generation an overlapped run takes ahead for a step that never runs: its answer (here 438 KB pickled, twice
    the pipe's 208 KiB socket buffer; a vLLM batch with logprobs is bigger still) must not keep the engine process
    from exiting (it did: the stop waited out STOP_S and terminated it, 30 s per overlapped run on the H200 and
    here). It now exits by itself once the generation is done (5.6 s for it on 2 idle cores; twice the tokens took
    27 s beside the other pytest worker). (It stops the shared engine process: the last test to take `serving`.)"""
    eng, _ = serving
    assert eng.process.is_alive()
    eng.submit([[1, 2, 3]] * 4096, Sampling(max_tokens=100, temperature=1.0))  # never collected
    eng.stop()
    line = [x for x in capsys.readouterr().out.splitlines() if "engine process stopped in" in x]
    assert line and float(line[0].split(" in ")[1].split()[0]) < P.STOP_S, line  # not "terminated in 30.x s"


@pytest.mark.slow  # starts the engine process (one for the three failures, in this order: ~4 s a start)
def test_an_error_keeps_it_serving_stale_weights_fail_the_check_and_its_death_ends_the_call(engine):
    """Three failures of one engine process, the last one ending it: an error in the engine process is one line and
    it keeps serving; weights changed without a push fail the check; a dead engine process ends the call with its
    exit code."""
    eng, model = engine
    # an error in the engine process is one line, and it keeps serving
    with pytest.raises(EngineProcessError, match="the generation engine process failed: IndexError"):
        eng.generate([[10_000]], GREEDY)  # not in the vocabulary
    assert eng.generate(PROMPTS, GREEDY).completion_ids == here(model)
    # weights changed without a push fail the check
    with torch.no_grad():
        model.model.norm.weight.add_(1.0)
    with pytest.raises(StaleWeightsError, match=r"model.norm.weight differs \(max abs difference 1\)"):
        eng.check_weights()
    # a dead engine process ends the call with its exit code
    pending = eng.submit(PROMPTS, Sampling(max_tokens=6, temperature=0.0))
    pending.result()
    os.kill(eng.process.pid, signal.SIGKILL)
    eng.process.join(timeout=10)
    with pytest.raises(EngineProcessError, match=r"engine process \(pid \d+\) ended with exit code -9"):
        eng.generate(PROMPTS, GREEDY)


@pytest.mark.slow  # starts the engine process
def test_an_engine_process_that_cannot_start_says_why(tmp_path, monkeypatch, capfd):
    """And, before it tries, it took its own MPS client priority (launch/mps.py) and said so in the rank's log."""
    monkeypatch.setenv("CUDA_MPS_CLIENT_PRIORITY", "1")
    monkeypatch.setenv("COLOCATE_RL_ENGINE_MPS_PRIORITY", "0")
    eng = P.ProcessEngine(
        spec(tmp_path / "missing"), tiny_model(), no_gather, bucket_bytes=4096, check_weights=True, device="cpu"
    )
    with pytest.raises(UserError, match="generation.engine_process: the engine process did not start .*missing"):
        eng.start()
    eng.stop()
    assert eng.process is None
    assert "MPS client settings CUDA_MPS_CLIENT_PRIORITY=0" in capfd.readouterr().out


def test_a_batch_is_split_in_order_among_the_engine_processes_and_joined_back():
    assert P.split(list(range(7)), 2) == [[0, 1, 2, 3], [4, 5, 6]]
    assert P.split([[1]], 3) == [[[1]], [], []]  # an engine process without prompts is not asked
    assert P.split(list(range(8)), 1) == [list(range(8))]
    a = Generation([[1, 2], [3]], [[-0.1, -0.2], [-0.3]], {"generate_s": 2.0, "cpu_s": 2.1, "preempted": 3})
    b = Generation([[4]], [[-0.4]], {"generate_s": 1.5, "cpu_s": 1.6, "preempted": 5})
    both = Generation.joined([a, b], at_once=True)
    assert both.completion_ids == [[1, 2], [3], [4]] and both.logprobs == [[-0.1, -0.2], [-0.3], [-0.4]]
    # the batch took as long as its slowest part; CPU seconds and preemptions add up over the processes
    assert both.engine_usage == {"generate_s": 2.0, "cpu_s": pytest.approx(3.7), "preempted": 8}
    assert (
        Generation.joined([a, Generation([[4]])], at_once=True).logprobs is None
    )  # a part without logprobs: none for the batch
    assert Generation.joined([a], at_once=True) is a


def test_each_engine_process_gets_its_own_seed_and_its_part_of_vllms_memory():
    base = {
        "kind": "vllm", "seed": 7, "max_batch": None,
        "llm_args": {"gpu_memory_utilization": 0.3, "max_num_seqs": 257, "tensor_parallel_size": 1},
        "options": {"max_num_seqs": None, "kv_cache_memory_bytes": 2**30, "sleep_level": 0},
    }  # fmt: skip
    assert P.child_specs(base, 1) == [base]
    first, second = P.child_specs(base, 2)
    assert [first["seed"], second["seed"]] == [7, 7 + P.SEED_STRIDE]
    for child in (first, second):
        assert child["llm_args"] == {"gpu_memory_utilization": 0.15, "max_num_seqs": 129, "tensor_parallel_size": 1}
        assert child["options"] == {"max_num_seqs": None, "kv_cache_memory_bytes": 2**29, "sleep_level": 0}
    assert base["llm_args"]["gpu_memory_utilization"] == 0.3  # the rank's spec is left as it was
    transformers = P.child_specs(spec("/m"), 2)
    assert [c["seed"] for c in transformers] == [0, P.SEED_STRIDE] and transformers[1]["device"] == "cpu"


@pytest.mark.slow  # starts two engine processes
def test_two_engine_processes_generate_what_the_rank_would_take_every_push_and_end_the_call_when_one_dies(saved):
    model = tiny_model(seed=0)
    eng = P.ProcessEngine(
        spec(saved), model, no_gather, bucket_bytes=4096, check_weights=True, device="cpu", processes=2
    )
    eng.start()
    try:
        pids = [c.process.pid for c in eng.children]
        assert len(set(pids)) == 2 and os.getpid() not in pids
        out = eng.generate(PROMPTS, GREEDY)  # 2 prompts to the first, 1 to the second
        assert eng.generate([], GREEDY).completion_ids == []
        assert out.completion_ids == here(model)
        assert out.engine_usage["generate_s"] > 0 and out.engine_usage["cpu_s"] > 0
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.5)
        eng.push_weights()  # the same staging buffer, loaded by both, then checked in both
        assert eng.generate(PROMPTS, GREEDY).completion_ids == here(model)
        with torch.no_grad():
            model.model.norm.weight.add_(1.0)
        with pytest.raises(StaleWeightsError, match=r"engine process 1: model.norm.weight differs"):
            eng.check_weights()
        os.kill(pids[1], signal.SIGKILL)
        eng.children[1].process.join(timeout=10)
        with pytest.raises(EngineProcessError, match=rf"engine process \(pid {pids[1]}\) ended with exit code -9"):
            eng.generate(PROMPTS, GREEDY)
    finally:
        eng.stop()
    assert eng.process is None and not eng.children


def test_the_vllm_engine_process_leaves_torchruns_world():
    """What torchrun gave the rank would make the engine process's one-process world wait for torchrun's store."""
    from colocate_rl.rank.engine_server import solo_world

    env = {"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RUN_ID": "x", "MASTER_PORT": "29500", "RANK": "3"}
    solo_world(env, 3, core_process=False)
    assert not any(k.startswith("TORCHELASTIC_") for k in env)
    assert env["MASTER_ADDR"] == "127.0.0.1" and env["MASTER_PORT"] != "29500" and int(env["MASTER_PORT"]) > 0
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0" and "CUDA_VISIBLE_DEVICES" not in env


@pytest.mark.parametrize(("visible", "local_rank", "sees"), [(None, 3, "3"), ("4,5,6,7", 1, "5"), ("2", 0, "2")])
def test_vllms_own_engine_core_process_sees_only_the_ranks_gpu(visible, local_rank, sees):
    """With vLLM's engine core in a process of its own, vLLM's executor takes GPU 0 of what that process sees: the
    engine process lets it see only the rank's GPU (numbered as the rank numbers them in CUDA_VISIBLE_DEVICES)."""
    from colocate_rl.rank.engine_server import solo_world

    env = {} if visible is None else {"CUDA_VISIBLE_DEVICES": visible}
    solo_world(env, local_rank, core_process=True)
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1" and env["CUDA_VISIBLE_DEVICES"] == sees


@pytest.mark.slow  # starts the engine process
def test_a_lora_model_is_pushed_merged_and_checked_under_its_own_module_names(saved):
    """LoRA: the engine process holds base + adapter merged; the check compares the last layer's adapted weights
    part by part (transformers names them q_proj, k_proj, ...; vLLM's fused qkv_proj is for the vLLM engine)."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_model(seed=0), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)  # an adapter that changes the weights (B starts at zero)
    eng = P.ProcessEngine(spec(saved), model, no_gather, bucket_bytes=4096, check_weights=True, device="cpu")
    eng.start()
    try:
        eng.push_weights()  # raised StaleWeightsError on fused names before the check took each part
        assert {"model.layers.2.self_attn.q_proj.weight", "model.layers.2.mlp.down_proj.weight"} <= set(eng.last_check)
        merged = model.merge_and_unload()
        assert eng.generate(PROMPTS, GREEDY).completion_ids == here(merged)
    finally:
        eng.stop()


def test_vllms_worker_loads_and_checks_the_staged_weights_as_collective_rpc_hands_them():
    """The worker extension that loads and compares weights in vLLM's own engine-core process. vLLM cannot run on
    CPU, so the worker is a test double: the extension's methods on an object whose `model_runner.model` has vLLM's
    `load_weights` (here: copy by name) over a real tiny model; the specs arrive as vLLM's msgpack hands them over
    (tuples as lists, here through JSON). The buffer is the CPU one `stage` fills (on the GPU: `open_shared`)."""
    import json
    from types import SimpleNamespace

    from colocate_rl.rank.adapter.vllm import StagedWeightsWorker

    class Model(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def load_weights(self, weights):
            params = dict(self.named_parameters())
            with torch.no_grad():
                for name, value in weights:
                    params[name].copy_(value)

    source, target = Model(tiny_model(seed=1)), Model(tiny_model(seed=0))
    worker = StagedWeightsWorker()
    worker.model_runner = SimpleNamespace(model=target)
    worker.colocate_rl_buffer = torch.empty(W.staging_bytes(source.named_parameters(), 2**20), dtype=torch.uint8)
    for bucket in W.fitting(list(source.named_parameters()), worker.colocate_rl_buffer.numel()):
        specs = json.loads(json.dumps(W.stage(worker.colocate_rl_buffer, bucket)))
        assert worker.colocate_rl_compare(specs) != []  # before the load: the seeds differ
        worker.colocate_rl_load(specs)
        assert worker.colocate_rl_compare(specs) == []
    for name, param in target.named_parameters():
        assert torch.equal(param, dict(source.named_parameters())[name]), name


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="CPU pinning is Linux's")
def test_the_usage_counts_the_times_another_thread_took_the_cpu(tmp_path):
    """What `engine_process/preempted` tells: a busy loop beside a second busy process pinned to the same CPU is
    switched out far more often than without it, and gets a smaller share of the CPU. Measured against the same loop
    without the rival, up to three times: other processes (the other pytest worker) may share the CPU too."""
    import multiprocessing
    import resource

    from colocate_rl.rank.engine_server import usage_since

    def busy(seconds: float) -> dict:
        before, started = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        while time.perf_counter() - started < seconds:
            pass
        return usage_since(before, started)

    def share(usage: dict) -> float:
        return usage["cpu_s"] / usage["generate_s"]

    cpu = min(os.sched_getaffinity(0))
    saved = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {cpu})
    tries = []
    try:
        for _ in range(3):
            alone = busy(0.3)
            rival = multiprocessing.get_context("fork").Process(target=_spin_on, args=(cpu, 3.0))
            rival.start()
            try:
                time.sleep(0.2)  # the rival is spinning
                shared = busy(0.6)
            finally:
                rival.kill()
                rival.join()
            tries.append((alone, shared))
            # on an idle CPU: ~0 against 30-150 switches, all of the CPU against about half of it
            if shared["preempted"] >= alone["preempted"] + 10 and share(shared) < 0.8 * share(alone):
                break
        else:
            raise AssertionError(tries)
    finally:
        os.sched_setaffinity(0, saved)


def _spin_on(cpu: int, seconds: float) -> None:
    os.sched_setaffinity(0, {cpu})
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def test_an_answer_awaited_longer_than_the_limit_is_reported_once_with_the_processes_pid(tmp_path):
    """The rank's wait for an engine process's answer: past `long_wait_s` it is told once (pid, the wait's start),
    and the answer still arrives. The engine process is a stand-in that is alive and answers late (its other end of
    the pipe, here); the pipe is real."""
    import multiprocessing
    import threading
    from types import SimpleNamespace

    mine, theirs = multiprocessing.Pipe()
    told = []
    eng = P.ProcessEngine(
        spec(tmp_path), tiny_model(), no_gather, bucket_bytes=4096, check_weights=False, device="cpu",
        on_long_wait=lambda pid, since: told.append((pid, since)), long_wait_s=0.2,
    )  # fmt: skip
    child = P.Child(SimpleNamespace(pid=4242, is_alive=lambda: True), mine)
    begin = time.time()
    threading.Timer(2.5, lambda: theirs.send((7, "ok", "late", True))).start()
    assert eng._await(child, 7) == "late"
    assert len(told) == 1 and told[0][0] == 4242 and begin - 0.1 <= told[0][1] <= begin + 0.5
