"""DiLoCo with any merge method around your own training loop: a tiny GPT-2 on data made here.

    torchrun --nproc_per_node 2 examples/own_loop.py --aggregator iso-c --out own-loop
    python examples/own_loop.py --aggregator ties          # one process: one worker

Each process is one worker: it trains the model on its own shard with AdamW; every
``--sync-every`` steps ``ml.DiLoCo`` merges the workers' deltas with the aggregator (over gloo)
and takes a Nesterov SGD outer step. The loop itself is the plain loop you would write anyway.
Rank 0 writes ``OUT/model.safetensors`` and ``OUT/losses.json`` (mean loss of each round).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from transformers import GPT2Config, GPT2LMHeadModel

import mergekit_loco as ml

VOCAB, SEQ_LEN, BATCH = 64, 16, 4


def make_model(seed: int = 0) -> GPT2LMHeadModel:
    """A 2-layer, 32-wide GPT-2, the same on every process (seeded)."""
    config = GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ_LEN, n_embd=32, n_layer=2, n_head=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(config)
    model.loss_type = "ForCausalLM"  # transformers cannot tell it from this class name, and warns
    return model


def make_batches(rank: int, steps: int) -> list[torch.Tensor]:
    """Worker ``rank``'s batches: sequences ``x_{t+1} = (3 x_t + rank + 1) mod VOCAB`` from
    random starts, so each worker sees a different (learnable) rule."""
    generator = torch.Generator().manual_seed(1000 + rank)
    batches = []
    for _ in range(steps):
        tokens = torch.empty(BATCH, SEQ_LEN, dtype=torch.long)
        tokens[:, 0] = torch.randint(VOCAB, (BATCH,), generator=generator)
        for t in range(1, SEQ_LEN):
            tokens[:, t] = (3 * tokens[:, t - 1] + rank + 1) % VOCAB
        batches.append(tokens)
    return batches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--aggregator", default="iso-c", help="any name of `mloco methods`")
    parser.add_argument("--steps", type=int, default=24, help="inner steps per worker")
    parser.add_argument("--sync-every", type=int, default=6, help="H: inner steps per round")
    parser.add_argument("--inner-lr", type=float, default=3e-3)
    parser.add_argument("--outer-lr", type=float, default=0.7)
    parser.add_argument("--outer-momentum", type=float, default=0.9)
    parser.add_argument("--out", type=Path, default=Path("own-loop"))
    args = parser.parse_args()

    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if distributed:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if distributed else 0

    model = make_model()
    inner = torch.optim.AdamW(model.parameters(), lr=args.inner_lr)
    outer = torch.optim.SGD(
        model.parameters(), lr=args.outer_lr, momentum=args.outer_momentum, nesterov=True
    )
    losses = []
    with ml.DiLoCo(model, inner, outer, aggregator=args.aggregator, sync_every=args.sync_every):
        for batch in make_batches(rank, args.steps):  # your loop, unchanged
            loss = model(input_ids=batch, labels=batch).loss
            loss.backward()
            inner.step()
            inner.zero_grad()
            losses.append(loss.item())

    if rank == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        weights = {n: p.detach().contiguous() for n, p in model.named_parameters()}
        save_file(weights, args.out / "model.safetensors")
        per_round = [
            sum(losses[i : i + args.sync_every]) / args.sync_every
            for i in range(0, len(losses), args.sync_every)
        ]
        (args.out / "losses.json").write_text(json.dumps(per_round) + "\n")
        print(f"{args.aggregator}: round losses " + " ".join(f"{x:.3f}" for x in per_round))
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
