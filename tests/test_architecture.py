"""The package's structure as rules, checked on the source (AST), and the module map in docs/guide/architecture.md.

1. The process boundary: only `colocate_rl.rank` (the per-rank program under torchrun) imports torch, TRL, vLLM,
   DeepSpeed, transformers, accelerate, peft, datasets or NVML at module level. Everything else runs on the launching
   machine, where `--help` must be instant and the launcher must hold no GPU memory.
2. Nothing on the launcher side imports `colocate_rl.rank` (the `colocate_rl.worker` entry point excepted).
3. Layering: a package imports only packages below it (module-level, function-level and `TYPE_CHECKING` imports
   alike: an annotation that names a higher layer's type is a dependency on it too).
4. No import circle between modules (all imports counted, within a package too).
5. No module over MAX_LINES lines.
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "colocate_rl"
HEAVY = {"torch", "trl", "vllm", "deepspeed", "transformers", "accelerate", "peft", "datasets", "pynvml"}
# Which unit may import which: a unit imports only units of a lower level. Units are the subpackages and the
# top-level modules of colocate_rl.
LEVELS = {
    "errors": 0,
    "algorithms": 0.5,  # the recipe's `algorithm:` names (imports only errors)
    "rundir": 1,
    "recipe": 1,
    "prompts": 1,
    "rewards": 1,
    "data_check": 1.5,
    "prompt_length": 1.5,  # the data's longest prompt in tokens (imports prompts)
    "tools": 1.5,  # tools and environments by name (imports rewards' loader)
    "warm_start": 0.5,  # the tiny-calc warm start (imports nothing of ours; its task generator is a copy)
    "builtin_model": 1,
    "model_config": 1,
    "plan": 2,
    "telemetry": 2,
    "launch": 3,
    "rank": 4,
    "memory": 4,
    "pipeline": 5,
    "resume": 5.5,  # train --resume's plan (imports pipeline's resolve)
    "cli": 6,
    "__main__": 7,
    "worker": 7,
    "__init__": 0,
}
RANK_SIDE = {"rank", "worker"}


def unit_of(path: Path, package: Path) -> str:
    rel = path.relative_to(package)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def imports(path: Path) -> list[tuple[str, bool]]:
    """(imported module, at run time at module level) for every import; one under `if TYPE_CHECKING:` counts, but
    never as a module-level one (it does not run)."""
    found: list[tuple[str, bool]] = []

    def walk(node: ast.AST, top: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                walk(ast.Module(body=child.body, type_ignores=[]), False)  # never runs, but depends
                walk(ast.Module(body=child.orelse, type_ignores=[]), top)
                continue
            if isinstance(child, ast.Import):
                found.extend((alias.name, top) for alias in child.names)
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
                found.append((child.module, top))
                if child.module == "colocate_rl":  # `from colocate_rl import x`: x is the module
                    found.extend((f"colocate_rl.{alias.name}", top) for alias in child.names)
            walk(child, top and not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    walk(ast.parse(path.read_text()), True)
    return found


def violations(package: Path) -> list[str]:
    """Every breach of the three rules in the package at `package`."""
    out = []
    for path in sorted(package.rglob("*.py")):
        unit = unit_of(path, package)
        name = path.relative_to(package.parent).with_suffix("").as_posix().replace("/", ".")
        for module, top in imports(path):
            root = module.split(".")[0]
            if root in HEAVY and top and unit not in RANK_SIDE:
                out.append(f"{name} imports {module} at module level (only colocate_rl.rank may)")
            if root != "colocate_rl" or module == "colocate_rl":
                continue
            target = module.split(".")[1]
            if target == unit:
                continue
            if target in RANK_SIDE and unit not in RANK_SIDE:
                out.append(f"{name} imports {module} (the launcher side never imports the rank side)")
            elif LEVELS.get(target, 99) >= LEVELS.get(unit, -1):
                out.append(f"{name} imports {module} ({unit} may import only units below level {LEVELS.get(unit)})")
    return out


def module_graph(package: Path) -> dict[str, set[str]]:
    """Module → the package's modules it imports (any import; `from pkg import mod` names the module)."""
    names = {}
    for path in package.rglob("*.py"):
        name = path.relative_to(package.parent).with_suffix("").as_posix().replace("/", ".")
        names[name.removesuffix(".__init__")] = path
    graph = {}
    for name, path in names.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets |= {
                    f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in names else node.module for a in node.names
                }
        graph[name] = {t for t in targets if t in names and t != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every import circle (a strongly connected group of more than one module), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = stack[stack.index(v) :]
            del stack[stack.index(v) :]
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_package_keeps_its_process_boundary_and_layers():
    assert violations(PACKAGE) == []


def test_no_module_imports_itself_back():
    assert cycles(module_graph(PACKAGE)) == []


def test_the_cycle_finder_finds_a_circle_through_type_checking(tmp_path):
    package = tmp_path / "colocate_rl"
    (package / "plan").mkdir(parents=True)
    (package / "plan" / "a.py").write_text("from colocate_rl.plan.b import B\n")
    (package / "plan" / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from colocate_rl.plan.a import A\n"
    )
    (package / "plan" / "c.py").write_text("from colocate_rl.plan import a\n")
    assert cycles(module_graph(package)) == [["colocate_rl.plan.a", "colocate_rl.plan.b"]]


MAX_LINES = 400


def test_no_module_is_over_the_line_limit():
    long = {
        p.relative_to(PACKAGE).as_posix(): n
        for p in PACKAGE.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert long == {}


def test_every_unit_has_a_level():
    units = {unit_of(p, PACKAGE) for p in PACKAGE.rglob("*.py")}
    assert units <= set(LEVELS), f"new units need a level in LEVELS: {sorted(units - set(LEVELS))}"


@pytest.mark.parametrize(
    ("unit", "source", "expected"),
    [
        ("plan/x.py", "import torch\n", "imports torch at module level"),
        ("memory/x.py", "from transformers import AutoConfig\n", "imports transformers at module level"),
        ("launch/x.py", "from colocate_rl.rank.worker import main\n", "never imports the rank side"),
        ("recipe/x.py", "from colocate_rl.plan.host import Host\n", "recipe may import only units below"),
        ("plan/x.py", "def f():\n    from colocate_rl.cli import app\n", "plan may import only units below"),
        (
            "plan/x.py",
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from colocate_rl.memory.autolayout import X\n",
            "plan may import only units below",
        ),
    ],
)
def test_the_checker_finds_each_kind_of_breach(tmp_path, unit, source, expected):
    package = tmp_path / "colocate_rl"
    path = package / unit
    path.parent.mkdir(parents=True)
    path.write_text(source)
    found = violations(package)
    assert len(found) == 1 and expected in found[0], found


def test_allowed_imports_pass_the_checker(tmp_path):
    package = tmp_path / "colocate_rl"
    (package / "plan").mkdir(parents=True)
    (package / "rank").mkdir()
    (package / "plan" / "x.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import torch\n    from colocate_rl.recipe.schema import X\n"
        "def f():\n    import torch\n"
    )
    (package / "rank" / "y.py").write_text("import torch\nfrom colocate_rl.plan.x import f\n")
    assert violations(package) == []


def test_the_module_map_lists_every_module():
    """docs/guide/architecture.md names every module of the package (as `path/module.py`) and no other; one row
    `algorithms/<name>.py` stands for the algorithm declarations (adding one is adding one file)."""
    text = (ROOT / "docs" / "guide" / "architecture.md").read_text()
    modules = {p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py") if p.name != "__init__.py"}
    declarations = {m for m in modules if m.startswith("algorithms/")} if "`algorithms/<name>.py`" in text else set()
    named = {m for m in modules if f"`{m}`" in text} | declarations
    assert modules == named, f"missing from the module map: {sorted(modules - named)}"
