"""One writer per output folder: an exclusive advisory lock held for the writer's lifetime.

A training run holds its run folder's lock (``mloco train --out``), a comparison its results
folder's (``mloco compare -o``), from the moment it first needs the folder until it ends. A
second process that would write there is refused at once, naming the process that holds it.
The lock is ``flock(LOCK_EX | LOCK_NB)`` on :data:`~mergekit_loco.io.atomic.LOCK_FILE` in the
folder: the kernel drops it when its process ends, even by SIGKILL or the OOM killer, so a lock
is never stale. The file holds its last holder's PID and stays in the folder: deleting it would
let a second process lock a new file of that name while the first still holds the old one.
Without ``fcntl`` (Windows) folders are not locked.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from mergekit_loco.io.atomic import LOCK_FILE, OutputRefused
from mergekit_loco.io.files import shown

try:
    import fcntl
except ImportError:  # Windows: no advisory locks, no lock
    fcntl = None


class FolderInUse(OutputRefused):
    """Another live process holds the folder's lock; the message names the folder and its PID."""


class LocksUnsupported(OutputRefused):
    """The filesystem of the folder refuses ``flock`` (some network filesystems)."""


class FolderLock:
    """The lock on ``folder``, taken by :meth:`acquire` (once; it creates the folder) and held
    until :meth:`release`, the end of the ``with`` block, or the end of the process. ``doing``
    and ``then`` complete the refusal: ``FOLDER is in use by another mloco process (PID N)
    {doing}; wait for it to finish or stop it, then {then}``."""

    def __init__(self, folder: Path, doing: str, then: str):
        self.folder = Path(folder)
        self.doing = doing
        self.then = then
        self.descriptor: int | None = None

    def acquire(self) -> None:
        """Lock the folder, or raise :class:`FolderInUse` without waiting; then write our PID
        into the lock file. A lock file that is a symlink or not a regular file is refused, and
        never followed."""
        if self.descriptor is not None or fcntl is None:
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / LOCK_FILE
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        try:
            descriptor = os.open(path, flags, 0o644)
        except OSError as error:
            if error.errno != errno.ELOOP:
                raise
            raise OutputRefused(f"{shown(path)}: the lock file is a symlink; remove it") from None
        try:
            if not stat.S_ISREG(os.fstat(descriptor).st_mode):
                raise OutputRefused(f"{shown(path)}: the lock file is not a file; remove it")
            try:
                fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise FolderInUse(self.refusal(holder_pid(descriptor))) from None
            except OSError as error:  # ENOLCK, EOPNOTSUPP: a filesystem without flock
                raise LocksUnsupported(
                    f"{shown(path)}: this filesystem refuses a file lock ({error.strerror}), "
                    "which keeps two processes from writing one folder at once; choose a folder "
                    "on a local disk"
                ) from None
            os.ftruncate(descriptor, 0)
            os.pwrite(descriptor, f"{os.getpid()}\n".encode(), 0)
        except BaseException:
            os.close(descriptor)
            raise
        self.descriptor = descriptor

    def refusal(self, pid: str) -> str:
        return (
            f"{shown(self.folder)} is in use by another mloco process (PID {pid}) {self.doing}; "
            f"wait for it to finish or stop it, then {self.then}"
        )

    def release(self) -> None:
        """Drop the lock (closing the file releases it); the file stays."""
        if self.descriptor is not None:
            os.close(self.descriptor)
            self.descriptor = None

    def __enter__(self) -> FolderLock:
        return self

    def __exit__(self, *exc_info) -> None:
        self.release()


def holder_pid(descriptor: int) -> str:
    """The PID the holder wrote into the lock file, or ``unknown`` (it has not written it yet)."""
    written = os.pread(descriptor, 32, 0).decode("ascii", errors="replace").strip()
    return written if written.isdigit() else "unknown"
