"""The rich console every command prints its tables on, the progress bars of one-shot commands,
and the one way to print a line on stderr.

On a terminal rich fits a table to the terminal's width. Elsewhere (a log file, ``tee``, CI)
it assumes 80 columns and cuts cells (``aggre…``, ``[-0.6…``); there the console is wide enough
that no table is cut, unless ``COLUMNS`` sets a width.
"""

from __future__ import annotations

import os
import sys

from rich.console import Console
from rich.progress import Progress, ProgressColumn

#: The width of a console that does not write to a terminal: wider than any table we print.
UNCUT_WIDTH = 10_000


def output_console(**options) -> Console:
    """``Console(**options)``, at :data:`UNCUT_WIDTH` columns when it writes to no terminal and
    neither ``width`` nor ``$COLUMNS`` says otherwise."""
    console = Console(**options)
    if not console.is_terminal and "width" not in options and "COLUMNS" not in os.environ:
        console.width = UNCUT_WIDTH
    return console


def print_line(line: str) -> None:
    """``line`` and its newline on stderr in one write, so that the lines of torchrun ranks
    sharing one stderr never interleave mid-line (``print`` writes the newline apart)."""
    sys.stderr.write(f"{line}\n")
    sys.stderr.flush()


def stderr_progress(enabled: bool, *columns: str | ProgressColumn) -> Progress:
    """A rich progress bar of ``columns`` on stderr, drawn only when ``enabled`` on a terminal
    and cleared when done (``merge``'s and ``eval``'s; stdout keeps only their results)."""
    console = Console(stderr=True)
    return Progress(
        *columns,
        console=console,
        transient=True,
        disable=not (enabled and console.is_terminal),
    )
