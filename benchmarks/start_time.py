"""How long ``mloco`` takes to answer its first commands, next to Python and to ``import torch``.

    python benchmarks/start_time.py [--repeats 7]

Each command runs ``--repeats`` times in a fresh interpreter, interleaved with the two
references so that a change of load hits all alike; the table shows the median wall time and
its ratio to ``python -c pass`` and to ``python -c "import torch"``. The target (issue 12):
``mloco --help``, ``mloco methods`` and a typo answer in <= 1.5 s on an idle machine, i.e. well
below one ``import torch``.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time

PYTHON = [sys.executable]
MLOCO = [sys.executable, "-m", "mergekit_loco"]
COMMANDS = {
    "python -c pass": [*PYTHON, "-c", "pass"],
    'python -c "import torch"': [*PYTHON, "-c", "import torch"],
    "mloco --help": [*MLOCO, "--help"],
    "mloco methods": [*MLOCO, "methods"],
    "mloco mrege (typo)": [*MLOCO, "mrege"],
    "mloco merge --help": [*MLOCO, "merge", "--help"],
    "mloco train --help": [*MLOCO, "train", "--help"],
}
TARGET_SECONDS = 1.5
TARGETED = ("mloco --help", "mloco methods", "mloco mrege (typo)")


def seconds(command: list[str]) -> float:
    started = time.perf_counter()
    subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
    return time.perf_counter() - started


def machine() -> str:
    load = ", ".join(f"{value:.1f}" for value in os.getloadavg())
    return (
        f"{platform.platform()}, {os.cpu_count()} CPUs (load {load}), "
        f"Python {platform.python_version()}, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    repeats = parser.parse_args().repeats
    print(machine())
    times: dict[str, list[float]] = {label: [] for label in COMMANDS}
    seconds(MLOCO + ["--help"])  # warm the file cache and byte-code once
    for _ in range(repeats):
        for label, command in COMMANDS.items():
            times[label].append(seconds(command))
    median = {label: statistics.median(values) for label, values in times.items()}
    python, torch = median["python -c pass"], median['python -c "import torch"']
    print(f"\nmedian of {repeats} fresh processes each, interleaved\n")
    print(f"{'command':28s} {'median s':>9s} {'x python':>9s} {'x import torch':>15s}  target")
    for label, value in median.items():
        target = ""
        if label in TARGETED:
            target = f"<= {TARGET_SECONDS} s: {'ok' if value <= TARGET_SECONDS else 'MISSED'}"
        print(f"{label:28s} {value:9.3f} {value / python:9.1f} {value / torch:15.2f}  {target}")


if __name__ == "__main__":
    main()
