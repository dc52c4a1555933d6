"""The lock of a folder being written (mergekit_loco/io/lock.py); two real processes racing for
a run folder or a results folder are in tests/test_faults.py and tests/test_compare.py."""

from __future__ import annotations

import os

import pytest

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


def test_without_fcntl_a_folder_is_not_locked(tmp_path, monkeypatch):
    """Windows has no ``fcntl``: there a folder takes no lock, and nothing fails."""
    monkeypatch.setattr(lock, "fcntl", None)
    with FolderLock(tmp_path, "comparing into it", "run it again") as first:
        first.acquire()
        FolderLock(tmp_path, "comparing into it", "run it again").acquire()
    assert not (tmp_path / LOCK_FILE).exists()
