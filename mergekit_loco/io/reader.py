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

import math
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch

from mergekit_loco.io.atomic import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from mergekit_loco.io.files import (
    UnsafeInputError,
    inside,
    open_regular,
    parse_json,
    read_json,
    shown,
)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
LENGTH_PREFIX_BYTES = 8
#: safetensors refuses headers above 100 MB too; a bigger length means a corrupt prefix.
MAX_HEADER_BYTES = 100_000_000
#: Elements per tensor (and any shape entry) must stay below 2**63: torch sizes are int64.
MAX_NUMEL = 2**63
#: Shard names one index may give (real models: a few hundred at most); each is resolved on the
#: filesystem, and one file spelled many ways (``./s``, ``.//s``...) is read once.
MAX_SHARD_NAMES = 10_000

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")

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
    """Where one tensor lives: ``file`` bytes ``[begin, end)`` (absolute offsets), as the
    header read from the file version ``stamp`` (:func:`file_stamp`) said."""

    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int
    stamp: tuple[int, ...]


def file_stamp(descriptor: int) -> tuple[int, ...]:
    """Device, inode, size and modification time of an open file: another file put in its
    place (an atomic replace) or a rewrite changes it."""
    status = os.fstat(descriptor)
    return status.st_dev, status.st_ino, status.st_size, status.st_mtime_ns


def read_header(file: Path) -> dict[str, TensorEntry]:
    """Parse and check the header of one safetensors file; entries in header order.

    Checks what the format (and the ``safetensors`` library) requires: an 8-byte little-endian
    length N <= 100 MB, N bytes of UTF-8 JSON (an object, no duplicate keys, no NaN),
    ``__metadata__`` mapping strings to strings, each tensor ``{"dtype", "shape",
    "data_offsets"}`` with a known dtype, non-negative integer shape and ``end - begin = numel x
    itemsize``, and the tensors' byte ranges tiling the data section exactly (sorted by offset,
    the first begins at 0, each begins where the previous ends, the last ends at the end of the
    file: no overlap, gap or trailing byte). Raises :class:`CheckpointError` naming the file
    (and tensor); no message quotes bytes of a file that failed these checks.
    """
    where = shown(file)
    try:
        with open_regular(file, "safetensors file") as handle:
            stamp = file_stamp(handle.fileno())
            file_size = stamp[2]
            prefix = handle.read(LENGTH_PREFIX_BYTES)
            if len(prefix) < LENGTH_PREFIX_BYTES:
                raise CheckpointError(
                    f"{where}: header cut: the file has {file_size} bytes, fewer than the "
                    f"{LENGTH_PREFIX_BYTES}-byte header length (not a safetensors file)"
                )
            header_bytes = int.from_bytes(prefix, "little")
            if header_bytes > min(file_size - LENGTH_PREFIX_BYTES, MAX_HEADER_BYTES):
                raise CheckpointError(
                    f"{where}: header cut: the header length is larger than the rest of the "
                    f"file or than {MAX_HEADER_BYTES // 10**6} MB (truncated or not a "
                    "safetensors file)"
                )
            raw_header = handle.read(header_bytes)
    except UnsafeInputError as error:
        raise CheckpointError(str(error)) from None
    except OSError as error:
        raise CheckpointError(f"{where}: cannot read ({error.strerror or error})") from None
    if len(raw_header) != header_bytes:
        raise CheckpointError(f"{where}: header cut (the file shrank while being read)")
    if not raw_header.startswith(b"{"):
        raise CheckpointError(f"{where}: bad JSON header (not an object)")
    try:
        header = parse_json(raw_header, f"{where}: bad JSON header", text_only=True)
    except UnsafeInputError as error:
        raise CheckpointError(str(error)) from None
    data_start = LENGTH_PREFIX_BYTES + header_bytes
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(
        isinstance(value, str) for value in metadata.values()
    ):
        raise CheckpointError(f"{where}: corrupt header: __metadata__ must map strings to strings")
    entries = {
        name: parse_entry(file, name, info, data_start, stamp) for name, info in header.items()
    }
    check_tiling(file, entries, data_start, file_size)
    return entries


def check_tiling(
    file: Path, entries: dict[str, TensorEntry], data_start: int, file_size: int
) -> None:
    """The tensors' byte ranges, sorted, must cover ``[data_start, file_size)`` exactly once."""
    position = data_start
    for name, entry in sorted(entries.items(), key=lambda item: (item[1].begin, item[1].end)):
        if entry.begin != position:
            problem = "overlaps the tensor before it" if entry.begin < position else "leaves a gap"
            raise CheckpointError(
                f"{shown(file)}: corrupt header: tensor {shown(name)[:200]!r} {problem} (its data "
                f"starts at byte {entry.begin - data_start} of the data section, "
                f"not {position - data_start})"
            )
        if entry.end > file_size:
            raise CheckpointError(
                f"{shown(file)}: data cut: tensor {shown(name)[:200]!r} ends at byte {entry.end} "
                f"but the file has {file_size} bytes (truncated?)"
            )
        position = entry.end
    if position < file_size:
        raise CheckpointError(
            f"{shown(file)}: corrupt file: {file_size - position} bytes after the last tensor's "
            "data"
        )


def parse_entry(
    file: Path, name: str, info: object, data_start: int, stamp: tuple[int, ...]
) -> TensorEntry:
    """One header entry -> :class:`TensorEntry`, checking ``end - begin = numel * itemsize``."""

    def corrupt(problem: str) -> CheckpointError:
        return CheckpointError(
            f"{shown(file)}: corrupt header: tensor {shown(name)[:200]!r} {problem}"
        )

    if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
        raise corrupt("needs exactly the keys dtype, shape and data_offsets")
    dtype_name, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if not isinstance(shape, list) or not all(is_count(size) for size in shape):
        raise corrupt("has a shape that is not a list of non-negative integers")
    if (
        not (isinstance(offsets, list) and len(offsets) == 2 and all(map(is_count, offsets)))
        or offsets[0] > offsets[1]
    ):
        raise corrupt("has data_offsets that are not [begin, end], begin <= end")
    if not isinstance(dtype_name, str) or dtype_name not in SAFETENSORS_DTYPES:
        raise corrupt("has an unknown dtype")
    dtype = SAFETENSORS_DTYPES[dtype_name]
    numel = math.prod(shape)
    if math.prod(size for size in shape if size) >= MAX_NUMEL:  # torch multiplies every size
        raise corrupt("has a shape whose product overflows")
    begin, end = offsets
    if end - begin != numel * dtype.itemsize:
        raise corrupt(
            f"spans {end - begin} bytes but {dtype_name} x {list(shape)} needs "
            f"{numel * dtype.itemsize}"
        )
    return TensorEntry(file, dtype, tuple(shape), data_start + begin, data_start + end, stamp)


def is_count(value: object) -> bool:
    """A JSON non-negative integer (``true`` is not one)."""
    return type(value) is int and 0 <= value < MAX_NUMEL


def read_index(index: Path) -> dict[str, TensorEntry]:
    """Entries of a sharded checkpoint: shards in name order, tensors in header order.

    Every shard the ``weight_map`` names must resolve inside the index's folder and hold the
    tensors it is named for. A tensor a shard holds but the map omits is part of the checkpoint
    (transformers loads it too); one held by two shards is an error.
    """
    try:
        document = read_json(index, "index file")
    except UnsafeInputError as error:
        raise CheckpointError(str(error)) from None
    weight_map = document.get("weight_map") if isinstance(document, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(value, str) for value in weight_map.values()
    ):
        raise CheckpointError(
            f"{shown(index)}: bad index: expected a JSON object whose weight_map maps tensor "
            "names to shard file names"
        )
    spelled: dict[str, list[str]] = {}  # shard name as the map spells it -> its tensors
    for name, shard_name in weight_map.items():
        spelled.setdefault(shard_name, []).append(name)
    if len(spelled) > MAX_SHARD_NAMES:
        raise CheckpointError(
            f"{shown(index)}: bad index: its weight_map names {len(spelled)} shard files, more "
            f"than {MAX_SHARD_NAMES}"
        )
    shards: dict[Path, tuple[Path, list[str]]] = {}  # one file however the map spells it
    for shard_name, listed in sorted(spelled.items()):
        try:
            shard = inside(index.parent, shard_name, "shard")
        except UnsafeInputError as error:
            raise CheckpointError(f"{shown(index)}: {error}") from None
        if not shard.exists():
            raise CheckpointError(
                f"{shown(index)}: points at missing shard {shown(shard_name)} (for tensor "
                f"{shown(listed[0])[:200]!r})"
            )
        shards.setdefault(shard.resolve(), (shard, []))[1].extend(listed)
    entries = {}
    for shard, listed in shards.values():
        shard_name = shard.name
        shard_entries = read_header(shard)
        absent = [name for name in listed if name not in shard_entries]
        if absent:
            raise CheckpointError(
                f"{shown(shard)}: tensor {shown(absent[0])[:200]!r} listed in {index.name} is "
                "not in this shard"
            )
        for name, entry in shard_entries.items():
            if name in entries:
                raise CheckpointError(
                    f"{shown(index)}: tensor {shown(name)[:200]!r} is in two shards, "
                    f"{shown(entries[name].file.name)} and {shown(shard_name)}; which one the "
                    "model holds is ambiguous"
                )
            entries[name] = entry
    return entries


#: Shards a reader keeps open at once, the most recently read: a merge of a few models of
#: hundreds of shards each would otherwise pass the usual limit of 1024 open files. A shard
#: closed and opened again is checked against its header's file version as before.
MAX_OPEN_SHARDS = 16


class CheckpointReader:
    """Tensors of a checkpoint, read lazily one at a time. Use :func:`open_checkpoint`.

    ``names()`` lists the tensors in file order; ``shape``/``dtype`` come from the header;
    ``get(name)`` reads one tensor from disk (one read at a time per reader, from any thread).
    """

    def __init__(self, path: Path, weights_file: Path, entries: dict[str, TensorEntry]):
        self.path = path
        self.weights_file = weights_file
        self._entries = entries
        self._handles: OrderedDict[Path, BinaryIO] = OrderedDict()
        self._reading = threading.Lock()

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
            raise CheckpointError(f"{shown(self.path)}: no tensor {shown(name)!r}")
        return self._entries[name]

    def shape(self, name: str) -> tuple[int, ...]:
        return self.entry(name).shape

    def dtype(self, name: str) -> torch.dtype:
        return self.entry(name).dtype

    def file_of(self, name: str) -> Path:
        """The file (shard) holding tensor ``name``."""
        return self.entry(name).file

    def get(self, name: str) -> torch.Tensor:
        """Read tensor ``name`` into new CPU memory, from the file version its header was read
        from (a file replaced or rewritten since is refused, naming it: its offsets no longer
        hold)."""
        entry = self.entry(name)
        with self._reading:
            return self._read(name, entry)

    def _read(self, name: str, entry: TensorEntry) -> torch.Tensor:
        handle = self._handle(entry.file)
        stamp = file_stamp(handle.fileno())
        if stamp != entry.stamp:
            raise CheckpointError(
                f"{shown(entry.file)}: changed since its header was read (replaced, cut or "
                f"rewritten while being read: {stamp[2]} bytes, {entry.stamp[2]} then); run "
                "again once nothing writes it"
            )
        size = entry.end - entry.begin
        try:
            buffer = torch.empty(size, dtype=torch.uint8)
        except (RuntimeError, MemoryError):  # torch's allocator says RuntimeError
            raise CheckpointError(
                f"{shown(entry.file)}: tensor {shown(name)!r} needs {size:,} bytes, more memory "
                "than this machine can give"
            ) from None
        view = memoryview(buffer.numpy())
        handle.seek(entry.begin)
        filled = 0
        while filled < len(view):
            try:
                count = handle.readinto(view[filled:])
            except OSError as error:
                raise CheckpointError(
                    f"{shown(entry.file)}: cannot read tensor {shown(name)!r} "
                    f"({error.strerror or error})"
                ) from error
            if not count:
                raise CheckpointError(
                    f"{shown(entry.file)}: data cut: tensor {shown(name)!r} ends at byte "
                    f"{entry.end} but the file ends at byte {entry.begin + filled}"
                )
            filled += count
        return buffer.view(entry.dtype).reshape(entry.shape)

    def _handle(self, file: Path) -> BinaryIO:
        """``file`` open for reading; the least recently read shard is closed past
        :data:`MAX_OPEN_SHARDS`."""
        if file in self._handles:
            self._handles.move_to_end(file)
            return self._handles[file]
        try:
            handle = open_regular(file, "safetensors file")
        except UnsafeInputError as error:
            raise CheckpointError(str(error)) from None
        self._handles[file] = handle
        if len(self._handles) > MAX_OPEN_SHARDS:
            self._handles.popitem(last=False)[1].close()
        return handle

    def close(self) -> None:
        with self._reading:
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
    is read on :meth:`CheckpointReader.get`. Every file a folder or index leads to must resolve
    inside that folder; only regular files are opened.
    """
    path = Path(path)
    if path.is_dir():
        both = [name for name in (INDEX_FILE, SINGLE_FILE) if os.path.lexists(path / name)]
        if len(both) == 2:
            raise CheckpointError(
                f"{shown(path)}: holds both {SINGLE_FILE} and {INDEX_FILE}, so which one is the "
                f"model is ambiguous (transformers loads {SINGLE_FILE}); give the one you mean, "
                f"{shown(path / SINGLE_FILE)} or {shown(path / INDEX_FILE)}, or remove the stale "
                "one"
            )
        for name, read in ((INDEX_FILE, read_index), (SINGLE_FILE, read_header)):
            if (path / name).exists() or (path / name).is_symlink():
                try:
                    file = inside(path, name, name)
                except UnsafeInputError as error:
                    raise CheckpointError(str(error)) from None
                return with_tensors(CheckpointReader(path, file, read(file)))
        found = sorted(p.name for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES)
        hint = f" (found {shown(found[0])}: convert it to safetensors first)" if found else ""
        final = path / "final"  # a training run's folder: run_layout.FINAL holds its model
        if any((final / name).is_file() for name in (INDEX_FILE, SINGLE_FILE)):
            hint = f" (a training run: its model is {shown(final)})"
        if (path / "adapter_config.json").is_file():  # a PEFT adapter (io.lora)
            hint = (
                " (a PEFT LoRA adapter, not a whole model: mloco merge takes it as a model to "
                "merge, beside --base the model it adapts; to use it alone, merge it into that "
                f"base first: mloco merge {shown(path)} --base BASE -m ta -o OUT)"
            )
        if (path / "global.safetensors").is_file():  # a training checkpoint (train.checkpoint)
            run_final = path.parent.parent / "final"
            hint = (
                f" (a training checkpoint: its parameters are {shown(path / 'global.safetensors')}"
                f"; mloco eval takes that file with --tokenizer {shown(run_final)})"
            )
        raise CheckpointError(
            f"{shown(path)}: no {SINGLE_FILE} or {INDEX_FILE} in this folder{hint}"
        )
    if not (path.exists() or path.is_symlink()):
        raise CheckpointError(f"{shown(path)}: no such file or folder")
    if path.name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS) and (path.parent / ADAPTER_CONFIG).is_file():
        raise CheckpointError(
            f"{shown(path)}: a file of the PEFT LoRA adapter {shown(path.parent)}; give the "
            f"adapter's folder, {shown(path.parent)}, instead"
        )
    folder = model_folder_of(path)
    if path.suffix in PICKLE_SUFFIXES:
        instead = f", or give its model folder {shown(folder)} instead" if folder else ""
        raise CheckpointError(
            f"{shown(path)}: pickle checkpoints are not read (loading one can run code); "
            f"convert it to safetensors{instead}"
        )
    if path.name.endswith(".index.json"):
        return with_tensors(CheckpointReader(path, path, read_index(path)))
    try:
        return with_tensors(CheckpointReader(path, path, read_header(path)))
    except CheckpointError:
        if path.suffix == ".safetensors" or not path.is_file():  # damaged, or a FIFO, a device
            raise
        instead = f"its model folder {shown(folder)}" if folder else "a .safetensors file"
        raise CheckpointError(  # config.json, a tokenizer file...: not a damaged checkpoint
            f"{shown(path)}: not a safetensors checkpoint; give {instead} instead"
        ) from None


def model_folder_of(file: Path) -> Path | None:
    """The folder of ``file`` if it is a model folder (holds ``model.safetensors`` or its
    index), else None."""
    folder = file.parent
    return folder if any((folder / n).is_file() for n in (SINGLE_FILE, INDEX_FILE)) else None


def with_tensors(reader: CheckpointReader) -> CheckpointReader:
    """``reader``, refused when its checkpoint holds no tensor (a merge of it would write an
    empty model and call it done)."""
    if not len(reader):
        raise CheckpointError(f"{shown(reader.path)}: holds no tensors")
    return reader
