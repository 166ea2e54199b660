"""The `colocate-rl` command line: one module per verb group, each parsing options, calling one domain function
and rendering (`train`/`validate`: cli.train; `mem-probe`: cli.memory; `recipes`/`env`/`report`: cli.info).
`guarded` (cli.common) is the one exception boundary. Heavy libraries (torch, transformers, trl, vllm) are imported
only inside the work a verb does, so `colocate-rl --help` is instant."""

from colocate_rl.cli import info, memory, train  # noqa: F401  (each registers its verbs on the app)
from colocate_rl.cli.common import app


def main() -> None:
    app()


if __name__ == "__main__":
    main()
