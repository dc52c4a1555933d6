"""Write the bundled example checkpoints: a tiny Llama base and three "fine-tunes" of it.

    python examples/make_tiny_checkpoints.py [OUT_DIR]   # default: examples/tiny

The fine-tunes are not trained: each is ``base + delta`` with a random low-rank delta per matrix
(rank 2, as fine-tuning updates tend to be low-rank) plus small noise, so every merge method has
something to work on. ``ft3`` is saved sharded to show that layout. Every folder carries the same
tokenizer (a 512-token byte-level BPE trained here on the Python standard library's sources, as
``mloco train`` trains one), so a merge of them loads with ``AutoTokenizer`` and ``mloco eval``
can score it. Each folder is ~300 KB.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.utils import logging

from mergekit_loco.train.documents import hash_order
from mergekit_loco.train.sources import load_documents
from mergekit_loco.train.tokenizer import EOS_TOKEN, train_tokenizer

VOCAB_SIZE = 512
TOKENIZER_TRAIN_CHARS = 1_000_000
CONFIG = LlamaConfig(
    vocab_size=VOCAB_SIZE,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    bos_token_id=0,  # EOS_TOKEN, the tokenizer's only special token, is id 0
    eos_token_id=0,
    pad_token_id=0,
)
FINETUNES = {"ft1": 1, "ft2": 2, "ft3": 3}  # name -> seed
DELTA_RANK = 2
DELTA_SCALE = 0.02


def finetune_delta(tensor: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Rank-2 ``U V^T`` plus 10% noise for matrices; noise for vectors (norm weights)."""
    noise = torch.randn(tensor.shape, generator=generator) * DELTA_SCALE
    if tensor.ndim != 2:
        return noise
    rows, cols = tensor.shape
    left = torch.randn(rows, DELTA_RANK, generator=generator)
    right = torch.randn(DELTA_RANK, cols, generator=generator)
    return DELTA_SCALE * (left @ right) / DELTA_RANK**0.5 + 0.1 * noise


def stdlib_tokenizer():
    """The BPE ``mloco train --vocab-size 512`` would train on ``stdlib`` (fewer characters)."""
    documents = hash_order(load_documents("stdlib"), "tokenizer")
    tokenizer = train_tokenizer((d.read() for d in documents), VOCAB_SIZE, TOKENIZER_TRAIN_CHARS)
    assert tokenizer.convert_tokens_to_ids(EOS_TOKEN) == CONFIG.eos_token_id
    return tokenizer


def main(out_dir: Path) -> None:
    logging.disable_progress_bar()
    tokenizer = stdlib_tokenizer()
    torch.manual_seed(0)
    base = LlamaForCausalLM(CONFIG)
    base.save_pretrained(out_dir / "base")
    tokenizer.save_pretrained(out_dir / "base")
    for name, seed in FINETUNES.items():
        generator = torch.Generator().manual_seed(seed)
        tuned = LlamaForCausalLM(CONFIG)
        tuned.load_state_dict(
            {n: t + finetune_delta(t, generator) for n, t in base.state_dict().items()}
        )
        tuned.save_pretrained(out_dir / name, max_shard_size="160KB" if name == "ft3" else "5GB")
        tokenizer.save_pretrained(out_dir / name)
        print(f"wrote {out_dir / name}")
    print(f"wrote {out_dir / 'base'}")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent / "tiny")
