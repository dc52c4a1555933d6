"""Checkpoint I/O: a lazy safetensors reader and a sharded atomic writer (files and HF folders).

This package knows nothing about merge methods. Its names are imported on first use (PEP 562),
so its light modules (``io.files``, ``io.atomic``) load without torch, as ``mloco --help`` needs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mergekit_loco.lazy import lazy_exports

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


__getattr__, __dir__ = lazy_exports(__name__, _HOMES)
