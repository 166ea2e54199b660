"""The adapter over the libraries' internals (colocate_rl/rank/adapter/) and the trainer subclass that puts the
generation engine under TRL's training step: checked against the installed TRL, DeepSpeed and PEFT; a renamed or
changed symbol ends the run before step 1 with one line naming it and the installed versions."""

import pytest
from conftest import ROOT, clean_env

from colocate_rl.rank import adapter
from colocate_rl.rank.adapter import trl as T


def test_the_installed_trl_has_every_hook_and_helper():
    from trl import GRPOTrainer, RLOOTrainer

    assert T.check_trainer_class(GRPOTrainer) == [] and T.check_trainer_class(RLOOTrainer) == []
    adapter.verify_installed(GRPOTrainer, vllm=False, deepspeed_offload=True, lora=True)  # DeepSpeed, PEFT too
    assert T.base_of(adapter.engine_trainer(RLOOTrainer)) == "RLOOTrainer"


def test_a_renamed_trl_method_is_named_with_the_installed_versions(monkeypatch):
    from trl import GRPOTrainer

    monkeypatch.setattr(GRPOTrainer, "_tokenize_prompts_v2", GRPOTrainer._tokenize_prompts, raising=False)
    monkeypatch.delattr(GRPOTrainer, "_tokenize_prompts")  # as a TRL release that renamed it would
    with pytest.raises(adapter.AdapterError) as e:
        adapter.verify_installed(GRPOTrainer, vllm=False, deepspeed_offload=False)
    [line] = e.value.lines
    assert line.startswith("trl GRPOTrainer._tokenize_prompts is missing: colocate-rl relies on it (installed: trl ")
    assert "written for trl 1.16.0" in line and "colocate_rl/rank/adapter/" in line


def test_a_changed_signature_is_named(monkeypatch):
    from trl import RLOOTrainer

    def _calculate_rewards(self, inputs, prompts, completions):  # a parameter dropped
        return None

    monkeypatch.setattr(RLOOTrainer, "_calculate_rewards", _calculate_rewards)
    with pytest.raises(adapter.AdapterError, match=r"^trl RLOOTrainer\._calculate_rewards\('self', 'inputs'"):
        adapter.verify_installed(RLOOTrainer, vllm=False, deepspeed_offload=False)


def test_missing_deepspeed_and_vllm_internals_are_named(monkeypatch):
    from deepspeed.runtime.engine import DeepSpeedEngine
    from trl import GRPOTrainer

    monkeypatch.delattr(DeepSpeedEngine, "offload_states")
    with pytest.raises(adapter.AdapterError, match=r"^deepspeed DeepSpeedEngine\.offload_states is missing"):
        adapter.verify_installed(GRPOTrainer, vllm=False, deepspeed_offload=True)
    monkeypatch.undo()
    try:
        import vllm  # noqa: F401
    except ImportError:  # CPU machines: vLLM cannot be installed, and a run that needs it is told so
        with pytest.raises(adapter.AdapterError, match=r"^vllm: No module named 'vllm'"):
            adapter.verify_installed(GRPOTrainer, vllm=True, deepspeed_offload=False)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from colocate_rl.builtin_model import build_model

    return build_model("tiny", tmp_path_factory.mktemp("model") / "tiny", seed=0)


@pytest.mark.parametrize("algorithm", ["grpo", "rloo"])
def test_trls_training_step_generates_through_the_engine(tiny, tmp_path, algorithm):
    """A real TRL trainer (one CPU process) trains one step: every completion comes from the engine, weights are
    pushed once for the step, the trainer passes the start-up check, and TRL's own class does not."""
    import trl

    from colocate_rl.builtin_model import load_tokenizer
    from colocate_rl.prompts import load_prompts
    from colocate_rl.rank.hf_engine import TransformersEngine, transformers_engine
    from colocate_rl.rewards import resolve_reward

    calls = []

    class Recording(TransformersEngine):
        def push_weights(self):
            calls.append(("push",))

        def generate(self, prompt_ids, sampling):
            out = super().generate(prompt_ids, sampling)
            calls.append(("generate", len(prompt_ids), sampling.temperature))
            return out

    def factory(trainer):
        engine = transformers_engine(trainer)
        engine.__class__ = Recording
        return engine

    Config, Trainer = (trl.GRPOConfig, trl.GRPOTrainer) if algorithm == "grpo" else (trl.RLOOConfig, trl.RLOOTrainer)
    config = Config(
        output_dir=str(tmp_path),
        use_cpu=True,
        bf16=False,
        report_to="none",
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=6,
        temperature=0.7,
        max_steps=1,
        save_strategy="no",
        disable_tqdm=True,
    )
    kwargs = dict(
        model=str(tiny),
        reward_funcs=[resolve_reward("digit_share", key="r")],
        args=config,
        train_dataset=load_prompts("builtin:digits", num_samples=8, seed=0),
        processing_class=load_tokenizer(tiny),
    )
    trainer = adapter.engine_trainer(Trainer)(**kwargs, engine_factory=factory)
    adapter.verify_trainer(trainer)
    trainer.train()
    assert calls == [("push",), ("generate", 4, 0.7)]  # one generation batch of the step, at the recipe's sampling
    plain = Trainer(**kwargs)
    with pytest.raises(adapter.AdapterError, match="generation engine is NoneType"):
        adapter.verify_trainer(plain)


# A sitecustomize that renames GRPOTrainer._generate_single_turn once TRL's module is imported (an import hook: processes
# that never import TRL, like the launcher, are untouched)
SITE = """
import importlib.abc, importlib.util, sys


class RenameOnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "trl.trainer.grpo_trainer":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            cls = module.GRPOTrainer
            cls._generate_single_turn_v2 = cls._generate_single_turn
            del cls._generate_single_turn

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, RenameOnImport())
"""


@pytest.mark.slow  # a real `colocate-rl train` through torchrun (~30 s)
def test_a_run_on_a_trl_with_a_renamed_hook_stops_before_step_1_with_one_line(tmp_path):
    """The ranks import a TRL whose `_generate_single_turn` was renamed (a sitecustomize on their PYTHONPATH does it):
    the run ends with exit 2 and the one line naming the symbol, before any step is logged."""
    import subprocess
    import sys

    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITE)
    env = clean_env(PYTHONPATH=f"{site}:{ROOT}", CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    run_dir = tmp_path / "run"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "colocate_rl",
            "train",
            "quickstart",
            "--run-dir",
            str(run_dir),
            "--set",
            "trainer.max_steps=2",
            "--set",
            "distributed.zero_stage=0",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        cwd=ROOT,
    )
    out = result.stdout + result.stderr
    assert result.returncode == 2, out[-3000:]
    assert "trl GRPOTrainer._generate_single_turn is missing: colocate-rl relies on it (installed: trl 1.16.0" in out
    assert not (run_dir / "metrics.jsonl").exists() or not (run_dir / "metrics.jsonl").read_text().strip()
    assert "Traceback" not in out and "ChildFailedError" not in out, out[-3000:]  # only the lines that say why
