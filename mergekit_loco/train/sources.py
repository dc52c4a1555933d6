"""Text sources: the embedded corpora and the user's files, as named documents.

A data spec is a comma-separated list of sources: ``stdlib`` (the Python standard library's
own sources, the default), ``pydoc`` (its English documentation topics), ``torchsrc`` (the
Python sources of the torch package the project pins, for longer runs on code), ``austen`` and
``bible`` (public-domain text that Debian packages ship, unpacked beforehand; see docs/data.md),
or a path (text file, ``.jsonl`` file, folder).

User files are read as hostile input: only regular files, UTF-8 text without NUL bytes (the first
:data:`SNIFF_BYTES` are checked when the spec is loaded, so a binary file fails at once; the rest
as it streams), and never whole: a document's text comes in pieces of at most
:data:`CHUNK_BYTES`, cut after a newline, and a ``.jsonl`` line may hold at most
:data:`MAX_JSONL_LINE_BYTES`. Memory is bounded by what is tokenized, not by the file size
(a ``.jsonl`` line costs 16 bytes until it is read: ``documents.FileLines``).
"""

from __future__ import annotations

import codecs
import hashlib
import json
import os
import re
import sysconfig
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

from mergekit_loco.io.files import UnsafeInputError, inside, open_regular, shown
from mergekit_loco.train.debian_formats import (
    read_r_lazyload_strings,
    read_sword_ztext_chapters,
    split_before,
)
from mergekit_loco.train.documents import Corpus, Document, FileLines, in_memory

BUILTIN_SOURCES = ("stdlib", "pydoc", "torchsrc", "austen", "bible")
TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py", ".jsonl")
_STDLIB_SKIPPED_DIRS = {"site-packages", "dist-packages", "test", "tests", "idlelib", "__pycache__"}
#: Largest piece of a document's text read at once (a file up to this size is one piece).
CHUNK_BYTES = 2**20
#: Bytes of each file checked for binary content when the data spec is loaded.
SNIFF_BYTES = 8192
#: Longest ``.jsonl`` line (one document) accepted.
MAX_JSONL_LINE_BYTES = 64 * 2**20


def cache_root() -> Path:
    """``$MLOCO_CACHE``, else ``~/.cache/mergekit_loco``."""
    return Path(os.environ.get("MLOCO_CACHE", "~/.cache/mergekit_loco")).expanduser()


# -- sources ------------------------------------------------------------------------------------
#: The most sources one data spec may list (more: give a folder that holds them).
MAX_SOURCES = 10_000
#: The most separators one source's own name may hold (``notes,2024.txt`` holds one).
MAX_SEPARATORS_IN_NAME = 63


def split_sources(spec: str, separator: str = ",") -> list[str]:
    """The sources of a comma-separated data spec. A path whose name holds the separator (at
    most :data:`MAX_SEPARATORS_IN_NAME` times) stays whole where it exists
    (``notes,2024.txt``): at each position the longest run of parts that names an existing
    path is one source; a run too long to be a path name is none."""
    parts = spec.split(separator)
    if len(parts) > MAX_SOURCES:
        raise ValueError(
            f"data spec of {len(parts)} {separator!r}-separated sources, more than "
            f"{MAX_SOURCES}: put the files in one folder and give the folder"
        )
    sources, start = [], 0
    while start < len(parts):
        longest = min(len(parts), start + 1 + MAX_SEPARATORS_IN_NAME)
        end = next(
            (
                end
                for end in range(longest, start + 1, -1)
                if os.path.exists(os.path.expanduser(separator.join(parts[start:end]).strip()))
            ),
            start + 1,
        )  # os.path.exists: False for a name too long (Path.exists raised ENAMETOOLONG)
        sources.append(separator.join(parts[start:end]).strip())
        start = end
    return sources


def load_documents(spec: str) -> Corpus:
    """The documents of a comma-separated data spec (:func:`split_sources`), each source in a
    fixed sorted order."""
    parts = split_sources(spec)
    if not spec.strip() or not all(parts):
        raise ValueError(f"data spec {spec!r} has an empty source")
    return Corpus((group for part in parts for group in _source_documents(part)), spec)


def runs_of_documents(items: Iterable[Document | FileLines]) -> list[Sequence[Document]]:
    """Consecutive documents as one list, each file of lines as its own part."""
    parts: list[Sequence[Document]] = []
    for item in items:
        if isinstance(item, FileLines):
            parts.append(item)
        elif parts and isinstance(parts[-1], list):
            parts[-1].append(item)
        else:
            parts.append([item])
    return parts


def _source_documents(source: str) -> list[Sequence[Document]]:
    if source == "stdlib":
        return [_stdlib_documents()]
    if source == "pydoc":
        return [_pydoc_documents()]
    if source == "torchsrc":
        return [_torch_source_documents()]
    if source == "austen":
        return [_austen_documents()]
    if source == "bible":
        return [_bible_documents()]
    path = Path(source).expanduser()
    # a user's documents are named by the folder's or file's own name and the path inside it,
    # however the path was typed (data, ./data/, /home/me/data): the names decide the split
    root = path.resolve().name
    if path.is_dir():
        files = folder_files(path)
        parts = runs_of_documents(
            _file_documents(file, f"{root}/{file.relative_to(path).as_posix()}") for file in files
        )
        if not any(len(part) for part in parts):
            what = "only empty" if files else "no"  # a .jsonl of no lines holds no document
            raise ValueError(f"data folder {source!r} holds {what} {'/'.join(TEXT_SUFFIXES)} files")
        return parts
    if path.exists():  # a FIFO or device is refused by name here, not read
        return runs_of_documents([_file_documents(path, root)])
    raise ValueError(
        f"unknown data source {source!r}: not one of {', '.join(BUILTIN_SOURCES)} "
        "and no such file or folder"
    )


def folder_files(folder: Path) -> list[Path]:
    """The text files below ``folder`` (sorted; hidden names and symlinked folders skipped, a
    FIFO or device skipped); a file that is a symlink leading outside ``folder`` is refused."""
    files = []
    for directory, subfolders, names in os.walk(folder):  # never follows symlinked folders
        subfolders[:] = [name for name in subfolders if not name.startswith(".")]
        for name in names:
            file = Path(directory, name)
            if name.startswith(".") or file.suffix not in TEXT_SUFFIXES:
                continue
            if file.is_symlink():
                try:
                    inside(folder, file.relative_to(folder).as_posix(), "data file")
                except UnsafeInputError as error:
                    raise ValueError(str(error)) from None
            if file.is_file():
                files.append(file)
    return sorted(files)


def _file_documents(path: Path, name: str) -> Document | FileLines:
    """A text file as one document; a ``.jsonl`` file as one document per line (its "text")."""
    stat = path.stat()
    stamp = f"{stat.st_size}:{stat.st_mtime_ns}"
    sniff_text(path)
    origin = str(path.resolve())
    if path.suffix != ".jsonl":
        return Document(name, stamp, lambda: stream_text(path), origin)
    lines = FileLines(name, stamp, lambda offset: jsonl_text(path, offset), origin)
    for number, offset in jsonl_lines(path):
        lines.append(number, offset)
    return lines


def not_text(path: Path, position: int, what: str) -> ValueError:
    return ValueError(
        f"{shown(path)}: not a text file ({what} at byte {position}); --data reads UTF-8 text, "
        ".jsonl files and folders of them"
    )


def check_text(path: Path, block: bytes, position: int, decoder, final: bool = False) -> str:
    """``block`` (at byte ``position`` of ``path``) decoded as UTF-8 text without NUL bytes."""
    nul = block.find(b"\0")
    if nul >= 0:
        raise not_text(path, position + nul, "a NUL byte")
    try:
        return decoder.decode(block, final)
    except UnicodeDecodeError as error:
        raise not_text(path, position + error.start, "invalid UTF-8") from None


def sniff_text(path: Path) -> None:
    """Refuse ``path`` at once if its first :data:`SNIFF_BYTES` are not UTF-8 text (a cut
    multi-byte character at the end of the sample is allowed)."""
    try:
        with open_regular(path, "text file") as handle:
            block = handle.read(SNIFF_BYTES)
    except UnsafeInputError as error:
        raise ValueError(str(error)) from None
    check_text(path, block, 0, codecs.getincrementaldecoder("utf-8")())


def stream_text(path: Path) -> Iterator[str]:
    """The text of ``path`` in pieces of about :data:`CHUNK_BYTES`, each cut after a newline
    when there is one (so a file up to that size is one piece, as if read whole)."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    carry, position = "", 0
    try:
        handle = open_regular(path, "text file")
    except UnsafeInputError as error:
        raise ValueError(str(error)) from None
    with handle:
        while True:
            block = handle.read(CHUNK_BYTES)
            text = carry + check_text(path, block, position, decoder, final=not block)
            position += len(block)
            if not block:
                if text:
                    yield text
                return
            cut = text.rfind("\n") + 1 or len(text)
            piece, carry = text[:cut], text[cut:]
            if piece:
                yield piece


def jsonl_lines(path: Path) -> Iterator[tuple[int, int]]:
    """``(line number, byte offset)`` of every non-empty line of a ``.jsonl`` file, each checked
    to be a JSON object with a "text" string (read one bounded line at a time)."""
    try:
        handle = open_regular(path, "text file")
    except UnsafeInputError as error:
        raise ValueError(str(error)) from None
    with open(handle.fileno(), "rb", closefd=False) as lines, handle:
        offset = 0
        for number in range(1, 2**63):
            line = lines.readline(MAX_JSONL_LINE_BYTES + 1)
            if not line:
                return
            if len(line) > MAX_JSONL_LINE_BYTES:
                raise ValueError(
                    f"{shown(path)}:{number}: line longer than {MAX_JSONL_LINE_BYTES} bytes"
                )
            if line.strip():
                parse_jsonl_line(path, number, line, offset)
                yield number, offset
            offset += len(line)


def parse_jsonl_line(path: Path, number: int, line: bytes, offset: int) -> str:
    text = check_text(path, line, offset, codecs.getincrementaldecoder("utf-8")(), final=True)
    try:
        value = json.loads(text)["text"]
    except (ValueError, KeyError, TypeError, RecursionError):  # ValueError: JSON, huge ints
        raise ValueError(
            f'{shown(path)}:{number}: expected a JSON object with a "text" string'
        ) from None
    if not isinstance(value, str):
        raise ValueError(f'{shown(path)}:{number}: "text" is not a string')
    if b"\\u" in line and (surrogate := _LONE_SURROGATE.search(value)):
        raise ValueError(
            f'{shown(path)}:{number}: "text" holds the escape \\u{ord(surrogate[0]):04x}, half '
            "of a surrogate pair without its other half: not Unicode text"
        )
    return value


#: A UTF-16 surrogate left alone in a decoded string (JSON's ``"\ud83d"``): no character.
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def jsonl_text(path: Path, offset: int) -> str:
    """The "text" of the ``.jsonl`` line starting at byte ``offset``."""
    with open_regular(path, "text file") as handle:
        handle.seek(offset)
        with open(handle.fileno(), "rb", closefd=False) as lines:
            line = lines.readline(MAX_JSONL_LINE_BYTES + 1)
    return parse_jsonl_line(path, 0, line, offset)


def _python_tree_documents(root: Path, prefix: str) -> list[Document]:
    """The ``.py`` files below ``root`` (no tests, idlelib or installed packages), named
    ``prefix/relative/path.py``, in sorted order."""
    files = []
    for folder, subfolders, names in os.walk(root):
        subfolders[:] = [name for name in subfolders if name not in _STDLIB_SKIPPED_DIRS]
        files += [Path(folder, name) for name in names if name.endswith(".py")]
    return [
        _file_documents(path, f"{prefix}/{path.relative_to(root).as_posix()}")
        for path in sorted(files, key=lambda path: path.relative_to(root).parts)
        if os.access(path, os.R_OK)
    ]


def _stdlib_documents() -> list[Document]:
    """The standard library's own ``.py`` files."""
    return _python_tree_documents(Path(sysconfig.get_paths()["stdlib"]), "stdlib")


def _torch_source_documents() -> list[Document]:
    """The ``.py`` files of the installed torch package (the version pyproject pins, so the
    same documents on every machine), without its test folders."""
    import torch

    return _python_tree_documents(Path(torch.__file__).parent, "torchsrc")


def _pydoc_documents() -> list[Document]:
    """English reference prose shipped with CPython: one document per ``pydoc_data`` topic."""
    try:
        from pydoc_data.topics import topics
    except ImportError as error:
        raise ValueError("data source 'pydoc': this Python has no pydoc_data.topics") from error
    return [
        in_memory(f"pydoc/{name}", hashlib.sha256(text.encode()).hexdigest(), text)
        for name, text in sorted(topics.items())
    ]


def _missing_debian_data(source: str, env: str, package: str, folder: Path) -> ValueError:
    return ValueError(
        f"data source {source!r} needs the Debian package {package} unpacked in {folder} "
        f"(or set ${env}); run: apt-get download {package} && "
        f"dpkg -x {package}_*.deb {folder}"
    )


def _austen_documents() -> list[Document]:
    """Jane Austen's six novels from r-cran-janeaustenr, one document per chapter."""
    folder = Path(os.environ.get("MLOCO_AUSTEN_DIR", cache_root() / "austen")).expanduser()
    indexes = sorted(folder.rglob("janeaustenr/data/Rdata.rdx")) if folder.is_dir() else []
    if not indexes:
        raise _missing_debian_data("austen", "MLOCO_AUSTEN_DIR", "r-cran-janeaustenr", folder)
    stamp = str(indexes[0].with_suffix(".rdb").stat().st_size)
    heading = re.compile(r"^chapter\s+[\divxlc]+\b", re.IGNORECASE)
    documents = []
    for book, lines in read_r_lazyload_strings(indexes[0]).items():
        chapters = split_before(lines, heading)
        for number, chapter in enumerate(chapters):
            text = "\n".join(chapter).strip() + "\n"
            documents.append(in_memory(f"austen/{book}/{number:03d}", stamp, text))
    return documents


def _bible_documents() -> list[Document]:
    """The World English Bible from sword-text-web, one document per chapter (notes dropped)."""
    folder = Path(os.environ.get("MLOCO_BIBLE_DIR", cache_root() / "bible")).expanduser()
    modules = sorted(folder.rglob("engWEB*/ot.bzz")) if folder.is_dir() else []
    if not modules:
        raise _missing_debian_data("bible", "MLOCO_BIBLE_DIR", "sword-text-web", folder)
    module = modules[0].parent
    stamp = str(sum((module / f"{part}.bzz").stat().st_size for part in ("ot", "nt")))
    return [
        in_memory(f"bible/{chapter}", stamp, text)
        for chapter, text in read_sword_ztext_chapters(module).items()
    ]
