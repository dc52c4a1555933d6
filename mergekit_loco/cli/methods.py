"""``mloco methods``: every merge method with its parameters and math, without importing torch."""

from __future__ import annotations

from rich.markup import escape

from mergekit_loco.cli.catalog import method_catalog
from mergekit_loco.cli.common import Debug, user_errors
from mergekit_loco.console import output_console


@user_errors
def methods(debug: Debug = False) -> None:
    """List the merge methods with their parameters (defaults) and math."""
    console = output_console(highlight=False)
    for info in method_catalog():
        base_note = "" if info.needs_base else "  (no --base needed)"
        parameters = ", ".join(f"{name}={value}" for name, value in info.parameters.items())
        console.print(f"[bold]{info.name}[/bold]{base_note}")
        console.print(escape(f"  parameters: {parameters or 'none'}"))
        console.print(escape(f"  {info.math}"))
