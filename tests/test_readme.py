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
    assert len(readme) == 6 and not any("--quiet" in line for line in readme if " train " in line)
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
