"""One DiLoCo outer step over torch.distributed: merge_across_ranks against gather_then_merge.

gather_then_merge is what the seed paper's code does: all-gather every worker's full delta and
merge everything on every rank. For P gloo processes on this machine (default 2 and 4) and
R = V P workers (V = --virtual, default 1), every rank builds its workers' random deltas of a
Llama-shaped model (default hidden 384, 8 layers, FFN 1024, vocab 8192, untied: 20.4M
parameters, float32) and times one outer step per method with each implementation. Printed per
method: bytes sent per rank (the largest over ranks, by the model of docs/distributed.md) and
their ratio to naive (also for the mean over ranks), wall time of the step, spectral seconds per
rank (the larger over ranks), the naive / ours ratios, and the largest difference between the two
results. Then, for the methods with a compressible plan,
bf16 and int8 compression: bytes and the relative error against the exact merge.

    python benchmarks/outer_step_bench.py                  # P = 2, 4; V = 1
    python benchmarks/outer_step_bench.py --small          # a 0.95M-parameter smoke run
    python benchmarks/outer_step_bench.py --worlds 2 --virtual 2
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from common import llama_shapes, machine
from rich.console import Console
from rich.table import Table

from mergekit_loco.dist import gather_then_merge, merge_across_ranks
from mergekit_loco.methods import get_method
from mergekit_loco.task_vector import TaskVector

METHODS = {  # label: (method, options)
    "mean": ("mean", {}),
    "ta": ("ta", {}),
    "ties": ("ties", {}),
    "dare": ("dare", {}),
    "breadcrumbs": ("breadcrumbs", {}),
    "tsv": ("tsv", {}),
    "iso-c": ("iso-c", {}),
    "iso-c ns": ("iso-c", {"spectral": "ns"}),
    "iso-cts": ("iso-cts", {}),
}
COMPRESSED = ("mean", "iso-c", "tsv", "iso-cts")


def worker_delta(shapes, worker: int) -> TaskVector:
    generator = torch.Generator().manual_seed(worker)
    return TaskVector(
        {name: 1e-3 * torch.randn(shape, generator=generator) for name, shape in shapes.items()}
    )


def largest_difference(got: TaskVector, expected: TaskVector) -> float:
    """max |got - expected| / max |expected| over all tensors."""
    difference = max(float((got[n] - expected[n]).abs().max()) for n in expected)
    return difference / max(float(expected[n].abs().max()) for n in expected)


def relative_error(got: TaskVector, expected: TaskVector) -> float:
    """||got - expected||_F / ||expected||_F over all tensors."""
    error = sum(float((got[n] - expected[n]).double().norm() ** 2) for n in expected)
    return (error / sum(float(expected[n].double().norm() ** 2) for n in expected)) ** 0.5


def timed(run) -> tuple[TaskVector, float, dict]:
    dist.barrier()
    start = time.perf_counter()
    merged, stats = run()
    seconds = time.perf_counter() - start
    return (
        merged,
        seconds,
        {
            "wall": seconds,
            "bytes": stats.bytes_sent,
            "naive_bytes": stats.bytes_naive,
            "comm": stats.comm_seconds,
            "spectral": stats.spectral_seconds,
            "plan": stats.plan,
            "collectives": stats.collectives,
        },
    )


def rank_main(rank: int, world: int, store: str, args: dict, report: str) -> None:
    torch.set_num_threads(args["threads"])
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=world,
        timeout=timedelta(seconds=1800),
    )  # fmt: skip
    shapes = llama_shapes(args["hidden"], args["layers"], args["ffn"], args["vocab"])
    per_rank = args["virtual"]
    local = [worker_delta(shapes, rank * per_rank + v) for v in range(per_rank)]
    rows = []
    for label in args["methods"]:
        name, options = METHODS[label]
        method = get_method(name, **options)
        ours, _, ours_stats = timed(lambda m=method: merge_across_ranks(m, local))
        naive, _, naive_stats = timed(lambda m=method: gather_then_merge(m, local))
        row = {"method": label, "ours": ours_stats, "naive": naive_stats}
        row["difference"] = largest_difference(ours, naive)
        if label in COMPRESSED:
            for compression in ("bf16", "int8"):
                merged, _, stats = timed(
                    lambda m=method, c=compression: merge_across_ranks(m, local, compression=c)
                )
                row[compression] = {**stats, "error": relative_error(merged, ours)}
        rows.append(row)
        del ours, naive
    everyone = [None] * world
    dist.all_gather_object(everyone, rows)
    if rank == 0:
        Path(report).write_text(json.dumps(everyone))
    dist.destroy_process_group()
    os._exit(0)  # skip a slow interpreter shutdown


def run_world(world: int, args: argparse.Namespace) -> list[list[dict]]:
    with tempfile.TemporaryDirectory() as folder:
        report = Path(folder) / "report.json"
        keys = ("threads", "hidden", "layers", "ffn", "vocab", "virtual", "methods")
        settings = {key: getattr(args, key) for key in keys}
        mp.spawn(rank_main, args=(world, f"{folder}/store", settings, str(report)), nprocs=world)
        return json.loads(report.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--virtual", type=int, default=1, help="workers per rank (V)")
    parser.add_argument("--hidden", type=int, default=384)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--ffn", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--small", action="store_true", help="hidden 128, 2 layers, vocab 2048")
    args = parser.parse_args()
    if args.small:
        args.hidden, args.layers, args.ffn, args.vocab = 128, 2, 384, 2048
    shapes = llama_shapes(args.hidden, args.layers, args.ffn, args.vocab)
    parameters = sum(torch.Size(shape).numel() for shape in shapes.values())

    console = Console(width=180)
    steps = Table(
        title=f"outer step, {parameters / 1e6:.1f}M parameters (float32), V = {args.virtual}"
    )
    compression = Table(title="compression (merge_across_ranks, auto plan)")
    for column in ("P", "R", "method", "plan", "MB/rank ours", "naive", "ours/naive",
                   "mean over ranks",
                   "wall s ours", "naive", "naive/ours", "spectral s/rank ours", "naive",
                   "naive/ours", "max |diff|"):  # fmt: skip
        steps.add_column(column, justify="right")
    for column in ("P", "method", "compression", "plan", "MB/rank", "vs exact", "rel. error"):
        compression.add_column(column, justify="right")
    for world in args.worlds:
        started = time.perf_counter()
        per_rank_rows = run_world(world, args)
        console.print(f"P = {world}: {time.perf_counter() - started:.0f} s")
        for index, row in enumerate(per_rank_rows[0]):
            ranks = [rows[index] for rows in per_rank_rows]

            def worst(kind: str, key: str, ranks=ranks) -> float:
                return max(rank[kind][key] for rank in ranks)

            ours_mb, naive_mb = worst("ours", "bytes") / 1e6, worst("naive", "bytes") / 1e6
            ours_mean = sum(rank["ours"]["bytes"] for rank in ranks) / len(ranks) / 1e6
            spectral_ratio = "-"  # the sum methods have no spectral work of their own
            if worst("ours", "spectral") > 1e-3:
                spectral_ratio = f"{worst('naive', 'spectral') / worst('ours', 'spectral'):.2f}"
            steps.add_row(
                str(world), str(world * args.virtual), row["method"], row["ours"]["plan"],
                f"{ours_mb:.1f}", f"{naive_mb:.1f}", f"{ours_mb / naive_mb:.3f}",
                f"{ours_mean / naive_mb:.3f}",
                f"{worst('ours', 'wall'):.2f}", f"{worst('naive', 'wall'):.2f}",
                f"{worst('naive', 'wall') / worst('ours', 'wall'):.2f}",
                f"{worst('ours', 'spectral'):.2f}", f"{worst('naive', 'spectral'):.2f}",
                spectral_ratio,
                f"{max(rank['difference'] for rank in ranks):.1e}",
            )  # fmt: skip
            for kind in ("bf16", "int8"):
                if kind in row:
                    mb = worst(kind, "bytes") / 1e6
                    error = max(rank[kind]["error"] for rank in ranks)
                    compression.add_row(
                        str(world), row["method"], kind, row[kind]["plan"], f"{mb:.1f}",
                        f"{mb / ours_mb:.2f}", f"{error:.1e}",
                    )  # fmt: skip
    console.print(steps)
    console.print(compression)
    console.print(f"machine: {machine()}, {args.threads} torch thread(s) per process")
    console.print(
        "goal: tsv and iso-cts send <= 0.25x the bytes of naive at R = 8; iso-c the bytes of "
        "mean; spectral seconds per rank near 1/P of naive"
    )


if __name__ == "__main__":
    main()
