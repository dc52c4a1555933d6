"""The inner AdamW step: torch's per-tensor loop (its CPU default, which mloco's InnerOptimizer
runs), the foreach path and fused, on one model, timed side by side in one run.

Each variant trains its own copy of the model (same init, same batches) for --steps steps;
only ``optimizer.step()`` is timed, the variants taking turns step by step so that they share
the machine's load. Printed per variant: seconds per step, the ratio to the per-tensor loop,
and whether its parameters after the last step equal the per-tensor loop's bit for bit (fused
does not: it would change a training run's numbers).

    python benchmarks/inner_optimizer_bench.py                 # nano (the protocol's model)
    python benchmarks/inner_optimizer_bench.py --model micro --steps 5   # a smoke run
"""

from __future__ import annotations

import argparse
import time

import torch
from common import machine

from mergekit_loco.train.model import build_model, model_config

VARIANTS = {"per-tensor (torch's CPU default)": {"foreach": False},
            "foreach": {"foreach": True},
            "fused": {"fused": True}}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="nano", help="micro, nano, ... (default nano)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=2, help="sequences per step (default 2)")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=4096)
    args = parser.parse_args()

    config = model_config(args.model, args.vocab)
    models = {name: build_model(config, seed=0) for name in VARIANTS}
    optimizers = {
        name: torch.optim.AdamW(models[name].parameters(), lr=1e-3, weight_decay=0.1, **kwargs)
        for name, kwargs in VARIANTS.items()
    }
    seconds = dict.fromkeys(VARIANTS, 0.0)
    generator = torch.Generator().manual_seed(1)
    for _ in range(args.steps):
        batch = torch.randint(0, args.vocab, (args.batch, args.seq_len), generator=generator)
        for name, model in models.items():
            model(input_ids=batch, labels=batch).loss.backward()
            started = time.perf_counter()
            optimizers[name].step()
            seconds[name] += time.perf_counter() - started
            optimizers[name].zero_grad(set_to_none=True)

    reference_name = next(iter(VARIANTS))
    reference = list(models[reference_name].parameters())
    print(machine())
    print(f"model {args.model}, {sum(p.numel() for p in reference):,} parameters, "
          f"{args.steps} steps of {args.batch} x {args.seq_len} tokens")  # fmt: skip
    print(f"{'AdamW step':<34} {'s / step':>10} {'vs per-tensor':>14} {'same bits':>10}")
    for name, model in models.items():
        same = all(torch.equal(a, b) for a, b in zip(reference, model.parameters(), strict=True))
        ratio = seconds[name] / seconds[reference_name]
        print(f"{name:<34} {seconds[name] / args.steps:>10.4f} {ratio:>14.2f} "
              f"{'yes' if same else 'no':>10}")  # fmt: skip


if __name__ == "__main__":
    main()
