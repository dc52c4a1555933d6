"""The docs' examples run as written, in the order a reader meets them, in one folder.

README.md's usage block runs first through the real entry point (``python -m mergekit_loco``),
then every ``mloco`` command of docs/merging.md and docs/compare.md (through ``main()``, which
is faster; the entry point is covered by the README part). Running them in one folder proves
that no docs command collides with an earlier one's output. Then the Python blocks.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from mergekit_loco.cli import main

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
#: The docs pages whose ``mloco`` commands run after the README's, in this order.
DOCS = ("docs/merging.md", "docs/compare.md")


def blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", text, flags=re.S | re.M)


def commands(text: str) -> list[str]:
    """The ``mloco`` lines of the bash blocks (``\\`` continuations joined, comments cut)."""
    lines = "\n".join(blocks(text, "bash")).replace("\\\n", " ").splitlines()
    return [line.split("  #")[0].strip() for line in lines if line.startswith("mloco ")]


def console_examples(text: str) -> list[tuple[str, str]]:
    """``$ mloco ...`` lines of console blocks with the output shown under each."""
    examples = []
    for block in blocks(text, "console"):
        for chunk in re.split(r"^\$ ", block, flags=re.M)[1:]:
            command, _, output = chunk.partition("\n")
            examples.append((command, output.strip()))
    return examples


def run_main(capsys, command: str) -> tuple[int, str]:
    """``command`` through :func:`main` in-process: (exit code, stderr)."""
    with pytest.raises(SystemExit) as exited:
        main(shlex.split(command)[1:])
    return exited.value.code, capsys.readouterr().err


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    shutil.copytree(ROOT / "examples", tmp_path / "examples")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLOCO_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    return tmp_path


def test_readme_then_docs_commands_run_in_order(workdir, capsys):
    readme = commands(README)
    assert len(readme) == 7 and not any("--quiet" in line for line in readme if " train " in line)
    for command in readme:
        done = subprocess.run(
            [sys.executable, "-m", "mergekit_loco", *shlex.split(command)[1:]],
            cwd=workdir, env=os.environ, capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        assert done.returncode == 0, f"{command}\n{done.stderr[-2000:]}"
    assert (workdir / "merged" / "model.safetensors").is_file()
    assert (workdir / "soup.safetensors").is_file()
    assert (workdir / "runs" / "isoloco" / "final" / "model.safetensors").is_file()
    for page in DOCS:
        text = (ROOT / page).read_text()
        for command in commands(text):
            code, stderr = run_main(capsys, command)
            assert code == 0, (page, command, stderr)
        for command, shown in console_examples(text):
            code, stderr = run_main(capsys, command)
            assert code == 2 and stderr.strip() == shown, (page, command, stderr)
        for block in blocks(text, "python"):
            exec(compile(block, page, "exec"), {})
    assert (workdir / "merged-ties" / "config.json").is_file()
    assert (workdir / "merged-ties-api" / "model.safetensors").is_file()
    assert (workdir / "runs" / "merge-demo" / "merging.png").is_file()
    assert (workdir / "runs" / "compare-demo" / "loss_vs_workers.png").is_file()


def test_readme_python_example_runs(workdir):
    (example,) = blocks(README, "python")
    exec(compile(example, "README.md", "exec"), {})
    assert (workdir / "merged-api" / "model.safetensors").is_file()


def test_tiny_merges_load_with_their_tokenizer(workdir, capsys):
    """The bundled checkpoints carry a tokenizer, and a merge of them copies it."""
    command = "mloco merge examples/tiny/ft1 examples/tiny/ft2 --base examples/tiny/base -m ties"
    assert run_main(capsys, command)[0] == 0
    tokenizer = AutoTokenizer.from_pretrained(workdir / "merged-ties", local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(workdir / "merged-ties")
    ids = tokenizer("def main():\n    return 0\n", return_tensors="pt").input_ids
    assert tokenizer.decode(ids[0]) == "def main():\n    return 0\n"
    assert int(ids.max()) < model.config.vocab_size == len(tokenizer)
    assert model(ids).logits.isfinite().all()


def test_demo_says_what_it_does_first_and_shows_progress():
    """``make demo`` prints its plan and usual duration before any work, and trains with the
    progress bar on (no --quiet); README's make demo line promises the same duration."""
    script = (ROOT / "examples" / "demo.sh").read_text()
    intro = script.index("cat <<INTRO")
    first_work = min(script.index(word) for word in ("mloco ", "merge_demo.sh", "python -"))
    assert intro < first_work
    plan = script[intro : script.index("\nINTRO\n", intro)]
    minutes = re.search(r"usually about (\d) minutes on 2 idle CPU cores", plan)
    assert minutes and int(minutes.group(1)) < 5
    assert "--quiet" not in script
    assert f"about {minutes.group(1)} min" in README.split("make test")[0]
    assert "mloco train" in script and "final" in script


def fake_venv(root: Path) -> dict[str, str]:
    """``root/.venv/bin`` holding ``mloco`` and ``python`` of this interpreter, as ``make install``
    leaves them, and an environment whose PATH has neither (a shell without the venv)."""
    bin_folder = root / ".venv" / "bin"
    bin_folder.mkdir(parents=True)
    for name, command in (("python", ""), ("mloco", " -m mergekit_loco")):
        (bin_folder / name).write_text(f'#!/bin/sh\nexec "{sys.executable}"{command} "$@"\n')
        (bin_folder / name).chmod(0o755)
    path = os.pathsep.join(p for p in ("/usr/bin", "/bin") if Path(p, "bash").exists())
    return {**os.environ, "PATH": path, "PYTHONPATH": str(ROOT)}


def test_merge_demo_runs_without_the_venv_on_path(tmp_path):
    """``bash examples/merge_demo.sh`` from a shell whose PATH lacks the venv finds ``mloco``
    and ``python`` in ``.venv/bin``, as demo.sh does (before: ``mloco: command not found``)."""
    shutil.copytree(ROOT / "examples", tmp_path / "examples")
    env = fake_venv(tmp_path)
    assert shutil.which("mloco", path=env["PATH"]) is None
    done = subprocess.run(
        ["bash", "examples/merge_demo.sh", "out"], cwd=tmp_path, env=env,
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "command not found" not in done.stderr
    assert (tmp_path / "out" / "iso-cts" / "model.safetensors").is_file()
    assert "loaded out/ties: logits" in done.stdout


def test_demo_eval_hint_scores_only_the_runs_held_out_tokens(tmp_path):
    """The command demo.sh prints to score a trained model passes the run's --val-tokens (eval's
    default of 65536 would score tokens the run trained on)."""
    script = (ROOT / "examples" / "demo.sh").read_text()
    val_tokens = re.search(r"^val_tokens=(\d+)$", script, flags=re.M).group(1)
    assert '--val-tokens "$val_tokens"' in script
    results = script[script.index("<<'PY'\n") + 7 : script.index("\nPY\n")]
    for preset in ("diloco", "isoloco"):
        (tmp_path / preset).mkdir()
        (tmp_path / preset / "metrics.jsonl").write_text('{"event": "final", "val_loss": 4.5}\n')
    done = subprocess.run(
        [sys.executable, "-", str(tmp_path), val_tokens], input=results,
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    hint = next(line for line in done.stdout.splitlines() if "mloco eval" in line)
    assert shlex.split(hint)[-2:] == ["--tokens", val_tokens]
