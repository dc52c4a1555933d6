"""README.md's examples run as written: its first ```bash block through the real entry point,
and its ```python block, from a copy of the repository's examples in a temporary folder."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README, flags=re.S)


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    shutil.copytree(ROOT / "examples", tmp_path / "examples")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_readme_bash_commands_run(workdir, tmp_path):
    script = blocks("bash")[1].replace("\\\n", " ")
    commands = [line.split("#")[0].strip() for line in script.splitlines()]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MLOCO_CACHE": str(tmp_path / "cache")}
    for command in filter(None, commands):
        args = shlex.split(command)
        assert args[0] == "mloco"
        done = subprocess.run(
            [sys.executable, "-m", "mergekit_loco", *args[1:]],
            cwd=workdir, env=env, capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        assert done.returncode == 0, f"{command}\n{done.stderr[-2000:]}"
    assert (workdir / "merged" / "model.safetensors").is_file()
    assert (workdir / "soup.safetensors").is_file()
    assert (workdir / "runs" / "isoloco" / "final" / "model.safetensors").is_file()


def test_readme_python_example_runs(workdir):
    (example,) = blocks("python")
    exec(compile(example, "README.md", "exec"), {})
    assert (workdir / "merged-api" / "model.safetensors").is_file()
