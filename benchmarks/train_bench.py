"""Simulated DiLoCo throughput against a plain single-model AdamW loop (same model and batch).

For each aggregator (mean, iso-c exact, iso-c ns) one real ``train()`` run of R = 8 workers x
H = 30 inner steps is timed round by round (setup and evaluation excluded); the baseline is a
bare loop (forward, backward, clip, AdamW, schedule) on the same model with the same
per-worker batch, timed in a pass before and after each DiLoCo run. Overhead = 1 - DiLoCo
tokens/s over the mean of the two neighbouring plain passes; the outer step's share of a round
is reported separately. Goal: < 5 %.

On CPU the clock is the process's CPU time (``--clock cpu``, the default there), which other
work on a shared machine disturbs less (wall time swung 2x between identical passes there).
On CUDA it is wall time after a synchronize.

    python benchmarks/train_bench.py                 # nano, R=8, H=30, one round each
    python benchmarks/train_bench.py --threads 1 --rounds 2
    python benchmarks/train_bench.py --device cuda --model 178m
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import types
from pathlib import Path

import torch
from common import machine
from rich.console import Console
from rich.table import Table

from mergekit_loco.train import diloco, loop
from mergekit_loco.train.config import resolve_config
from mergekit_loco.train.data import BatchStream, prepare_data
from mergekit_loco.train.loop import train
from mergekit_loco.train.model import build_model, count_parameters, model_config
from mergekit_loco.train.rounds import autocast, synchronize
from mergekit_loco.train.workers import InnerOptimizer, resolve_device

AGGREGATORS = {  # label: (aggregator, options)
    "mean": ("mean", {}),
    "iso-c exact": ("iso-c", {}),
    "iso-c ns": ("iso-c", {"spectral": "ns"}),
}


def time_training_loop_with(clock) -> None:
    """Make the training loop time its rounds, and the DiLoCo driver its outer steps, with
    ``clock`` (both read ``time.perf_counter``)."""
    loop.time = diloco.time = types.SimpleNamespace(perf_counter=clock)


def plain_adamw_tokens_per_second(config, steps: int, clock) -> float:
    """A bare single-model loop with the inner step's work: forward, backward, clip, AdamW,
    schedule; the same model, seed and per-worker batch shape as a DiLoCo worker
    (``steps`` at most R * H * rounds)."""
    device = resolve_device(config.run.device)
    data = prepare_data(
        config.data.source,
        max_train_tokens=config.total_rounds() * config.tokens_per_round(),
        val_tokens=config.data.val_tokens,
        vocab_size=config.data.vocab_size,
        seed=config.run.seed,
    )
    spec = model_config(config.model.name, len(data.tokenizer), eos_id=data.eos_id)
    model = build_model(spec, config.run.seed).to(device).train()
    optimizer = InnerOptimizer(model, config, steps + 1)
    stream = BatchStream(data.train, config.data.seq_len)  # the run's tokens, batches of one worker
    with torch.no_grad():
        model(input_ids=data.train[None, : config.data.seq_len].to(device))  # warm-up
    synchronize(device)
    start = clock()
    for _ in range(steps):
        batch = stream.next_batch(config.worker_batch).to(device)
        with autocast(device):
            loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.inner.grad_clip)
        optimizer.step()
    synchronize(device)
    return steps * config.worker_batch * config.data.seq_len / (clock() - start)


def diloco_run(config) -> tuple[float, float, float]:
    """``(tokens/s, outer share of a round, outer seconds per round)`` from metrics.jsonl."""
    train(config, progress=False)
    rounds = [
        event
        for event in map(json.loads, (Path(config.run.out) / "metrics.jsonl").open())
        if event["event"] == "round"
    ]
    round_seconds = sum(event["round_seconds"] for event in rounds)
    outer_seconds = sum(event["outer_step_seconds"] for event in rounds)
    tokens = len(rounds) * config.tokens_per_round()
    return tokens / round_seconds, outer_seconds / round_seconds, outer_seconds / len(rounds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="nano")
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--inner-steps", type=int, default=30)
    parser.add_argument("--global-batch", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=1, help="DiLoCo rounds per aggregator")
    parser.add_argument("--baseline-steps", type=int, default=40, help="steps per plain pass")
    parser.add_argument("--data", default="stdlib")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--clock", choices=("cpu", "wall"), default=None,
                        help="cpu: process CPU time (default on CPU); wall: wall time")  # fmt: skip
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    clock_name = args.clock or ("cpu" if args.device == "cpu" else "wall")
    clock = time.process_time if clock_name == "cpu" else time.perf_counter
    time_training_loop_with(clock)

    with tempfile.TemporaryDirectory() as scratch:

        def config_for(aggregator: str, options: dict, name: str):
            return resolve_config(
                None, model=args.model, workers=args.workers, inner_steps=args.inner_steps,
                global_batch=args.global_batch, seq_len=args.seq_len, data=args.data,
                tokens=args.rounds * args.inner_steps * args.global_batch * args.seq_len,
                val_tokens=4 * args.seq_len, device=args.device, aggregator=aggregator,
                aggregator_options=options, outer_momentum=0.9, nesterov=True,
                out=str(Path(scratch) / name), quiet=True,
            )  # fmt: skip

        # baseline passes around every DiLoCo run; each run is compared with its two neighbours
        reference = config_for("mean", {}, "baseline")
        plain = [plain_adamw_tokens_per_second(reference, args.baseline_steps, clock)]
        results = {}
        for label, (aggregator, options) in AGGREGATORS.items():
            results[label] = diloco_run(config_for(aggregator, options, label.replace(" ", "-")))
            plain.append(plain_adamw_tokens_per_second(reference, args.baseline_steps, clock))
        parameters = count_parameters(build_model(model_config(args.model, 4096), 0))

    table = Table(
        title=f"simulated DiLoCo vs plain AdamW: {args.model} (~{parameters / 1e6:.1f}M params), "
        f"R={args.workers}, H={args.inner_steps}, batch {args.global_batch // args.workers}"
        f"x{args.seq_len} per step, {args.rounds} round(s) each"
    )
    for column in ("run", "tokens/s", "plain tokens/s", "ratio", "overhead",
                   "outer step / round", "outer step s"):  # fmt: skip
        table.add_column(column, justify="right")
    for index, (label, (rate, share, outer)) in enumerate(results.items()):
        neighbours = (plain[index] + plain[index + 1]) / 2
        table.add_row(
            f"DiLoCo {label}",
            f"{rate:,.0f}",
            f"{neighbours:,.0f}",
            f"{rate / neighbours:.3f}",
            f"{100 * (1 - rate / neighbours):.1f} %",
            f"{100 * share:.2f} %",
            f"{outer:.3f}",
        )
    console = Console(width=120)
    console.print(table)
    passes = " / ".join(f"{rate:,.0f}" for rate in plain)
    console.print(f"plain AdamW passes ({args.baseline_steps} steps each): {passes} tok/s")
    console.print(f"machine: {machine()}, device {args.device}, clock: {clock_name} time")
    console.print("goal: simulation overhead (1 - ratio) under 5 %")


if __name__ == "__main__":
    main()
