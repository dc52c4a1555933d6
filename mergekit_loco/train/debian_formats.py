"""Readers of the two Debian-packaged corpora's file formats: an R lazy-load database
(r-cran-janeaustenr) and a SWORD zText module (sword-text-web). Pure parsers: bytes on disk in,
text out; :mod:`mergekit_loco.train.sources` turns the text into documents.
"""

from __future__ import annotations

import gzip
import re
import struct
import zlib
from pathlib import Path


def split_before(lines: list[str], heading: re.Pattern) -> list[list[str]]:
    """Split ``lines`` into runs, each starting at a heading line (the first run may not)."""
    runs: list[list[str]] = [[]]
    for line in lines:
        if heading.match(line) and any(text.strip() for text in runs[-1]):
            runs.append([])
        runs[-1].append(line)
    return runs


def read_r_lazyload_strings(index_path: Path) -> dict[str, list[str]]:
    """The character vectors of an R lazy-load database (``X.rdx`` index + ``X.rdb`` data).

    Each entry of the ``.rdb`` is a 4-byte big-endian length then a zlib stream of an R XDR
    serialization; the ``.rdx`` is a gzipped serialization of ``list(variables = list(name =
    c(offset, length)), ...)``. Only the value types these datasets use are decoded.
    """
    index = _RReader(gzip.decompress(index_path.read_bytes())).read()
    variables = index["variables"]
    blob = index_path.with_suffix(".rdb").read_bytes()
    vectors = {}
    for name, (offset, length) in variables.items():
        value = _RReader(zlib.decompress(blob[offset + 4 : offset + length])).read()
        if isinstance(value, list) and all(item is None or isinstance(item, str) for item in value):
            vectors[name] = [item or "" for item in value]
    return vectors


class _RReader:
    """A minimal reader of R's XDR serialization format (versions 2 and 3)."""

    _NIL, _REF, _SYMBOL, _PAIRLIST, _CHARS = 254, 255, 1, 2, 9
    _LOGICAL, _INTEGER, _REAL, _STRINGS, _LIST = 10, 13, 14, 16, 19

    def __init__(self, raw: bytes):
        if raw[:2] != b"X\n":
            raise ValueError("not an R XDR serialization")
        self.raw, self.offset, self.references = raw, 2, []
        version = self._int()
        self.offset += 8  # writer and minimal reader R versions
        if version == 3:
            encoding_length = self._int()  # then the native encoding's name
            self.offset += encoding_length

    def _int(self) -> int:
        (value,) = struct.unpack_from(">i", self.raw, self.offset)
        self.offset += 4
        return value

    def read(self):
        """Vectors become lists (named ones dicts), symbols strings, NA/NULL None."""
        flags = self._int()
        kind, has_attributes, has_tag = flags & 0xFF, flags & (1 << 9), flags & (1 << 10)
        if kind == self._NIL:
            return None
        if kind == self._REF:
            return self.references[(flags >> 8 or self._int()) - 1]
        if kind == self._SYMBOL:
            symbol = self.read()
            self.references.append(symbol)
            return symbol
        if kind == self._CHARS:
            length = self._int()
            if length == -1:
                return None
            self.offset += length
            return self.raw[self.offset - length : self.offset].decode("utf-8", errors="replace")
        if kind == self._PAIRLIST:
            pairs = {}
            if has_attributes:
                self.read()
            tag = self.read() if has_tag else None
            pairs[tag] = self.read()
            rest = self.read()
            return {**pairs, **(rest or {})}
        length = self._int()
        if kind in (self._LOGICAL, self._INTEGER, self._REAL):
            code = "d" if kind == self._REAL else "i"
            values = list(struct.unpack_from(f">{length}{code}", self.raw, self.offset))
            self.offset += length * struct.calcsize(code)
        elif kind in (self._STRINGS, self._LIST):
            values = [self.read() for _ in range(length)]
        else:
            raise ValueError(f"R serialization: value type {kind} is not supported")
        attributes = self.read() if has_attributes else {}
        names = attributes.get("names")
        return dict(zip(names, values, strict=True)) if names and kind == self._LIST else values


def read_sword_ztext_chapters(module: Path) -> dict[str, str]:
    """Chapters (OSIS id -> plain text) of a SWORD zText module with OSIS markup.

    ``{ot,nt}.bzs`` lists blocks as little-endian uint32 (offset, size, uncompressed size) into
    ``{ot,nt}.bzz``, each a zlib stream of the OSIS text; chapters start at ``<chapter sID=...>``
    and end at the next chapter or book. Book title pages and footnotes are dropped.
    """
    markup = []
    for testament in ("ot", "nt"):
        index = (module / f"{testament}.bzs").read_bytes()
        blocks = (module / f"{testament}.bzz").read_bytes()
        for offset, size, _ in struct.iter_unpack("<III", index):
            markup.append(zlib.decompress(blocks[offset : offset + size]).decode("utf-8"))
    osis = re.sub(r"<note\b.*?</note>", " ", "".join(markup), flags=re.DOTALL)
    osis = re.sub(r'<div eID="[^"]*" type="x-p"/>|</l>', "\n", osis)
    pieces = re.split(r'<chapter\b[^>]*\bsID="([^"]+)"[^>]*/>', osis)
    chapters = {}
    for chapter, body in zip(pieces[1::2], pieces[2::2], strict=True):
        body = re.split(r'<div\b[^>]*\btype="book"', body)[0]  # the next book's title page
        text = re.sub(r"<[^>]+>", "", body)
        text = re.sub(r"[ \t]+", " ", text)
        text = re.sub(r" ([,.;:!?’”)])", r"\1", text)
        text = re.sub(r"\s*\n\s*", "\n", text).strip()
        if text:
            chapters[chapter] = text + "\n"
    return chapters
