"""Reading files that strangers made: regular files only, inside their folder, bounded.

Every input file is opened with :func:`open_regular` (no FIFO, device or socket can block or
stream forever; ``O_NONBLOCK`` so that opening a FIFO never waits), small JSON files are read
with :func:`read_json` (a size cap, no NaN/Infinity, no duplicate keys, bounded nesting), and a
file named by another file (a shard in an index, a tokenizer file in a folder) must resolve
inside that folder (:func:`inside`). Messages show paths through :func:`shown`, which escapes
control and format characters, so a crafted name cannot break the one-line error or drive the
terminal. No message ever quotes bytes of a file that failed to parse.
"""

from __future__ import annotations

import io
import json
import os
import stat
import unicodedata
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

#: Bound on small JSON files (index, config, manifest, state): safetensors' header cap.
MAX_JSON_BYTES = 100_000_000


class UnsafeInputError(ValueError):
    """An input that is not a readable regular file, leads outside its folder, or is malformed."""


#: The most characters of a value :func:`shown` escapes; a longer one's rest is counted, not
#: shown (a 20 MB tensor name took seconds to escape before its message cut it to 200).
SHOWN_CHARS = 4096


def shown(value: object) -> str:
    """``value`` as text safe for a one-line message: control/format characters escaped, and
    the lone surrogates of a non-UTF-8 file name (``\\udce9``), which no UTF-8 stream takes;
    past :data:`SHOWN_CHARS` characters, only their number."""
    text, rest = str(value), ""
    if len(text) > SHOWN_CHARS:
        text, rest = text[:SHOWN_CHARS], f"... ({len(text):,} characters)"
    return (
        "".join(
            char.encode("unicode_escape").decode("ascii")
            if unicodedata.category(char) in ("Cc", "Cf", "Zl", "Zp", "Cs")
            else char
            for char in text
        )
        + rest
    )


def brief(value: object, width: int = 40) -> str:
    """``repr(value)`` cut to ``width`` characters; an integer too long for Python to print
    (over 4300 digits) or to show is described by its size."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 128:
        return f"an integer of about {int(value.bit_length() * 0.30103) + 1} digits"
    return repr(value)[:width]


def kind_of(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def open_regular(path: Path, what: str = "file") -> BinaryIO:
    """Open ``path`` for binary reading, refusing anything but a regular file (unbuffered).

    The check is made on the opened descriptor (``fstat``), so a swap after the check cannot
    slip a FIFO or device in.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise UnsafeInputError(f"{shown(path)}: no such {what}") from None
    except OSError as error:
        raise UnsafeInputError(f"{shown(path)}: cannot read ({error.strerror or error})") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise UnsafeInputError(f"{shown(path)}: is {kind_of(mode)}, not a {what}")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb", buffering=0)


def open_limited(path: Path, limit: int, what: str = "file") -> BinaryIO:
    """:func:`open_regular`, refusing a file larger than ``limit`` bytes."""
    handle = open_regular(path, what)
    size = os.fstat(handle.fileno()).st_size
    if size > limit:
        handle.close()
        raise UnsafeInputError(f"{shown(path)}: {size} bytes, more than a {what} may hold")
    return handle


def read_limited(path: Path, limit: int, what: str = "file") -> bytes:
    """The bytes of the regular file ``path``, refusing one larger than ``limit`` bytes."""
    with open_limited(path, limit, what) as handle:
        try:
            return handle.read(limit + 1)[:limit]
        except OSError as error:
            reason = error.strerror or error
            raise UnsafeInputError(f"{shown(path)}: cannot read ({reason})") from None


def read_lines(
    path: Path, limit: int, what: str = "file", line_limit: int = 1 << 20
) -> Iterator[bytes | None]:
    """The lines of the regular file ``path`` (without their line ending), streamed: memory
    holds one line at a time. A file larger than ``limit`` bytes is refused; a line longer than
    ``line_limit`` comes as None (read past in chunks, never held)."""
    with open_regular(path, what) as raw:
        size = os.fstat(raw.fileno()).st_size
        if size > limit:
            raise UnsafeInputError(f"{shown(path)}: {size} bytes, more than a {what} may hold")
        handle = io.BufferedReader(raw)
        try:
            while line := handle.readline(line_limit + 1):
                if len(line) > line_limit and not line.endswith(b"\n"):
                    while line and not line.endswith(b"\n"):
                        line = handle.readline(line_limit)
                    yield None
                else:
                    yield line.rstrip(b"\r\n")
        except OSError as error:
            reason = error.strerror or error
            raise UnsafeInputError(f"{shown(path)}: cannot read ({reason})") from None


def _no_constant(name: str) -> object:
    raise ValueError(f"{name} is not JSON")


def unique_keys(pairs: list[tuple[str, object]]) -> dict:
    """``dict(pairs)``, refusing a key that appears twice."""
    result = dict(pairs)
    if len(result) != len(pairs):
        seen = set()
        for key, _ in pairs:
            if key in seen:
                raise ValueError(f"key {shown(key)[:80]!r} appears twice")
            seen.add(key)
    return result


def unique_text_keys(pairs: list[tuple[str, object]]) -> dict:
    """:func:`unique_keys`, also refusing a key or string value that is no Unicode text (a
    lone surrogate escape such as ``"\\ud800"``, which UTF-8 cannot hold)."""
    for key, value in pairs:
        if not (is_text(key) and all_text(value)):
            raise ValueError(f"a string at key {ascii(key)[:80]} holds a lone surrogate")
    return unique_keys(pairs)


def is_text(text: str) -> bool:
    """``text`` encodes to UTF-8 (holds no lone surrogate)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def all_text(value: object) -> bool:
    """Every string in ``value`` and its nested lists :func:`is_text` (objects inside were
    checked when they were parsed)."""
    if isinstance(value, str):
        return is_text(value)
    return not isinstance(value, list) or all(map(all_text, value))


def json_int(literal: str) -> int | float:
    """A JSON integer literal; ``-0`` is the float -0.0, as JSON and serde read it (so a
    safetensors offset or shape of ``-0`` is refused as not an integer, as safetensors does)."""
    return -0.0 if literal == "-0" else int(literal)


def parse_json(raw: bytes, where: str, text_only: bool = False) -> object:
    """Strict JSON: UTF-8, no NaN/Infinity, no duplicate keys, ``-0`` read as a float, nesting
    bounded by the interpreter's recursion limit (a deeper text is refused, never a
    ``RecursionError``); with ``text_only`` no lone surrogate escape in a key or string value
    either (safetensors refuses them; mloco's own files may hold one: a non-UTF-8 path that
    ``json.dumps`` escaped).

    Raises :class:`UnsafeInputError` naming ``where`` (never quoting the bytes).
    """
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise UnsafeInputError(f"{where}: not UTF-8 (at byte {error.start})") from None
    try:
        hook = unique_text_keys if text_only else unique_keys
        return json.loads(
            text, object_pairs_hook=hook, parse_constant=_no_constant, parse_int=json_int
        )
    except json.JSONDecodeError as error:
        raise UnsafeInputError(
            f"{where}: not valid JSON ({error.msg} at char {error.pos})"
        ) from None
    except RecursionError:
        raise UnsafeInputError(f"{where}: not valid JSON (nested too deep)") from None
    except ValueError as error:
        raise UnsafeInputError(f"{where}: not valid JSON ({error})") from None


def read_json(path: Path, what: str = "JSON file", limit: int = MAX_JSON_BYTES) -> object:
    """:func:`parse_json` of the regular file ``path`` (at most ``limit`` bytes)."""
    return parse_json(read_limited(path, limit, what), shown(path))


def allowed_roots(folder: Path) -> list[Path]:
    """Where the files ``folder`` names may resolve to: ``folder`` itself and, for a snapshot of
    the Hugging Face hub cache (``models--ORG--NAME/snapshots/REVISION/``, whose files are
    symlinks to ``../../blobs/HASH``), that repository's ``blobs/`` folder."""
    root = folder.resolve()
    repository = root.parent.parent
    blobs = repository / "blobs"
    is_snapshot = root.parent.name == "snapshots" and repository.name.startswith(
        ("models--", "datasets--")
    )
    return [root, blobs] if is_snapshot and blobs.is_dir() and not blobs.is_symlink() else [root]


def inside(folder: Path, name: str, what: str) -> Path:
    """``folder / name``, refusing a name that is absolute, climbs out (``..``) or resolves
    (through symlinks) outside ``folder`` (or its hub-cache ``blobs/``, :func:`allowed_roots`):
    the file a checkpoint or tokenizer folder names must be in that folder."""
    if not isinstance(name, str) or not name or "\0" in name:
        raise UnsafeInputError(f"{shown(folder)}: {what} is not a file name")
    relative = Path(name)
    if relative.is_absolute() or ".." in relative.parts:
        raise UnsafeInputError(
            f"{shown(folder)}: {what} {shown(name)!r} points outside the folder; refused"
        )
    path = folder / relative
    try:
        resolved = path.resolve()
        roots = allowed_roots(folder)
    except (OSError, RuntimeError) as error:
        raise UnsafeInputError(f"{shown(path)}: cannot resolve ({error})") from None
    if not any(resolved.is_relative_to(root) for root in roots):
        raise UnsafeInputError(
            f"{shown(path)}: {what} is a symlink leading outside {shown(folder)}; refused "
            "(copy the real file into the folder)"
        )
    return path
