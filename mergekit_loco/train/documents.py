"""Named documents and the collections the data pipeline walks: a corpus of sources and its
seeded orders. A ``.jsonl`` file of a million lines holds a million documents, so collections
keep what each document needs (a line's number and byte offset, an index) in flat arrays and
build the :class:`Document` only when it is read: memory grows by bytes per document, not by
Python objects per document.
"""

from __future__ import annotations

import bisect
import hashlib
from array import array
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import overload

import numpy as np


@dataclass(frozen=True, slots=True)
class Document:
    """A named document whose text is read on demand, in pieces (``chunks()``); ``stamp``
    changes when the text may; ``origin`` is the file it comes from, resolved ("" if none)."""

    name: str
    stamp: str
    chunks: Callable[[], Iterable[str]]
    origin: str = ""

    def read(self) -> str:
        """The whole text (for small documents and tests; streaming code uses ``chunks``)."""
        return "".join(self.chunks())


def in_memory(name: str, stamp: str, text: str) -> Document:
    return Document(name, stamp, lambda: (text,))


class DocumentSequence(Sequence[Document]):
    """A read-only sequence of documents built on access; slicing gives a list."""

    def document(self, index: int) -> Document:
        raise NotImplementedError

    @overload
    def __getitem__(self, index: int) -> Document: ...
    @overload
    def __getitem__(self, index: slice) -> list[Document]: ...
    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self.document(i) for i in range(*index.indices(len(self)))]
        if not -len(self) <= index < len(self):
            raise IndexError(f"document index {index} out of range for {len(self)} documents")
        return self.document(index % len(self))

    def __iter__(self) -> Iterator[Document]:
        return (self.document(index) for index in range(len(self)))


class FileLines(DocumentSequence):
    """The documents of one file, one per line: ``name:NUMBER`` for each line number, its text
    ``read_line(offset)``; 16 bytes a document until one is read."""

    def __init__(self, name: str, stamp: str, read_line: Callable[[int], str], origin: str = ""):
        self.name, self.stamp, self.read_line, self.origin = name, stamp, read_line, origin
        self.numbers, self.offsets = array("q"), array("q")

    def append(self, number: int, offset: int) -> None:
        self.numbers.append(number)
        self.offsets.append(offset)

    def __len__(self) -> int:
        return len(self.numbers)

    def document(self, index: int) -> Document:
        offset = self.offsets[index]
        number = self.numbers[index]
        return Document(
            f"{self.name}:{number}",
            self.stamp,
            lambda: (self.read_line(offset),),
            f"{self.origin}:{number}" if self.origin else "",
        )


class Corpus(DocumentSequence):
    """The documents of several sources, one after the other; each part is a list of documents
    or one file's lines. No file may be read twice (a folder and a file in it), and no two
    documents may share a name (two folders of one name): names decide the split."""

    def __init__(self, parts: Iterable[Sequence[Document]], spec: str):
        self.parts = [part for part in parts if len(part)]
        self.ends, total = [], 0
        names: set[str] = set()
        origins: set[str] = set()
        for part in self.parts:
            total += len(part)
            self.ends.append(total)
            whole = [(part.name, part.origin, part[0])] if isinstance(part, FileLines) else None
            for name, origin, document in whole or ((d.name, d.origin, d) for d in part):
                if origin and origin in origins:
                    raise ValueError(
                        f"data spec {spec!r} includes document {document.name!r} twice"
                    )
                if name in names:
                    raise ValueError(
                        f"data spec {spec!r} has two documents named {document.name!r} (two "
                        "sources of one name?); rename one folder or file"
                    )
                names.add(name)
                if origin:
                    origins.add(origin)

    def __len__(self) -> int:
        return self.ends[-1] if self.ends else 0

    def document(self, index: int) -> Document:
        part = bisect.bisect_right(self.ends, index)
        start = self.ends[part - 1] if part else 0
        return self.parts[part][index - start]


class Ordered(DocumentSequence):
    """``documents`` in the order of ``indices`` (slicing keeps the view)."""

    def __init__(self, documents: Sequence[Document], indices: np.ndarray):
        self.documents, self.indices = documents, indices

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return Ordered(self.documents, self.indices[index])
        return super().__getitem__(index)

    def document(self, index: int) -> Document:
        return self.documents[int(self.indices[index])]


def hash_order(documents: Sequence[Document], salt: str) -> Ordered:
    """Documents in the deterministic pseudo-random order of ``sha256(salt, name)``: the sort of
    the 32-byte digests, as four big-endian 64-bit words (first word first)."""
    digests = bytearray()
    for document in documents:
        digests += hashlib.sha256(
            f"{salt}\0{document.name}".encode(errors="surrogateescape")
        ).digest()
    words = np.frombuffer(bytes(digests), dtype=">u8").reshape(-1, 4).astype(np.uint64)
    return Ordered(documents, np.lexsort(words.T[::-1]))


def content_fingerprint(documents: Iterable[Document]) -> str:
    """sha256 over every document's name and text: equal on every machine that holds the same
    texts (a stamp of :func:`fingerprint` changes when a reinstall rewrites a file)."""
    digest = hashlib.sha256()
    for document in documents:
        digest.update(f"{document.name}\0".encode(errors="surrogateescape"))
        for chunk in document.chunks():
            digest.update(chunk.encode())
        digest.update(b"\0")
    return digest.hexdigest()


def fingerprint(documents: Iterable[Document]) -> str:
    """sha256 over every document's name and stamp: changes when any text may have changed."""
    digest = hashlib.sha256()
    for document in documents:
        digest.update(f"{document.name}\0{document.stamp}\0".encode(errors="surrogateescape"))
    return digest.hexdigest()
