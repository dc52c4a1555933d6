"""The ``mloco`` command line: thin wrappers that parse options and call the Python API."""

from __future__ import annotations

import sys

import typer

from mergekit_loco.cli.common import (
    EXIT_BAD_INPUT,
    EXIT_INTERRUPTED,
    USER_ERRORS,
    Debug,
    Quiet,
    one_line,
    print_error,
    user_errors,
)
from mergekit_loco.cli.compare import compare_command, eval_command, report_command
from mergekit_loco.cli.merge import merge, methods
from mergekit_loco.cli.train import train_command

app = typer.Typer(
    name="mloco",
    help="Model merging and DiLoCo training on one task-vector abstraction.",
    add_completion=False,
    pretty_exceptions_enable=False,
)

app.command()(merge)
app.command()(methods)
app.command(name="train")(train_command)
app.command(name="compare")(compare_command)
app.command(name="report")(report_command)
app.command(name="eval")(eval_command)

__all__ = [
    "EXIT_BAD_INPUT",
    "EXIT_INTERRUPTED",
    "USER_ERRORS",
    "Debug",
    "Quiet",
    "app",
    "main",
    "one_line",
    "print_error",
    "user_errors",
]


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
