"""Checkpoint I/O: a lazy safetensors reader and a sharded atomic writer (files and HF folders).

This package knows nothing about merge methods.
"""

from mergekit_loco.io.atomic import OutputExistsError, OutputRefused
from mergekit_loco.io.reader import CheckpointError, CheckpointReader, open_checkpoint
from mergekit_loco.io.writer import DEFAULT_MAX_SHARD_BYTES, CheckpointWriter

__all__ = [
    "DEFAULT_MAX_SHARD_BYTES",
    "CheckpointError",
    "CheckpointReader",
    "CheckpointWriter",
    "OutputExistsError",
    "OutputRefused",
    "open_checkpoint",
]
