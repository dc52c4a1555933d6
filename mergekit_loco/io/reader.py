"""Lazy safetensors reader: one ``.safetensors`` file or a Hugging Face folder.

A safetensors file is ``u64 little-endian header length N | N bytes of JSON | tensor data``; the
JSON maps each tensor name to ``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets
relative to the data section). Headers are parsed and checked against the file size when the
checkpoint is opened; tensor data is read one tensor at a time into a fresh buffer with one
``readinto``. (safetensors' ``safe_open`` memory-maps the file instead, and every page it touches
stays in the process's resident set until the file is closed, so a streamed merge would end up
with all its inputs resident.)
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
LENGTH_PREFIX_BYTES = 8
#: safetensors refuses headers above 100 MB too; a bigger length means a corrupt prefix.
MAX_HEADER_BYTES = 100_000_000

SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U64": torch.uint64,
    "U32": torch.uint32,
    "U16": torch.uint16,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


class CheckpointError(ValueError):
    """A checkpoint that cannot be read or written; the message names the file and tensor."""


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lives: ``file`` bytes ``[begin, end)`` (absolute offsets)."""

    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int


def read_header(file: Path) -> dict[str, TensorEntry]:
    """Parse and check the header of one safetensors file; entries in header order.

    Raises :class:`CheckpointError` for a missing or unreadable file, a cut or non-JSON header,
    an unknown dtype, offsets that disagree with dtype x shape, or data past the end of the file.
    """
    try:
        with open(file, "rb") as handle:
            file_size = handle.seek(0, 2)
            handle.seek(0)
            prefix = handle.read(LENGTH_PREFIX_BYTES)
            if len(prefix) < LENGTH_PREFIX_BYTES:
                raise CheckpointError(
                    f"{file}: header cut: the file has {file_size} bytes, fewer than the "
                    f"{LENGTH_PREFIX_BYTES}-byte header length"
                )
            header_bytes = int.from_bytes(prefix, "little")
            available = file_size - LENGTH_PREFIX_BYTES
            if header_bytes > min(available, MAX_HEADER_BYTES):
                raise CheckpointError(
                    f"{file}: header cut: the header length says {header_bytes} bytes but "
                    f"{available} follow (truncated or not a safetensors file)"
                )
            raw_header = handle.read(header_bytes)
    except FileNotFoundError:
        raise CheckpointError(f"{file}: no such file") from None
    except OSError as error:
        raise CheckpointError(f"{file}: cannot read ({error.strerror or error})") from error
    try:
        header = json.loads(raw_header)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CheckpointError(f"{file}: bad JSON header ({error})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{file}: bad JSON header (not an object)")
    data_start = LENGTH_PREFIX_BYTES + header_bytes
    entries = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        entry = parse_entry(file, name, info, data_start)
        if entry.end > file_size:
            raise CheckpointError(
                f"{file}: data cut: tensor {name!r} ends at byte {entry.end} but the file has "
                f"{file_size} bytes (truncated?)"
            )
        entries[name] = entry
    return entries


def parse_entry(file: Path, name: str, info: object, data_start: int) -> TensorEntry:
    """One header entry -> :class:`TensorEntry`, checking ``end - begin = numel * itemsize``."""
    try:
        dtype_name, shape, (begin, end) = info["dtype"], info["shape"], info["data_offsets"]
        valid = all(isinstance(v, int) and v >= 0 for v in (*shape, begin, end)) and begin <= end
    except (TypeError, KeyError, ValueError):
        valid = False
    if not valid:
        raise CheckpointError(f"{file}: bad JSON header: tensor {name!r} has entry {info!r}")
    if dtype_name not in SAFETENSORS_DTYPES:
        raise CheckpointError(f"{file}: tensor {name!r} has unknown dtype {dtype_name!r}")
    dtype = SAFETENSORS_DTYPES[dtype_name]
    needed = math.prod(shape) * dtype.itemsize
    if end - begin != needed:
        raise CheckpointError(
            f"{file}: corrupt header: tensor {name!r} spans {end - begin} bytes but "
            f"{dtype_name} x {list(shape)} needs {needed}"
        )
    return TensorEntry(file, dtype, tuple(shape), data_start + begin, data_start + end)


def read_index(index: Path) -> dict[str, TensorEntry]:
    """Entries of a sharded checkpoint: shards in name order, tensors in header order."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError
    except OSError as error:
        raise CheckpointError(f"{index}: cannot read ({error.strerror or error})") from error
    except (ValueError, KeyError, TypeError) as error:
        raise CheckpointError(
            f"{index}: bad index (expected JSON with a weight_map): {error}"
        ) from None
    entries = {}
    for shard_name in sorted(set(weight_map.values())):
        shard = index.parent / shard_name
        listed = [name for name, file in weight_map.items() if file == shard_name]
        if not shard.is_file():
            raise CheckpointError(
                f"{index}: points at missing shard {shard_name} (for tensor {listed[0]!r})"
            )
        shard_entries = read_header(shard)
        absent = [name for name in listed if name not in shard_entries]
        if absent:
            raise CheckpointError(
                f"{shard}: tensor {absent[0]!r} listed in {index.name} is not in this shard"
            )
        entries.update((name, entry) for name, entry in shard_entries.items() if name in listed)
    return entries


class CheckpointReader:
    """Tensors of a checkpoint, read lazily one at a time. Use :func:`open_checkpoint`.

    ``names()`` lists the tensors in file order; ``shape``/``dtype`` come from the header;
    ``get(name)`` reads one tensor from disk.
    """

    def __init__(self, path: Path, weights_file: Path, entries: dict[str, TensorEntry]):
        self.path = path
        self.weights_file = weights_file
        self._entries = entries
        self._handles: dict[Path, BinaryIO] = {}

    @property
    def config_dir(self) -> Path:
        """The folder that holds ``config.json``, tokenizer files etc. (or the file's folder)."""
        return self.weights_file.parent

    def names(self) -> list[str]:
        return list(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def entry(self, name: str) -> TensorEntry:
        if name not in self._entries:
            raise CheckpointError(f"{self.path}: no tensor {name!r}")
        return self._entries[name]

    def shape(self, name: str) -> tuple[int, ...]:
        return self.entry(name).shape

    def dtype(self, name: str) -> torch.dtype:
        return self.entry(name).dtype

    def file_of(self, name: str) -> Path:
        """The file (shard) holding tensor ``name``."""
        return self.entry(name).file

    def get(self, name: str) -> torch.Tensor:
        """Read tensor ``name`` into new CPU memory."""
        entry = self.entry(name)
        buffer = torch.empty(entry.end - entry.begin, dtype=torch.uint8)
        view = memoryview(buffer.numpy())
        handle = self._handle(entry.file)
        handle.seek(entry.begin)
        filled = 0
        while filled < len(view):
            try:
                count = handle.readinto(view[filled:])
            except OSError as error:
                raise CheckpointError(
                    f"{entry.file}: cannot read tensor {name!r} ({error.strerror or error})"
                ) from error
            if not count:
                raise CheckpointError(
                    f"{entry.file}: data cut: tensor {name!r} ends at byte {entry.end} but the "
                    f"file ends at byte {entry.begin + filled}"
                )
            filled += count
        return buffer.view(entry.dtype).reshape(entry.shape)

    def _handle(self, file: Path) -> BinaryIO:
        if file not in self._handles:
            try:
                self._handles[file] = open(file, "rb", buffering=0)
            except OSError as error:
                raise CheckpointError(f"{file}: cannot read ({error.strerror or error})") from None
        return self._handles[file]

    def close(self) -> None:
        for handle in self._handles.values():
            handle.close()
        self._handles.clear()

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"CheckpointReader({str(self.path)!r}, {len(self)} tensors)"


def open_checkpoint(path: str | Path) -> CheckpointReader:
    """Open a ``.safetensors`` file, a folder with ``model.safetensors``, or a folder (or index
    file) with a sharded ``model.safetensors.index.json``. Headers are checked now; tensor data
    is read on :meth:`CheckpointReader.get`.
    """
    path = Path(path)
    if path.is_dir():
        if (path / INDEX_FILE).is_file():
            return CheckpointReader(path, path / INDEX_FILE, read_index(path / INDEX_FILE))
        if (path / SINGLE_FILE).is_file():
            return CheckpointReader(path, path / SINGLE_FILE, read_header(path / SINGLE_FILE))
        found = sorted(p.name for p in path.iterdir() if p.suffix in (".bin", ".pt", ".pth"))
        hint = f" (found {found[0]}: convert it to safetensors first)" if found else ""
        raise CheckpointError(f"{path}: no {SINGLE_FILE} or {INDEX_FILE} in this folder{hint}")
    if not path.exists():
        raise CheckpointError(f"{path}: no such file or folder")
    if path.name.endswith(".index.json"):
        return CheckpointReader(path, path, read_index(path))
    if path.suffix in (".bin", ".pt", ".pth"):
        raise CheckpointError(f"{path}: pickle checkpoints are not read; convert to safetensors")
    return CheckpointReader(path, path, read_header(path))
