"""The ``mloco`` command line: thin wrappers that parse options and call the Python API.

Nothing heavy is imported here: each command's module is imported when that command runs
(``mloco --help`` or ``mloco methods`` never load torch), see :class:`LazyGroup`.
"""

from __future__ import annotations

import sys

import typer

from mergekit_loco.cli.command import CommandEntry, LazyGroup
from mergekit_loco.cli.common import EXIT_BAD_INPUT, EXIT_INTERRUPTED, one_line, print_error

#: Every command: its module and function, the line ``mloco --help`` shows, its examples.
COMMANDS = {
    "merge": CommandEntry(
        "mergekit_loco.cli.merge",
        "merge",
        "Merge fine-tunes of one base: theta = base + scale * method(model_t - base).",
        (
            "mloco merge ft1 ft2 ft3 --base base --method iso-c -o merged",
            "mloco merge a.safetensors b.safetensors --method mean  # no base needed",
            "mloco merge ft1 ft2 --base base --method ties --density 0.5 --dtype bfloat16",
        ),
    ),
    "methods": CommandEntry(
        "mergekit_loco.cli.methods",
        "methods",
        "List the merge methods with their parameters (defaults) and math.",
        (
            "mloco methods",
            "mloco methods ties  # one method: its whole description",
            "mloco merge ft1 ft2 --base base --method ties --density 0.3  # a listed parameter",
        ),
    ),
    "train": CommandEntry(
        "mergekit_loco.cli.train",
        "train_command",
        "DiLoCo training where any merge method is the aggregator (or a data-parallel baseline).",
        (
            "mloco train --preset isoloco --workers 8 --out runs/isoloco",
            "mloco train --aggregator ties --density 0.5 --model micro --tokens 500000",
            "mloco train --resume --out runs/isoloco  # after Ctrl-C",
        ),
    ),
    "compare": CommandEntry(
        "mergekit_loco.cli.compare",
        "compare_command",
        "Which aggregator for my R and H (a FLOP-matched sweep), or which merge method (merge).",
        (
            "mloco compare --aggregators diloco,isoloco --workers 1,2,4,8 -o results",
            "mloco compare --mode merge --base base --finetuned a,b --data stdlib,pydoc -o mres",
        ),
    ),
    "report": CommandEntry(
        "mergekit_loco.cli.compare",
        "report_command",
        "Re-render tables and figures from saved results (no training).",
        ("mloco report results", "mloco report mres-s0 mres-s1 -o mres-combined"),
    ),
    "eval": CommandEntry(
        "mergekit_loco.cli.compare",
        "eval_command",
        "Token-weighted validation loss and perplexity of each model on each dataset.",
        (
            "mloco eval merged runs/isoloco/final --data stdlib",
            "mloco eval merged --data stdlib,pydoc --tokens 8192 --json",
        ),
    ),
}


class Mloco(LazyGroup):
    entries = COMMANDS


app = typer.Typer(
    name="mloco",
    help="Model merging and DiLoCo training on one task-vector abstraction.",
    cls=Mloco,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # click's plain help: wraps at any width, never cuts a name
    epilog="Run mloco COMMAND --help for a command's options and examples.",
)


def print_version(asked: bool) -> None:
    """``mloco --version``: the installed package's version, then exit (no torch loaded)."""
    if asked:
        from mergekit_loco import __version__

        print(f"mloco {__version__}")
        raise typer.Exit()


@app.callback()
def mloco(
    version: bool = typer.Option(
        False, "--version", callback=print_version, is_eager=True, help="Print the version."
    ),
) -> None:
    """Model merging and DiLoCo training on one task-vector abstraction."""


def main(argv: list[str] | None = None) -> None:
    """Entry point of ``mloco``: usage errors become one ``error:`` line too (exit 2)."""
    args = sys.argv[1:] if argv is None else list(argv)
    try:
        exit_code = app(args=args or ["--help"], prog_name="mloco", standalone_mode=False)
    except typer.TyperException as error:  # click usage errors: missing option, bad value...
        print_error(one_line(error.format_message()))
        exit_code = getattr(error, "exit_code", EXIT_BAD_INPUT)
    except typer.Abort:
        print_error("interrupted; nothing was written")
        exit_code = EXIT_INTERRUPTED
    sys.exit(exit_code if isinstance(exit_code, int) else 0)
