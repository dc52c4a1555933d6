"""Tiny real transformers Llama checkpoints for tests: a base and fine-tunes = base + deltas.

Checkpoints are written with transformers' ``save_pretrained`` (folders, sharded or not) or
safetensors' ``save_file`` (single files), and read back with safetensors alone, so tests never
check mergekit_loco's I/O against itself.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.utils import logging

logging.disable_progress_bar()

TINY_LLAMA = {
    "vocab_size": 64,
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "max_position_embeddings": 32,
}
#: save_pretrained shard size that splits the tiny Llama into several shards.
SMALL_SHARD = "4KB"


def tiny_llama(seed: int = 0, dtype: torch.dtype = torch.float32, **config) -> LlamaForCausalLM:
    """A randomly initialised tiny ``LlamaForCausalLM`` (about 7k parameters by default)."""
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**(TINY_LLAMA | config))).to(dtype)


def save_model(model: LlamaForCausalLM, path: Path, layout: str = "folder") -> Path:
    """``layout``: "folder" (model.safetensors + config), "sharded" (index + shards + config)
    or "file" (one .safetensors file, ``path`` should end in .safetensors)."""
    if layout == "file":
        save_file(model.state_dict(), path, metadata={"format": "pt"})
    elif layout in ("folder", "sharded"):
        shard_size = SMALL_SHARD if layout == "sharded" else "5GB"
        model.save_pretrained(path, max_shard_size=shard_size)
    else:
        raise ValueError(f"unknown layout {layout!r}")
    return path


def finetune_of(base: LlamaForCausalLM, seed: int, delta_std: float = 0.02) -> LlamaForCausalLM:
    """A copy of ``base`` with every floating tensor moved by ``N(0, delta_std^2)`` noise."""
    generator = torch.Generator().manual_seed(seed)
    tuned = LlamaForCausalLM(base.config).to(base.dtype)
    state = {}
    for name, tensor in base.state_dict().items():
        noise = torch.randn(tensor.shape, generator=generator) * delta_std
        state[name] = (tensor.float() + noise).to(tensor.dtype)
    tuned.load_state_dict(state)
    return tuned


def make_family(
    root: Path,
    count: int = 2,
    layout: str = "folder",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> tuple[Path, list[Path]]:
    """Write a base and ``count`` fine-tunes under ``root``: ``(base_path, finetune_paths)``."""
    root.mkdir(parents=True, exist_ok=True)
    suffix = ".safetensors" if layout == "file" else ""
    base = tiny_llama(seed, dtype)
    base_path = save_model(base, root / f"base{suffix}", layout)
    tuned_paths = [
        save_model(finetune_of(base, seed + 1 + index), root / f"ft{index + 1}{suffix}", layout)
        for index in range(count)
    ]
    return base_path, tuned_paths


def load_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of a file or HF folder, via safetensors only."""
    path = Path(path)
    if path.is_file():
        return load_file(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        state = {}
        for shard in sorted(set(json.loads(index.read_text())["weight_map"].values())):
            state.update(load_file(path / shard))
        return state
    return load_file(path / "model.safetensors")


def write_state_dict(state: Mapping[str, torch.Tensor], path: Path) -> Path:
    """Write ``state`` as one safetensors file (tensors made contiguous)."""
    save_file({name: t.contiguous() for name, t in state.items()}, path, metadata={"format": "pt"})
    return path
