"""Micro-batches re-cut by length and trimmed (colocate_rl.rank.adapter.trl_micro_batches): the cut itself, and TRL's
trainers trained with and without it on the CPU: the same losses and weights, narrower forwards.

The engine is transformers' (the CPU path; vLLM cannot run here), returning the trainer's own log-probabilities
shifted per token as the sampler's (conftest.engine_with_sampler_logprobs), so that the importance-sampling correction is on.
"""

from __future__ import annotations

import pytest
import torch
from conftest import cpu_trainer

from colocate_rl.rank import adapter
from colocate_rl.rank.adapter import trl_micro_batches as mb


def _batch(prompt_lengths, completion_lengths, width_p=6, width_c=5, start=0):
    """A micro-batch as TRL makes it: prompts padded on the left, completions on the right, per-token entries."""
    rows = len(prompt_lengths)
    prompt_mask = torch.zeros(rows, width_p, dtype=torch.long)
    completion_mask = torch.zeros(rows, width_c, dtype=torch.long)
    for i, (p, c) in enumerate(zip(prompt_lengths, completion_lengths)):
        prompt_mask[i, width_p - p :] = 1
        completion_mask[i, :c] = 1
    ids = torch.arange(start, start + rows)[:, None]
    return {
        "prompt_ids": ids * 100 + torch.arange(width_p) * prompt_mask,
        "prompt_mask": prompt_mask,
        "completion_ids": ids * 100 + 50 + torch.arange(width_c) * completion_mask,
        "completion_mask": completion_mask,
        "sampling_per_token_logps": -ids.float() - torch.arange(width_c) / 10,
        "importance_sampling_ratio": ids.float() + 1.0,  # (rows, 1): sequence level
        "advantages": ids.float().squeeze(1),
        "num_items_in_batch": torch.tensor(17.0),
    }


def _rows(batches):
    """Each row's real tokens and entries, by its id: what a re-cut must keep."""
    out = {}
    for b in batches:
        for i in range(b["prompt_ids"].size(0)):
            pm, cm = b["prompt_mask"][i].bool(), b["completion_mask"][i].bool()
            out[int(b["advantages"][i])] = (
                b["prompt_ids"][i][pm].tolist(),
                b["completion_ids"][i][cm].tolist(),
                b["sampling_per_token_logps"][i][cm].tolist(),
                float(b["importance_sampling_ratio"][i, 0]),
            )
    return out


def test_a_recut_puts_similar_lengths_together_longest_first_and_trims_each():
    batches = [_batch([1, 6, 2, 5], [5, 1, 2, 4]), _batch([3, 1, 6, 2], [0, 2, 5, 3], start=4)]
    out = mb.regroup(batches, by_length=True)
    assert _rows(out) == _rows(batches)  # every row whole, once
    lengths = [(b["prompt_mask"].sum(1) + b["completion_mask"].sum(1)).tolist() for b in out]
    assert lengths == [[11, 9, 7, 6], [5, 4, 3, 3]]
    assert [(b["prompt_ids"].size(1), b["completion_ids"].size(1)) for b in out] == [(6, 5), (3, 3)]
    assert out[1]["sampling_per_token_logps"].shape == (4, 3)
    assert out[1]["importance_sampling_ratio"].shape == (4, 1)  # sequence level: not a completion column
    assert all(b["num_items_in_batch"] == 17.0 for b in out)


def test_without_regrouping_each_micro_batch_is_only_trimmed_and_never_to_nothing():
    batches = [_batch([1, 2], [0, 0]), _batch([1, 6], [2, 1], start=2)]
    out = mb.regroup(batches, by_length=False)
    assert [b["advantages"].tolist() for b in out] == [[0.0, 1.0], [2.0, 3.0]]
    assert [(b["prompt_ids"].size(1), b["completion_ids"].size(1)) for b in out] == [(2, 1), (6, 2)]
    assert _rows(out) == _rows(batches)


def test_widths_keep_trls_padding_multiple():
    out = mb.regroup([_batch([1, 2], [1, 3], width_p=8, width_c=8)], by_length=False, multiple=4)
    assert (out[0]["prompt_ids"].size(1), out[0]["completion_ids"].size(1)) == (4, 4)
    out = mb.regroup([_batch([5, 2], [1, 3], width_p=6, width_c=5)], by_length=False, multiple=4)
    assert (out[0]["prompt_ids"].size(1), out[0]["completion_ids"].size(1)) == (6, 4)  # never wider than TRL's


def test_batches_with_anything_but_text_are_left_as_trl_made_them():
    batches = [{**_batch([1, 2], [1, 1]), "pixel_values": torch.zeros(2, 3)}]
    assert mb.regroup(batches, by_length=True) is batches


# ------------------------------------------------------------------------------------- TRL's trainers, on the CPU


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from colocate_rl.builtin_model import build_model

    return build_model("tiny", tmp_path_factory.mktemp("model") / "tiny", seed=0)


def _prompts():
    from datasets import Dataset

    words = "one two three four five six seven eight nine ten eleven twelve".split()
    return Dataset.from_list([{"prompt": " ".join(words[: 1 + (3 * i) % 12])} for i in range(16)])


def _train(tiny, tmp_path, monkeypatch, *, grouping: bool, trainer: str = "grpo", **config_kwargs):
    import trl

    base, config_cls = (trl.GRPOTrainer, trl.GRPOConfig) if trainer == "grpo" else (trl.RLOOTrainer, trl.RLOOConfig)
    widths = []

    def recorded(self, model, input_ids, *args, **kwargs):
        widths.append(tuple(input_ids.shape))
        return forward(self, model, input_ids, *args, **kwargs)

    forward = base._get_per_token_logps_and_entropies

    class Trainer(adapter.engine_trainer(base)):
        length_grouping = grouping

    sampler = {"use_vllm": True, "vllm_importance_sampling_mode": "token_truncate"} if trainer == "grpo" else {}
    built = cpu_trainer(
        Trainer,
        config_cls,
        tiny,
        tmp_path,
        _prompts(),
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=8,
        **sampler,
        **{"gradient_accumulation_steps": 4, **config_kwargs},
    )
    adapter.verify_trainer(built)
    with monkeypatch.context() as patch:
        patch.setattr(base, "_get_per_token_logps_and_entropies", recorded)
        built.train()
    logs = [row for row in built.state.log_history if "loss" in row]
    return built, logs, widths, {k: v.detach().clone() for k, v in built.model.state_dict().items()}


@pytest.mark.parametrize(
    ("trainer", "config", "regroups"),
    [
        ("grpo", {"loss_type": "dapo"}, True),
        ("grpo", {"loss_type": "grpo"}, True),
        ("grpo", {"loss_type": "bnpo"}, False),  # its loss is normalised per micro-batch: only trimmed
        ("grpo", {"loss_type": "dapo", "steps_per_generation": 8}, False),  # one generation, two optimizer steps
        ("rloo", {}, True),
    ],
)
def test_trls_trainers_learn_the_same_from_narrower_micro_batches(
    tiny, tmp_path, monkeypatch, trainer, config, regroups
):
    _, theirs, their_widths, their_weights = _train(
        tiny, tmp_path / "a", monkeypatch, grouping=False, trainer=trainer, **config
    )
    built, ours, widths, weights = _train(tiny, tmp_path / "b", monkeypatch, grouping=True, trainer=trainer, **config)
    assert built.groups_by_length == regroups
    assert len(ours) == len(theirs) == 2
    for a, b in zip(ours, theirs):
        for name in ("loss", "grad_norm"):
            assert a[name] == pytest.approx(b[name], rel=1e-4, abs=1e-6), name
    # Adam turns rounding in a near-zero gradient into a visible update: within 1 % of one step (learning rate 1e-3)
    for name, value in their_weights.items():
        torch.testing.assert_close(weights[name], value, rtol=1e-4, atol=1e-5)
    # the same rows go through the forward, regrouped in fewer columns (trimmed alone, these random micro-batches of
    # two prompts each hold the longer one: no narrower; the unit tests above trim)
    assert [w[0] for w in widths] == [w[0] for w in their_widths]
    columns, their_columns = sum(w[1] for w in widths), sum(w[1] for w in their_widths)
    assert columns < their_columns if regroups else columns <= their_columns
    kept = [
        row["micro_batches/tokens_vs_trl"] for row in ours if "micro_batches/tokens_vs_trl" in row
    ]  # steps that generate
    assert len(kept) == (1 if config.get("steps_per_generation") else 2)
    assert all(0 < k <= 1 for k in kept) and (min(kept) < 1) == (columns < their_columns)
    assert all("micro_batches/tokens_vs_trl" not in row for row in theirs)


def test_a_moved_micro_batch_buffer_is_named():
    import trl

    class Moved(trl.GRPOTrainer):
        def _prepare_inputs(self, generation_batch):  # the buffer of micro-batches gone
            return generation_batch

    problems = mb.check(Moved, "GRPOTrainer")
    assert any("_prepare_inputs no longer has `self._buffered_inputs = [" in p for p in problems)
    assert mb.check(trl.GRPOTrainer, "GRPOTrainer") == mb.check(trl.RLOOTrainer, "RLOOTrainer") == []
