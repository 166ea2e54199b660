"""What every verb of the command line shares: the app (its `--version`, and help that names each value by its
metavar), the consoles, the option types, and `guarded`, the one exception boundary (known errors become one line
each on stderr and exit 2, never a traceback)."""

from __future__ import annotations

import functools
from typing import Annotated

import typer
from rich.console import Console
from typer.core import TyperCommand, TyperGroup

from colocate_rl.errors import UserError


def _metavar(param, ctx=None) -> str | None:
    """What the help shows after a parameter's name: an option's metavar (its name in capitals when it has none,
    nothing for a flag), nothing for an argument (its name is its metavar). Typer's own, `<bool>`, `<int range>`,
    `<list[Path]>`, are Python's types, not what to type."""
    if param.param_type_name != "option" or param.is_flag:
        return None
    return param.metavar or param.name.upper()


class _ReadableHelp:
    """Help whose value column is `_metavar`: it replaces `display_type_rich`, what typer's rich help shows there (a
    typer that calls something else shows its own types again; tests/test_ux.py notices)."""

    def get_params(self, ctx):
        params = super().get_params(ctx)
        for param in params:
            param.display_type_rich = functools.partial(_metavar, param)
        return params


class Command(_ReadableHelp, TyperCommand):
    """A verb whose help names each value by its metavar."""


class Group(_ReadableHelp, TyperGroup):
    """The app's group, with the same help."""


class App(typer.Typer):
    """Typer whose commands are `Command`s."""

    def command(self, *args, cls=None, **kwargs):
        return super().command(*args, cls=cls or Command, **kwargs)


app = App(
    cls=Group,
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Colocated online RL (GRPO, RLOO) with TRL: one YAML recipe → torchrun → vLLM beside "
    "the trainer on every GPU.",
)
console = Console()
err_console = Console(stderr=True)


def _print_version(value: bool) -> None:
    if value:
        import colocate_rl

        console.print(f"colocate-rl {colocate_rl.__version__}", highlight=False)
        raise typer.Exit()


@app.callback()
def _options(
    version: Annotated[
        bool, typer.Option("--version", callback=_print_version, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    pass


RecipeArg = Annotated[str, typer.Argument(metavar="RECIPE", help="Recipe file, or the name of a shipped recipe.")]
SetOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--set",
        metavar="KEY=VALUE",
        help="Override a key: --set trainer.max_steps=20. A text key (data.system_prompt, model.name, ...) takes the "
        "text as typed (null: unset); any other key a YAML value. A relative path starts from here.",
    ),
]
SetStrOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--set-str",
        metavar="KEY=TEXT",
        help="Override a key with the text as typed, never read as YAML (e.g. the text null); after every --set.",
    ),
]
GpusOpt = Annotated[
    int | None,
    typer.Option(
        "--gpus",
        metavar="N",
        min=0,
        help="Plan for N GPUs per node with vLLM instead of detecting them (e.g. on a login node).",
    ),
]
PlanMemOpt = Annotated[
    float | None,
    typer.Option(
        "--gpu-memory",
        metavar="GIB",
        min=1,
        help="Memory of one GPU in GiB for planning (zero_stage auto; default: the detected GPU's, or 80 with --gpus).",
    ),
]
NnodesOpt = Annotated[
    str | None,
    typer.Option(
        "--nnodes",
        metavar="N",
        help="Number of nodes (distributed.nnodes; under srun read from Slurm).",
        show_default=False,
    ),
]
NodeRankOpt = Annotated[
    str | None,
    typer.Option(
        "--node-rank", metavar="K", help="This node's rank, 0 … nnodes-1 (distributed.node_rank).", show_default=False
    ),
]
RdzvEndpointOpt = Annotated[
    str | None,
    typer.Option(
        "--rdzv-endpoint",
        metavar="HOST:PORT",
        help="Rendezvous host:port, normally node 0 (distributed.rdzv_endpoint).",
        show_default=False,
    ),
]
RdzvIdOpt = Annotated[
    str | None,
    typer.Option(
        "--rdzv-id",
        metavar="ID",
        help="Rendezvous id, the same on every node of one job (distributed.rdzv_id).",
        show_default=False,
    ),
]


def guarded(fn):
    """Known errors → one line each on stderr, exit 2, no traceback."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except UserError as e:
            for line in e.lines:
                err_console.print(f"[red]error:[/] {line}", markup=True, highlight=False, soft_wrap=True)
            raise typer.Exit(2)
        except KeyboardInterrupt:
            err_console.print("interrupted")
            raise typer.Exit(130)

    return wrapper


def parse_sets(items: list[str] | None, strings: list[str] | None = None) -> dict:
    """`--set` and `--set-str` strings as overrides (dotted key → value)."""
    from colocate_rl.recipe.load import parse_sets as parse

    return parse(items or [], strings or [])
