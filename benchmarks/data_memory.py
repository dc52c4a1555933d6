"""Memory of a ``--data`` ``.jsonl`` of many short documents: loading its documents and their
seeded order, in a fresh process per size.

    python benchmarks/data_memory.py [--lines 100000 1200000]

For each size it writes ``{"text": "a"}`` lines to a temporary file, then a child process
loads them (``load_documents``) and orders them (``hash_order``), and prints the resident
memory each step added and the peak above the start, per line and in all.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from common import machine

CHILD = """
import json, sys, time
from mergekit_loco.train.documents import hash_order
from mergekit_loco.train.sources import load_documents

def field(name):
    text = open("/proc/self/status").read()
    return int(text.split(name + ":")[1].split()[0]) * 1024

start = field("VmRSS")
began = time.perf_counter()
documents = load_documents(sys.argv[1])
loaded = field("VmRSS")
order = hash_order(documents, "seed")
ordered = field("VmRSS")
print(json.dumps({"lines": len(order), "load": loaded - start, "order": ordered - loaded,
                  "peak": field("VmHWM") - start, "seconds": time.perf_counter() - began}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lines", type=int, nargs="+", default=[100_000, 1_200_000])
    args = parser.parse_args()
    print(f"machine: {machine()}\n")
    header = f"{'lines':>10} {'load MB':>8} {'order MB':>9} {'peak MB':>8} {'B/line':>7} {'s':>6}"
    print(header)
    print("-" * len(header))
    with tempfile.TemporaryDirectory() as folder:
        for count in args.lines:
            path = Path(folder) / f"lines{count}.jsonl"
            path.write_text((json.dumps({"text": "a"}) + "\n") * count)
            done = subprocess.run(
                [sys.executable, "-c", CHILD, str(path)], capture_output=True, text=True, check=True
            )
            row = json.loads(done.stdout)
            load, order, peak = (row[key] / 2**20 for key in ("load", "order", "peak"))
            per_line = (row["load"] + row["order"]) / row["lines"]
            print(
                f"{row['lines']:>10,} {load:>8.1f} {order:>9.1f} {peak:>8.1f} {per_line:>7.0f}"
                f" {row['seconds']:>6.1f}"
            )
    print("\nload/order: resident memory each step added; peak: above the child's start.")


if __name__ == "__main__":
    main()
