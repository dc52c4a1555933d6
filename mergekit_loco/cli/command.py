"""How every ``mloco`` command parses and shows its help, and how the group loads commands lazily.

:class:`Command`: the usage line names arguments as ``MODELS...``, flags show no type, the help
ends with examples, and ``--flag true`` is answered with how flags work. :class:`LazyGroup`:
``mloco --help`` lists the commands from a table and imports only the one that runs.
"""

from __future__ import annotations

import importlib
import shlex
from dataclasses import dataclass

import typer
from typer.core import TyperArgument, TyperCommand, TyperGroup, TyperOption

#: Words a user may put after a flag meaning on or off: ``--rank-aware true``.
BOOLEAN_WORDS = frozenset({"true", "false", "yes", "no", "on", "off", "1", "0"})
#: ``ctx.meta`` key of the arguments the command was given (for messages that repeat them).
ARGS_KEY = "mloco.args"


def flag_message(option: str, param: TyperOption) -> str:
    """What to write instead of ``--flag VALUE``."""
    if param.secondary_opts:
        on, off = param.opts[0], param.secondary_opts[0]
        return f"it is a flag and takes no value: write {on} or {off}"
    return f"it is a flag and takes no value: write {option} to turn it on, omit it for off"


def flag_given_a_value(args: list[str], flags: dict[str, TyperOption]) -> tuple[str, str] | None:
    """``(option, message)`` for the first ``--flag true`` or ``--flag=true`` in ``args``."""
    for position, arg in enumerate(args):
        if arg == "--":
            return None
        option, equals, value = arg.partition("=")
        if option not in flags:
            continue
        if not equals and position + 1 < len(args):
            value = args[position + 1]
        if equals or value.lower() in BOOLEAN_WORDS:
            return option, flag_message(option, flags[option])
    return None


class Command(TyperCommand):
    """A typer command with plain flags, ``NAME...`` arguments and examples after the help."""

    def get_params(self, ctx: typer.Context) -> list:
        params = super().get_params(ctx)
        for param in params:
            if isinstance(param, TyperOption) and param.is_flag:
                param.metavar = ""  # the type column: ``--force``, not ``--force <bool>``
            elif isinstance(param, TyperArgument) and param.metavar is None:
                param.metavar = param.name.upper()
        return params

    def collect_usage_pieces(self, ctx: typer.Context) -> list[str]:
        pieces = [self.options_metavar] if self.options_metavar else []
        for param in self.get_params(ctx):
            if isinstance(param, TyperArgument):
                name = param.metavar + ("..." if param.nargs != 1 else "")
                pieces.append(name if param.required else f"[{name}]")
        return pieces

    def parse_args(self, ctx: typer.Context, args: list[str]) -> list[str]:
        ctx.meta[ARGS_KEY] = list(args)
        flags = {
            option: param
            for param in self.get_params(ctx)
            if isinstance(param, TyperOption) and param.is_flag and not param.count
            for option in (*param.opts, *param.secondary_opts)
        }
        misused = flag_given_a_value(args, flags)
        if misused is not None:
            option, message = misused
            raise typer.BadParameter(message, ctx=ctx, param_hint=f"'{option}'")
        return super().parse_args(ctx, args)


def command_line(ctx: typer.Context, *extra: str) -> str:
    """The command as the user typed it (``mloco merge a b --method ta``), plus ``extra`` options:
    at the end, or before a ``--`` (after which they would be read as arguments)."""
    args = list(ctx.meta.get(ARGS_KEY, []))
    end = args.index("--") if "--" in args else len(args)
    return shlex.join([*ctx.command_path.split(), *args[:end], *extra, *args[end:]])


@dataclass(frozen=True)
class CommandEntry:
    """One row of the command table: where the command lives and how ``mloco --help`` lists it.

    ``summary`` must be the first sentence of the function's docstring (a test checks it).
    """

    module: str
    function: str
    summary: str
    examples: tuple[str, ...]

    def epilog(self) -> str:
        """The examples as the help's last section (``\\b``: click keeps the lines as they are)."""
        return "\n".join(["\b", "Examples", *(f"  $ {line}" for line in self.examples)])

    def load(self, name: str) -> Command:
        """Import the command's module and build its click command."""
        function = getattr(importlib.import_module(self.module), self.function)
        single = typer.Typer(
            add_completion=False, pretty_exceptions_enable=False, rich_markup_mode=None
        )
        single.command(name, cls=Command, short_help=self.summary, epilog=self.epilog())(function)
        return typer.main.get_command(single)


class LazyGroup(TyperGroup):
    """``mloco``: lists commands from :data:`COMMANDS` and imports only the one that runs.

    :meth:`get_command` returns a summary stand-in (name and help, nothing to run) so that the
    listing and typo suggestions import nothing; :meth:`resolve_command`, which click calls to
    run a command, loads the real one.
    """

    entries: dict[str, CommandEntry] = {}

    def __init__(self, **attrs) -> None:
        super().__init__(**attrs)
        for name, entry in self.entries.items():
            self.commands[name] = Command(name, help=entry.summary, short_help=entry.summary)

    def resolve_command(self, ctx: typer.Context, args: list[str]):
        name, _, rest = super().resolve_command(ctx, args)
        command = self.entries[name].load(name)
        self.commands[name] = command
        return name, command, rest

    def get_params(self, ctx: typer.Context) -> list:
        params = super().get_params(ctx)
        for param in params:
            if isinstance(param, TyperOption) and param.is_flag:
                param.metavar = ""
        return params
