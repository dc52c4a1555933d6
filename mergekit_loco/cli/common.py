"""What every ``mloco`` command shares: one-line errors, exit codes, common options.

Every command is wrapped by :func:`user_errors`: a bad input becomes one ``error: ...`` line on
stderr and exit code 2 (``--debug`` shows the traceback instead); Ctrl-C exits 130.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Annotated, TypeVar

import typer

from mergekit_loco.console import print_line
from mergekit_loco.io.files import shown

USER_ERRORS = (ValueError, KeyError, OSError, OverflowError)
EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130
#: A run or a sweep's cell failed while running (diverged, a torchrun peer died or hung, its
#: process was killed, or anything else failed: out of memory, a full disk); the message names
#: the last good checkpoint.
EXIT_RUN_FAILED = 1

Debug = Annotated[bool, typer.Option("--debug", help="Show the traceback of an error.")]
Quiet = Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar, no summary.")]
Command = TypeVar("Command", bound=Callable)


def one_line(error: BaseException | str) -> str:
    """The error as one line: KeyError without quotes, OSError as ``file: reason``; control and
    format characters (a crafted file name's newline or escape sequence) are escaped."""
    if isinstance(error, KeyError) and error.args:
        message = str(error.args[0])
    elif isinstance(error, OSError) and error.filename and error.strerror:
        message = f"{error.filename}: {error.strerror}"
    else:
        message = str(error)
    return shown(" ".join(message.split())) or type(error).__name__


def print_error(message: str) -> None:
    print_line(f"error: {message}")


def print_warning(message: str) -> None:
    """A doubtful but valid request: one ``warning: ...`` line on stderr; the command goes on."""
    print_line(f"warning: {message}")


def user_errors(command: Command) -> Command:
    """Turn bad-input exceptions into ``error: <one line>`` and exit 2 (re-raise if ``debug``)."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except KeyboardInterrupt:
            print_error("interrupted; nothing was written")
            raise typer.Exit(EXIT_INTERRUPTED) from None
        except USER_ERRORS as error:
            if kwargs.get("debug"):
                raise
            print_error(one_line(error))
            raise typer.Exit(EXIT_BAD_INPUT) from None

    return wrapper


def path_parser(value: str) -> Path:
    """A path option or argument (typer's ``parser=``): an empty one, such as an unset shell
    variable gives, is refused instead of becoming ``Path("") == "."``, the current folder."""
    return Path(path_text_parser(value))


def path_text_parser(value: str) -> str:
    """:func:`path_parser` for an option kept as text (a folder read later, a list)."""
    if not value.strip():
        raise typer.BadParameter("an empty path (an unset shell variable?); give a path")
    return value


def parse_choice(option: str, value: str, choices: Sequence[str]) -> str:
    """``value`` if it is one of ``choices``, else a ``ValueError`` naming ``option``."""
    if value not in choices:
        raise ValueError(f"{option} must be one of {', '.join(choices)}, not {value!r}")
    return value


def check_seed(seed: int, option: str = "--seed") -> int:
    """A seed torch accepts: an integer in [0, 2**63)."""
    if not 0 <= seed < 2**63:
        raise ValueError(f"{option}: {seed} is not an integer in [0, 2**63)")
    return seed


def format_bytes(count: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if count < 1000:
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1000
    return f"{count:.1f} TB"
