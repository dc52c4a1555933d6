"""Sharded, atomic safetensors writer.

Tensors are written as they come, so memory holds one tensor at a time. Everything goes into a
hidden temp sibling of the output (:func:`mergekit_loco.io.atomic.staged_output`) and is renamed
into place only when the ``with`` block ends without error; on any exception, Ctrl-C or SIGTERM
the temp is removed and nothing is left at the output path. ``force`` replaces only an output
this tool wrote or a checkpoint and nothing else (:func:`mergekit_loco.io.atomic.check_output`).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import BinaryIO

import torch

from mergekit_loco.io.atomic import (
    CHECKPOINT_SIDE_FILES,
    OWNER_MARKER,
    check_output,
    is_file_output,
    staged_output,
)
from mergekit_loco.io.files import (
    MAX_JSON_BYTES,
    UnsafeInputError,
    inside,
    open_limited,
    parse_json,
    read_limited,
    shown,
)
from mergekit_loco.io.reader import INDEX_FILE, SAFETENSORS_DTYPES, SINGLE_FILE, CheckpointError

#: Hugging Face's default shard size.
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9
#: Files copied from the base's folder into a folder output.
CONFIG_FILES = tuple(sorted(CHECKPOINT_SIDE_FILES - {OWNER_MARKER}))
#: The largest of them copied (real tokenizer.json files run to tens of MB).
MAX_CONFIG_FILE_BYTES = MAX_JSON_BYTES
DTYPE_NAMES = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}
COPY_CHUNK_BYTES = 2**20
#: The model config among :data:`CONFIG_FILES`, and its keys that name the weights' dtype.
CONFIG_FILE = "config.json"
DTYPE_KEYS = ("dtype", "torch_dtype")


class ShardBuilder:
    """One shard under construction.

    Tensor bytes go to one body file per element size; :meth:`finish` writes the header and then
    the 8-, 4-, 2- and 1-byte bodies, so every tensor starts at a multiple of its element size
    (the header is padded to 8 bytes), as safetensors itself lays files out.
    """

    def __init__(self, staging: Path, number: int):
        self._body_stem = staging / f"shard-{number:05d}.body"
        self._bodies: dict[int, BinaryIO] = {}
        self._tensors: list[tuple[str, torch.dtype, tuple[int, ...], int]] = []
        self.nbytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        itemsize = tensor.dtype.itemsize
        if itemsize not in self._bodies:
            self._bodies[itemsize] = open(f"{self._body_stem}{itemsize}", "wb")
        nbytes = tensor.numel() * itemsize
        if nbytes:
            self._bodies[itemsize].write(memoryview(tensor.reshape(-1).view(torch.uint8).numpy()))
        self._tensors.append((name, tensor.dtype, tuple(tensor.shape), nbytes))
        self.nbytes += nbytes

    def names(self) -> list[str]:
        return [name for name, *_ in self._tensors]

    def finish(self, file: Path) -> None:
        """Write the shard to ``file`` and delete the bodies."""
        sizes = sorted(self._bodies, reverse=True)
        header: dict[str, object] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for size in sizes:
            for name, dtype, shape, nbytes in self._tensors:
                if dtype.itemsize == size:
                    header[name] = {
                        "dtype": DTYPE_NAMES[dtype],
                        "shape": list(shape),
                        "data_offsets": [offset, offset + nbytes],
                    }
                    offset += nbytes
        raw_header = json.dumps(header, separators=(",", ":")).encode()
        raw_header += b" " * (-len(raw_header) % 8)
        with open(file, "wb") as shard:
            shard.write(len(raw_header).to_bytes(8, "little"))
            shard.write(raw_header)
            for size in sizes:
                self._bodies[size].close()
                body = Path(f"{self._body_stem}{size}")
                with open(body, "rb") as source:
                    append_file(source, shard)
                body.unlink()

    def discard(self) -> None:
        for body in self._bodies.values():
            body.close()


def append_file(source: BinaryIO, target: BinaryIO) -> None:
    """Append ``source`` to ``target`` inside the kernel (``sendfile``: no copy through Python),
    falling back to a buffered copy where the platform has no ``sendfile`` for files."""
    target.flush()
    size = os.fstat(source.fileno()).st_size
    offset = 0
    try:
        while offset < size:
            sent = os.sendfile(target.fileno(), source.fileno(), offset, size - offset)
            if sent == 0:
                break
            offset += sent
    except (AttributeError, OSError):
        if offset:
            raise
    if offset < size:
        source.seek(offset)
        shutil.copyfileobj(source, target, COPY_CHUNK_BYTES)


class CheckpointWriter:
    """Write a checkpoint tensor by tensor, atomically.

    ``out_path`` ending in ``.safetensors`` gives one file; anything else a Hugging Face folder:
    ``model.safetensors``, or ``model-0000i-of-0000N.safetensors`` shards of at most
    ``max_shard_bytes`` (a bigger tensor gets a shard of its own) plus
    ``model.safetensors.index.json``, and the config/tokenizer files found in ``config_dir``.
    An existing output raises :class:`OutputExistsError` at construction unless ``force``; with
    ``force`` the old output (only one this tool wrote, or a checkpoint and nothing else) is
    swapped out only once the new one is complete. An output that is, holds or lies inside one
    of ``inputs`` is refused (:class:`OutputRefused`).

    >>> with CheckpointWriter("merged/") as writer:  # doctest: +SKIP
    ...     writer.write("lm_head.weight", tensor)
    """

    def __init__(
        self,
        out_path: str | Path,
        max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
        force: bool = False,
        config_dir: str | Path | None = None,
        inputs: Iterable[str | Path | None] = (),
    ):
        if max_shard_bytes <= 0:
            raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
        self.out_path = Path(out_path)
        self.single_file = is_file_output(self.out_path)
        self.max_shard_bytes = max_shard_bytes
        self.force = force
        self.config_dir = Path(config_dir) if config_dir is not None else None
        check_output(self.out_path, force, inputs)
        if self.config_dir is not None and not self.single_file:
            for file_name in self._config_files():  # refused now, not after the merge
                self._open_config(file_name).close()
        self._staging: Path | None = None
        self._stack = ExitStack()
        self._finished_shards: list[list[str]] = []
        self._tensor_bytes = 0
        self._current: ShardBuilder | None = None
        self._written: set[str] = set()
        self._float_dtypes: set[torch.dtype] = set()

    # -- writing --------------------------------------------------------------------------------
    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Append tensor ``name`` (moved to CPU); it is on disk when this returns."""
        if self._staging is None:
            raise RuntimeError("CheckpointWriter.write outside its `with` block")
        if name in self._written:
            raise CheckpointError(f"{self.out_path}: tensor {name!r} written twice")
        if tensor.dtype not in DTYPE_NAMES:
            raise CheckpointError(
                f"{self.out_path}: tensor {name!r} has dtype {tensor.dtype}, which safetensors "
                "cannot store"
            )
        tensor = tensor.detach().to("cpu").contiguous()
        nbytes = tensor.numel() * tensor.dtype.itemsize
        with self._output_errors(f"tensor {name!r} to "):
            current = self._current
            if (
                current is not None
                and not self.single_file
                and current.nbytes
                and current.nbytes + nbytes > self.max_shard_bytes
            ):
                self._finish_shard()
            if self._current is None:
                self._current = ShardBuilder(self._staging, len(self._finished_shards) + 1)
            self._current.add(name, tensor)
        self._written.add(name)
        if tensor.is_floating_point():
            self._float_dtypes.add(tensor.dtype)

    def _shard_file(self, number: int) -> Path:
        return self._staging / f"shard-{number:05d}.safetensors"

    def _finish_shard(self) -> None:
        self._current.finish(self._shard_file(len(self._finished_shards) + 1))
        self._finished_shards.append(self._current.names())
        self._tensor_bytes += self._current.nbytes
        self._current = None

    def _assemble(self) -> None:
        """Finish the last shard, name the shards, write the index, copy configs, all inside
        the staging folder (a file output as ``staging / NAME``)."""
        if self._current is None and not self._finished_shards:
            self._current = ShardBuilder(self._staging, 1)
        if self._current is not None:
            self._finish_shard()
        if self.single_file:
            self._shard_file(1).rename(self._staging / self.out_path.name)
            return
        count = len(self._finished_shards)
        if count == 1:
            self._shard_file(1).rename(self._staging / SINGLE_FILE)
        else:
            self._write_index(count)
        if self.config_dir is not None:
            self._copy_configs()

    def _config_files(self) -> list[str]:
        """The names of :data:`CONFIG_FILES` present in ``config_dir`` (or dangling links)."""
        found = []
        for file_name in CONFIG_FILES:
            source = self.config_dir / file_name
            if source.exists() or source.is_symlink():
                found.append(file_name)
        return found

    def _open_config(self, file_name: str) -> BinaryIO:
        """``config_dir / file_name`` opened: a regular file inside ``config_dir`` of at most
        :data:`MAX_CONFIG_FILE_BYTES`, else :class:`CheckpointError` naming it."""
        try:
            source = inside(self.config_dir, file_name, file_name)
            return open_limited(source, MAX_CONFIG_FILE_BYTES, "config or tokenizer file")
        except UnsafeInputError as error:
            raise CheckpointError(str(error)) from None

    def _copy_configs(self) -> None:
        """Copy the config/tokenizer files of ``config_dir`` that are regular files inside it,
        each of at most :data:`MAX_CONFIG_FILE_BYTES` (checked again as it is copied)."""
        for file_name in self._config_files():
            with (
                self._open_config(file_name) as handle,
                open(self._staging / file_name, "wb") as copy,
            ):
                left = MAX_CONFIG_FILE_BYTES + 1
                while chunk := handle.read(min(COPY_CHUNK_BYTES, left)):
                    left -= len(chunk)
                    if left == 0:
                        raise CheckpointError(
                            f"{shown(self.config_dir / file_name)}: grew past "
                            f"{MAX_CONFIG_FILE_BYTES} bytes while it was copied"
                        )
                    copy.write(chunk)
        if len(self._float_dtypes) == 1 and (self._staging / CONFIG_FILE).is_file():
            self._name_dtype(self._staging / CONFIG_FILE, *self._float_dtypes)

    def _name_dtype(self, config_file: Path, dtype: torch.dtype) -> None:
        """Set the dtype keys transformers reads (``dtype``, ``torch_dtype``; those the copied
        ``config.json`` has) to ``dtype``, the one floating dtype written, so that
        ``from_pretrained(OUT)`` loads the model in the dtype it was written in. A config that
        is not a JSON object stays as copied (transformers will say what is wrong with it)."""
        try:
            text = read_limited(config_file, MAX_CONFIG_FILE_BYTES, "config")
            config = parse_json(text, shown(config_file))
        except UnsafeInputError:
            return
        keys = [key for key in DTYPE_KEYS if isinstance(config, dict) and key in config]
        if keys:
            config |= dict.fromkeys(keys, str(dtype).removeprefix("torch."))
            config_file.write_text(json.dumps(config, indent=2) + "\n")

    def _write_index(self, count: int) -> None:
        weight_map = {}
        for number, names in enumerate(self._finished_shards, start=1):
            shard_name = f"model-{number:05d}-of-{count:05d}.safetensors"
            self._shard_file(number).rename(self._staging / shard_name)
            weight_map.update(dict.fromkeys(names, shard_name))
        index = {
            "metadata": {"total_size": self._tensor_bytes},
            "weight_map": dict(sorted(weight_map.items())),
        }
        (self._staging / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")

    @contextmanager
    def _output_errors(self, what: str = "") -> Iterator[None]:
        """OSError (full disk, read-only folder, ...) -> CheckpointError naming the output."""
        try:
            yield
        except OSError as error:
            reason = error.strerror or str(error)
            raise CheckpointError(f"cannot write {what}{shown(self.out_path)}: {reason}") from error

    # -- context: staging, cleanup, signals -----------------------------------------------------
    def __enter__(self) -> CheckpointWriter:
        with self._output_errors():
            self._staging = self._stack.enter_context(
                staged_output(self.out_path, "merge", self.force, file=self.single_file)
            )
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        try:
            if exc_type is None:
                with self._output_errors():
                    self._assemble()
        except BaseException as error:
            self._close(type(error), error, error.__traceback__)
            raise
        with self._output_errors():
            self._close(exc_type, exc, traceback)

    def _close(self, exc_type, exc, traceback) -> None:
        """Discard open bodies, then let :func:`staged_output` commit or clean up."""
        if self._current is not None:
            self._current.discard()
        self._staging = None
        self._stack.__exit__(exc_type, exc, traceback)
