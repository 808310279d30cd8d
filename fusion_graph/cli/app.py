"""The ``fusion-graph`` command line: run a turn, replay and calibrate traces, report stored threads.

::

    fusion-graph demo                  # a recorded conversation played live: no key, no server
    fusion-graph run "Rename foo to bar in app.py" --workspace .
    fusion-graph replay --cloud-share 30 --plot timelines.png   # the bundled sample traces
    fusion-graph calibrate my-traces/ --target-cloud-fraction 0.2 --json
    fusion-graph label my-traces/ --out labels.jsonl      # ask the local model every recorded step
    fusion-graph calibrate --labels labels.jsonl --target-cloud-fraction 0.2
    fusion-graph report --db .fusion-graph/threads.sqlite
    fusion-graph doctor --live

Each command lives in its own module (``run``, ``replay``, ``calibrate``, ``label``, ``report``,
``doctor``, ``demo``).
"""

from __future__ import annotations

from typing import Annotated

import typer

from fusion_graph.cli.calibrate import calibrate_command
from fusion_graph.cli.demo import demo
from fusion_graph.cli.doctor import doctor
from fusion_graph.cli.label import label
from fusion_graph.cli.replay import replay
from fusion_graph.cli.report import report
from fusion_graph.cli.run import run

app = typer.Typer(
    name="fusion-graph",
    help="Route each agent step to a cloud or a local llama-server model; replay, label, calibrate, report.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    # Plain help: flags without a value type beside them (typer's rich panels show ``--json <bool>``).
    rich_markup_mode=None,
)


def _print_version(value: bool) -> None:
    if value:
        from fusion_graph import __version__

        typer.echo(f"fusion-graph {__version__}")
        raise typer.Exit()


@app.callback()
def _options(
    version: Annotated[
        bool,
        typer.Option("--version", callback=_print_version, is_eager=True, help="Print the version and exit."),
    ] = False,
) -> None:
    """Options before the command (``--version``); a bad ``FUSION_*`` run default stops every command.

    The run context's defaults from the environment are checked before any
    command runs: an invalid one is one line naming the variable (exit 2), not a
    traceback.
    """
    from fusion_graph.cli.common import fail
    from fusion_graph.context import context_defaults
    from fusion_graph.errors import ContextError

    try:
        context_defaults()
    except ContextError as error:
        raise fail(str(error)) from None


app.command()(demo)  # first in --help: what a fresh install can run
app.command()(run)
app.command()(replay)
app.command("calibrate")(calibrate_command)
app.command()(label)
app.command()(report)
app.command()(doctor)


if __name__ == "__main__":  # python -m fusion_graph.cli.app
    app()
