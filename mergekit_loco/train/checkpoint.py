"""Atomic, verifiable training checkpoints: ``OUT/checkpoints/round-XXXXXX/``.

A checkpoint after k completed rounds holds:

- ``state.json``: round k, the resolved config, world size (rank 0)
- ``global.safetensors``: the global parameters theta, float32 (rank 0)
- ``shared.pt``: the optimizer state every process shares: ``OuterOptimizer.state_dict()``
  (DiLoCo) or the one AdamW + schedule (data-parallel mode) (rank 0)
- ``worker-XXXX.pt``: worker i's data position and inner optimizer + schedule (its rank)
- ``rng-rank-XXXX.pt``: each process's torch RNG states
- ``manifest.json``: sha256 of every other file

All processes write into ``round-XXXXXX.tmp-<pid>/``; rank 0 then writes the manifest, renames
the folder to ``round-XXXXXX/`` (``os.replace``), points ``checkpoints/latest`` at it (temp
file + ``os.replace``) and deletes all but the newest ``keep``. A crash leaves at worst a
``.tmp-`` folder, never a half-written checkpoint. Multi-node runs need ``OUT`` on a shared
filesystem.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from mergekit_loco.io.atomic import write_atomically
from mergekit_loco.train.workers import WorkerGroup

CHECKPOINTS = "checkpoints"
LATEST = "latest"
MANIFEST = "manifest.json"
STATE = "state.json"
GLOBAL_PARAMS = "global.safetensors"
SHARED = "shared.pt"


def worker_file(index: int) -> str:
    return f"worker-{index:04d}.pt"


def rng_file(rank: int) -> str:
    return f"rng-rank-{rank:04d}.pt"


def round_name(round_index: int) -> str:
    return f"round-{round_index:06d}"


class CheckpointCorrupt(ValueError):
    """A checkpoint file is missing or its sha256 differs from the manifest."""


@dataclass
class Checkpoint:
    """Training state after ``round`` completed rounds, as one process holds it.

    ``global_params`` and ``shared`` (the outer optimizer's state, or in data-parallel mode
    the one inner optimizer's) are rank 0's to write and every rank reads them; ``workers``
    maps this process's worker indices to their state (data position, inner optimizer).
    """

    round: int
    config: dict
    global_params: dict[str, torch.Tensor]
    shared: dict | None
    workers: dict[int, dict]
    rng: dict = field(default_factory=dict)


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict) -> None:
    if "torch" in state:
        torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def save_checkpoint(out: str | Path, state: Checkpoint, group: WorkerGroup, keep: int = 2) -> Path:
    """Write ``state`` (every process its own part) as ``OUT/checkpoints/round-XXXXXX``."""
    root = Path(out) / CHECKPOINTS
    final = root / round_name(state.round)
    staging = root / group.broadcast(f"{final.name}.tmp-{os.getpid()}")
    if group.is_main:
        root.mkdir(parents=True, exist_ok=True)
        for leftover in root.glob("*.tmp-*"):  # from crashed runs
            shutil.rmtree(leftover, ignore_errors=True)
        staging.mkdir()
    group.barrier()

    written = {}
    for index, worker_state in state.workers.items():
        torch.save(worker_state, staging / worker_file(index))
        written[worker_file(index)] = sha256_of(staging / worker_file(index))
    torch.save(state.rng, staging / rng_file(group.rank))
    written[rng_file(group.rank)] = sha256_of(staging / rng_file(group.rank))
    if group.is_main:
        params = {
            name: t.detach().to("cpu", torch.float32) for name, t in state.global_params.items()
        }
        save_file(params, staging / GLOBAL_PARAMS)
        if state.shared is not None:
            torch.save(state.shared, staging / SHARED)
        meta = {"round": state.round, "world_size": group.world_size, "config": state.config}
        (staging / STATE).write_text(json.dumps(meta, indent=2))
        for name in (GLOBAL_PARAMS, SHARED, STATE):
            if (staging / name).is_file():
                written[name] = sha256_of(staging / name)

    manifests = group.gather(written)
    if group.is_main:
        files = {name: digest for part in manifests for name, digest in sorted(part.items())}
        (staging / MANIFEST).write_text(json.dumps({"files": files}, indent=2))
        if final.exists():  # an earlier run reached this round and was not resumed from it
            shutil.rmtree(final)
        os.replace(staging, final)
        write_atomically(root / LATEST, final.name + "\n")
        prune(root, keep, final.name)
    group.barrier()
    return final


def prune(root: Path, keep: int, newest: str) -> None:
    """Delete all but the ``keep`` highest-numbered checkpoints (never ``newest``)."""
    rounds = sorted(p.name for p in root.glob("round-*") if p.is_dir() and ".tmp-" not in p.name)
    for name in rounds[:-keep] if keep > 0 else rounds:
        if name != newest:
            shutil.rmtree(root / name, ignore_errors=True)


def latest_checkpoint(out: str | Path) -> Path | None:
    """The checkpoint ``OUT/checkpoints/latest`` points to, or None if there is none."""
    root = Path(out) / CHECKPOINTS
    pointer = root / LATEST
    if not pointer.is_file():
        return None
    path = root / pointer.read_text().strip()
    if not path.is_dir():
        raise CheckpointCorrupt(f"{pointer} points to {path.name}, which does not exist")
    return path


def verify(path: Path, names: Iterable[str] | None = None) -> dict[str, str]:
    """Check the sha256 of ``names`` (default: every file) against the manifest."""
    manifest_path = path / MANIFEST
    try:
        files = json.loads(manifest_path.read_text())["files"]
    except (OSError, ValueError, KeyError) as error:
        raise CheckpointCorrupt(f"checkpoint {path}: unreadable {MANIFEST} ({error})") from None
    for name in files if names is None else names:
        file = path / name
        if name not in files:
            raise CheckpointCorrupt(f"checkpoint {path} lists no {name} in its manifest")
        if not file.is_file():
            raise CheckpointCorrupt(f"checkpoint file {file} is missing")
        if sha256_of(file) != files[name]:
            raise CheckpointCorrupt(
                f"checkpoint file {file} is corrupt (sha256 differs from {MANIFEST}); "
                "delete this checkpoint folder to resume from the one before"
            )
    return files


def read_state(path: Path) -> dict:
    """``state.json`` (round, world size, config) after checking its hash."""
    verify(path, [STATE])
    return json.loads((path / STATE).read_text())


def load_checkpoint(path: Path, worker_ids: Iterable[int], rank: int) -> Checkpoint:
    """This process's part of the checkpoint at ``path``, each file verified first."""
    worker_ids = list(worker_ids)
    files = verify(path, [STATE, GLOBAL_PARAMS])
    state = json.loads((path / STATE).read_text())
    needed = [worker_file(i) for i in worker_ids]
    needed += [name for name in (SHARED, rng_file(rank)) if name in files]
    verify(path, needed)

    def torch_load(name: str):
        return torch.load(path / name, map_location="cpu", weights_only=True)

    return Checkpoint(
        round=int(state["round"]),
        config=state["config"],
        global_params=load_file(path / GLOBAL_PARAMS),
        shared=torch_load(SHARED) if SHARED in files else None,
        workers={i: torch_load(worker_file(i)) for i in worker_ids},
        rng=torch_load(rng_file(rank)) if rng_file(rank) in files else {},
    )
