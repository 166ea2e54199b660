"""Tools and environments (`tools:`): the built-in calculator, finding the user's code, the checks before launch, the
limits every call runs under on a rank, and the adapter's hooks into TRL's multi-turn path. Fast tier: no process
starts here (the end-to-end runs through torchrun are in tests/test_tool_loop.py)."""

import asyncio
import time
import types
from pathlib import Path

import pytest
from conftest import CPU, assert_user_error, cli_here, resolved, write_recipe

from colocate_rl.errors import UserError
from colocate_rl.plan import tools as plan_tools
from colocate_rl.rank.tools import ToolError, ToolGuard, trainer_tools
from colocate_rl.recipe.tools import ToolsSection
from colocate_rl.tools import calculator, resolve_environment, resolve_tool, schema_problem

ARITHMETIC = {
    "model": {"name": "builtin:tiny", "chat_template": "qwen2_5"},
    "data": {"source": "builtin:arithmetic"},
    "rewards": [{"name": "answer_match"}, {"name": "tool_call_ok"}],
    "trainer": {"max_steps": 2, "per_device_train_batch_size": 4, "num_generations": 4},
    "distributed": {"deepspeed": None},
    "tools": {"functions": ["calculator"]},
}

TOOL_FILE = '''
import time


def lookup(city: str) -> str:
    """Look up the weather of a city.

    Args:
        city: The city's name.
    """
    return "sunny in " + city


def undocumented(x: int) -> int:
    return x


def slow(seconds: float) -> str:
    """Sleep.

    Args:
        seconds: How long.
    """
    try:
        time.sleep(seconds)
    except Exception:  # a tool that swallows errors must still be stopped
        time.sleep(seconds)
    return "done"


def leaves(code: int) -> str:
    """Exit.

    Args:
        code: The exit code.
    """
    raise SystemExit(code)


class Counter:
    """An environment: counts the calls of its one tool."""

    def __init__(self):
        self.n = 0

    def reset(self, **row):
        self.n = 0
        return " (count with increment)"

    def increment(self, by: int) -> str:
        """Add to the counter.

        Args:
            by: How much to add.
        """
        self.n += by
        return str(self.n)

    def get_reward(self) -> float:
        return float(self.n)


class NoReset:
    def act(self, x: int) -> str:
        """Act.

        Args:
            x: A number.
        """
        return str(x)


class NoReward:
    def reset(self, **row):
        pass

    def act(self, x: int) -> str:
        """Act.

        Args:
            x: A number.
        """
        return str(x)


def broken_factory():
    raise RuntimeError("no backend")
'''


@pytest.fixture
def tool_file(tmp_path):
    path = tmp_path / "my_tools.py"
    path.write_text(TOOL_FILE)
    return path


# ---------------------------------------------------------------------------------------------- the built-in tool


def test_calculator_evaluates_arithmetic_and_nothing_else():
    assert [calculator(e) for e in ("17 + 25", "7 / 2", "(3 + 4) * 2", "-5 - 3", "2 ** 10", "8 / 4")] == [
        "42",
        "3.5",
        "14",
        "-8",
        "1024",
        "2",
    ]
    for bad in ("__import__('os').system('true')", "x + 1", "2 ** 100000", "open('f')", "1 +", "9" * 300):
        with pytest.raises(ValueError):
            calculator(bad)
    assert schema_problem(calculator, "tools.functions[0]") is None


# ---------------------------------------------------------------------------------------------- finding the code


def test_tools_are_found_by_name_as_rewards_are(tool_file):
    assert resolve_tool("calculator", key="k") is calculator
    assert resolve_tool(f"{tool_file}:lookup", key="k")(city="Oslo") == "sunny in Oslo"
    with pytest.raises(UserError, match=r"tools.functions\[0\]: unknown tool 'calculater'.*calculator"):
        resolve_tool("calculater", key="tools.functions[0]")
    with pytest.raises(UserError, match="has no attribute 'lokup'.*lookup"):
        resolve_tool(f"{tool_file}:lokup", key="k")
    with pytest.raises(UserError, match="is a class, not a function"):
        resolve_tool(f"{tool_file}:Counter", key="k")
    with pytest.raises(UserError, match="tool file .* not found"):
        resolve_tool("missing.py:f", key="k")
    assert resolve_environment(f"{tool_file}:Counter", key="k")().reset() == " (count with increment)"
    problem = schema_problem(resolve_tool(f"{tool_file}:undocumented", key="k"), "tools.functions[1]")
    assert problem.startswith("tools.functions[1]: tool 'undocumented' has no schema") and "docstring" in problem


# ---------------------------------------------------------------------------------------------- checks before launch


ROOT_RUN = Path("/tmp/run")


def test_a_tool_recipe_plans_with_the_turn_limit_for_trl():
    from colocate_rl.plan.trl_args import trl_args

    r = resolved(ARITHMETIC, CPU, "tools.max_turns=3")
    args = trl_args(r, ROOT_RUN)
    assert args["max_tool_calling_iterations"] == 3
    plain = resolved({**ARITHMETIC, "tools": {}}, CPU)
    assert "max_tool_calling_iterations" not in trl_args(plain, ROOT_RUN)


@pytest.mark.parametrize(
    "change, fragment",
    [
        ({"algorithm": "rloo"}, "tools: algorithm rloo runs TRL's RLOOTrainer, which has no tool loop"),
        ({"data": {"source": "builtin:arithmetic", "chat": False}}, "tools: tool calls are chat messages"),
        ({"model": {"name": "builtin:tiny"}}, "model.chat_template: the model's chat template drops tool calls"),
        ({"model": {"name": "builtin:tiny", "chat_template": "qwen25"}}, "did you mean 'qwen2_5'"),
        ({"model": {"name": "builtin:tiny", "chat_template": "qwen2_5_training"}}, "TRL cannot parse tool calls"),
        ({"tools": {"functions": ["calculator", "calculator"]}}, "two tools are named 'calculator'"),
        ({"tools": {"functions": ["calculater"]}}, "tools.functions[0]: unknown tool 'calculater'"),
        (
            {"distributed": {"deepspeed": "zero3"}, "generation": {"backend": "transformers"}},
            "tools: with the transformers backend, ZeRO-3",
        ),
    ],
    ids=[
        "rloo",
        "not-chat",
        "template-without-tools",
        "unknown-template",
        "unparsed-template",
        "twice",
        "unknown",
        "zero3",
    ],
)
def test_bad_tool_recipes_stop_with_one_line_each(change, fragment):
    with pytest.raises(UserError) as e:
        resolved({**ARITHMETIC, **change}, CPU)
    assert any(fragment in line for line in e.value.lines), e.value.lines


def test_user_tool_and_environment_code_is_checked_before_launch(tool_file):
    def problems(tools):
        with pytest.raises(UserError) as e:
            resolved({**ARITHMETIC, "tools": tools}, CPU)
        return e.value.lines

    assert resolved({**ARITHMETIC, "tools": {"functions": [f"{tool_file}:lookup"]}}, CPU)
    assert resolved({**ARITHMETIC, "tools": {"environment": f"{tool_file}:Counter"}}, CPU)
    [line] = problems({"functions": [f"{tool_file}:undocumented"]})
    assert line.startswith("tools.functions[0]: tool 'undocumented' has no schema")
    [line] = problems({"environment": f"{tool_file}:NoReset"})
    assert line == "tools.environment: NoReset has no reset method; TRL starts each episode with it"
    [line] = problems({"environment": f"{tool_file}:broken_factory"})
    assert line.startswith("tools.environment: building an environment failed: RuntimeError: no backend")
    [line] = problems({"functions": [f"{tool_file}:increment_"], "environment": f"{tool_file}:Counter"})
    assert line.startswith("tools.functions[0]:")


def test_an_environment_with_get_reward_may_be_the_only_reward(tool_file, tmp_path):
    """TRL scores episodes with the environment's get_reward when no reward function is given; without one (or
    without an environment) an empty rewards list stops at validate with one line, exit 2."""
    from colocate_rl.plan.trl_args import trl_args

    owned = resolved({**ARITHMETIC, "rewards": [], "tools": {"environment": f"{tool_file}:Counter"}}, CPU)
    assert trl_args(owned, ROOT_RUN)["reward_weights"] is None  # TRL gives the environment's reward weight 1
    for tools, line in [
        (
            {"environment": f"{tool_file}:NoReward"},
            "rewards: none given and tools.environment's NoReward has no get_reward(); add a reward under rewards: "
            "or a get_reward() method that scores the episode",
        ),
        (
            {},
            "rewards: none given; add one (e.g. rewards: [{name: answer_match}]), or score episodes with a "
            "tools.environment whose class has get_reward()",
        ),
    ]:
        recipe = write_recipe(tmp_path / "r.yaml", {**ARITHMETIC, "rewards": [], "tools": tools})
        assert_user_error(cli_here("validate", recipe), line, one_line=True)


def test_trl_parses_exactly_the_templates_the_plan_names():
    """The plan's list of TRL's parsed templates (it cannot import TRL) against TRL's own `add_response_schema`."""
    from trl.chat_template_utils import add_response_schema

    parsed = []
    for path in sorted(plan_tools.trl_templates_dir().glob("*.jinja")):
        try:
            add_response_schema(types.SimpleNamespace(chat_template=path.read_text()))
        except ValueError:
            continue
        parsed.append(path.stem)
    assert tuple(parsed) == plan_tools.TRL_PARSED_TEMPLATES


def test_validate_names_the_tool_key(tool_file, tmp_path):
    recipe = write_recipe(tmp_path / "r.yaml", {**ARITHMETIC, "tools": {"functions": [f"{tool_file}:undocumented"]}})
    result = cli_here("validate", recipe)
    assert_user_error(result, "tools.functions[0]: tool 'undocumented' has no schema", one_line=True)


# ---------------------------------------------------------------------------------------------- limits on the ranks


def guard(**limits) -> ToolGuard:
    g = ToolGuard(ToolsSection(**{"functions": ["calculator"], **limits}))
    g.start_batch(2)
    return g


def test_a_call_that_runs_too_long_returns_an_error_to_the_model(tool_file):
    slow = guard(timeout_s=0.3).wrap(resolve_tool(f"{tool_file}:slow", key="k"), 0)
    start = time.monotonic()
    with pytest.raises(ToolError, match="did not return within 0.3 s"):
        slow(seconds=5)
    assert time.monotonic() - start < 2.5  # swallowed once, stopped again
    assert slow(seconds=0.01) == "done"


def test_sys_exit_in_a_tool_is_a_result_not_the_end_of_the_rank(tool_file):
    leaves = guard().wrap(resolve_tool(f"{tool_file}:leaves", key="k"), 0)
    with pytest.raises(ToolError, match=r"sys.exit\(3\)"):
        leaves(code=3)


def test_an_episode_makes_at_most_max_calls_calls():
    g = guard(max_calls=2)
    first, second = g.wrap(calculator, 0), g.wrap(calculator, 1)
    assert [first(expression="1+1"), first(expression="2+2")] == ["2", "4"]
    with pytest.raises(ToolError, match="at most 2 calls per episode"):
        first(expression="3+3")
    assert second(expression="5*5") == "25"  # another episode's own count
    assert g.calls == [2, 1] and g.limited == 1
    with pytest.raises(ValueError):  # the tool's own error reaches TRL, which returns it to the model
        second(expression="import os")


def test_async_tools_are_limited_too():
    async def wait(seconds: float) -> str:
        """Wait.

        Args:
            seconds: How long.
        """
        await asyncio.sleep(seconds)
        return "waited"

    wrapped = guard(timeout_s=0.2).wrap(wait, 0)
    assert asyncio.run(wrapped(seconds=0.01)) == "waited"
    with pytest.raises(ToolError, match="within 0.2 s"):
        asyncio.run(wrapped(seconds=3))


def test_the_ranks_hand_trl_the_recipes_tools(tool_file):
    assert trainer_tools(ToolsSection()) == {}
    args = trainer_tools(ToolsSection(functions=["calculator"], environment=f"{tool_file}:Counter"))
    assert args["tools"] == [calculator] and args["environment_factory"]().reset() == " (count with increment)"


# ---------------------------------------------------------------------------------------------- the adapter


def test_the_adapter_checks_trls_multi_turn_path():
    from trl import GRPOTrainer, RLOOTrainer

    from colocate_rl.rank.adapter import trl as adapter

    assert adapter.check_trainer_class(GRPOTrainer) == [] and adapter.check_trainer_class(RLOOTrainer) == []

    class Renamed(GRPOTrainer):  # a TRL release that renamed the per-episode tool tables
        def _tool_call_loop(
            self, prompts, prompt_ids, completion_ids, completions, logprobs, images, multimodal_fields
        ):
            return self._tool_tables[0]

    assert adapter.check_trainer_class(Renamed) == [
        "trl GRPOTrainer._tool_call_loop no longer has `self._sync_tool_dicts[idx_with_tool]`",
        "trl GRPOTrainer._tool_call_loop no longer has `self._async_tool_dicts[idx_with_tool]`",
    ]

    class Reshaped(GRPOTrainer):
        def _generate(self, prompts, tools):
            return None

    problems = adapter.check_trainer_class(Reshaped)
    assert problems[0].startswith("trl GRPOTrainer._generate('self', 'prompts', 'tools') changed")


def test_a_renamed_multi_turn_symbol_ends_the_run_with_one_line(monkeypatch):
    from trl import GRPOTrainer

    from colocate_rl.rank import adapter

    monkeypatch.delattr(GRPOTrainer, "_tool_call_loop")
    with pytest.raises(adapter.AdapterError) as e:
        adapter.verify_installed(GRPOTrainer, vllm=False, deepspeed_offload=False)
    [line] = e.value.lines
    assert line.startswith(
        "trl GRPOTrainer._tool_call_loop is missing: colocate-rl relies on it (installed: trl 1.16.0"
    )


def test_a_timer_set_before_a_tool_call_still_fires():
    """pytest-timeout (or any caller) may have a SIGALRM timer running: a tool call puts it back, less the time taken."""
    import signal

    fired = []
    previous = signal.signal(signal.SIGALRM, lambda *a: fired.append(True))
    signal.setitimer(signal.ITIMER_REAL, 0.6)
    try:
        assert guard(timeout_s=5).wrap(calculator, 0)(expression="1+1") == "2"
        remaining, _ = signal.getitimer(signal.ITIMER_REAL)
        assert 0 < remaining <= 0.6
        time.sleep(0.8)
        assert fired == [True]
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def test_outside_the_main_thread_a_slow_call_is_abandoned_not_waited_for(tool_file):
    import threading

    slow = guard(timeout_s=0.3).wrap(resolve_tool(f"{tool_file}:slow", key="k"), 0)
    outcome = []

    def call():
        start = time.monotonic()
        try:
            slow(seconds=3)
        except ToolError as e:
            outcome.append((str(e), time.monotonic() - start))

    worker = threading.Thread(target=call)
    worker.start()
    worker.join(timeout=10)
    [(message, took)] = outcome
    assert message == "the tool did not return within 0.3 s" and took < 2
