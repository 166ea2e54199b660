"""benchmarks/bench_generation.py and benchmarks/generation_vllm.py without a GPU: the commands of every workload,
the engine arguments the standalone vLLM takes from a run directory (planned in-process, as `train` writes it, and
checked against the engine a real TRL trainer builds), the engine's SamplingParams and the variants, the probe (with
a stand-in for `vllm.LLM`), and the ratio table (from hand-written result rows, not measurements)."""

import json
import shlex
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from colocate_rl.pipeline import load_resolved
from colocate_rl.plan.host import assumed_host
from colocate_rl.plan.launch_plan import make_plan
from colocate_rl.recipe.load import parse_sets
from tests.conftest import ROOT, import_benchmark

bench = import_benchmark("bench_generation")
G = import_benchmark("generation_vllm")

SMOLLM2_CONFIG = {  # SmolLM2-135M-Instruct's config.json, the fields the memory plan reads
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "vocab_size": 49152,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
}


@pytest.fixture
def model_and_data(tmp_path):
    model = tmp_path / "smollm2"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(SMOLLM2_CONFIG))
    data = tmp_path / "gsm8k.jsonl"
    data.write_text(
        "".join(json.dumps({"question": f"What is {i} + 1?", "answer": f"#### {i + 1}"}) + "\n" for i in range(64))
    )
    return model, data


def args_for(*argv: str) -> SimpleNamespace:
    """The driver's parsed options (its defaults, then `argv`), without running it."""
    ns = SimpleNamespace(
        steps=bench.STEPS,
        warmup=bench.WARMUP,
        variants=bench.SAME_VARIANTS,
        mp_variants=bench.MP_VARIANTS,
        devices="0,1",
        model=None,
        data=None,
        set=[],
        override=[],
        env=[],
    )
    for key, value in zip(argv[::2], argv[1::2]):
        setattr(ns, key, value)
    return ns


def test_dry_run_prints_each_workloads_commands_and_runs_nothing(tmp_path, model_and_data, capsys):
    model, data = model_and_data
    out = tmp_path / "bench"
    code = bench.main(
        ["--out", str(out), "--workloads", "all", "--dry-run", "--model", str(model), "--data", str(data)]
    )
    lines = capsys.readouterr().out.splitlines()
    assert code == 0 and not out.exists()
    assert len(lines) == 5 * len(bench.WORKLOADS)  # colocated, timed, same, mp, trl per workload
    by_workload = {name: lines[5 * i : 5 * i + 5] for i, name in enumerate(bench.WORKLOADS)}
    for name, (colocated, timed, same, mp, trl) in by_workload.items():
        gpus = "0,1" if name == "b256" else "0"
        assert colocated.startswith(
            f"CUDA_VISIBLE_DEVICES={gpus} PYTHONPATH={bench.PROBE_PATH}:{bench.ROOT} COLOCATE_BENCH_PROBE=1 "
        )
        argv = shlex.split(colocated.split(" ", 3)[3])
        # stage timed: the same run without the probe, in its own run directory
        assert timed.startswith(f"CUDA_VISIBLE_DEVICES={gpus} PYTHONPATH={bench.ROOT} ") and "PROBE" not in timed
        timed_argv = shlex.split(timed.split(" ", 2)[2])
        assert timed_argv[argv.index("--run-dir") + 1] == str(out / "runs" / f"{name}.timed")
        assert [a for a in timed_argv if a != timed_argv[argv.index("--run-dir") + 1]] == [
            a for a in argv if a != argv[argv.index("--run-dir") + 1]
        ]
        assert argv[1:5] == ["-m", "colocate_rl", "train", bench.WORKLOADS[name][1]]
        assert argv[argv.index("--run-dir") + 1] == str(out / "runs" / name)
        sets = [argv[i + 1] for i, a in enumerate(argv) if a == "--set"]
        assert sets[: len(bench.WORKLOADS[name][2])] == bench.WORKLOADS[name][2]
        assert "trainer.max_steps=12" in sets and "output.save_model=false" in sets
        # stage trl: the same command with TRL's engine and the micro-batch as written, in its own run directory
        trl_argv = shlex.split(trl.split(" ", 3)[3])
        assert trl.split(" ", 3)[:3] == colocated.split(" ", 3)[:3]
        assert trl_argv[argv.index("--run-dir") + 1] == str(out / "runs" / f"{name}.trl")
        assert [trl_argv[i + 1] for i, a in enumerate(trl_argv) if a == "--set"] == sets + [
            "generation.engine=trl",
            "trainer.micro_batch_size=null",
        ]
        for line, stage, variants in ((same, "same", "trl,detok,lean"), (mp, "mp", "trl,lean")):
            # standalone: one GPU, colocate_rl from this checkout (the run on the GPU had none installed)
            assert line.startswith(f"CUDA_VISIBLE_DEVICES=0 PYTHONPATH={bench.ROOT} ")
            argv = shlex.split(line.split(" ", 2)[2])
            assert argv[1] == "benchmarks/generation_vllm.py"
            opts = dict(zip(argv[2::2], argv[3::2]))
            assert opts == {
                "--run-dir": str(out / "runs" / name),
                "--engine": stage,
                "--variants": variants,
                "--warmup": "2",
                "--batches": "10",
                "--out": str(out / "standalone" / f"{name}.{stage}.json"),
            }
    c256_sets = shlex.split(by_workload["c256"][0])
    assert f"model.name={model}" in c256_sets and f"data.source={data}" in c256_sets


def test_bad_options_exit_2_before_anything_runs(tmp_path, capsys):
    out = tmp_path / "bench"
    assert bench.main(["--out", str(out), "--workloads", "c256", "--dry-run"]) == 2
    assert "c256 needs --model" in capsys.readouterr().err
    assert bench.main(["--out", str(out), "--workloads", "b256", "--devices", "0", "--dry-run"]) == 2
    assert "b256 needs 2 GPUs" in capsys.readouterr().err
    assert bench.main(["--out", str(out), "--workloads", "a7", "--stages", "same,xx"]) == 2
    err = capsys.readouterr().err
    assert "unknown workload a7" in err and "unknown stage xx" in err
    assert not out.exists()


def plan_run_dir(name: str, run_dir: Path, args: SimpleNamespace) -> None:
    """Write the run directory `train` would write for the workload's colocated command (planned in-process, for a
    node of H200s, as tests/test_golden.py plans; `train --dry-run` writes nothing)."""
    argv = bench.colocated_command(run_dir.name, name, run_dir.parent.parent, args)
    sets = [argv[i + 1] for i, a in enumerate(argv) if a == "--set"]
    host = assumed_host(bench.WORKLOADS[name][0], 141.0, cpu_count=32)
    resolved, _ = load_resolved(ROOT / argv[4], parse_sets(sets), host=host, env={})
    plan = make_plan(resolved, run_dir=run_dir, python="python", cwd=ROOT, cache_dir=run_dir / "cache", base_env={})
    for rel, text in plan.files.items():
        (run_dir / rel).parent.mkdir(parents=True, exist_ok=True)
        (run_dir / rel).write_text(text)


COMMON = dict(  # what every workload's rank 0 passes to vllm.LLM besides the per-workload values
    tensor_parallel_size=1,
    model_impl="vllm",  # TRL 1.16's GRPOConfig.vllm_model_impl default
    distributed_executor_backend="external_launcher",
    seed=0,
    max_num_batched_tokens=4096,
    logprobs_mode="processed_logprobs",
    trust_remote_code=False,
    enforce_eager=False,
    enable_prefix_caching=True,
)


@pytest.mark.parametrize(
    "name, expected, max_tokens",
    [
        ("a16", dict(gpu_memory_utilization=0.25, max_model_len=512, max_num_seqs=16), 256),
        ("a128", dict(gpu_memory_utilization=0.25, max_model_len=512, max_num_seqs=128), 256),
        ("b256", dict(gpu_memory_utilization=0.25, max_model_len=768, max_num_seqs=128, enable_sleep_mode=True), 512),
        # the recipe's share is auto: what 256 sequences need + 5 % (planned for one 140 GiB GPU)
        ("c256", dict(gpu_memory_utilization=0.1, max_model_len=768, max_num_seqs=256), 256),
    ],
)
def test_standalone_engine_arguments_come_from_the_run_dir(name, expected, max_tokens, tmp_path, model_and_data):
    model, data = model_and_data
    run_dir = tmp_path / "bench" / "runs" / name
    plan_run_dir(name, run_dir, args_for("model", str(model), "data", str(data)))
    kwargs = G.engine_kwargs(run_dir)
    spec = json.loads((run_dir / "launch.json").read_text())
    if name != "b256":  # sleep_level auto, decided by the plan (here without a GPU: 2): launch.json holds the level
        expected["enable_sleep_mode"] = spec["engine"]["sleep_level"] > 0
    assert kwargs == dict(model=spec["model_path"], **COMMON, **expected)
    assert spec["model_path"] == (str(model) if name == "c256" else str(run_dir / "model"))
    sampling = G.sampling_kwargs(G.trl_config(G.read_launch(run_dir)))
    assert sampling == dict(
        n=1,
        repetition_penalty=1.0,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        min_p=0.0,
        max_tokens=max_tokens,
        logprobs=0,
        detokenize=False,  # colocate-rl's engine reads token ids only
        flat_logprobs=True,  # and the logprobs as flat lists
    )
    assert bench.completions_per_rank(spec["trl_args"]) == expected["max_num_seqs"]


def tiny_model_dir(path: Path) -> Path:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from colocate_rl import builtin_model

    builtin_model._train_tokenizer(path, 512)
    config = Qwen2Config(
        vocab_size=512,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    Qwen2ForCausalLM(config).save_pretrained(path)
    return path


@pytest.mark.parametrize("algorithm", ["grpo", "rloo"])
def test_engine_arguments_equal_those_of_the_engine_a_real_trainer_builds(algorithm, tmp_path, monkeypatch):
    """A real TRL trainer of colocate-rl's (the worker's engine factory, vLLM's start skipped) builds colocate-rl's
    engine; its llm_kwargs and training sampling are what generation_vllm rebuilds from a run directory holding the
    same launch.json."""
    from datasets import Dataset

    from colocate_rl.builtin_model import load_tokenizer
    from colocate_rl.plan.engine_options import EngineOptions
    from colocate_rl.plan.launch_spec import LaunchSpec
    from colocate_rl.rank import vllm_engine as E
    from colocate_rl.rank.adapter import engine_trainer
    from colocate_rl.rank.engine import Sampling
    from colocate_rl.rank.worker import config_args, engine_factory
    from colocate_rl.recipe.schema import GenerationSection

    model = tiny_model_dir(tmp_path / "model")
    options = EngineOptions.from_generation(GenerationSection(sleep_level=2, max_num_batched_tokens=8192))
    trl_args = dict(
        output_dir=str(tmp_path / "checkpoints"),
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        num_generations=4,
        max_completion_length=32,
        temperature=0.9,
        top_k=5,
        seed=3,
        use_vllm=True,
        vllm_mode="colocate",
        vllm_gpu_memory_utilization=0.25,
        vllm_tensor_parallel_size=1,
        vllm_enable_sleep_mode=True,
        vllm_max_model_length=128,
        generation_kwargs={"seed": 7},
        report_to="none",
        bf16=False,
    )
    if algorithm == "grpo":
        from trl import GRPOConfig as Config
        from trl import GRPOTrainer as Trainer
    else:
        from trl import RLOOConfig as Config
        from trl import RLOOTrainer as Trainer
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    spec = LaunchSpec(
        model_path=str(model),
        algorithm=algorithm,
        backend="vllm",
        device="cuda",
        world_size=1,
        trl_args={**trl_args, "bf16": True, "deepspeed": "/nowhere/deepspeed.json"},  # not read for generation
        engine=options,
        recipe_hash="0",
    )
    (run_dir / "launch.json").write_text(spec.to_json())
    recipe = {"algorithm": algorithm, "model": {"name": str(model)}, "data": {"source": "builtin:digits"}}
    recipe.update(rewards=[{"name": "digit_share"}], trainer={"seed": trl_args["seed"]})
    (run_dir / "recipe.yaml").write_text(json.dumps(recipe))  # JSON is YAML

    monkeypatch.setattr(E.VLLMEngine, "start", lambda self: None)  # vLLM cannot start here
    # as the worker builds it
    factory, trl_builds_vllm = engine_factory(spec, run_dir, trl_args["seed"], GenerationSection())
    trainer = engine_trainer(Trainer)(
        model=str(model),
        reward_funcs=[lambda completions, **kwargs: [0.0] * len(completions)],
        args=Config(**config_args(Config, trl_args)),
        train_dataset=Dataset.from_list([{"prompt": "Count from 1 to 5."}] * 8),
        processing_class=load_tokenizer(model),
        engine_factory=factory,
        trl_builds_vllm=trl_builds_vllm,
    )
    real = trainer.engine
    assert isinstance(real, E.VLLMEngine) and not trl_builds_vllm
    # before another TRL config resets accelerate's state (building a TrainingArguments does)
    real_kwargs = real.llm_kwargs()
    real_sampling = E.sampling_kwargs(Sampling.from_args(trainer.args))  # what TRL's generation step asks for

    rebuilt = G.build_engine(run_dir)
    assert rebuilt.llm_kwargs() == real_kwargs
    assert real_kwargs["max_num_seqs"] == 8 and real_kwargs["max_num_batched_tokens"] == 8192
    assert real_kwargs["seed"] == 3  # trainer.seed + the tensor-parallel group of rank 0
    assert G.sampling_kwargs(G.trl_config(G.read_launch(run_dir))) == real_sampling
    assert real_sampling["logprobs"] == 0  # colocate-rl's engine returns them for RLOO too (RLOO does not use them)
    assert (real_sampling["temperature"], real_sampling["top_k"], real_sampling["max_tokens"]) == (0.9, 5, 32)
    assert real_sampling["seed"] == 7  # generation_kwargs reach SamplingParams last


def test_variants_change_one_thing_each_and_groups_are_found():
    base = dict(n=1, temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, repetition_penalty=1.0, max_tokens=8, logprobs=0)
    assert G.variant_sampling(base, "trl") == base
    assert G.variant_sampling(base, "nodetok") == {**base, "detokenize": False}
    assert G.variant_sampling(base, "detok") == {**base, "detokenize": True}
    assert G.variant_sampling(base, "lean") == {**base, "logprobs": None, "detokenize": False}
    assert G.variant_sampling(base, "flat") == {**base, "detokenize": False, "flat_logprobs": True}
    assert G.variant_sampling(base, "nested") == {**base, "flat_logprobs": False}
    with pytest.raises(SystemExit, match="stop strings"):
        G.variant_sampling({**base, "stop": ["\n"]}, "nodetok")
    with pytest.raises(SystemExit, match="unknown variant"):
        G.variant_sampling(base, "fast")
    assert G.prompt_groups([[1, 2]] * 3 + [[3]] * 3) == ([[1, 2], [3]], 3)
    assert G.prompt_groups([[1, 2]] * 3 + [[3]] * 2) is None


class FakeCompletion:
    def __init__(self, n):
        self.token_ids, self.logprobs = list(range(n)), None


class FakeLLM:
    """Stands in for vllm.LLM: each prompt gets `len(prompt)` completion tokens."""

    def __init__(self):
        cfg = SimpleNamespace(
            scheduler_config=SimpleNamespace(max_num_seqs=128, max_num_batched_tokens=4096, async_scheduling=True),
            cache_config=SimpleNamespace(enable_prefix_caching=True),
            model_config=SimpleNamespace(enforce_eager=False, max_model_len=512),
            compilation_config=SimpleNamespace(max_cudagraph_capture_size=256),
            parallel_config=SimpleNamespace(distributed_executor_backend="external_launcher"),
        )
        self.llm_engine = SimpleNamespace(vllm_config=cfg, engine_core=SimpleNamespace())

    def generate(self, prompts, sampling_params=None, use_tqdm=True):
        return [SimpleNamespace(outputs=[FakeCompletion(len(p["prompt_token_ids"]))]) for p in prompts]


def vllm_engine(run_dir: Path, rank: int):
    """colocate-rl's VLLMEngine whose `start` brings up a FakeLLM (the real one starts vLLM)."""
    from colocate_rl.plan.engine_options import EngineOptions
    from colocate_rl.rank import vllm_engine as E
    from colocate_rl.recipe.schema import GenerationSection

    accelerator = SimpleNamespace(process_index=rank, num_processes=rank + 1)
    options = EngineOptions.from_generation(GenerationSection(sleep_level=0))
    engine = E.VLLMEngine(None, accelerator, options, {}, gather=None, run_dir=run_dir)
    engine.start = lambda: setattr(engine, "llm", FakeLLM())
    return engine


def test_probe_records_each_generate_of_a_rank(tmp_path, monkeypatch):
    """colocate-rl's trainer (its hooks over a stand-in base class) starts its engine and the probe attaches to it;
    the engine's own `_generate` then records each vLLM call and its `read_outputs` (a stand-in SamplingParams)."""
    from colocate_rl.rank import vllm_engine as E
    from colocate_rl.rank.adapter import trl as A
    from colocate_rl.rank.engine import Sampling

    monkeypatch.setattr(A._EngineHooks, "__init__", A._EngineHooks.__init__)  # restored after the test
    monkeypatch.setattr(E, "read_outputs", E.read_outputs)  # the probe wraps it
    G.patch_engine(A)
    G.patch_engine(A)  # once only
    assert A._EngineHooks.__init__._bench_probe

    monkeypatch.setenv(G.PROFILE_ENV, "generate=1")
    engine = vllm_engine(tmp_path, rank=1)
    base = type("Base", (), {"__init__": lambda self, *args, **kwargs: None})
    trainer = type("Trainer", (A.GRPOHooks, base), {})(
        args=SimpleNamespace(use_vllm=False), engine_factory=lambda t: engine
    )
    assert trainer.engine is engine and engine.llm.generate._bench_probe and E.read_outputs._bench_probe
    G.probe_engine(engine)  # once only
    monkeypatch.setitem(sys.modules, "vllm", SimpleNamespace(SamplingParams=lambda **kwargs: SimpleNamespace(**kwargs)))
    for batch in ([[1, 2, 3]] * 2, [[4, 5]] * 2):
        out = engine._generate(batch, Sampling(max_tokens=8, top_k=3))
        assert out.completion_ids == [list(range(len(p))) for p in batch]
    record, calls, extract = G.read_probe(tmp_path, rank=1)
    assert record["config"]["max_num_seqs"] == 128 and record["config"]["max_cudagraph_capture_size"] == 256
    assert record["config"]["engine_core_client"] == "SimpleNamespace" and record["gc_off"] is False
    assert [c["prompt_token_ids"] for c in calls] == [[[1, 2, 3]] * 2, [[4, 5]] * 2]
    assert [c["completion_tokens"] for c in calls] == [6, 4] and [c["requests"] for c in calls] == [2, 2]
    assert calls[0]["sampling"]["logprobs"] == 0 and calls[0]["sampling"]["top_k"] == 3
    assert calls[0]["sampling"]["detokenize"] is False and calls[0]["sampling"]["flat_logprobs"] is True
    assert calls[0]["gc_tracked_objects"] > 0 and "gc_tracked_objects" not in calls[1]
    assert set(extract) == {0, 1} and all(c["llm_generate_s"] >= 0 for c in calls)
    profile = json.loads((tmp_path / "bench" / "profile.generate.rank1.json").read_text())
    assert profile["wall_s"] > 0 and profile["kernels"] == 0  # call 1 (no torch work in the fake: nothing else)


def test_the_engine_process_is_probed_where_it_builds_its_engine(tmp_path, monkeypatch):
    """`generation.engine_process`: the probe attaches in the engine's own process, to the engine `child_vllm` built
    and started there (a stand-in here: vLLM cannot start on CPU), and records its generations for the standalone."""
    from colocate_rl.rank import engine_server as S
    from colocate_rl.rank import vllm_engine as E
    from colocate_rl.rank.engine import Sampling

    def build(spec):  # what engine_server.child_vllm returns: an engine, started
        engine = vllm_engine(tmp_path, rank=0)
        engine.start()
        return engine

    monkeypatch.setattr(S, "child_vllm", build)
    monkeypatch.setattr(E, "read_outputs", E.read_outputs)  # the probe wraps it
    G.patch_engine_process(S)
    G.patch_engine_process(S)  # once only
    engine = S.child_vllm({})
    assert engine.llm.generate._bench_probe and S.child_vllm._bench_probe
    monkeypatch.setitem(sys.modules, "vllm", SimpleNamespace(SamplingParams=lambda **kwargs: SimpleNamespace(**kwargs)))
    engine._generate([[1, 2, 3]] * 2, Sampling(max_tokens=8))
    _record, calls, _extract = G.read_probe(tmp_path, rank=0)
    assert [c["prompt_token_ids"] for c in calls] == [[[1, 2, 3]] * 2]


def test_trl_engine_and_training_step_are_probed_in_a_worker(tmp_path, monkeypatch):
    """TRL's engine (`generation.engine: trl`, no run_dir of its own) records into the worker's RUN_DIR, its
    extraction TRL's `extract_logprobs`; the training_step call named in COLOCATE_BENCH_PROFILE is profiled (a test
    double for TRL's trainer class: the probe patches it by name)."""
    import torch
    import trl.generation.vllm_generation as trl_vllm

    from colocate_rl.rank.hf_engine import TRLEngine

    class Trainer:
        accelerator = SimpleNamespace(process_index=0)

        def training_step(self, x):
            return torch.ones(64, 64) @ torch.ones(64, 64) * x

    monkeypatch.setattr(sys, "argv", ["colocate_rl/worker.py", str(tmp_path)])
    monkeypatch.setattr(trl_vllm, "extract_logprobs", trl_vllm.extract_logprobs)  # the probe wraps it
    monkeypatch.setenv(G.PROFILE_ENV, "train=1,generate=x")
    assert G.profile_targets() == {"train": 1}
    G.patch_trainer(SimpleNamespace(GRPOTrainer=Trainer))
    engine, trainer = TRLEngine(SimpleNamespace(llm=FakeLLM(), accelerator=SimpleNamespace(process_index=0))), Trainer()
    G.probe_engine(engine)
    G.probe_engine(TRLEngine(SimpleNamespace(llm=None)))  # TRL's server mode: no vLLM in the rank, left alone
    for batch in ([[1, 2]], [[3, 4, 5]]):  # as TRL's VLLMGeneration.generate calls them
        outputs = engine.vllm.llm.generate([{"prompt_token_ids": p} for p in batch], SimpleNamespace(n=1))
        trl_vllm.extract_logprobs(outputs)
    _, calls, extract = G.read_probe(tmp_path, 0)
    assert [c["completion_tokens"] for c in calls] == [2, 3] and set(extract) == {0, 1}
    assert [float(trainer.training_step(k)[0, 0]) for k in (1, 2, 3)] == [64.0, 128.0, 192.0]
    profile = json.loads((tmp_path / "bench" / "profile.train.rank0.json").read_text())
    assert any("mm" in name for name, _, _ in profile["top_cpu_ms"])  # call 1 was profiled


def write_hand_made_results(out: Path, name: str) -> None:
    """A finished workload's files, with made-up numbers: 3 steps (1 warm-up), 100 tokens per generation."""
    run = out / "runs" / name
    (run / "bench").mkdir(parents=True)
    steps = [
        {"step": i + 1, "reward": 0.1, "time/generate_s": s, "completions/mean_length": 50.0, "wall_s": wall}
        | {"time/train_s": train, "time/wake_s": 0.05, "time/sleep_s": 0.02, "mem/gpu_peak_gib": peak}
        for i, (s, wall, train, peak) in enumerate(
            ((9.0, 10.0, 5.0, 30.0), (2.0, 13.0, 1.0, 10.0), (2.0, 16.5, 1.2, 12.0))
        )
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in steps))
    sampling = {"n": 1, "logprobs": 0}
    probe = [{"kind": "engine", "config": {"max_num_seqs": 2, "max_cudagraph_capture_size": 4}, "gc_off": False}]
    probe += [
        {
            "kind": "call",
            "call": i,
            "requests": 2,
            "completion_tokens": 100,
            "llm_generate_s": 1.5,
            "gc_s": 0.01,
            "sampling": sampling,
            "prompt_token_ids": [[1], [1]],
        }
        for i in range(3)
    ]
    probe += [{"kind": "extract", "call": i, "s": 0.25} for i in range(3)]
    (run / "bench" / "generate_calls.rank0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in probe))
    standalone = {
        "config": {"max_num_seqs": 2, "max_cudagraph_capture_size": 4},
        "variants": {
            "trl": {
                "sampling": sampling,
                "batches": [{"s": 5.0, "tokens": 100}] + [{"s": 1.0, "tokens": 100, "post_s": 0.2}] * 2,
            },
            "lean": {
                "sampling": {"n": 1, "logprobs": None},
                "batches": [{"s": 5.0, "tokens": 100}] + [{"s": 0.5, "tokens": 100}] * 2,
            },
            "rescore": {
                "sampling": {"n": 1, "logprobs": None},
                "batches": [{"s": 5.0, "tokens": 100, "rescore_s": 1.0}]
                + [{"s": 0.7, "generate_s": 0.5, "rescore_s": 0.2, "tokens": 100}] * 2,
                "agreement": {"tokens": 200, "max_abs": 0.03, "mean_abs": 0.004, "mean": 0.001},
            },
        },
    }
    (out / "standalone").mkdir(parents=True)
    (out / "standalone" / f"{name}.same.json").write_text(json.dumps(standalone))


def test_ratio_and_table_from_hand_written_result_files(tmp_path):
    """Made-up numbers, not measurements: colocated 2 s and standalone 1 s per 100-token batch → ratio 0.5."""
    write_hand_made_results(tmp_path, "a16")
    row = bench.figures("a16", tmp_path, 1, {"colocated": 0, "same": 0}, ["cmd"])
    c = row["colocated"]
    assert (c["measured"], c["s_per_batch"], c["tokens_per_s"], c["tokens_from"]) == (2, 2.0, 50.0, "probe")
    assert (c["llm_generate_s"], c["extract_s"], c["gc_s"], c["requests"]) == (1.5, 0.25, 0.01, 2)
    # the whole step over the measured steps only: the warm-up's 5 s train phase and 30 GiB peak are left out
    assert (c["s_per_step"], c["train_s"], c["wake_sleep_s"], c["gpu_peak_gib"]) == (3.5, 1.1, 0.07, 12.0)
    assert c["weight_sync_s"] is None
    trl = row["same"]["variants"]["trl"]
    assert (trl["s_per_batch"], trl["tokens_per_s"], trl["post_s"]) == (1.0, 100.0, 0.2)
    assert row["same"]["variants"]["lean"]["tokens_per_s"] == 200.0
    assert row["ratio"] == 0.5 and row["sampling_match"] is True and row["config_diff"] == {}
    assert "mp" not in row

    text = bench.table([{**row, "ratio": 0.1}, row])  # the last row of a workload wins
    header, rule, line = text.splitlines()[:3]
    cells = dict(
        zip([h.strip() for h in header.strip("|").split("|")], [v.strip() for v in line.strip("|").split("|")])
    )
    assert len(rule.split("|")) == len(bench.TABLE_COLUMNS) + 2
    assert cells["workload"] == "a16" and cells["ratio colocated/standalone"] == "0.5"
    assert cells["colocated tok/s"] == "50.0" and cells["standalone tok/s"] == "100.0"
    assert cells["standalone lean tok/s"] == "200.0" and cells["mp-engine trl tok/s"] == ""
    assert (cells["standalone rescore s/batch"], cells["rescore's prefill s"]) == ("0.7", "0.2")
    assert cells["rescore vs sampled logprobs, max abs diff"] == "0.03"
    assert cells["exits"] == "colocated:0 same:0" and cells["CUDA graph max size"] == "4"
    assert text.count("| a16 |") == 1 and "ratio = colocated tokens/s" in text


def test_the_ratio_takes_the_unprobed_runs_generate_phase_where_it_ran(tmp_path):
    """Made-up numbers: the probed run 2 s a batch, the timed (unprobed) run 1.25 s, standalone 1 s → ratio 0.8 from
    the timed run, with its tokens from completions/mean_length (it has no probe records)."""
    write_hand_made_results(tmp_path, "c256")
    run, timed = tmp_path / "runs" / "c256", tmp_path / "runs" / "c256.timed"
    timed.mkdir()
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    faster = [{**r, "time/generate_s": 1.25} for r in records]
    (timed / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in faster))
    (timed / "launch.json").write_text(json.dumps({"trl_args": {"per_device_train_batch_size": 2}}))
    row = bench.figures("c256", tmp_path, 1, {"colocated": 0, "timed": 0, "same": 0}, [])
    assert row["colocated"]["tokens_per_s"] == 50.0 and row["timed"]["tokens_per_s"] == 80.0
    assert row["timed"]["tokens_from"] == "completions/mean_length"
    assert (row["ratio"], row["ratio_from"]) == (0.8, "timed")
    assert "| 1.25 | 80.0 |" in bench.table([row])
    (timed / "metrics.jsonl").unlink()  # no timed run: the probed run's figure, and the row says so
    without = bench.figures("c256", tmp_path, 1, {}, [])
    assert (without["ratio"], without["ratio_from"]) == (0.5, "colocated (probed)")


def test_table_option_rewrites_table_md_from_results(tmp_path):
    write_hand_made_results(tmp_path, "a128")
    row = bench.figures("a128", tmp_path, 1, {"colocated": 0}, [])
    (tmp_path / "results.jsonl").write_text(json.dumps(row) + "\n")
    assert bench.main(["--out", str(tmp_path), "--table"]) == 0
    assert "| a128 | 2 | 3.5 |  |  | 1.1 |  | 0.07 | 12.0 | 2.0 | 50.0 |" in (tmp_path / "table.md").read_text()


def test_the_trl_engine_stage_is_compared_step_for_step(tmp_path):
    """Made-up numbers: the same steps twice as long with TRL's engine (runs/NAME.trl) → × vs TRL engine 2.0."""
    write_hand_made_results(tmp_path, "c256")
    run, trl = tmp_path / "runs" / "c256", tmp_path / "runs" / "c256.trl"
    trl.mkdir()
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    slower = [{**r, "wall_s": 2 * r["wall_s"], "time/generate_s": 2 * r["time/generate_s"]} for r in records]
    (trl / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in slower))
    (trl / "launch.json").write_text(json.dumps({"trl_args": {"per_device_train_batch_size": 2}}))
    row = bench.figures("c256", tmp_path, 1, {"colocated": 0, "trl": 0}, [])
    assert (row["colocated"]["s_per_step"], row["trl_engine"]["s_per_step"], row["vs_trl_engine"]) == (3.5, 7.0, 2.0)
    assert row["trl_engine"]["tokens_from"] == "completions/mean_length"  # no probe records with TRL's engine
    assert "| c256 | 2 | 3.5 | 7.0 | 2.0 | 1.1 |" in bench.table([row])


def test_launch_env_is_what_launch_sh_exports(tmp_path):
    (tmp_path / "launch.sh").write_text(
        "#!/usr/bin/env bash\nset -euo pipefail\ncd /x\nexport OMP_NUM_THREADS=16\nexport A='b c'\nexec python -m x\n"
    )
    assert G.launch_env(tmp_path) == {"OMP_NUM_THREADS": "16", "A": "b c"}
    assert G.parse_overrides(["max_num_batched_tokens=16384", "kv=text"]) == {
        "max_num_batched_tokens": 16384,
        "kv": "text",
    }


@pytest.mark.slow
def test_sitecustomize_patches_the_engine_only_in_a_probed_worker():
    """benchmarks/generation_probe on PYTHONPATH: a process whose command line names colocate_rl.worker (or a spawned
    one's, `--multiprocessing-fork`), with COLOCATE_BENCH_PROBE=1, gets the engine patched on import; any other process
    gets no import hook."""
    import subprocess

    from tests.conftest import clean_env

    env = clean_env(PYTHONPATH=str(bench.PROBE_PATH), COLOCATE_BENCH_PROBE="1", COLOCATE_BENCH_PROFILE="train=2")
    code = (
        "import colocate_rl.rank.adapter.trl as A, trl.trainer.grpo_trainer as T, sys;"
        "import colocate_rl.rank.engine_server as S;"
        "print(A._EngineHooks.__init__._bench_probe, T.GRPOTrainer.training_step._bench_probe, S.child_vllm._bench_probe,"
        " [type(f).__name__ for f in sys.meta_path].count('_Finder'))"
    )  # the hook leaves once every module it patches is imported
    worker = subprocess.run([sys.executable, "-c", code, "colocate_rl.worker"], env=env, capture_output=True, text=True)
    assert worker.stdout.strip() == "True True True 0", worker.stderr[-2000:]
    hooks = "import sys; print([type(f).__name__ for f in sys.meta_path if type(f).__name__ == '_Finder'])"
    other = subprocess.run([sys.executable, "-c", hooks], env=env, capture_output=True, text=True)
    assert other.stdout.strip() == "[]", other.stderr[-2000:]
    # a process a rank spawned (its engine process): the engine it builds is patched there
    code = "import colocate_rl.rank.engine_server as S; print(S.child_vllm._bench_probe)"
    spawned = subprocess.run([sys.executable, "-c", code, "--multiprocessing-fork"], env=env, capture_output=True,
                             text=True)  # fmt: skip
    assert spawned.stdout.strip() == "True", spawned.stderr[-2000:]


def test_an_experiments_recipe_override_reaches_both_sides(tmp_path):
    """`--set trainer.extra_args.generation_kwargs={detokenize: true}` (an experiment row) changes the engine's
    SamplingParams in the colocated run (generation_kwargs are merged last), so the standalone's `trl` variant
    follows it from the run directory."""
    run_dir = tmp_path / "bench" / "runs" / "a128+detok"
    argv_sets = ["trainer.extra_args.generation_kwargs={detokenize: true}", "trainer.seed=5"]
    plan_run_dir("a128", run_dir, args_for("set", argv_sets))
    assert G.sampling_kwargs(G.trl_config(G.read_launch(run_dir)))["detokenize"] is True
    kwargs = G.engine_kwargs(run_dir)
    assert kwargs["max_num_seqs"] == 128 and kwargs["seed"] == 5  # vLLM samples from trainer.seed on rank 0


def test_the_rescore_variant_reads_each_completion_tokens_logprob_from_the_prompt_logprobs():
    """Stand-ins for vLLM's request outputs (vLLM does not run here), shaped as vLLM 0.26 fills them: prompt
    logprobs hold nothing at position 0, then one entry per position (the token itself, `prompt_logprobs=0`), as
    `FlatLogprobs` lists or as one dict per position."""
    prompts = [[5, 6], [7]]
    sampled = [
        SimpleNamespace(outputs=[SimpleNamespace(token_ids=[8, 9])]),
        SimpleNamespace(outputs=[SimpleNamespace(token_ids=[4])]),
    ]
    requests = G.rescore_requests(prompts, sampled)
    assert requests == [{"prompt_token_ids": [5, 6, 8, 9]}, {"prompt_token_ids": [7, 4]}]
    flat = SimpleNamespace(
        prompt_token_ids=[5, 6, 8, 9],
        prompt_logprobs=SimpleNamespace(start_indices=[0, 0, 1, 2], logprobs=[-1.0, -2.0, -3.0]),
    )
    nested = SimpleNamespace(prompt_token_ids=[7, 4], prompt_logprobs=[None, {4: SimpleNamespace(logprob=-0.5)}])
    assert G.rescored_logprobs([flat, nested], [2, 1]) == [[-2.0, -3.0], [-0.5]]
    found = G.agreement([[-2.1, None], [-0.5]], [[-2.0, -3.0], [-0.5]])
    assert found == {"tokens": 2, "max_abs": 0.1, "mean_abs": 0.05, "mean": -0.05}
    assert G.variant_sampling({"logprobs": 0, "max_tokens": 16}, "rescore") == {
        "logprobs": None,
        "max_tokens": 16,
        "detokenize": False,
    }
    assert G.RESCORE["prompt_logprobs"] == 0 and G.RESCORE["max_tokens"] == 1
