"""ZeroLayout is the one reader of a DeepSpeed config's ZeRO settings; every consumer agrees with it."""

import json

import pytest

from colocate_rl.memory.autolayout import Candidate
from colocate_rl.plan.deepspeed import ZeroLayout
from colocate_rl.plan.resolve import check_engine
from colocate_rl.recipe.load import parse_recipe


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        (None, (None, False, False)),
        ({}, (0, False, False)),
        ({"zero_optimization": {"stage": 2}}, (2, False, False)),
        ({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}}, (3, True, False)),
        ({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}}, (3, False, True)),
        ({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "none"}}}, (3, False, False)),
        # DeepSpeed's default device is "none": an empty block offloads nothing
        ({"zero_optimization": {"stage": 3, "offload_optimizer": {}}}, (3, False, False)),
        ({"zero_optimization": {"stage": 3, "offload_optimizer": None}}, (3, False, False)),
    ],
)
def test_zero_layout_reads_stage_and_offload(config, expected):
    zero = ZeroLayout.of(config)
    assert (zero.stage, zero.offload_optimizer, zero.offload_params) == expected
    candidate = Candidate.of(config, False)
    assert (candidate.stage, candidate.offload_optimizer, candidate.offload_params) == expected


def test_empty_offload_block_is_not_offloaded_for_the_engine_check_either():
    """The review's drift: `"offload_optimizer": {}` was 'on CPU' for the engine check and 'on the GPU' for the
    estimate. Both follow ZeroLayout now: the trainer offload during generation is allowed."""
    recipe = parse_recipe(
        {"rewards": [{"name": "digit_share"}], "generation": {"offload_trainer_during_generation": True}}
    )
    config = {"zero_optimization": {"stage": 2, "offload_optimizer": {}}}
    assert check_engine(recipe, config) == []
    offloaded = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    assert any("already live on CPU" in p for p in check_engine(recipe, offloaded)), json.dumps(offloaded)
