"""What a merge checks before it streams: the models fit the base (headers only), and where the
output's config and tokenizer come from."""

from __future__ import annotations

import itertools
import numbers
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from mergekit_loco.io import CheckpointError, CheckpointReader
from mergekit_loco.io.atomic import INDEX_SUFFIX
from mergekit_loco.io.lora import ADAPTER_WEIGHTS, is_lora_adapter
from mergekit_loco.io.reader import INDEX_FILE, SINGLE_FILE, read_index


def checked_scale(scale: float, compute_dtype: torch.dtype) -> float:
    """``scale`` as a float: any real number (``numbers.Real``, numpy's too; not a bool) that
    is finite in ``compute_dtype``, else ``ValueError`` naming ``--scale``."""
    real = isinstance(scale, numbers.Real) and not isinstance(scale, bool)
    if not (real and abs(scale) <= torch.finfo(compute_dtype).max):
        raise ValueError(f"--scale: {scale!r} is not a finite number in {compute_dtype}")
    return float(scale)


def identity(path: Path) -> tuple[int, int] | None:
    """The file or folder ``path`` names, through links (None if it cannot be looked at; the
    reader then says why)."""
    try:
        status = os.stat(path)
    except (OSError, ValueError):
        return None
    return status.st_dev, status.st_ino


def weight_files(path: Path, as_base: bool = False) -> frozenset[tuple[int, int]]:
    """The weight files a checkpoint path is read from (:func:`identity` of each): a file
    itself, the shards of an index (a folder's or the file's), a folder's adapter weights (a
    LoRA adapter folder given as a model) or its ``model.safetensors`` (any other folder, and
    every folder given as the base). Empty when none can be looked at (the reader then says
    why)."""
    index = path / INDEX_FILE if path.is_dir() else path
    files = [path]
    if index.name.endswith(INDEX_SUFFIX) and index.is_file():
        try:
            files = list({entry.file for entry in read_index(index).values()})
        except CheckpointError:
            files = []
    elif path.is_dir():
        adapter = not as_base and is_lora_adapter(path)
        files = [path / (ADAPTER_WEIGHTS if adapter else SINGLE_FILE)]
    return frozenset(key for key in map(identity, files) if key is not None)


def same_checkpoint(first: Path, second: Path, second_is_base: bool = False) -> bool:
    """``first`` and ``second`` lead to one checkpoint: equal paths, one through links, the
    same set of weight files (a sharded folder and its index file), or a weights file and a
    folder that holds it (:func:`weight_files`). Two models that merely share a shard (a
    frozen shard hard-linked by a dedup tool, one blob of the Hugging Face cache under two
    revisions) are two checkpoints. ``second_is_base``: ``second`` is read as the base
    (:func:`weight_files`)."""
    seen = Checkpoints()
    seen.add(Fingerprint.of(second, as_base=second_is_base))
    return seen.find(Fingerprint.of(first)) is not None


@dataclass(frozen=True)
class Fingerprint:
    """What :class:`Checkpoints` compares of a checkpoint path, looked at once (each look
    stats files and may read a shard index): its :func:`identity`, its :func:`weight_files`,
    and whether it is one weights file."""

    path: Path
    identity: tuple[int, int] | None
    files: frozenset[tuple[int, int]]
    one_file: bool

    @classmethod
    def of(cls, path: Path, as_base: bool = False) -> Fingerprint:
        files = weight_files(path, as_base=as_base)
        return cls(path, identity(path), files, is_weights_file(path))


class Checkpoints:
    """Checkpoints seen so far (their :class:`Fingerprint`), so that :meth:`find` answers
    :func:`same_checkpoint` against all of them by lookups, in time linear in the path's
    weight files rather than in the paths seen (before, a merge config of 3000 models took
    89 s, pair by pair). The rule: ``first`` and ``second`` are one checkpoint where the paths
    are equal, their identities are, or both have weight files and those are equal or one is a
    weights file among the other's."""

    def __init__(self) -> None:
        self.order: dict[Path, int] = {}  # path -> its position among those added
        self._by_identity: dict[tuple[int, int], Path] = {}  # each map keeps the first added
        self._by_files: dict[frozenset[tuple[int, int]], Path] = {}
        self._holding: dict[tuple[int, int], Path] = {}  # a weight file -> a path read from it
        self._single: dict[tuple[int, int], Path] = {}  # a weight file -> a path that is it

    def find(self, model: Fingerprint) -> Path | None:
        """The first path added that is ``model``'s checkpoint (``model`` as ``first`` of
        :func:`same_checkpoint`, the one added as ``second``), else None."""
        found = [model.path if model.path in self.order else None]
        if model.identity is not None:
            found.append(self._by_identity.get(model.identity))
        if model.files:
            found.append(self._by_files.get(model.files))
            if model.one_file:  # its one file among another's
                found.append(self._holding.get(next(iter(model.files))))
            found += [self._single.get(file) for file in model.files]  # another's one among its
        return min(filter(None, found), key=self.order.__getitem__, default=None)

    def add(self, model: Fingerprint) -> None:
        """Remember ``model`` (a fingerprint of a path; the first of a path is kept)."""
        path = model.path
        if path in self.order:
            return
        self.order[path] = len(self.order)
        if model.identity is not None:
            self._by_identity.setdefault(model.identity, path)
        if model.files:
            self._by_files.setdefault(model.files, path)
            for file in model.files:
                self._holding.setdefault(file, path)
            if model.one_file:
                self._single.setdefault(next(iter(model.files)), path)


def is_weights_file(path: Path) -> bool:
    """``path`` is one weights file (not a folder or an index)."""
    return path.is_file() and not path.name.endswith(INDEX_SUFFIX)


def check_distinct(models: Sequence[Path], base: Path | None) -> None:
    """Each checkpoint once: a model given twice would count twice, and a model that is the base
    has a zero task vector that still weighs in every method but ``ta``. Raises
    :class:`CheckpointError` naming the path and saying what to do instead."""
    bases, seen = Checkpoints(), Checkpoints()
    if base is not None:
        bases.add(Fingerprint.of(base, as_base=True))
    for path in models:
        model = Fingerprint.of(path)
        if bases.find(model) is not None:
            raise CheckpointError(
                f"{path}: is the base ({base}) given again as a model; its task vector "
                "(model - base) is zero, so leave it out of the models"
            )
        earlier = seen.find(model)
        if earlier is not None:
            same = "" if str(earlier) == str(path) else f" (as {earlier})"
            raise CheckpointError(
                f"{path}: given twice as a model{same}; each model counts once (to weight "
                "one model more, give a mergekit YAML with per-model weight: mloco merge "
                "--config)"
            )
        seen.add(model)


def dtype_kind(dtype: torch.dtype) -> str:
    if dtype.is_floating_point:
        return "float"
    if dtype.is_complex:
        return "complex"
    return "bool" if dtype == torch.bool else "integer"


def added_rows(name: str, base: CheckpointReader, models: Sequence[CheckpointReader]) -> int:
    """Rows that fine-tunes appended to 2-D tensor ``name`` (added tokens in an embedding or
    lm_head): 0 if every model has the base's shape.

    Every model must have either the base's shape or ``base rows + added`` rows with one common
    ``added > 0``; any other shape, or different added counts, raise :class:`CheckpointError`
    naming the model at fault.
    """
    base_shape = base.shape(name)
    extended = []
    for model in models:
        shape = model.shape(name)
        if shape == base_shape:
            continue
        if not (len(base_shape) == len(shape) == 2 and shape[1] == base_shape[1]
                and shape[0] > base_shape[0]):  # fmt: skip
            raise CheckpointError(
                f"{model.file_of(name)}: tensor {name!r} has shape {list(shape)} but the base "
                f"({base.file_of(name)}) has {list(base_shape)} (only rows appended to a 2-D "
                "tensor, i.e. added tokens, can be merged)"
            )
        extended.append((model, shape[0]))
    if not extended:
        return 0
    first_model, first_rows = extended[0]
    for model, rows in extended[1:]:
        if rows != first_rows:
            raise CheckpointError(
                f"{model.file_of(name)}: tensor {name!r} has {rows} rows but "
                f"{first_model.file_of(name)} has {first_rows} (base: {base_shape[0]}); models "
                "that add tokens must add the same number to be merged"
            )
    return first_rows - base_shape[0]


def check_same_shape(name: str, first: CheckpointReader, model: CheckpointReader) -> None:
    """Without a base every model has the first one's shape of tensor ``name``: which rows a
    fine-tune appended (added tokens) is known only against the base."""
    shape, first_shape = model.shape(name), first.shape(name)
    if shape == first_shape:
        return
    where = f"{model.file_of(name)}: tensor {name!r} has"
    if len(shape) == len(first_shape) == 2 and shape[1] == first_shape[1]:
        raise CheckpointError(
            f"{where} {shape[0]} rows but {first.file_of(name)} has {first_shape[0]}: models "
            "with different vocabularies (added tokens) merge only with --base, which tells the "
            "rows they share from the rows each appended; give --base"
        )
    raise CheckpointError(
        f"{where} shape {list(shape)} but the first model ({first.file_of(name)}) has "
        f"{list(first_shape)}; without --base every model must have the same shapes"
    )


def check_common_dtype(name: str, models: Sequence[CheckpointReader]) -> None:
    """Without a base, floating tensor ``name`` is written in the dtype the models' dtypes
    promote to; torch promotes 8-bit floats with no other dtype."""
    holders: dict[torch.dtype, CheckpointReader] = {}  # each dtype -> the first model of it
    for model in models:
        holders.setdefault(model.dtype(name), model)
    for first, second in itertools.combinations(holders, 2):
        try:
            torch.promote_types(first, second)
        except RuntimeError:
            raise CheckpointError(
                f"{holders[second].file_of(name)}: tensor {name!r} is {second} but "
                f"{holders[first].file_of(name)} has it in {first}, which have no common dtype; "
                "give --base (its dtype is the output's)"
            ) from None


def check_compatible(
    base: CheckpointReader, models: Sequence[CheckpointReader], stand_in: bool = False
) -> dict:
    """Same tensor names, shapes and dtype kinds in every model as in ``base`` (headers only),
    except for rows appended to 2-D tensors (see :func:`added_rows`).

    ``stand_in``: ``base`` is the first model of a merge without a base; every model then has
    its shapes (:func:`check_same_shape`) and floating dtypes with a common one
    (:func:`check_common_dtype`), and messages call it the first model.
    Returns ``{name: added rows}`` for the tensors with appended rows.
    """
    owner_name = "the first model" if stand_in else "the base"
    owner = f"{owner_name} ({base.path})"
    appended = {}
    for model in models:
        if model is base:
            continue
        for name in base.names():
            if name not in model:
                raise CheckpointError(f"{model.path}: tensor {name!r} of {owner} is missing")
        extra = next((name for name in model.names() if name not in base), None)
        if extra is not None:
            raise CheckpointError(f"{model.path}: tensor {extra!r} is not in {owner}")
        for name in base.names():
            kind, base_kind = dtype_kind(model.dtype(name)), dtype_kind(base.dtype(name))
            if kind != base_kind:
                raise CheckpointError(
                    f"{model.file_of(name)}: tensor {name!r} is {kind} ({model.dtype(name)}) but "
                    f"{owner_name}'s is {base_kind} ({base.dtype(name)}, in {base.file_of(name)})"
                )
            if stand_in:
                check_same_shape(name, base, model)
    for name in base.names():
        if stand_in:
            if base.dtype(name).is_floating_point:
                check_common_dtype(name, models)
            continue
        rows = added_rows(name, base, models)
        if rows and not base.dtype(name).is_floating_point:
            raise CheckpointError(
                f"{base.file_of(name)}: tensor {name!r} is not floating point; rows appended "
                "to it cannot be merged"
            )
        if rows:
            appended[name] = rows
    return appended


def floating_shapes(reader: CheckpointReader) -> dict[str, tuple[int, ...]]:
    """``{name: shape}`` of the floating tensors of ``reader``: those a merge merges."""
    return {
        name: tuple(reader.shape(name))
        for name in reader.names()
        if reader.dtype(name).is_floating_point
    }


def config_source(
    base: CheckpointReader, models: Sequence[CheckpointReader], appended: dict
) -> Path:
    """Where the output's config and tokenizer files come from: the base's folder, or, when
    models added tokens, the folder of the first full model that did (its vocabulary is kept;
    a LoRA adapter adds none)."""
    name = next(iter(appended), None)
    if name is None:
        return base.config_dir
    full = (m for m in models if isinstance(m, CheckpointReader) and name in m)
    return next(m for m in full if m.shape(name) != base.shape(name)).config_dir
