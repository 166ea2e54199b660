"""GRPO's old log-probabilities from the loss's forward (colocate_rl.rank.adapter.trl_old_logprobs) against TRL's own
extra forward: the same losses, importance-sampling metrics and weights, one forward fewer.

vLLM cannot run here, so the engine is transformers' (the CPU path) made to return sampled log-probabilities as vLLM
does: the trainer's own, shifted per token to stand for the sampler's mismatch, so that the ratios are not all 1.
"""

from __future__ import annotations

import pytest
import torch
from conftest import cpu_trainer

from colocate_rl.rank import adapter
from colocate_rl.rank.adapter import trl_old_logprobs

METRICS = trl_old_logprobs.METRICS


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from colocate_rl.builtin_model import build_model

    return build_model("tiny", tmp_path_factory.mktemp("model") / "tiny", seed=0)


def _train(tiny, tmp_path, monkeypatch, *, from_loss: bool, mode: str, accumulation: int):
    import trl

    from colocate_rl.prompts import load_prompts

    forwards = []

    trl_forward = trl.GRPOTrainer._get_per_token_logps_and_entropies

    def counted(self, *args, **kwargs):  # TRL's forward, as it runs (with or without entropies: the loss's or not)
        forwards.append(kwargs.get("compute_entropy", False))
        return trl_forward(self, *args, **kwargs)

    class Trainer(adapter.engine_trainer(trl.GRPOTrainer)):
        old_logprobs_from_loss = from_loss

    trainer = cpu_trainer(
        Trainer,
        trl.GRPOConfig,
        tiny,
        tmp_path,
        load_prompts("builtin:digits", num_samples=16, seed=0),
        use_vllm=True,
        vllm_importance_sampling_mode=mode,
        vllm_importance_sampling_clip_min=0.5 if mode == "token_mask" else None,
        per_device_train_batch_size=8,
        gradient_accumulation_steps=accumulation,
        num_generations=4,
        max_completion_length=6,
    )
    adapter.verify_trainer(trainer)
    assert trainer.defers_old_logprobs == from_loss
    with monkeypatch.context() as patch:
        patch.setattr(trl.GRPOTrainer, "_get_per_token_logps_and_entropies", counted)
        trainer.train()
    logs = [row for row in trainer.state.log_history if "loss" in row]
    return logs, forwards, {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


@pytest.mark.parametrize(("mode", "accumulation"), [("sequence_mask", 2), ("token_truncate", 1), ("token_mask", 2)])
def test_the_loss_forms_the_importance_sampling_ratio_as_trls_extra_forward_does(
    tiny, tmp_path, monkeypatch, mode, accumulation
):
    run = dict(mode=mode, accumulation=accumulation)
    trl_logs, trl_forwards, trl_weights = _train(tiny, tmp_path / "a", monkeypatch, from_loss=False, **run)
    logs, forwards, weights = _train(tiny, tmp_path / "b", monkeypatch, from_loss=True, **run)
    # TRL: per step one no-grad forward of the generation batch, then one loss forward per micro-batch; here only the latter
    assert trl_forwards == [False, *[True] * accumulation] * 2
    assert forwards == [True] * accumulation * 2
    assert len(logs) == len(trl_logs) == 2
    for ours, theirs in zip(logs, trl_logs):
        for name in ("loss", *METRICS):
            assert ours[name] == pytest.approx(theirs[name], rel=1e-4, abs=1e-6), name
    assert any(row[METRICS[4]] != pytest.approx(1.0) for row in logs)  # the ratios did correct something
    for name, value in trl_weights.items():
        torch.testing.assert_close(weights[name], value, rtol=1e-4, atol=1e-6)
    assert any(not torch.equal(w, v) for w, v in zip(weights.values(), _initial(tiny).values()))  # it trained


def _initial(tiny):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny)).state_dict()


def test_a_moved_old_logprob_forward_is_named():
    import trl

    class Moved(trl.GRPOTrainer):
        def _generate_and_score_completions(self, inputs):  # the old-logprob forward gone
            return {}

    problems = trl_old_logprobs.check(Moved)
    assert any("no longer has `old_per_token_logps, _, _ =" in p for p in problems)
    assert trl_old_logprobs.check(trl.GRPOTrainer) == []
