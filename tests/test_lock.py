"""The lock of a folder being written (mergekit_loco/io/lock.py); two real processes racing for
a run folder or a results folder are in tests/test_faults.py and tests/test_compare.py."""

from __future__ import annotations

import errno
import os
from types import SimpleNamespace

import pytest
from hostile import assert_refused, run_cli

from mergekit_loco.io import lock
from mergekit_loco.io.atomic import LOCK_FILE, OutputRefused
from mergekit_loco.io.lock import FolderInUse, FolderLock


def test_a_held_folder_refuses_a_second_holder_until_released(tmp_path):
    folder = tmp_path / "new" / "run"
    with FolderLock(folder, "training into it", "--resume") as first:
        first.acquire()
        first.acquire()  # once is enough: a second call keeps the same lock
        assert (folder / LOCK_FILE).read_text() == f"{os.getpid()}\n"
        with pytest.raises(FolderInUse) as refused:
            FolderLock(folder, "training into it", "--resume").acquire()
        assert str(refused.value) == (
            f"{folder} is in use by another mloco process (PID {os.getpid()}) training into it; "
            "wait for it to finish or stop it, then --resume"
        )
    with FolderLock(folder, "training into it", "--resume") as second:
        second.acquire()  # released at the end of the first's block


def test_a_lock_file_that_is_a_symlink_is_refused_and_its_target_kept(tmp_path):
    (tmp_path / "notes.txt").write_text("mine\n")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / LOCK_FILE).symlink_to(tmp_path / "notes.txt")
    with pytest.raises(OutputRefused, match=f"run/{LOCK_FILE}: the lock file is a symlink"):
        FolderLock(tmp_path / "run", "training into it", "--resume").acquire()
    assert (tmp_path / "notes.txt").read_text() == "mine\n"


def test_a_filesystem_without_locks_refuses_the_run_in_one_line(tmp_path, monkeypatch, capsys):
    """flock failing with ENOLCK (some network filesystems; before: the bare system error):
    ``mloco train --out`` there exits 2 naming the lock file, the system's reason and what to
    do; nothing is trained."""
    fcntl = pytest.importorskip("fcntl")

    def flock(descriptor: int, operation: int) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(lock, "fcntl", SimpleNamespace(flock=flock, LOCK_EX=fcntl.LOCK_EX,
                                                       LOCK_NB=fcntl.LOCK_NB))  # fmt: skip
    data = tmp_path / "data"
    data.mkdir()
    for index in range(20):
        (data / f"doc{index}.txt").write_text(f"the river {index} ran past stone walls " * 40)
    out = tmp_path / "run"
    code, err, _ = run_cli(capsys, "train", "--model", "micro", "--data", data, "--tokens", "512",
                           "--global-batch", "4", "--seq-len", "32", "--vocab-size", "300",
                           "--val-tokens", "256", "--inner-steps", "2", "--workers", "2",
                           "--out", out, "--quiet")  # fmt: skip
    assert_refused(code, err, f"{out / LOCK_FILE}: this filesystem refuses a file lock (No "
                   "locks available)", "choose a folder on a local disk")  # fmt: skip
    assert not (out / "checkpoints").exists() and not (out / "final").exists()


def test_without_fcntl_a_folder_is_not_locked(tmp_path, monkeypatch):
    """Windows has no ``fcntl``: there a folder takes no lock, and nothing fails."""
    monkeypatch.setattr(lock, "fcntl", None)
    with FolderLock(tmp_path, "comparing into it", "run it again") as first:
        first.acquire()
        FolderLock(tmp_path, "comparing into it", "run it again").acquire()
    assert not (tmp_path / LOCK_FILE).exists()
