"""Checkpoint I/O: a lazy safetensors reader and a sharded atomic writer (files and HF folders).

This package knows nothing about merge methods. Its names are imported on first use (PEP 562),
so its light modules (``io.files``, ``io.atomic``) load without torch, as ``mloco --help`` needs.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mergekit_loco.io.atomic import OutputExistsError, OutputRefused
    from mergekit_loco.io.reader import CheckpointError, CheckpointReader, open_checkpoint
    from mergekit_loco.io.writer import DEFAULT_MAX_SHARD_BYTES, CheckpointWriter

#: public name -> the module that defines it
_HOMES = {
    "DEFAULT_MAX_SHARD_BYTES": "mergekit_loco.io.writer",
    "CheckpointError": "mergekit_loco.io.reader",
    "CheckpointReader": "mergekit_loco.io.reader",
    "CheckpointWriter": "mergekit_loco.io.writer",
    "OutputExistsError": "mergekit_loco.io.atomic",
    "OutputRefused": "mergekit_loco.io.atomic",
    "open_checkpoint": "mergekit_loco.io.reader",
}
__all__ = [
    "DEFAULT_MAX_SHARD_BYTES",
    "CheckpointError",
    "CheckpointReader",
    "CheckpointWriter",
    "OutputExistsError",
    "OutputRefused",
    "open_checkpoint",
]


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module 'mergekit_loco.io' has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOMES[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_HOMES])
