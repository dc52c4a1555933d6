"""Outputs written atomically, and replaced only when they are ours.

Two writers, one rule each:

- :func:`write_atomically` for one small file (temp file in the same folder, then ``os.replace``).
- :func:`staged_output` for everything else (a merged checkpoint, a training checkpoint, a final
  model, a tokenizer cache): the caller fills a hidden staging folder ``.NAME.tmp-HOST-PID-XXXX``
  beside the target; when the ``with`` block ends without error the ownership marker is written
  into it and it is renamed into place. On an exception, Ctrl-C or SIGTERM the staging folder (and
  any parent folder made for it) is removed and the target is untouched. What a SIGKILL leaves
  (a staging folder, or the ``.NAME.old-HOST-PID-XXXX`` of a replaced target) names the process
  that made it: the next write of that target removes it once that process is gone
  (:func:`clear_dead_leftovers`), or renames an old target back if the new one never landed.

A folder this tool creates carries :data:`OWNER_MARKER`. :func:`check_output` decides whether an
existing output may be replaced (``--force``): only a checkpoint and nothing else
(:func:`foreign_entry`; a user's file added to an output of ours keeps it), never a symlink,
never a path that holds, or lies inside, one of the run's inputs. :func:`check_free_or_ours`
decides whether a command may write into an existing folder (a run's ``--out``, a results or
report folder): only one that is empty or ours, with or without ``--force``.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import socket
import tempfile
import threading
from collections.abc import Collection, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from mergekit_loco.io.files import UnsafeInputError, read_json, shown

#: The name ending of a sharded checkpoint's index file (its shards lie in its folder).
INDEX_SUFFIX = ".safetensors.index.json"
#: A PEFT LoRA adapter's config file, and its weights file beside it.
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"

#: The file that marks a folder as written by mergekit_loco (``--force`` may replace it).
OWNER_MARKER = ".mloco-output.json"
#: The lock file of a folder a process is writing (:mod:`mergekit_loco.io.lock`). It is no
#: output: a folder that holds only it is empty, and nothing ever deletes it.
LOCK_FILE = ".mloco-lock"
#: File names a checkpoint folder may hold (besides ``*.safetensors`` and index files).
#: The folder of a tokenizer's named chat templates (``NAME.jinja``), beside its files.
CHAT_TEMPLATES = "additional_chat_templates"
CHECKPOINT_SIDE_FILES = frozenset(
    {
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "added_tokens.json",
        "tokenizer.model",
        "spiece.model",
        "vocab.json",
        "vocab.txt",
        "merges.txt",
        "chat_template.jinja",
        "chat_template.json",
        OWNER_MARKER,
    }
)


class OutputRefused(ValueError):
    """An output path that may not be written or replaced; the message says why."""


class OutputExistsError(OutputRefused):
    """The output path exists and ``force`` was not given."""


#: Bytes of a name kept in the hidden names beside it (a file name may have 255 bytes).
STEM_BYTES = 120


def hidden_stem(path: Path) -> str:
    """The part of the hidden names beside ``path`` (``.STEM.tmp-...``) that names it:
    ``path.name``, or for a name too long to take a suffix within 255 bytes its first bytes
    and a hash of the whole (one name, one stem)."""
    name = path.name
    encoded = name.encode("utf-8", "surrogateescape")
    if len(encoded) <= STEM_BYTES:
        return name
    head = encoded[: STEM_BYTES - 9].decode("utf-8", "ignore")
    return f"{head}~{hashlib.sha256(encoded).hexdigest()[:8]}"


def write_atomically(path: Path, data: str | bytes) -> None:
    """Write ``data`` to ``path`` so that readers see the old file or the whole new one (mode
    0644); the folder is created if needed, and the temp file never outlives a failure."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, staging = tempfile.mkstemp(dir=path.parent, prefix=f".{hidden_stem(path)}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb" if isinstance(data, bytes) else "w") as handle:
            handle.write(data)
        os.chmod(staging, 0o644)  # mkstemp makes it private
        os.replace(staging, path)
    except BaseException:
        Path(staging).unlink(missing_ok=True)
        raise


# -- ownership -----------------------------------------------------------------------------------
def mark_output(folder: Path, kind: str) -> None:
    """Write the ownership marker (``{"written_by": "mergekit_loco", "kind": kind}``)."""
    marker = {"written_by": "mergekit_loco", "kind": kind}
    write_atomically(folder / OWNER_MARKER, json.dumps(marker) + "\n")


def claim_folder(folder: Path, kind: str, reads: Collection[str] = ()) -> None:
    """Create ``folder`` (and parents) and mark it as ours if it is new, empty or holds only the
    entries named ``reads`` (what the command reads there) and :data:`LOCK_FILE`; a folder that
    holds other files is used but not marked (so ``--force`` never treats it as ours)."""
    folder.mkdir(parents=True, exist_ok=True)
    ignored = (*reads, LOCK_FILE)
    if not is_ours(folder) and all(entry.name in ignored for entry in folder.iterdir()):
        mark_output(folder, kind)


def is_ours(folder: Path) -> bool:
    """``folder`` is a real folder (not a symlink) holding our marker as a regular file."""
    marker = folder / OWNER_MARKER
    real = not (folder.is_symlink() or marker.is_symlink())
    return real and folder.is_dir() and marker.is_file()


def marked_kind(folder: Path) -> str | None:
    """The ``kind`` our marker in ``folder`` names (:func:`mark_output`); None if the folder is
    not ours (:func:`is_ours`) or its marker names none."""
    if not is_ours(folder):
        return None
    try:
        marker = read_json(folder / OWNER_MARKER, "ownership marker", limit=4096)
    except UnsafeInputError:
        return None
    kind = marker.get("kind") if isinstance(marker, dict) else None
    return kind if isinstance(kind, str) else None


def check_free_or_ours(
    folder: Path,
    what: str,
    kinds: Collection[str],
    reads: Collection[str] = (),
    has_force: bool = True,
) -> None:
    """Refuse to write into ``folder`` unless it is new, ours and marked with one of ``kinds``
    (:func:`marked_kind`: what the command itself writes; a model folder inside a run is no run
    folder, a run folder no sweep), or holds nothing but the entries named ``reads`` (what the
    command reads there) and :data:`LOCK_FILE`; never a symlink or a file. ``--force`` changes
    nothing here (the message says so where the command has one, ``has_force``). The message
    names the folder, what wrote it and a file it holds."""
    if folder.is_symlink() or (folder.exists() and not folder.is_dir()):
        what_it_is = "a symlink" if folder.is_symlink() else "not a folder"
        raise OutputRefused(
            f"{shown(folder)}: {what} is {what_it_is}; refused (choose another folder)"
        )
    if not folder.exists() or marked_kind(folder) in kinds:
        return
    ignored = (*reads, LOCK_FILE)
    held = sorted(entry.name for entry in folder.iterdir() if entry.name not in ignored)
    if not held:
        return
    named = next((name for name in held if name != OWNER_MARKER), held[0])
    whose = (
        f"is a {shown(marked_kind(folder) or 'folder')} mergekit_loco wrote, not a "
        f"{' or a '.join(kinds)}"
        if is_ours(folder)
        else f"holds files mergekit_loco did not write (no {OWNER_MARKER})"
    )
    raise OutputRefused(
        f"{shown(folder)}: {what} {whose}: it holds {shown(named)}; refused"
        f"{' even with --force' if has_force else ''}: choose a new or empty folder"
    )


def foreign_entry(path: Path) -> Path | None:
    """The first entry that keeps ``path`` from being a plain checkpoint (None when it is one): a
    plain checkpoint is a ``.safetensors`` file, or a folder of regular files that all belong to
    a checkpoint or a LoRA adapter (``*.safetensors``, ``*.safetensors.index.json``, config,
    tokenizer and adapter files) and nothing else, or an empty folder: replacing it loses no
    other file."""
    if path.is_symlink() or not (path.is_file() or path.is_dir()):
        return path
    if path.is_file():
        return None if path.suffix == ".safetensors" else path
    entries = sorted(path.iterdir())
    return next(
        (
            entry
            for entry in entries
            if entry.is_symlink()
            or not (entry.is_file() or entry.name == CHAT_TEMPLATES)
            or not (
                entry.suffix == ".safetensors"
                or entry.name.endswith(INDEX_SUFFIX)
                or entry.name in CHECKPOINT_SIDE_FILES
                or entry.name == ADAPTER_CONFIG
                or (entry.name == CHAT_TEMPLATES and only_templates(entry))
            )
        ),
        None,
    )


def only_templates(folder: Path) -> bool:
    """``folder`` is a real folder of regular ``*.jinja`` files (a tokenizer's named chat
    templates, as transformers' ``save_pretrained`` writes them)."""
    if folder.is_symlink() or not folder.is_dir():
        return False
    return all(
        not e.is_symlink() and e.is_file() and e.suffix == ".jinja" for e in folder.iterdir()
    )


def settled(path: Path) -> Path:
    """``path`` with its ``..`` resolved as the kernel will once missing folders exist
    (``new/../x`` is ``./x``, not a folder ``new`` then ``new/..``); unchanged without ``..``."""
    if ".." not in path.parts:
        return path
    return path.resolve() if path.name == ".." else path.parent.resolve() / path.name


def overlapping_input(target: Path, inputs: Iterable[str | Path | None]) -> Path | None:
    """The first input that ``target`` is, holds, or lies inside (resolved paths), if any. An
    index file stands for its folder, where its shards lie."""
    where = target.resolve()
    for given in inputs:
        if given is None:
            continue
        source = Path(given).expanduser()
        if not (source.exists() or source.is_symlink()):
            continue
        if source.name.endswith(INDEX_SUFFIX) and source.is_file():
            source = source.parent
        resolved = source.resolve()
        if resolved.is_relative_to(where) or where.is_relative_to(resolved):
            return source
        if source.absolute().is_relative_to(target.absolute()):  # a symlink inside the target
            return source
    return None


def is_file_output(out: Path) -> bool:
    """Whether the checkpoint output ``out`` is one ``.safetensors`` file (a name ending in
    ``.safetensors``) rather than a folder. The name ``.safetensors`` alone is refused
    (:class:`OutputRefused`): it looks like a file but has no suffix, so it would make a hidden
    folder."""
    if out.name == ".safetensors":
        raise OutputRefused(
            f"{shown(out)}: '.safetensors' alone names no output (it would be a hidden folder); "
            "give a name: NAME.safetensors for one file, or a folder name"
        )
    return out.suffix == ".safetensors"


def check_output(
    target: Path, force: bool, inputs: Iterable[str | Path | None] = (), kind: str = "output"
) -> None:
    """Refuse to write ``target`` unless it is free, or ``force`` and it is ours or a checkpoint.

    Always refused: a target that is, holds or lies inside an input (``inputs``), and a target
    that is a symlink. ``force`` replaces only a plain checkpoint (:func:`foreign_entry`): an
    output mloco wrote to which a user added a file is refused too, with or without ``force``
    (the refusal never advises a ``--force`` that would be refused). Raises
    :class:`OutputExistsError` (a checkpoint exists, no ``force``) or :class:`OutputRefused`,
    naming the path and what to do. What a killed writer of ``target`` left is cleared first
    (:func:`clear_dead_leftovers`: an old target it was replacing is back in place).
    """
    target = settled(target)
    if target.name in ("", "."):  # the current folder, or the root: no name to stage beside
        raise OutputRefused(f"{shown(target)}: name the {kind}, like -o {target / 'merged'}")
    source = overlapping_input(target, inputs)
    if source is not None:
        raise OutputRefused(
            f"{shown(target)}: the {kind} would overlap the input {shown(source)} (it is, holds or "
            "lies inside it); choose another output path"
        )
    if target.is_symlink():
        raise OutputRefused(
            f"{shown(target)}: the {kind} path is a symlink; refused (remove the link or choose "
            "another path)"
        )
    clear_dead_leftovers(target)
    if not target.exists():
        return
    what = "folder" if target.is_dir() else "file"
    foreign = foreign_entry(target)  # named with or without force: --force would not help
    if foreign is not None:
        holds = "" if foreign == target else f" (it holds {shown(foreign.name)})"
        raise OutputRefused(
            f"{shown(target)}: the {kind} {what} exists and is not a checkpoint{holds}; --force "
            "replaces only a checkpoint (a .safetensors file, or a folder of checkpoint files and "
            "nothing else): remove it yourself or choose another path"
        )
    if not force:
        raise OutputExistsError(
            f"{shown(target)}: {kind} {what} exists; pass --force (force=True) to replace it"
        )


def check_results_folder(
    out: Path,
    kind: str,
    inputs: Iterable[str | Path | None],
    subfolders: Iterable[str] = (),
    has_force: bool = True,
) -> None:
    """Refuse a results folder (``mloco compare -o``, resumed in place) unless it is new, empty
    or ours of ``kind`` (:func:`check_free_or_ours`), does not overlap an input, and no entry
    of it or of its ``subfolders`` is a symlink."""
    source = overlapping_input(out, inputs)
    if source is not None:
        raise OutputRefused(
            f"{shown(out)}: -o would overlap the input {shown(source)} (it is, holds or lies "
            "inside it); choose another results folder"
        )
    check_free_or_ours(out, "-o", (kind,), has_force=has_force)
    for folder in (out, *(out / name for name in subfolders)):
        entries = sorted(folder.iterdir()) if folder.is_dir() else []
        for entry in entries:
            if entry.is_symlink():
                raise OutputRefused(
                    f"{shown(entry)}: is a symlink inside the results folder; refused (remove "
                    "the link or choose another -o)"
                )


def remove_output(path: Path) -> None:
    """Delete a file or folder that :func:`check_output` allowed (a symlink only as a link)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


# -- staging ---------------------------------------------------------------------------------------
def raise_on_signal(signum: int, frame: object) -> None:
    """SIGINT -> KeyboardInterrupt, SIGTERM -> SystemExit(128 + signum), so cleanup runs."""
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    raise SystemExit(128 + signum)


@contextmanager
def signals_raise() -> Iterator[None]:
    """SIGINT/SIGTERM raise (see :func:`raise_on_signal`) inside the block, on the main thread;
    the previous handlers come back afterwards. Only default handlers are replaced: an ignored
    signal stays ignored, and a program's own handler (e.g. the trainer's stop-between-rounds)
    keeps working."""
    defaults = {signal.SIGINT: signal.default_int_handler, signal.SIGTERM: signal.SIG_DFL}
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for signum, default in defaults.items():
            handler = signal.getsignal(signum)
            if handler in (default, raise_on_signal):
                previous[signum] = handler
                signal.signal(signum, raise_on_signal)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)


def make_missing_dirs(folder: Path) -> list[Path]:
    """Create ``folder`` and its missing parents; return those created, deepest first."""
    missing = []
    while not (folder.exists() or folder.is_symlink()):
        missing.append(folder)
        folder = folder.parent
    for created in reversed(missing):
        created.mkdir()
    return missing


def process_tag() -> str:
    """``HOST-PID`` of this process, for the names of its temporary paths (the host with
    anything but letters, digits, ``_`` and ``.`` replaced, so the last ``-`` ends it)."""
    host = re.sub(r"[^\w.]", "_", socket.gethostname())
    return f"{host}-{os.getpid()}"


def is_gone(host: str, pid: int) -> bool:
    """Whether the process ``pid`` of this host has ended (another host's: never known)."""
    if host != process_tag().rsplit("-", 1)[0]:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except (PermissionError, OverflowError):  # alive, another user's; no such PID can exist
        return False
    return False


def clear_dead_leftovers(target: Path) -> None:
    """Remove what a killed writer of ``target`` left beside it: its staging folder
    ``.NAME.tmp-HOST-PID-XXXX``, a replaced target it was deleting (``.NAME.del-...``), and the
    ``.NAME.old-HOST-PID-XXXX`` of a replaced target once the new target is in place (if it never
    landed, the old one is renamed back: nothing is lost). Only paths whose process, on this
    host, has ended; others are left alone."""
    stem = re.escape(hidden_stem(target))
    pattern = re.compile(rf"\.{stem}\.(tmp|old|del)-([\w.]+)-(\d+)-\w+")
    try:
        entries = list(target.parent.iterdir())
    except OSError:
        return
    for entry in entries:
        found = pattern.fullmatch(entry.name)
        if found is None or not is_gone(found[2], int(found[3])):
            continue
        if found[1] == "tmp":
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
        elif found[1] == "del" or target.exists() or target.is_symlink():
            remove_output(entry)
        else:
            os.rename(entry, target)


def commit(built: Path, target: Path, replace: bool) -> None:
    """Rename ``built`` to ``target``. An existing target (only if ``replace``) is first renamed
    to ``.NAME.old-HOST-PID-XXXX`` and deleted once the new one is in place (renamed back if that
    fails), so no failure leaves a ``.old-`` path or no target (a SIGKILL may:
    :func:`clear_dead_leftovers`)."""
    if not (target.exists() or target.is_symlink()):
        os.rename(built, target)
        return
    if not replace:
        raise OutputExistsError(f"{shown(target)}: appeared while it was being written")
    tag = f"{process_tag()}-{os.urandom(4).hex()}"
    old = target.with_name(f".{hidden_stem(target)}.old-{tag}")
    os.rename(target, old)
    try:
        os.rename(built, target)
    except BaseException:
        os.rename(old, target)
        raise
    doomed = target.with_name(
        f".{hidden_stem(target)}.del-{tag}"
    )  # .old- means: the new one not in
    os.rename(old, doomed)
    remove_output(doomed)


@contextmanager
def staged_output(
    target: Path, kind: str, replace: bool = False, file: bool = False
) -> Iterator[Path]:
    """Yield a fresh staging folder beside ``target``; commit it on success, remove it on failure.

    ``kind`` names what is written (``"merge"``, ``"checkpoint"``, ``"final model"``, ...). On a
    clean exit: for a folder target the marker :data:`OWNER_MARKER` is written into the staging
    folder, which then becomes ``target``; for a file target (``file=True``) the caller writes
    ``staging / target.name``, which then becomes ``target``. ``replace`` allows an existing
    target to be swapped out (call :func:`check_output` first). Permissions follow the umask
    (not mkdtemp's 0700).
    """
    target = settled(Path(target))
    created = make_missing_dirs(target.parent)
    clear_dead_leftovers(target)
    committed = False
    staging = Path(
        tempfile.mkdtemp(prefix=f".{hidden_stem(target)}.tmp-{process_tag()}-", dir=target.parent)
    )
    try:
        with signals_raise():
            yield staging
            umask = os.umask(0)
            os.umask(umask)
            staging.chmod(0o777 & ~umask)
            if file:
                commit(staging / target.name, target, replace)
            else:
                mark_output(staging, kind)
                commit(staging, target, replace)
            committed = True
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
        if not committed:
            for folder in created:
                try:
                    folder.rmdir()
                except OSError:
                    break
