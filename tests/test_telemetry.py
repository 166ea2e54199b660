"""Telemetry on CPU: exclusive phase accounting, timeline lines, and the merge into TRL's logs."""

import time
from types import SimpleNamespace

import pytest

from colocate_rl.rank.telemetry import Telemetry
from colocate_rl.rank.worker import merge_telemetry_into_logs


def test_nested_phases_are_exclusive_and_add_up_to_the_step(tmp_path):
    tel = Telemetry(tmp_path)
    tel.step_begin()
    with tel.phase("generate"):
        time.sleep(0.05)
        with tel.phase("wake"):
            time.sleep(0.2)
    with tel.phase("train"):
        time.sleep(0.02)
    metrics = tel.step_end(1)
    # exclusive: the 0.2 s spent in the nested wake is not charged to generate (lower bounds are exact,
    # upper bounds generous because a loaded machine oversleeps)
    assert 0.05 <= metrics["time/generate_s"] < 0.2
    assert metrics["time/wake_s"] >= 0.2 and metrics["time/train_s"] >= 0.02
    parts = sum(v for k, v in metrics.items() if k.startswith("time/") and k != "time/step_s")
    assert parts == pytest.approx(metrics["time/step_s"], abs=0.002)
    assert metrics["mem/rss_gib"] > 0 and metrics["mem/rss_peak_gib"] >= metrics["mem/rss_gib"]
    assert 0 < metrics["telemetry/overhead_s"] < 0.05  # ~2 ms measured; generous for loaded CI machines


def test_wrap_times_a_method_and_keeps_its_result(tmp_path):
    tel = Telemetry(tmp_path)
    obj = SimpleNamespace(sync_weights=lambda x: x * 2)
    tel.wrap(obj, "sync_weights", "weight_sync")
    tel.wrap(obj, "missing", "sleep")  # absent attributes are skipped
    tel.step_begin()
    assert obj.sync_weights(21) == 42
    assert "time/weight_sync_s" in tel.step_end(1)
    assert not hasattr(obj, "missing")


def test_telemetry_reaches_trl_logs_with_tokens_per_second(tmp_path):
    seen = {}
    trainer = SimpleNamespace(
        log=lambda logs, start_time=None: seen.update(logs),
        _metrics={"train": {"completions/mean_length": [10.0, 30.0]}},
        args=SimpleNamespace(generation_batch_size=16),
    )
    tel = Telemetry(tmp_path)
    merge_telemetry_into_logs(trainer, tel)
    tel.pending = {"time/generate_s": 0.5, "time/step_s": 1.0}
    trainer.log({"loss": 0.1})
    assert seen == {"loss": 0.1, "time/generate_s": 0.5, "time/step_s": 1.0, "gen/tokens_per_s": 640.0}
    seen.clear()
    trainer.log({"train_runtime": 3.0})  # the end-of-run record gets no step telemetry
    assert seen == {"train_runtime": 3.0} and tel.pending == {}
