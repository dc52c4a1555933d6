"""What the benchmarks share: the machine line of every table and Llama parameter shapes."""

from __future__ import annotations

import os
import platform

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def machine() -> str:
    """OS, CPU, cores, RAM, load average, Python and torch versions, torch threads."""
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    load = ", ".join(f"{value:.1f}" for value in os.getloadavg())
    return (
        f"{platform.platform()}, {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} CPUs (load {load}), {memory:.0f} GiB RAM, Python "
        f"{platform.python_version()}, torch {torch.__version__}, {torch.get_num_threads()} threads"
    )


def llama_shapes(hidden: int, layers: int, ffn: int, vocab: int) -> dict[str, tuple[int, ...]]:
    """Parameter names and shapes of a LlamaForCausalLM (untied embeddings, no GQA), read off a
    model built on the meta device, so nothing is allocated."""
    config = LlamaConfig(
        hidden_size=hidden,
        num_hidden_layers=layers,
        intermediate_size=ffn,
        vocab_size=vocab,
        num_attention_heads=max(1, hidden // 64),
        tie_word_embeddings=False,
    )
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    return {name: tuple(param.shape) for name, param in model.named_parameters()}
