"""Checkpoints: layout, manifest hashes (recomputed here), rotation, corruption, atomicity."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch

from mergekit_loco.io.atomic import OWNER_MARKER, mark_output
from mergekit_loco.train import checkpoint as ckpt
from mergekit_loco.train.checkpoint import (
    Checkpoint,
    CheckpointCorrupt,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from mergekit_loco.train.workers import SimulatedWorkers


def make_state(round_index: int) -> Checkpoint:
    generator = torch.Generator().manual_seed(round_index)
    params = {"w": torch.randn(4, 3, generator=generator), "b": torch.randn(3, generator=generator)}
    workers = {
        index: {"data": {"position": 64 * round_index + index}, "inner": {"lr": 0.1 * index}}
        for index in range(3)
    }
    return Checkpoint(
        round=round_index,
        config={"workers": 3, "aggregator": "mean"},
        global_params=params,
        shared={"steps_taken": round_index, "momentum_buffers": {"w": params["w"] * 2}},
        workers=workers,
        rng=ckpt.rng_state(),
    )


@pytest.fixture
def group():
    return SimulatedWorkers(3, torch.device("cpu"))


def test_layout_manifest_and_round_trip(tmp_path, group):
    path = save_checkpoint(tmp_path, make_state(1), group)
    assert path == tmp_path / "checkpoints" / "round-000001"
    assert (tmp_path / "checkpoints" / "latest").read_text() == "round-000001\n"
    names = sorted(p.name for p in path.iterdir())
    assert names == sorted(["state.json", "global.safetensors", "shared.pt", "manifest.json",
                            "worker-0000.pt", "worker-0001.pt", "worker-0002.pt",
                            "rng-rank-0000.pt", OWNER_MARKER])  # fmt: skip
    manifest = json.loads((path / "manifest.json").read_text())["files"]
    assert set(manifest) == set(names) - {"manifest.json", OWNER_MARKER}
    for name, digest in manifest.items():
        assert hashlib.sha256((path / name).read_bytes()).hexdigest() == digest

    loaded = load_checkpoint(path, worker_ids=[0, 2], rank=0)
    original = make_state(1)
    assert loaded.round == 1 and loaded.config == original.config
    for name, tensor in original.global_params.items():
        assert torch.equal(loaded.global_params[name], tensor)
    assert torch.equal(loaded.shared["momentum_buffers"]["w"], original.global_params["w"] * 2)
    assert loaded.workers == {0: original.workers[0], 2: original.workers[2]}
    assert torch.equal(loaded.rng["torch"], original.rng["torch"])


def test_keeps_the_newest_two_and_no_staging_folders(tmp_path, group):
    (tmp_path / "checkpoints").mkdir()
    crashed = tmp_path / "checkpoints" / ".round-000009.tmp-1234"  # a crashed save of ours
    crashed.mkdir()
    mark_output(crashed, "checkpoint")
    (tmp_path / "checkpoints" / "round-000009.tmp-1234").mkdir()  # not a name we write: kept
    for round_index in (1, 2, 3):
        save_checkpoint(tmp_path, make_state(round_index), group, keep=2)
    folders = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert folders == ["latest", "round-000002", "round-000003", "round-000009.tmp-1234"]
    assert latest_checkpoint(tmp_path) == tmp_path / "checkpoints" / "round-000003"


def test_failed_save_leaves_the_previous_checkpoint_current(tmp_path, group, monkeypatch):
    save_checkpoint(tmp_path, make_state(1), group)

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ckpt, "save_file", disk_full)
    with pytest.raises(OSError, match="No space"):
        save_checkpoint(tmp_path, make_state(2), group)
    assert latest_checkpoint(tmp_path).name == "round-000001"
    assert not (tmp_path / "checkpoints" / "round-000002").exists()
    load_checkpoint(latest_checkpoint(tmp_path), [0, 1, 2], rank=0)


def test_corrupt_or_missing_file_is_named(tmp_path, group):
    path = save_checkpoint(tmp_path, make_state(1), group)
    data = bytearray((path / "worker-0001.pt").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (path / "worker-0001.pt").write_bytes(bytes(data))
    with pytest.raises(CheckpointCorrupt, match=r"worker-0001\.pt is corrupt"):
        load_checkpoint(path, [0, 1, 2], rank=0)
    load_checkpoint(path, [0, 2], rank=0)  # a rank that does not read it is unaffected
    (path / "global.safetensors").unlink()
    with pytest.raises(CheckpointCorrupt, match=r"global\.safetensors is missing"):
        load_checkpoint(path, [0], rank=0)


def test_no_checkpoint_and_dangling_pointer(tmp_path, group):
    """A pointer naming a deleted folder (or no pointer) gives way to the newest checkpoint
    this tool wrote; with none (a user's look-alike folder does not count) there is none."""
    assert latest_checkpoint(tmp_path) is None
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "latest").write_text("round-000007\n")
    assert latest_checkpoint(tmp_path) is None
    (tmp_path / "checkpoints" / "round-000009").mkdir()  # not ours: no marker
    assert latest_checkpoint(tmp_path) is None
    for round_index in (1, 2):
        save_checkpoint(tmp_path, make_state(round_index), group, keep=2)
    (tmp_path / "checkpoints" / "latest").write_text("round-000007\n")
    assert latest_checkpoint(tmp_path).name == "round-000002"
    (tmp_path / "checkpoints" / "latest").unlink()
    assert latest_checkpoint(tmp_path).name == "round-000002"


def test_damaged_checkpoint_advice_depends_on_an_earlier_one(tmp_path, group):
    """Resume from the one before only when there is one; else start over."""
    first = save_checkpoint(tmp_path, make_state(1), group, keep=2)
    (first / "shared.pt").unlink()
    with pytest.raises(CheckpointCorrupt, match="missing; this is the only checkpoint: start over"):
        load_checkpoint(first, [0], rank=0)
    second = save_checkpoint(tmp_path, make_state(2), group, keep=2)
    (second / "shared.pt").write_bytes(b"damaged")
    with pytest.raises(CheckpointCorrupt, match="to resume from round-000001, the one before$"):
        load_checkpoint(second, [0], rank=0)
