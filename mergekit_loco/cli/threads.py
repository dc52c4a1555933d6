"""How many intra-op threads ``mloco train`` gives torch.

torch's default, one thread per core, is the fastest on an idle machine, but on a busy one its
OpenMP threads wait for each other while other processes hold the cores: one ``mloco train`` of
the nano model fell from 6,249 tok/s (idle) to 104 tok/s on a loaded 2-core machine, where
torchrun's one thread per process kept 2,509. So, in order:

1. ``--threads N``;
2. ``OMP_NUM_THREADS`` when set (torchrun sets 1 per process);
3. the cores idle right now: the idle share of the CPU time over ``SAMPLE_SECONDS`` (from
   ``/proc/stat``, while this process sleeps) times the cores this process may run on, rounded,
   at least 1 and at most the physical cores. Where ``/proc/stat`` is missing: the physical cores.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

SAMPLE_SECONDS = 0.2


def usable_cores() -> int:
    """Logical CPUs this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


SIBLINGS = Path("/sys/devices/system/cpu/cpu0/topology/thread_siblings_list")
STAT = Path("/proc/stat")


def physical_cores(siblings: Path = SIBLINGS) -> int:
    """Usable cores, counting hyper-threads of one core once: ``logical // threads per core``,
    the threads of CPU 0's core read from ``siblings`` (a Linux CPU list: ``0``, ``0,4``,
    ``0-1``); the logical count where it is missing or unreadable."""
    logical = usable_cores()
    try:
        text = siblings.read_text().strip()
        per_core = sum(
            int(high) - int(low) + 1 if high else 1
            for low, _, high in (part.partition("-") for part in text.split(","))
        )
    except (OSError, ValueError):
        return logical
    return max(1, logical // max(1, per_core))


def cpu_times(stat: Path = STAT) -> tuple[int, int] | None:
    """``(idle, total)`` jiffies of all CPUs since boot, from the ``cpu`` line of ``stat``
    (user nice system idle iowait irq softirq steal ...); None where it is missing or not that."""
    try:
        fields = stat.read_text().splitlines()[0].split()
        values = [int(value) for value in fields[1:9]]
    except (OSError, IndexError, ValueError):
        return None
    if fields[0] != "cpu" or len(values) < 5:
        return None
    return values[3] + values[4], sum(values)  # idle + iowait, all


def idle_cores(seconds: float = SAMPLE_SECONDS) -> float | None:
    """Cores left idle by every other process over the next ``seconds`` (this one sleeps)."""
    before = cpu_times()
    if before is None:
        return None
    time.sleep(seconds)
    after = cpu_times()
    elapsed = after[1] - before[1]
    if elapsed <= 0:
        return None
    return (after[0] - before[0]) / elapsed * (os.cpu_count() or 1)


def choose_threads(requested: int | None) -> tuple[int, str]:
    """``(threads, why)``: see the module docstring for the order."""
    if requested is not None:
        if requested < 1:
            raise ValueError(f"--threads must be at least 1, not {requested}")
        return requested, "--threads"
    if os.environ.get("OMP_NUM_THREADS", "").strip().isdigit():
        return max(1, int(os.environ["OMP_NUM_THREADS"])), "OMP_NUM_THREADS"
    physical = physical_cores()
    idle = idle_cores()
    if idle is None:
        return physical, f"{physical} physical cores"
    threads = min(physical, max(1, round(idle)))
    return threads, f"{idle:.1f} of {os.cpu_count()} cores idle, {physical} physical"
