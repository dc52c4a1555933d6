"""The 178M aggregator comparison on one GPU, for a short horizon (about 8 minutes of an H200).

    python benchmarks/compare_gpu.py OUT                    # 178m on cuda
    python benchmarks/compare_gpu.py OUT --size toy --data DIR   # micro on CPU (run by the tests)

The seed paper's setting: R = 8 simulated workers, H = 30 inner steps, FLOP-matched (global
batch 32 x 512 tokens), one seed, a validation set shared by every cell (``val_seed``), one
inner AdamW setting for every preset, and the data-parallel AdamW baseline. Four rounds
(1,966,080 tokens per cell), so this measures the first steps only: it is the scale-out check
(does every aggregator run at 178M, how fast, how much of a round the outer step takes), not a
result. Writes the sweep folder (tables, loss_vs_workers.png, curves.png) and prints the
report and a timing table with the machine. Resumable like any ``mloco compare``.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).parent))

from common import machine  # noqa: E402

from mergekit_loco.compare.runs import read_metrics  # noqa: E402
from mergekit_loco.compare.sweep import Sweep, plan, run_sweep  # noqa: E402

AGGREGATORS = ("diloco", "diloco-sgd", "isoloco", "isoc-sgd", "tsv")
SIZES = {
    # 32 x 512 tokens per inner step, 30 steps per round, 4 rounds
    "178m": {"model": "178m", "global_batch": 32, "seq_len": 512, "tokens": 4 * 30 * 32 * 512,
             "val_tokens": 65536, "device": "cuda", "inner_steps": 30},
    # the same protocol at toy size, for CPU
    "toy": {"model": "micro", "global_batch": 8, "seq_len": 32, "tokens": 4 * 2 * 8 * 32,
            "val_tokens": 1024, "vocab_size": 300, "device": "cpu", "inner_steps": 2},
}  # fmt: skip
#: one inner setting for every preset: the DiLoCo presets' AdamW lr, weight decay 0.1.
INNER = {"inner_lr": 1.38e-3, "weight_decay": 0.1}


def timing_table(out: Path, cells) -> Table:
    """Per cell: wall seconds, training tokens/s over its rounds, share of the outer step."""
    table = Table(title="Time per cell", caption=machine() + device_line())
    for column in ("cell", "val loss", "seconds", "train tokens/s", "outer step share"):
        table.add_column(column, justify="left" if column == "cell" else "right")
    for cell in cells:
        events = read_metrics(out / "runs" / cell.name)
        rounds = [e for e in events if e.get("event") == "round"]
        final = next((e for e in events if e.get("event") == "final"), {})
        round_seconds = math.fsum(e["round_seconds"] for e in rounds)
        outer_seconds = math.fsum(e.get("outer_step_seconds", 0.0) for e in rounds)
        tokens = rounds[-1]["tokens"] if rounds else 0
        table.add_row(
            cell.name,
            f"{final['val_loss']:.4f}" if "val_loss" in final else "-",
            f"{final.get('seconds', round_seconds):.1f}",
            f"{tokens / round_seconds:,.0f}" if round_seconds else "-",
            f"{outer_seconds / round_seconds:.1%}" if round_seconds else "-",
        )
    return table


def device_line() -> str:
    if not torch.cuda.is_available():
        return "; no GPU"
    return f"; GPU {torch.cuda.get_device_name(0)}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--size", choices=sorted(SIZES), default="178m")
    parser.add_argument("--aggregators", default=",".join(AGGREGATORS))
    parser.add_argument("--data", default="stdlib")
    parser.add_argument("--tokens", type=int, help="token budget per cell (default: 4 rounds)")
    arguments = parser.parse_args(argv)
    size = dict(SIZES[arguments.size])
    inner_steps = size.pop("inner_steps")
    shared = {**size, **INNER, "data": arguments.data, "val_seed": 1000}
    if arguments.tokens:
        shared["tokens"] = arguments.tokens
    if shared["device"] == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    sweep = Sweep(
        aggregators=arguments.aggregators.split(","),
        workers=(8,),
        inner_steps=(inner_steps,),
        seeds=(0,),
        shared=shared,
    )
    console = Console(width=160)
    run_sweep(sweep, arguments.out, console=console, progress=False)
    console.print(timing_table(arguments.out, plan(sweep)))


if __name__ == "__main__":
    main()
