"""Shared test helpers: a small training corpus copied from the Python standard library."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sysconfig
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import torch


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist (``make test`` runs two workers), torch runs on one thread in each
    worker: two workers of as many threads as cores wait on each other's OpenMP threads. A
    suite started in the background (``nohup make test &``) inherits SIGINT ignored, which the
    processes of the Ctrl-C tests would inherit in turn: Python's own handler is put back."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        torch.set_num_threads(1)
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


@contextlib.contextmanager
def stdlib_corpus(root: Path, files: Sequence[str], **env: str) -> Iterator[str]:
    """Copy ``files`` of the stdlib into ``root/corpus`` and yield that folder, with
    MLOCO_CACHE in ``root/cache`` and torch on one thread (tiny models on shared cores: OpenMP
    threads waiting for each other made a step up to 30x slower). ``env``: more variables."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for name in files:
        (root / "corpus" / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(stdlib / name, root / "corpus" / name)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MLOCO_CACHE", str(root / "cache"))
        patch.setenv("OMP_NUM_THREADS", "1")
        for name, value in env.items():
            patch.setenv(name, value)
        yield str(root / "corpus")
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def stopped(corpus, tmp_path_factory) -> Path:
    """A run of 2 rounds on the test module's ``corpus`` stopped after round 1 with a
    checkpoint (copy before use)."""
    from hostile import TRAIN

    from mergekit_loco.cli import main

    out = tmp_path_factory.mktemp("stopped") / "run"
    with pytest.raises(SystemExit) as exited:
        main(["train", *TRAIN, f"--data={corpus}", f"--out={out}", "--checkpoint-every=1",
              "--stop-after=1"])  # fmt: skip
    assert exited.value.code in (0, None)
    return out
