"""Atomic, verifiable training checkpoints: ``OUT/checkpoints/round-XXXXXX/``.

A checkpoint after k completed rounds holds:

- ``state.json``: round k, the resolved config, world size, the data's digest (rank 0)
- ``global.safetensors``: the global parameters theta, float32 (rank 0)
- ``shared.pt``: the optimizer state every process shares: ``OuterOptimizer.state_dict()``
  (DiLoCo) or the one AdamW + schedule (data-parallel mode) (rank 0)
- ``worker-XXXX.pt``: worker i's data position and inner optimizer + schedule (its rank)
- ``rng-rank-XXXX.pt``: each process's torch RNG states
- ``manifest.json``: sha256 of every other file

All processes write into the staging folder ``.round-XXXXXX.tmp-XXXX/`` of
:func:`mergekit_loco.io.atomic.staged_output`; rank 0 then writes the manifest, the folder is
renamed to ``round-XXXXXX/``, ``checkpoints/latest`` is pointed at it (temp file +
``os.replace``) and all but the newest ``keep`` are deleted. A crash leaves at worst a ``.tmp-``
folder, never a half-written checkpoint. Multi-node runs need ``OUT`` on a shared filesystem.

Only what this tool wrote is ever deleted: an entry of ``checkpoints/`` named exactly
``round-XXXXXX`` or ``.round-XXXXXX.tmp-HOST-PID-XXXX`` and holding the ownership marker
(:data:`~mergekit_loco.io.atomic.OWNER_MARKER`, written into the staging folder first thing).
A ``checkpoints/`` that is a symlink or leads outside ``OUT`` is refused (:func:`checkpoints_root`).

Only finite parameters are saved (:class:`NotFinite` otherwise), so a checkpoint is always a
good one to resume from. Reading treats every file as hostile: ``latest`` must name a
``round-XXXXXX`` folder inside ``checkpoints/``, the manifest may list only checkpoint file
names, ``state.json`` must hold a round, a world size and a config, pickles are loaded with
``weights_only=True`` and any failure to load names the file.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import shutil
import warnings
from collections.abc import Iterable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_file

from mergekit_loco.io import CheckpointError, open_checkpoint
from mergekit_loco.io.atomic import (
    OWNER_MARKER,
    OutputRefused,
    is_ours,
    mark_output,
    staged_output,
    write_atomically,
)
from mergekit_loco.io.files import (
    MAX_JSON_BYTES,
    UnsafeInputError,
    open_regular,
    parse_json,
    read_json,
    read_limited,
    shown,
)
from mergekit_loco.run_layout import CHECKPOINTS, LATEST
from mergekit_loco.train.workers import WorkerGroup

MANIFEST = "manifest.json"
STATE = "state.json"
GLOBAL_PARAMS = "global.safetensors"
SHARED = "shared.pt"
#: Names a checkpoint's manifest may list (anything else, e.g. ``../x``, is refused).
FILE_NAME = re.compile(r"(state\.json|global\.safetensors|shared\.pt|(worker|rng-rank)-\d{4,}\.pt)")
ROUND_NAME = re.compile(r"round-\d{6,}")
#: The staging folder of a save (:func:`mergekit_loco.io.atomic.staged_output`'s name for it).
STAGING_NAME = re.compile(r"\.round-\d{6,}\.tmp-[\w.-]+")


def worker_file(index: int) -> str:
    return f"worker-{index:04d}.pt"


def rng_file(rank: int) -> str:
    return f"rng-rank-{rank:04d}.pt"


def round_name(round_index: int) -> str:
    return f"round-{round_index:06d}"


class CheckpointCorrupt(ValueError):
    """A checkpoint file is missing, its sha256 differs from the manifest, or it does not hold
    what a checkpoint holds; the message names the file."""


class NotFinite(FloatingPointError):
    """Global parameters with NaN or Inf: not saved as a checkpoint."""


def check_finite(params: dict[str, torch.Tensor], where: str) -> None:
    """Raise :class:`NotFinite` naming the first tensor of ``params`` with NaN or Inf."""
    for name, tensor in params.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise NotFinite(f"{where}: global parameter {shown(name)!r} holds NaN or Inf")


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
    #: what the run trains on (:attr:`~mergekit_loco.train.data.PreparedData.source`); "" unknown
    data: str = ""
    #: wall seconds the run had taken when saved, over all its invocations (0: not recorded)
    seconds: float = 0.0
    #: the number of processes that wrote it
    world_size: int = 1
    #: training-token bounds of the budget's segments when the budget grew on resume
    #: (:func:`~mergekit_loco.train.data.worker_slice`); [] for a run never extended
    data_bounds: list[int] = field(default_factory=list)


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
    with open_regular(path, "checkpoint file") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def save_checkpoint(out: str | Path, state: Checkpoint, group: WorkerGroup, keep: int = 2) -> Path:
    """Write ``state`` (every process its own part) as ``OUT/checkpoints/round-XXXXXX``.

    Raises :class:`NotFinite` (on every rank, before anything is written) if the global
    parameters hold NaN or Inf, and :class:`OutputRefused` if a folder of that name exists that
    this tool did not write (a user's, which is never replaced).
    """
    root = checkpoints_root(out)
    final = root / round_name(state.round)
    check_finite(state.global_params, f"round {state.round}")
    check_not_foreign(final)
    with ExitStack() as stack:
        staging = None
        if group.is_main:
            root.mkdir(parents=True, exist_ok=True)
            for leftover in owned(root, STAGING_NAME):  # from crashed saves
                shutil.rmtree(leftover, ignore_errors=True)
            staging = stack.enter_context(staged_output(final, "checkpoint", replace=True))
            mark_output(staging, "checkpoint")  # a crash leaves a staging folder marked ours
        staging = Path(group.broadcast(str(staging)))
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
            if state.data:
                meta["data"] = state.data
            meta["seconds"] = state.seconds
            if len(state.data_bounds) > 1:
                meta["data_bounds"] = list(state.data_bounds)
            (staging / STATE).write_text(json.dumps(meta, indent=2))
            for name in (GLOBAL_PARAMS, SHARED, STATE):
                if (staging / name).is_file():
                    written[name] = sha256_of(staging / name)

        manifests = group.gather(written)
        if group.is_main:
            files = {name: digest for part in manifests for name, digest in sorted(part.items())}
            (staging / MANIFEST).write_text(json.dumps({"files": files}, indent=2))
    if group.is_main:  # committed: an earlier run's folder of this round was replaced
        write_atomically(root / LATEST, final.name + "\n")
        prune(root, keep, final.name)
    group.barrier()
    return final


def checkpoints_root(out: str | Path) -> Path:
    """``OUT/checkpoints``; :class:`OutputRefused` naming it if it is a symlink or resolves
    outside ``OUT`` (saving and pruning there would write and delete elsewhere)."""
    root = Path(out) / CHECKPOINTS
    if root.is_symlink() or not root.resolve().is_relative_to(Path(out).resolve()):
        raise OutputRefused(
            f"{shown(root)}: the checkpoints folder is a symlink or leads outside the run folder; "
            "refused (make it a real folder inside the run folder)"
        )
    return root


def owned(root: Path, name: re.Pattern) -> list[Path]:
    """The real folders of ``root`` named exactly ``name`` that carry our ownership marker."""
    return [p for p in root.iterdir() if name.fullmatch(p.name) and is_ours(p)]


def prune(root: Path, keep: int, newest: str) -> None:
    """Delete all but the ``keep`` highest-numbered checkpoints (never ``newest``); only
    ``round-XXXXXX`` folders this tool wrote (:func:`owned`) are counted or deleted."""
    rounds = sorted(owned(root, ROUND_NAME), key=round_of)
    for path in rounds[:-keep] if keep > 0 else rounds:
        if path.name != newest:
            shutil.rmtree(path, ignore_errors=True)


def latest_checkpoint(out: str | Path) -> Path | None:
    """The checkpoint ``OUT/checkpoints/latest`` points to, or None if there is none.

    The pointer must hold a ``round-XXXXXX`` name of a real folder inside ``checkpoints/``,
    itself a real folder inside ``OUT`` (:func:`checkpoints_root`). A pointer that is missing or
    empty, or names a folder that no longer exists (deleted by hand), gives way to the newest
    checkpoint folder this tool wrote there (:func:`newest_checkpoint`), if any.
    """
    root = checkpoints_root(out)
    name = pointed_name(root)
    if name is None:
        return newest_checkpoint(root)
    path = root / name
    if path.is_symlink() or not path.resolve().is_relative_to(root.resolve()):
        raise CheckpointCorrupt(
            f"{shown(root / LATEST)} points to {name}, which leads outside {root}"
        )
    return path if path.is_dir() else newest_checkpoint(root)


def check_not_foreign(folder: Path) -> None:
    """Refuse (:class:`OutputRefused`) a ``round-XXXXXX`` path that exists and is not a folder
    this tool wrote (:func:`is_ours`): a save would replace it."""
    if (folder.exists() or folder.is_symlink()) and not is_ours(folder):
        raise OutputRefused(
            f"{shown(folder)}: exists and was not written by mloco (no {OWNER_MARKER}); a "
            "checkpoint of that round would replace it: move it out of checkpoints/, then "
            "--resume"
        )


def pointed_name(root: Path) -> str | None:
    """The ``round-XXXXXX`` name ``root/latest`` holds; None without a pointer or with an empty
    one (what a crash before the pointer's bytes reached the disk can leave). Any other content
    is refused (it is not what this tool writes), with the advice to delete it."""
    pointer = root / LATEST
    if not (pointer.exists() or pointer.is_symlink()):
        return None
    try:
        raw = read_limited(pointer, 64, "checkpoint pointer")
    except UnsafeInputError as error:
        raise CheckpointCorrupt(str(error)) from None
    name = raw.decode("ascii", errors="replace").strip()
    if not name:
        return None
    if not ROUND_NAME.fullmatch(name):
        raise CheckpointCorrupt(
            f"{shown(pointer)} does not name a round-XXXXXX checkpoint folder of this run; "
            "delete it to resume from the newest checkpoint folder left"
        )
    return name


def round_of(path: Path) -> int:
    """The round a ``round-XXXXXX`` folder is named after."""
    return int(path.name.removeprefix("round-"))


def newest_checkpoint(root: Path, before: int | None = None) -> Path | None:
    """The highest-numbered ``round-XXXXXX`` folder this tool wrote in ``root`` (:func:`owned`),
    below round ``before`` if given; None if there is none."""
    rounds = owned(root, ROUND_NAME) if root.is_dir() and not root.is_symlink() else []
    rounds = [p for p in rounds if before is None or round_of(p) < before]
    return max(rounds, key=round_of, default=None)


#: :func:`damaged_advice` for a run's only checkpoint (``mloco compare`` words it for a cell).
ONLY_CHECKPOINT_ADVICE = "this is the only checkpoint: start over with --force instead of --resume"


def damaged_advice(path: Path) -> str:
    """What to do about the damaged checkpoint ``path``: resume from the one before it, or,
    when it is the only one, start over."""
    earlier = None
    if ROUND_NAME.fullmatch(path.name):
        earlier = newest_checkpoint(path.parent, before=round_of(path))
    if earlier is None:
        return ONLY_CHECKPOINT_ADVICE
    return f"delete this checkpoint folder to resume from {earlier.name}, the one before"


def verify(path: Path, names: Iterable[str] | None = None) -> dict[str, str]:
    """Check the sha256 of ``names`` (default: every file) against the manifest."""
    manifest_path = path / MANIFEST
    try:
        files = read_json(manifest_path, MANIFEST)["files"]
        if not isinstance(files, dict):
            raise TypeError
    except UnsafeInputError as error:
        raise CheckpointCorrupt(
            f"checkpoint {shown(path)}: unreadable {MANIFEST} ({error}); {damaged_advice(path)}"
        ) from None
    except (KeyError, TypeError):
        raise CheckpointCorrupt(
            f'checkpoint {shown(path)}: unreadable {MANIFEST} (no "files" object); '
            f"{damaged_advice(path)}"
        ) from None
    bad = next((n for n, d in files.items() if not (FILE_NAME.fullmatch(n) and is_sha256(d))), None)
    if bad is not None:
        raise CheckpointCorrupt(
            f"checkpoint {shown(path)}: {MANIFEST} lists {shown(bad)[:80]!r}, which is not a "
            f"checkpoint file with a sha256; {damaged_advice(path)}"
        )
    for name in files if names is None else names:
        file = path / name
        if name not in files:
            raise CheckpointCorrupt(
                f"checkpoint {shown(path)} lists no {name} in its manifest; {damaged_advice(path)}"
            )
        if not (file.exists() or file.is_symlink()):
            raise CheckpointCorrupt(
                f"checkpoint file {shown(file)} is missing; {damaged_advice(path)}"
            )
        try:
            digest = sha256_of(file)
        except UnsafeInputError as error:
            raise CheckpointCorrupt(f"checkpoint file {error}; {damaged_advice(path)}") from None
        if digest != files[name]:
            raise CheckpointCorrupt(
                f"checkpoint file {shown(file)} is corrupt (sha256 differs from {MANIFEST}); "
                f"{damaged_advice(path)}"
            )
    return files


def is_sha256(value: object) -> bool:
    return isinstance(value, str) and re.fullmatch(r"[0-9a-f]{64}", value) is not None


def is_seconds(value: object) -> bool:
    """A finite number >= 0 that a float holds (not a bool, not an integer of 400 digits)."""
    if type(value) not in (int, float):
        return False
    try:
        return 0 <= float(value) < math.inf
    except OverflowError:
        return False


def is_bounds(value: object) -> bool:
    """A list of at least one positive integer, each larger than the one before."""
    if not (isinstance(value, list) and value and all(type(v) is int for v in value)):
        return False
    return value[0] > 0 and all(a < b for a, b in zip(value, value[1:], strict=False))


def data_bounds(state: dict, saved_tokens: int) -> list[int]:
    """The training-token bounds a checkpoint's ``state.json`` records; ``[saved_tokens]`` (the
    budget of its config) when the run was never extended."""
    return list(state.get("data_bounds") or [saved_tokens])


def read_state(path: Path) -> dict:
    """``state.json`` (round, world size, config) after checking its hash and its content."""
    verify(path, [STATE])
    file = path / STATE
    try:
        state = parse_json(read_limited(file, MAX_JSON_BYTES, STATE), shown(file))
    except UnsafeInputError as error:
        raise CheckpointCorrupt(f"checkpoint file {error}") from None
    problem = None
    if not isinstance(state, dict):
        problem = "is not a JSON object"
    elif not (type(state.get("round")) is int and state["round"] >= 1):
        problem = 'has no "round" (a positive integer)'
    elif ROUND_NAME.fullmatch(path.name) and path.name != round_name(state["round"]):
        problem = f"says round {state['round']}, not that of its folder {path.name}"
    elif not (type(state.get("world_size")) is int and state["world_size"] >= 1):
        problem = 'has no "world_size" (a positive integer)'
    elif not isinstance(state.get("config"), dict):
        problem = 'has no "config" (a JSON object)'
    elif "data" in state and not is_sha256(state["data"]):
        problem = 'has a "data" that is not a sha256'
    elif "seconds" in state and not is_seconds(state["seconds"]):
        problem = 'has a "seconds" that is not a number of seconds'
    elif "data_bounds" in state and not is_bounds(state["data_bounds"]):
        problem = 'has a "data_bounds" that is not a rising list of token counts'
    if problem:
        raise CheckpointCorrupt(f"checkpoint file {shown(file)} {problem}")
    return state


@contextmanager
def reading(file: Path) -> Iterator[None]:
    """Any failure to load or apply ``file``'s content -> :class:`CheckpointCorrupt` naming it."""
    try:
        yield
    except CheckpointCorrupt:
        raise
    except (KeyError, IndexError, TypeError, ValueError, RuntimeError, EOFError, OSError) as error:
        what = (
            f"missing entry {error}"
            if isinstance(error, KeyError)
            else " ".join(str(error).split())[:200]
        )
        raise CheckpointCorrupt(
            f"checkpoint file {shown(file)} does not hold what this run needs ({shown(what)}); "
            f"{damaged_advice(file.parent)}"
        ) from None
    except Exception as error:  # pickle.UnpicklingError and friends from torch.load
        raise CheckpointCorrupt(
            f"checkpoint file {shown(file)} cannot be loaded ({type(error).__name__}: only "
            "tensors and plain containers are accepted)"
        ) from None


def load_checkpoint(path: Path, worker_ids: Iterable[int], rank: int) -> Checkpoint:
    """This process's part of the checkpoint at ``path``, each file verified first.

    Refused with :class:`CheckpointCorrupt` naming the file: a hash mismatch, a pickle with
    anything but tensors and plain containers, a ``global.safetensors`` our strict reader
    refuses or whose parameters are not finite, a worker file without a data position.
    """
    worker_ids = list(worker_ids)
    files = verify(path, [GLOBAL_PARAMS])
    state = read_state(path)
    needed = [worker_file(i) for i in worker_ids]
    needed += [name for name in (SHARED, rng_file(rank)) if name in files]
    verify(path, needed)

    def torch_load(name: str):
        with reading(path / name), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's notes on odd pickles: the error says it
            return torch.load(path / name, map_location="cpu", weights_only=True)

    global_params = {}
    try:
        with open_checkpoint(path / GLOBAL_PARAMS) as reader:
            for name in reader.names():
                global_params[name] = reader.get(name)
    except CheckpointError as error:
        raise CheckpointCorrupt(f"checkpoint file {error}") from None
    try:
        check_finite(global_params, f"checkpoint file {shown(path / GLOBAL_PARAMS)}")
    except NotFinite as error:
        raise CheckpointCorrupt(f"{error}; not a good checkpoint") from None
    workers = {i: torch_load(worker_file(i)) for i in worker_ids}
    for i, worker_state in workers.items():
        with reading(path / worker_file(i)):
            int(worker_state["data"]["position"])
    return Checkpoint(
        round=state["round"],
        config=state["config"],
        global_params=global_params,
        shared=torch_load(SHARED) if SHARED in files else None,
        workers=workers,
        rng=torch_load(rng_file(rank)) if rng_file(rank) in files else {},
        data=state.get("data", ""),
        seconds=float(state.get("seconds", 0.0)),
        world_size=state["world_size"],
        data_bounds=list(state.get("data_bounds", [])),
    )
