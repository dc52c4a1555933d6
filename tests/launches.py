"""Real processes for the tests. Each launch runs in a session of its own and carries a tag in
its environment that every process it starts inherits, torchrun's workers too: torchrun starts
each worker in a session of its own, outside the launch's process group, so killing the group
alone would miss them (a stopped rank outlived its test that way). A wall-clock guard fails
the test instead of hanging it."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Mapping
from pathlib import Path

import pytest

LAUNCH_ENV = "MLOCO_TEST_LAUNCH"
#: wall-clock guard of a launch: past it the test fails after the launch is killed
GUARD_S = 120


def free_port() -> int:
    """A local TCP port free now (for torchrun's or a node's rendezvous)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def alive_in_launch(tag: str) -> list[int]:
    """Processes of the launch ``tag`` still running, in any process group or session
    (zombies do not count)."""
    alive = []
    marker = f"{LAUNCH_ENV}={tag}".encode()
    for folder in Path("/proc").glob("[0-9]*"):
        try:
            state = (folder / "stat").read_text().rsplit(")", 1)[1].split()[0]
            environment = (folder / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError):
            continue  # exited while we looked
        if marker in environment and state != "Z":
            alive.append(int(folder.name))
    return alive


@dataclasses.dataclass
class Finished:
    returncode: int
    stdout: str
    stderr: str
    ended: float  # time.time() when it exited
    launch: str  # its LAUNCH_ENV tag


def launch(command: list[str], environment: Mapping[str, str] | None = None) -> subprocess.Popen:
    """Start ``command`` in a new session with ``environment`` (default: this process's) and a
    new :data:`LAUNCH_ENV` tag (``process.launch``); its output is piped."""
    tag = uuid.uuid4().hex
    environment = {**(os.environ if environment is None else environment), LAUNCH_ENV: tag}
    process = subprocess.Popen(
        command, env=environment, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    process.launch = tag
    return process


def finish(process: subprocess.Popen, guard_s: float = GUARD_S) -> Finished:
    """Wait for ``process`` (at most ``guard_s``, else fail the test after killing its launch)."""
    try:
        stdout, stderr = process.communicate(timeout=guard_s)
        ended = time.time()
    except subprocess.TimeoutExpired:
        kill_launch(process)
        stdout, stderr = process.communicate()
        pytest.fail(f"{process.args[:6]} hung past {guard_s} s:\n{stderr[-3000:]}")
    return Finished(process.returncode, stdout, stderr, ended, process.launch)


def kill_launch(process: subprocess.Popen) -> None:
    """SIGKILL every process of the launch (:func:`alive_in_launch`: torchrun's workers too, a
    stopped one included), then reap ``process``."""
    for pid in [process.pid, *alive_in_launch(process.launch)]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    process.wait()


def run_launch(
    command: list[str], environment: Mapping[str, str] | None = None, guard_s: float = GUARD_S
) -> Finished:
    """Run ``command`` (:func:`launch`) to its end; whatever of the launch is left then (or on
    a failure or the guard), is killed."""
    process = launch(command, environment)
    try:
        return finish(process, guard_s)
    finally:
        kill_launch(process)
