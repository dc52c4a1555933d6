"""``mloco methods [NAME]``: the merge methods with their parameters and math, without
importing torch."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.markup import escape

from mergekit_loco.cli.catalog import MethodInfo, method_catalog, method_names
from mergekit_loco.cli.common import Debug, user_errors
from mergekit_loco.console import output_console


@user_errors
def methods(
    name: Annotated[
        str | None,
        typer.Argument(help="One method: its whole description and every parameter's default."),
    ] = None,
    debug: Debug = False,
) -> None:
    """List the merge methods with their parameters (defaults) and math."""
    if name is not None and name not in method_names():
        from mergekit_loco.methods.registry import unknown_method  # torch: on error only

        raise unknown_method(name)
    console = output_console(highlight=False)
    for info in method_catalog():
        if name is None:
            console.print(*heading(info), escape(f"  {info.math}"), sep="\n")
        elif info.name == name:
            console.print(*heading(info), escape(info.description), sep="\n")


def heading(info: MethodInfo) -> tuple[str, str]:
    """The method's name (and whether it needs no base) and its parameters with defaults."""
    base_note = "" if info.needs_base else "  (no --base needed)"
    parameters = ", ".join(f"{key}={value}" for key, value in info.parameters.items())
    return f"[bold]{info.name}[/bold]{base_note}", escape(f"  parameters: {parameters or 'none'}")
