"""Document collections: the seeded order against a direct sort of sha256 digests, a corpus of
parts indexed like one list, and a .jsonl file of many lines held in bytes per line."""

from __future__ import annotations

import hashlib
import json
import random
import subprocess
import sys

import pytest

from mergekit_loco.train.documents import Corpus, FileLines, fingerprint, hash_order, in_memory


def names_of(documents) -> list[str]:
    return [document.name for document in documents]


def test_hash_order_is_the_sort_of_the_digests():
    rng = random.Random(3)
    names = {"".join(rng.choices("abcdefé/:\0 ", k=rng.randint(0, 12))) for _ in range(3000)}
    documents = [in_memory(name, "s", name) for name in sorted(names)]

    def by_digest(items, salt):
        return sorted(items, key=lambda d: hashlib.sha256(f"{salt}\0{d.name}".encode()).digest())

    ordered = hash_order(documents, "900")
    assert names_of(ordered) == names_of(by_digest(documents, "900"))
    # a slice is a view that orders again like the list it stands for
    rest = hash_order(ordered[100:], "7")
    assert names_of(rest) == names_of(by_digest(by_digest(documents, "900")[100:], "7"))
    assert len(hash_order([], "x")) == 0


def test_a_corpus_indexes_its_parts_as_one_list():
    lines = FileLines("notes.jsonl", "1:2", lambda offset: f"line at {offset}", "/d/notes.jsonl")
    for number, offset in ((1, 0), (3, 40), (4, 75)):
        lines.append(number, offset)
    first = [in_memory(f"a{i}", "s", f"text {i}") for i in range(2)]
    corpus = Corpus([first, [], lines, [in_memory("z", "s", "last")]], "spec")
    expected = ["a0", "a1", "notes.jsonl:1", "notes.jsonl:3", "notes.jsonl:4", "z"]
    assert len(corpus) == 6 and names_of(corpus) == expected
    assert corpus[-1].name == "z" and corpus[3].read() == "line at 40"
    assert names_of(corpus[1:4]) == expected[1:4]
    with pytest.raises(IndexError):
        corpus[6]
    assert fingerprint(corpus) == fingerprint([corpus[i] for i in range(6)])
    with pytest.raises(ValueError, match="includes document 'notes.jsonl:1' twice"):
        Corpus([lines, first, lines], "spec")
    with pytest.raises(ValueError, match="two documents named 'a1'"):
        Corpus([first, first[1:]], "spec")  # in memory: no file, so a name clash
    renamed = FileLines("other.jsonl", "1:2", lines.read_line, "/d/notes.jsonl")
    renamed.append(1, 0)
    with pytest.raises(ValueError, match="includes document 'other.jsonl:1' twice"):
        Corpus([lines, renamed], "spec")  # one file under two names


def test_a_jsonl_of_many_short_lines_is_held_in_bytes_per_line(tmp_path):
    """300,000 one-letter documents: the corpus and its order add well under 100 bytes a line
    (a Python object per line took about 480)."""
    path = tmp_path / "many.jsonl"
    path.write_text("".join(json.dumps({"text": "a"}) + "\n" for _ in range(300_000)))
    child = f"""
from mergekit_loco.train.documents import hash_order
from mergekit_loco.train.sources import load_documents
def rss():
    return int(open("/proc/self/status").read().split("VmRSS:")[1].split()[0]) * 1024
before = rss()
documents = load_documents({str(path)!r})
order = hash_order(documents, "seed")
assert len(order) == 300_000 and order[0].read() == "a"
print((rss() - before) / len(documents))
"""
    if not sys.platform.startswith("linux"):
        pytest.skip("reads /proc/self/status")
    done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert float(done.stdout) < 100
