"""Telemetry on CPU: exclusive phase accounting (on a clock the test turns), timeline lines, and the merge into
TRL's logs."""

from types import SimpleNamespace

import pytest

from colocate_rl.rank.telemetry import Telemetry
from colocate_rl.rank.worker import telemetry_extras


class Clock:
    """A clock that only moves when the test says so."""

    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def test_nested_phases_are_exclusive_and_add_up_to_the_step(tmp_path):
    clock = Clock()
    tel = Telemetry(tmp_path, clock=clock)
    tel.step_begin()
    with tel.phase("generate"):
        clock.advance(0.05)
        with tel.phase("wake"):
            clock.advance(0.2)
        clock.advance(0.01)
    clock.advance(0.003)  # between phases: charged to "other"
    with tel.phase("train"):
        clock.advance(0.02)
    metrics = tel.step_end(1)
    # exclusive: the 0.2 s spent in the nested wake is not charged to generate
    times = {k: v for k, v in metrics.items() if k.startswith("time/")}
    assert times == {
        "time/step_s": 0.283,
        "time/generate_s": 0.06,
        "time/wake_s": 0.2,
        "time/train_s": 0.02,
        "time/other_s": 0.003,
    }
    assert metrics["telemetry/overhead_s"] == 0  # the clock did not move inside telemetry
    assert metrics["mem/rss_gib"] > 0 and metrics["mem/rss_peak_gib"] >= metrics["mem/rss_gib"]
    # the next step starts from zero
    tel.step_begin()
    clock.advance(0.5)
    second = tel.step_end(2)
    assert (second["time/step_s"], second["time/other_s"]) == (0.5, 0.5) and "time/generate_s" not in second


def test_telemetry_counts_its_own_time_as_overhead_inside_the_step(tmp_path):
    clock = Clock()
    tel = Telemetry(tmp_path, clock=clock)
    read = tel.read_memory

    def slow_read():  # every memory reading takes 1 ms of the clock
        clock.advance(0.001)
        return read()

    tel.read_memory = slow_read
    tel.step_begin()
    with tel.phase("generate"):
        clock.advance(0.1)
    metrics = tel.step_end(1)
    # three readings (the phase's two edges, the step end), the last one after the step's end boundary
    assert metrics["telemetry/overhead_s"] == pytest.approx(0.003)
    assert metrics["time/step_s"] == pytest.approx(0.102) and metrics["time/generate_s"] == pytest.approx(0.101)


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
    """What colocate-rl's trainer merges into each log record (its `log` calls `log_extras`; TRL's private metric
    store is read through colocate_rl.rank.adapter.trl.step_metric)."""
    trainer = SimpleNamespace(
        _metrics={"train": {"completions/mean_length": [10.0, 30.0]}},
        args=SimpleNamespace(generation_batch_size=16),
    )
    tel = Telemetry(tmp_path)
    extras = telemetry_extras(tel)
    tel.pending = {"time/generate_s": 0.5, "time/step_s": 1.0}
    assert extras(trainer, {"loss": 0.1}) == {
        "loss": 0.1,
        "time/generate_s": 0.5,
        "time/step_s": 1.0,
        "gen/tokens_per_s": 640.0,
    }
    assert tel.pending == {} and extras(trainer, {"loss": 0.2}) == {"loss": 0.2}  # merged once


def test_gpu_step_reports_torch_peak_and_allocator_retries_of_that_step(tmp_path, monkeypatch):
    """On GPU each step reports torch's peak during the step and the allocator's retries during the step (not
    since the start). No GPU here: torch.cuda's memory counters and NVML are replaced by a fake allocator."""
    import torch

    gib = 2**30
    allocator = {"allocated": 2 * gib, "peak": 9 * gib, "retries": 0, "resets": 0}

    def reset_peak():
        allocator["peak"], allocator["resets"] = allocator["allocated"], allocator["resets"] + 1

    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda: allocator["allocated"])
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda: 12 * gib)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: allocator["peak"])
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda: {"num_alloc_retries": allocator["retries"]})
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", reset_peak)
    tel = Telemetry(tmp_path, clock=Clock())
    tel.cuda, tel.handle = True, object()
    monkeypatch.setattr(tel, "read_memory", lambda: 20.0)

    allocator["retries"] = 2  # two retries in step 1
    first = tel.step_end(1)
    assert (first["mem/torch_peak_gib"], first["mem/alloc_retries"]) == (9.0, 2)
    tel.step_begin()
    second = tel.step_end(2)  # nothing happened: the peak was reset to what is allocated, no new retries
    assert (second["mem/torch_peak_gib"], second["mem/alloc_retries"]) == (2.0, 0)
    allocator["peak"], allocator["retries"] = 30 * gib, 3
    third = tel.step_end(3)
    assert (third["mem/torch_peak_gib"], third["mem/alloc_retries"]) == (30.0, 1)
    assert allocator["resets"] == 3


def test_a_rank_line_is_written_whole_in_one_write(monkeypatch):
    """Ranks run `python -u`: print writes text and newline apart, and two ranks' lines joined in train.log (seen in
    CI: two engine stop lines on one line). log_line writes each line once, newline included."""
    import io

    from colocate_rl.telemetry import events

    writes = []

    class Unbuffered(io.StringIO):
        def write(self, s):
            writes.append(s)
            return len(s)

    monkeypatch.setattr("sys.stdout", Unbuffered())
    events.log_line("[colocate-rl engine] engine process stopped in 0.0 s")
    assert writes == ["[colocate-rl engine] engine process stopped in 0.0 s\n"]
