"""``--data`` from strangers: binary files refused at once, FIFOs never read, and memory bounded
by what the run tokenizes, not by the size of the file."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from hostile import TRAIN, assert_not_read, assert_refused, run_cli, snapshot

LINE = "the quick brown fox jumps over the lazy dog, then rests a while by the river.\n"


@pytest.mark.parametrize("kind", ["sparse_2GiB", "random_bytes", "binary_after_text", "fifo"])
def test_data_that_is_not_text_is_refused_fast(capsys, tmp_path, monkeypatch, kind):
    monkeypatch.setenv("MLOCO_CACHE", str(tmp_path / "cache"))
    data = tmp_path / "data.txt"
    if kind == "sparse_2GiB":
        with open(data, "wb") as handle:
            handle.truncate(2 * 2**30)
        fragment = "a NUL byte at byte 0"
    elif kind == "random_bytes":
        data.write_bytes(os.urandom(3_000_000))
        fragment = "not a text file"
    elif kind == "binary_after_text":  # past the sniffed start: caught while streaming
        data.write_bytes((LINE * 2000).encode() + b"\xff\xfe binary" + (LINE * 10).encode())
        fragment = "invalid UTF-8 at byte"
    else:
        os.mkfifo(data)
        fragment = "is a FIFO"
    out = tmp_path / "run"
    before = snapshot(tmp_path)
    started = time.perf_counter()
    code, err, _ = run_cli(capsys, "train", *TRAIN, f"--data={data}", f"--out={out}")
    assert time.perf_counter() - started < 60
    assert_refused(code, err, str(data), fragment)
    assert not out.exists()
    after = snapshot(tmp_path)
    assert {k: v for k, v in after.items() if not k.startswith("cache")} == before


def test_a_jsonl_text_with_a_lone_surrogate_escape_is_refused_naming_its_line(
    capsys, tmp_path, monkeypatch
):
    """JSON can spell half a surrogate pair (``"\\ud83d"``), which decodes to no character;
    before, training with the bundled tokenizer (and eval) ended in a TypeError traceback from
    the tokenizer, and training one said ``'utf-8' codec can't encode character``, naming no
    file. Refused naming the file and line; a whole pair (an emoji) is text."""
    monkeypatch.setenv("MLOCO_CACHE", str(tmp_path / "cache"))
    data = tmp_path / "data.jsonl"
    good = '{"text": "' + LINE.strip() + ' \\ud83d\\ude00"}\n'
    data.write_text(good * 150 + '{"text": "half \\ud83d here"}\n' + good * 50)
    out = tmp_path / "run"
    code, err, _ = run_cli(capsys, "train", *TRAIN, f"--data={data}", f"--out={out}")
    assert_refused(
        code, err, f'{data}:151: "text" holds the escape \\ud83d, half of a surrogate pair'
    )
    assert not out.exists()
    data.write_text(good * 200)
    code, err, _ = run_cli(capsys, "train", *TRAIN, f"--data={data}", f"--out={out}", "--quiet")
    assert code == 0, err


PEAK_SCRIPT = textwrap.dedent("""
    import resource, sys
    from pathlib import Path
    from mergekit_loco.train.data import prepare_data
    prepare_data(sys.argv[1], cache_dir=Path(sys.argv[2]), max_train_tokens=4096,
                 val_tokens=512, vocab_size=300)
    print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
""")


def peak_rss(data: Path, cache: Path) -> int:
    done = subprocess.run(
        [sys.executable, "-c", PEAK_SCRIPT, str(data), str(cache)],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    return int(done.stdout.split()[-1])


def test_memory_is_bounded_by_the_token_budget_not_the_file_size(tmp_path):
    """Two folders of one big document plus small ones: 5 MB and 80 MB of text give the same
    peak (both hit the tokenizer's 4M-character sample and the 4,608-token cap); reading the
    big file whole, or tokenizing all of it, would add hundreds of MB."""
    peaks = {}
    for size in (5, 80):
        folder = tmp_path / f"data{size}"
        folder.mkdir()
        for index in range(10):  # enough for the run whichever document is held out
            (folder / f"small{index}.txt").write_text(LINE * 50)
        with open(folder / "big.txt", "w") as handle:
            for _ in range(size):
                handle.write(LINE * (2**20 // len(LINE)))
        peaks[size] = peak_rss(folder, tmp_path / f"cache{size}")
    assert peaks[80] < peaks[5] + 64 * 2**20, peaks


def test_a_data_folder_never_leads_outside(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("MLOCO_CACHE", str(tmp_path / "cache"))
    secret = tmp_path / "secret.txt"
    secret.write_text("private notes\n" * 100)
    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "a.txt").write_text(LINE * 200)
    (folder / "b.txt").symlink_to(secret)
    before = snapshot(tmp_path)
    code, err, opened = run_cli(
        capsys, "train", *TRAIN, f"--data={folder}", "--out", tmp_path / "r"
    )
    assert_refused(code, err, str(folder / "b.txt"), "leading outside")
    assert_not_read(opened, secret)
    after = snapshot(tmp_path)
    assert {k: v for k, v in after.items() if not k.startswith("cache")} == before


def test_a_tokenizer_file_leading_outside_is_refused(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("MLOCO_CACHE", str(tmp_path / "cache"))
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text(LINE * 400)
    outside = tmp_path / "outside.json"
    outside.write_text("{}")
    tokenizer = tmp_path / "tok"
    tokenizer.mkdir()
    (tokenizer / "tokenizer.json").symlink_to(outside)
    args = ["train", *TRAIN, f"--data={tmp_path / 'corpus'}", f"--tokenizer={tokenizer}"]
    code, err, opened = run_cli(capsys, *args, "--out", tmp_path / "r")
    assert_refused(code, err, str(tokenizer / "tokenizer.json"), "leading outside")
    assert_not_read(opened, outside)
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("spec", ["", "stdlib,", " , "])
def test_an_empty_data_source_is_named(capsys, tmp_path, monkeypatch, spec):
    """Before: ``--out lies inside the input .`` (the empty source read as the current folder)."""
    monkeypatch.chdir(tmp_path)
    code, err, _ = run_cli(capsys, "train", *TRAIN, f"--data={spec}", f"--out={tmp_path / 'o'}")
    assert_refused(code, err, f"data spec {spec!r} has an empty source")
    assert not (tmp_path / "o").exists()
