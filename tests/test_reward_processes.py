"""Rewards scored on several processes (`rewards[].processes`): the pool's scores equal the function's own, the plan
resolves `auto` from the host's CPU cores, and bad input is refused with the key. The pool runs real spawned
processes here."""

import pytest
import yaml

from colocate_rl.errors import RewardProcessError, UserError
from colocate_rl.plan.host import assumed_host
from colocate_rl.plan.resolved import reward_processes
from colocate_rl.rank.rewards import RewardPool, reward_functions, slices
from colocate_rl.recipe.load import parse_recipe
from colocate_rl.rewards import math_verify

BASE = """
name: t
model: {name: builtin:tiny}
data: {source: builtin:arithmetic}
rewards: REWARDS
trainer: {max_steps: 2}
"""


def recipe(rewards: str):
    return parse_recipe(yaml.safe_load(BASE.replace("REWARDS", rewards)))


def test_slices_cover_the_batch_in_order_none_empty():
    assert slices(10, 3) == [(0, 3), (3, 6), (6, 10)]
    assert slices(2, 8) == [(0, 1), (1, 2)]
    assert slices(0, 4) == []
    fn = RewardPool.wrap.__get__(object.__new__(RewardPool))  # no processes: an empty batch never reaches one
    assert fn("math_verify", "k", 2)(prompts=[], completions=[]) == []


@pytest.fixture(scope="module")
def pool():
    p = RewardPool(2, [("math_verify", "rewards[0].name")])
    yield p
    p.close()


def test_math_verify_on_two_processes_scores_as_in_the_trainer(pool):
    completions = [f"So {i} + {i} = {2 * i}.\n#### {2 * i + (i % 3 == 0)}" for i in range(40)]
    answers = [f"#### {2 * i}" for i in range(40)] + []
    answers[5] = None  # a row without an answer: None, in its place
    fn = pool.wrap("math_verify", "rewards[0].name", 2)
    kwargs = dict(prompts=["p"] * 40, completion_ids=[[1]] * 40, answer=answers, trainer_state=None)
    got = fn(completions=completions, **kwargs, log_metric=print, log_extra=print)  # local-only ones stay here
    assert got == math_verify(completions=completions, **kwargs)
    assert got[5] is None and got[1] == 1.0 and got[3] == 0.0
    assert fn.__name__ == "math_verify"  # what TRL logs


def test_a_user_reward_runs_in_the_pool_and_its_errors_come_back_with_the_key(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the pool's processes find `rw.py` from the rank's working directory
    (tmp_path / "rw.py").write_text(
        "import os\n"
        "def pid(prompts, completions, **kw):\n"
        "    assert 'log_metric' not in kw and 'environments' not in kw\n"
        "    return [float(len(c) + len(t)) for c, t in zip(completions, kw['tag'])]\n"
        "def imports(prompts, completions, trainer_state, **kw):\n"
        "    import sys\n"
        "    assert not hasattr(trainer_state, 'log_history')\n"
        "    return [float(trainer_state.global_step + ('transformers' in sys.modules))] * len(completions)\n"
        "def short(prompts, completions, **kw):\n"
        "    return [1.0]\n"
        "def dies(prompts, completions, **kw):\n"
        "    os._exit(3)\n"
    )
    p = RewardPool(2, [])
    try:
        fn = p.wrap("rw.py:pid", "rewards[1].name", 2)
        assert fn(prompts=["a", "b", "c"], completions=["x", "yy", "zzz"], tag=["q", "qq", "qqq"],
                  environments=[1, 2, 3]) == [2.0, 4.0, 6.0]  # fmt: skip
        from transformers import TrainerState

        state = TrainerState(global_step=7, log_history=[{"loss": 1.0}] * 1000)
        # the trainer_state crosses as its plain fields: transformers (and torch) stay out of the pool's processes
        assert p.wrap("rw.py:imports", "rewards[1].name", 2)(prompts=["a"] * 2, completions=["x"] * 2,
                                                             trainer_state=state) == [7.0, 7.0]  # fmt: skip
        with pytest.raises(UserError, match=r"rewards\[2\].name rw.py:short: returned 1 values for 2 completions"):
            p.wrap("rw.py:short", "rewards[2].name", 2)(prompts=["a"] * 3, completions=["x"] * 3)
        with pytest.raises(RewardProcessError, match=r"rewards\[3\].name rw.py:dies: a reward process died"):
            p.wrap("rw.py:dies", "rewards[3].name", 2)(prompts=["a"] * 3, completions=["x"] * 3)
        with pytest.raises(RewardProcessError, match=r"rewards\[1\].name rw.py:pid: a reward process died"):
            fn(prompts=["a"], completions=["x"], tag=["q"])  # the pool is broken now: every later call says so
    finally:
        p.close()


def test_reward_functions_builds_a_pool_only_for_rewards_on_several_processes():
    funcs, pool = reward_functions(recipe("[{name: digit_share}, {name: answer_match, processes: 1}]"))
    assert pool is None and [f.__name__ for f in funcs] == ["digit_share", "answer_match"]
    funcs, pool = reward_functions(recipe("[{name: digit_share}, {name: math_verify, processes: 2}]"))
    try:
        assert pool is not None and pool.processes == 2
        assert funcs[1](prompts=["p"], completions=["#### 4"], answer=["#### 4"]) == [1.0]
    finally:
        pool.close()


def test_auto_gives_math_verify_the_ranks_spare_cores_and_the_rest_one():
    r = recipe("[{name: math_verify}, {name: digit_share}, {name: answer_match, processes: 3}]")
    assert reward_processes(r, assumed_host(1, cpu_count=16), 1) == [8, 1, 3]
    assert reward_processes(r, assumed_host(8, cpu_count=32), 8) == [2, 1, 3]  # 4 cores a rank, 2 spare
    assert reward_processes(r, assumed_host(1, cpu_count=2), 1) == [1, 1, 3]  # CI: no spare core
    two_engines = r.model_copy(
        update={"generation": r.generation.model_copy(update={"engine_process": True, "engine_processes": 2})}
    )
    assert reward_processes(two_engines, assumed_host(1, cpu_count=8), 1) == [5, 1, 3]  # 8 less trainer, 2 engines
    assert reward_processes(r, assumed_host(1, cpu_count=8), 1) == [6, 1, 3]


def test_processes_on_a_reward_model_is_refused_with_its_key():
    with pytest.raises(UserError, match=r"rewards\[0\]\.processes: 2 with a reward model"):
        recipe("[{model: some/rm, processes: 2}]")
    with pytest.raises(UserError, match=r"rewards\[0\]\.processes"):
        recipe("[{name: math_verify, processes: 0}]")


def test_an_async_reward_on_several_processes_is_refused_at_validation(tmp_path):
    from colocate_rl.plan.preflight import preflight

    (tmp_path / "judge.py").write_text(
        "async def judge(prompts, completions, **kw):\n    return [1.0] * len(completions)\n"
    )
    pre = preflight(recipe(f"[{{name: '{tmp_path}/judge.py:judge', processes: 2}}]"))
    assert any(line.startswith("rewards[0].processes: ") and "is async" in line for line in pre.problems), pre.problems
    pre = preflight(recipe(f"[{{name: '{tmp_path}/judge.py:judge'}}]"))  # auto: on the trainer's event loop
    assert not any("processes" in line for line in pre.problems), pre.problems


def test_a_rank_whose_reward_process_died_ends_in_one_line_and_an_event(tmp_path, monkeypatch, capsys):
    from colocate_rl.rank import worker
    from colocate_rl.telemetry import events

    def run(run_dir):
        raise RewardProcessError("rewards[0].name math_verify: a reward process died (killed, or out of memory)")

    monkeypatch.setattr(worker, "run", run)
    assert worker.main([str(tmp_path)]) == 1
    assert capsys.readouterr().err == (
        "error: rewards[0].name math_verify: a reward process died (killed, or out of memory)\n"
    )
    [event] = events.read_events(tmp_path, events.REWARD_FAILED)
    assert "a reward process died" in event["message"]
