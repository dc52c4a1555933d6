"""Data pipeline: sources, tokenizer cache, validation split, shards, batches, evaluation."""

from __future__ import annotations

import gzip
import json
import os
import re
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch

from mergekit_loco.train import data as data_module
from mergekit_loco.train import tokenizer as tokenizer_module
from mergekit_loco.train.data import (
    BatchStream,
    DataExhausted,
    evaluate_loss,
    prepare_data,
    validation_batches,
    worker_shard,
)
from mergekit_loco.train.debian_formats import read_r_lazyload_strings, read_sword_ztext_chapters
from mergekit_loco.train.model import build_model, model_config
from mergekit_loco.train.sources import MAX_SOURCES, load_documents
from mergekit_loco.train.tokenizer import load_or_train_tokenizer, load_tokenizer

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron".split()


def _document_text(index: int) -> str:
    words = " ".join(WORDS[(index * 7 + k) % len(WORDS)] for k in range(20 + index % 9))
    return f"<<doc {index:03d}>> {words}\n"


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    folder = tmp_path / "corpus"
    for index in range(40):
        path = folder / f"part{index % 3}" / f"doc{index:03d}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(_document_text(index))
    (folder / "part0" / "image.bin").write_bytes(b"\x00\xff not text")
    return folder


def _split_at_eos(ids: torch.Tensor, eos_id: int) -> list[list[int]]:
    pieces, current = [], []
    for token in ids.tolist():
        if token == eos_id:
            pieces.append(current)
            current = []
        else:
            current.append(token)
    return pieces + [current]


def _prepare(spec: str | Path, cache: Path, **options):
    options.setdefault("vocab_size", 300)
    return prepare_data(str(spec), cache_dir=cache, **options)


def test_documents_are_joined_with_eos(corpus, tmp_path):
    prepared = _prepare(corpus, tmp_path / "cache", val_tokens=0)
    pieces = _split_at_eos(prepared.train, prepared.eos_id)
    assert pieces[-1] == []  # the stream ends with EOS
    texts = sorted(prepared.tokenizer.decode(piece) for piece in pieces[:-1])
    assert texts == sorted(_document_text(index) for index in range(40))
    assert prepared.train.dtype == torch.int64 and prepared.val.numel() == 0


def test_validation_holds_out_whole_documents(corpus, tmp_path):
    prepared = _prepare(corpus, tmp_path / "cache", val_tokens=150)
    assert prepared.val.numel() == 150
    assert len(prepared.val_documents) >= 2
    held_out = [
        (corpus / name.removeprefix(f"{corpus.name}/")).read_text()
        for name in prepared.val_documents
    ]
    decoded_val = prepared.tokenizer.decode(prepared.val)
    full = "<|endoftext|>".join(held_out) + "<|endoftext|>"
    assert full.startswith(decoded_val)
    decoded_train = prepared.tokenizer.decode(prepared.train)
    for text in held_out:
        assert text.split(">>")[0] not in decoded_train
    train_documents = len(_split_at_eos(prepared.train, prepared.eos_id)) - 1
    assert train_documents + len(prepared.val_documents) == 40
    other_seed = _prepare(corpus, tmp_path / "cache", val_tokens=150, seed=1)
    assert other_seed.val_documents != prepared.val_documents


def test_the_split_does_not_depend_on_how_the_path_is_spelt(corpus, tmp_path, monkeypatch):
    """``corpus``, ``./corpus/`` and the absolute path name the documents alike, so they hold
    out the same documents and train on the same tokens."""
    monkeypatch.chdir(corpus.parent)
    spellings = [str(corpus), corpus.name, f"./{corpus.name}/", f"{corpus.name}/../{corpus.name}"]
    prepared = [_prepare(spec, tmp_path / "cache", val_tokens=150) for spec in spellings]
    assert all(p.val_documents == prepared[0].val_documents for p in prepared)
    assert all(torch.equal(p.train, prepared[0].train) for p in prepared)
    assert prepared[0].val_documents[0].startswith(f"{corpus.name}/")


def test_max_train_tokens_cuts_exactly_and_reports_shortfall(corpus, tmp_path):
    prepared = _prepare(corpus, tmp_path / "cache", val_tokens=64, max_train_tokens=500)
    assert prepared.train.numel() == 500
    everything = _prepare(corpus, tmp_path / "cache", val_tokens=64)
    assert torch.equal(prepared.train, everything.train[:500])
    available = everything.train.numel()
    with pytest.raises(
        ValueError, match=rf"has {available:,} training tokens.*10,000,000 requested"
    ):
        _prepare(corpus, tmp_path / "cache", val_tokens=64, max_train_tokens=10_000_000)


def test_a_tokenizer_cache_written_meanwhile_by_another_process_is_used(corpus, tmp_path,
                                                                        monkeypatch):  # fmt: skip
    """Two cells of a parallel sweep train the same tokenizer at once: the one that finishes
    second finds the cache written (the same documents, so the same tokenizer) and uses it,
    instead of failing with 'appeared while it was being written'."""
    cache = tmp_path / "cache"
    train = tokenizer_module.train_tokenizer

    def racing(texts, vocab_size, *args, **kwargs):
        tokenizer = train(texts, vocab_size, *args, **kwargs)
        [folder] = [f for f in (cache / "tokenizers").glob("bpe*")] or [None]
        assert folder is None  # nobody has written it yet: the other process now does
        monkeypatch.setattr(tokenizer_module, "train_tokenizer", train)
        tokenizer_module.load_or_train_tokenizer(str(corpus), vocab_size, cache)
        return tokenizer

    monkeypatch.setattr(tokenizer_module, "train_tokenizer", racing)
    first = tokenizer_module.load_or_train_tokenizer(str(corpus), 300, cache)
    assert len(list((cache / "tokenizers").iterdir())) == 1 and len(first) == 300


def test_second_call_hits_both_caches(corpus, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    first = _prepare(corpus, cache, val_tokens=64, max_train_tokens=400)

    def forbidden(*args, **kwargs):
        raise AssertionError("cache miss")

    monkeypatch.setattr(tokenizer_module, "train_tokenizer", forbidden)
    monkeypatch.setattr(data_module, "_tokenize_split", forbidden)
    second = _prepare(corpus, cache, val_tokens=64, max_train_tokens=400)
    assert torch.equal(first.train, second.train) and torch.equal(first.val, second.val)
    assert second.val_documents == first.val_documents

    (corpus / "part1" / "new.txt").write_text("a new document changes the key\n")
    with pytest.raises(AssertionError, match="cache miss"):
        load_or_train_tokenizer(str(corpus), 300, cache)


def test_hf_tokenizer_folder_is_accepted(corpus, tmp_path):
    trained = load_or_train_tokenizer(str(corpus), 300, tmp_path / "cache")
    folder = tmp_path / "my-tokenizer"
    trained.save_pretrained(folder)
    prepared = _prepare(corpus, tmp_path / "cache", tokenizer=str(folder), val_tokens=0)
    assert prepared.eos_id == trained.eos_token_id
    assert len(_split_at_eos(prepared.train, prepared.eos_id)) == 41
    with pytest.raises(ValueError, match="no-such-tokenizer"):
        load_tokenizer(tmp_path / "no-such-tokenizer")


def test_jsonl_source_one_document_per_line(tmp_path):
    path = tmp_path / "docs.jsonl"
    rows = [{"text": _document_text(index), "id": index} for index in range(12)]
    path.write_text("\n".join(json.dumps(row) for row in rows[:6]) + "\n\n")
    path.write_text(path.read_text() + "\n".join(json.dumps(row) for row in rows[6:]) + "\n")
    documents = load_documents(str(path))
    assert [document.read() for document in documents] == [row["text"] for row in rows]
    prepared = _prepare(path, tmp_path / "cache", val_tokens=0)
    assert len(_split_at_eos(prepared.train, prepared.eos_id)) == 13

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"body": "no text"}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2"):
        load_documents(str(bad))
    bad.write_text('{"text": "fine", "n": ' + "9" * 5000 + "}\n")  # beyond int() of a str
    with pytest.raises(ValueError, match=r"bad\.jsonl:1: expected a JSON object"):
        load_documents(str(bad))


def test_folder_source_is_recursive_sorted_and_text_only(corpus):
    names = [document.name for document in load_documents(str(corpus))]
    assert len(names) == 40 and names == sorted(names)
    assert not any(name.endswith(".bin") for name in names)
    extra = corpus.parent / "extra.md"
    extra.write_text("# one more\n")
    mixed = load_documents(f"{corpus}, {extra}")
    assert len(mixed) == 41 and mixed[-1].read() == "# one more\n"
    with pytest.raises(ValueError, match="doc000.txt' twice"):
        load_documents(f"{corpus},{corpus / 'part0' / 'doc000.txt'}")
    twin = corpus.parent / "twin" / corpus.name  # another folder of the same name
    twin.mkdir(parents=True)
    (twin / "part0").mkdir()
    (twin / "part0" / "doc000.txt").write_text("another text\n")
    with pytest.raises(ValueError, match=f"two documents named '{corpus.name}/part0/doc000.txt'"):
        load_documents(f"{corpus},{twin}")


def test_a_path_with_commas_in_its_name_is_one_source(tmp_path, monkeypatch):
    """``--data`` splits at commas, except inside a path that exists as written."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes, 2024.txt").write_text("first notes\n")
    (tmp_path / "a,b").mkdir()
    (tmp_path / "a,b" / "c.md").write_text("in a folder\n")
    (tmp_path / "plain.txt").write_text("plain\n")
    documents = load_documents("plain.txt,notes, 2024.txt, a,b")
    assert [d.read() for d in documents] == ["plain\n", "first notes\n", "in a folder\n"]
    with pytest.raises(ValueError, match="'notes'"):
        load_documents("plain.txt,notes")  # no file of that name: named as given


def test_a_long_list_of_files_is_split_and_a_huge_one_refused(tmp_path, monkeypatch):
    """Before, a list of 20 files whose joined spec was longer than a file name (299
    characters) failed with ``File name too long`` (Path.exists raised on the whole spec);
    160 absolute paths likewise. Every file is now read, in order; a spec of more than
    MAX_SOURCES parts is refused naming the bound."""
    monkeypatch.chdir(tmp_path)
    for index in range(160):
        (tmp_path / f"chapter-{index:03d}.txt").write_text(f"chapter {index}\n")
    relative = ",".join(f"chapter-{index:03d}.txt" for index in range(20))
    absolute = ",".join(str(tmp_path / f"chapter-{index:03d}.txt") for index in range(160))
    assert len(relative) > 255 and len(absolute) > 4096
    for spec, count in ((relative, 20), (absolute, 160)):
        documents = load_documents(spec)
        assert [d.read() for d in documents] == [f"chapter {index}\n" for index in range(count)]
    with pytest.raises(ValueError, match=f"more than {MAX_SOURCES}: put the files in one folder"):
        load_documents(",".join(["chapter-000.txt"] * (MAX_SOURCES + 1)))


def test_a_data_folder_without_documents_says_which_case(tmp_path):
    """A folder with no text file, and one whose only file is a .jsonl of no lines (before:
    "holds no ... files", though it held one)."""
    (tmp_path / "none").mkdir()
    (tmp_path / "none" / "notes.pdf").write_bytes(b"%PDF")
    with pytest.raises(ValueError, match=r"holds no \.txt/"):
        load_documents(str(tmp_path / "none"))
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "rows.jsonl").write_text("")
    with pytest.raises(ValueError, match=r"holds only empty \.txt/\.md/\.rst/\.py/\.jsonl files"):
        load_documents(str(tmp_path / "empty"))


@pytest.mark.parametrize("spec", ["no/such/place", "stdlib,,pydoc", "books"])
def test_bad_spec_names_the_source(spec, tmp_path):
    with pytest.raises(ValueError, match=re.escape(repr(spec))):
        prepare_data(spec, cache_dir=tmp_path)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            {"spec": None},
            "spec must be a data spec such as 'stdlib' or a corpus path, not NoneType",
        ),
        ({"val_tokens": 1.5}, "val_tokens must be an int, not 1.5"),
        ({"max_train_tokens": "8"}, "max_train_tokens must be an int or None, not '8'"),
        ({"vocab_size": True}, "vocab_size must be an int, not True"),
        ({"seed": None}, "seed must be an int, not None"),
        ({"val_seed": 2.0}, "val_seed must be an int or None, not 2.0"),
    ],
)
def test_prepare_data_names_an_argument_of_the_wrong_type(options, message, tmp_path):
    """``prepare_data(None)`` and ``val_tokens=1.5`` raised from deep inside (a split of None,
    a slice by a float): refused before any work, naming the argument."""
    with pytest.raises(TypeError, match=re.escape(f"prepare_data: {message}")):
        prepare_data(**{"spec": "stdlib", "cache_dir": tmp_path, **options})
    assert not (tmp_path / "tokens").exists()


def test_prepare_data_takes_a_path_and_numpy_integers(corpus, tmp_path):
    import numpy as np

    given = prepare_data(corpus, cache_dir=tmp_path, val_tokens=np.int64(50), vocab_size=300)
    plain = prepare_data(str(corpus), cache_dir=tmp_path, val_tokens=50, vocab_size=300)
    assert torch.equal(given.train, plain.train) and torch.equal(given.val, plain.val)


def test_stdlib_and_pydoc_sources_and_round_trip(tmp_path):
    stdlib = load_documents("stdlib")
    names = [document.name for document in stdlib]
    assert len(names) > 300 and "stdlib/json/decoder.py" in names
    assert not any("site-packages" in name or "/test/" in name for name in names)
    pydoc = load_documents("pydoc")
    assert len(pydoc) > 20 and "statement" in " ".join(doc.read() for doc in pydoc[:10]).lower()

    prepared = prepare_data(
        "stdlib,pydoc", cache_dir=tmp_path, max_train_tokens=20_000, val_tokens=2048
    )
    assert prepared.train.numel() == 20_000 and prepared.val.numel() == 2048
    assert len(prepared.tokenizer) == 4096
    text = dict(zip(names, stdlib, strict=True))["stdlib/json/decoder.py"].read()
    ids = prepared.tokenizer(text, add_special_tokens=False)["input_ids"]
    assert prepared.tokenizer.decode(ids) == text
    assert len(ids) < len(text) / 2.5  # BPE actually compresses code


def test_torchsrc_is_the_pinned_torch_package_python_files_without_tests():
    import torch

    root = Path(torch.__file__).parent
    documents = load_documents("torchsrc")
    names = [document.name for document in documents]
    on_disk = sorted(
        "torchsrc/" + path.relative_to(root).as_posix()
        for path in root.rglob("*.py")
        if not {"test", "tests", "__pycache__"} & set(path.relative_to(root).parts[:-1])
    )
    assert sorted(names) == on_disk and len(names) > 1000
    assert names == sorted(names, key=lambda name: name.split("/"))  # a stable order
    by_name = dict(zip(names, documents, strict=True))
    assert by_name["torchsrc/nn/modules/linear.py"].read() == (
        root / "nn" / "modules" / "linear.py"
    ).read_text(encoding="utf-8")


# -- Debian sources, on hand-built miniature packages -------------------------------------------
def _xdr_header() -> bytes:
    return b"X\n" + struct.pack(">iiii", 3, 0x040201, 0x030500, 5) + b"UTF-8"


def _xdr_chars(text: str | None) -> bytes:
    if text is None:
        return struct.pack(">ii", 9, -1)
    raw = text.encode()
    return struct.pack(">ii", 9 | (1 << 15), len(raw)) + raw


def _xdr_strings(texts: list[str | None]) -> bytes:
    return struct.pack(">ii", 16, len(texts)) + b"".join(_xdr_chars(text) for text in texts)


def _xdr_named_list(items: dict[str, bytes], names_symbol: bytes) -> bytes:
    """VECSXP with a names attribute; ``names_symbol`` is a SYMSXP or a REFSXP to one."""
    body = struct.pack(">ii", 19 | (1 << 9), len(items)) + b"".join(items.values())
    names = struct.pack(">i", 2 | (1 << 10)) + names_symbol + _xdr_strings(list(items))
    return body + names + struct.pack(">i", 254)


def _write_r_lazyload(folder: Path, vectors: dict[str, list[str | None]]) -> Path:
    blob, positions = b"", {}
    for name, lines in vectors.items():
        serialized = _xdr_header() + _xdr_strings(lines)
        entry = struct.pack(">I", len(serialized)) + zlib.compress(serialized)
        positions[name] = struct.pack(">iii", 13, 2, len(blob)) + struct.pack(">i", len(entry))
        blob += entry
    symbol = struct.pack(">i", 1) + _xdr_chars("names")
    reference = struct.pack(">i", (1 << 8) | 255)  # the first symbol again
    variables = _xdr_named_list(positions, symbol)
    index = _xdr_header() + _xdr_named_list({"variables": variables}, reference)
    folder.mkdir(parents=True)
    (folder / "Rdata.rdb").write_bytes(blob)
    (folder / "Rdata.rdx").write_bytes(gzip.compress(index))
    return folder / "Rdata.rdx"


def test_r_lazyload_reader_and_austen_chapters(tmp_path, monkeypatch):
    books = {
        "emma": ["EMMA", "", "CHAPTER I", "", "Emma was clever.", "CHAPTER II", "She smiled."],
        "persuasion": ["Persuasion", "Chapter 1", None, "Sir Walter read."],
    }
    package = tmp_path / "austen" / "usr/lib/R/site-library/janeaustenr/data"
    index = _write_r_lazyload(package, books)
    expected = {name: [line or "" for line in lines] for name, lines in books.items()}
    assert read_r_lazyload_strings(index) == expected

    monkeypatch.setenv("MLOCO_AUSTEN_DIR", str(tmp_path / "austen"))
    documents = {document.name: document.read() for document in load_documents("austen")}
    assert documents == {
        "austen/emma/000": "EMMA\n",
        "austen/emma/001": "CHAPTER I\n\nEmma was clever.\n",
        "austen/emma/002": "CHAPTER II\nShe smiled.\n",
        "austen/persuasion/000": "Persuasion\n",
        "austen/persuasion/001": "Chapter 1\n\nSir Walter read.\n",
    }


def _write_ztext(folder: Path, testament: str, books: list[str]) -> None:
    index, blocks = b"", b""
    for book in books:
        compressed = zlib.compress(book.encode())
        index += struct.pack("<III", len(blocks), len(compressed), len(book.encode()))
        blocks += compressed
    (folder / f"{testament}.bzs").write_bytes(index)
    (folder / f"{testament}.bzz").write_bytes(blocks)


def test_sword_reader_and_bible_chapters(tmp_path, monkeypatch):
    module = tmp_path / "bible" / "usr/share/sword/modules/texts/ztext/engWEB2015eb"
    module.mkdir(parents=True)
    genesis = (
        '<div type="book"/><chapter osisID="Gen.1" sID="Gen.1"/><w lemma="x">In</w> the '
        'beginning<note placement="foot">a footnote</note> God created. <div eID="g1" '
        'type="x-p"/><chapter eID="Gen.1"/><chapter osisID="Gen.2" sID="Gen.2"/>Rest'
        "<note>n</note>, then “light<note>m</note>.”"
        '<div eID="b1" type="book"/><div osisID="Exod" sID="b2" type="book"/><title>Exodus</title>'
        '<chapter osisID="Exod.1" sID="Exod.1"/>Names.'
    )
    _write_ztext(module, "ot", ['<milestone type="x-importer"/>', genesis])
    _write_ztext(module, "nt", ['<chapter osisID="John.1" sID="John.1"/><l>The Word.</l>'])
    expected = {
        "Gen.1": "In the beginning God created.\n",
        "Gen.2": "Rest, then “light.”\n",
        "Exod.1": "Names.\n",
        "John.1": "The Word.\n",
    }
    assert read_sword_ztext_chapters(module) == expected
    monkeypatch.setenv("MLOCO_BIBLE_DIR", str(tmp_path / "bible"))
    documents = load_documents("bible")
    assert [document.name for document in documents] == [
        "bible/Gen.1",
        "bible/Gen.2",
        "bible/Exod.1",
        "bible/John.1",
    ]


@pytest.mark.parametrize(
    ("source", "env", "package"),
    [
        ("austen", "MLOCO_AUSTEN_DIR", "r-cran-janeaustenr"),
        ("bible", "MLOCO_BIBLE_DIR", "sword-text-web"),
    ],
)
def test_missing_debian_source_says_how_to_get_it(source, env, package, tmp_path, monkeypatch):
    monkeypatch.setenv(env, str(tmp_path / "empty"))
    with pytest.raises(ValueError) as error:
        load_documents(source)
    message = str(error.value)
    assert f"apt-get download {package}" in message
    assert f"dpkg -x {package}_*.deb {tmp_path / 'empty'}" in message


# -- shards and batches -------------------------------------------------------------------------
def test_worker_shards_are_contiguous_disjoint_and_deterministic():
    tokens = torch.arange(103)
    shards = [worker_shard(tokens, worker, 4) for worker in range(4)]
    assert all(shard.numel() == 25 for shard in shards)
    assert torch.equal(torch.cat(shards), torch.arange(100))  # contiguous, disjoint, in order
    assert torch.equal(worker_shard(tokens, 2, 4), shards[2])
    with pytest.raises(ValueError, match="worker 4"):
        worker_shard(tokens, 4, 4)
    with pytest.raises(ValueError, match="cannot be split"):
        worker_shard(torch.arange(3), 0, 4)


def test_batch_stream_windows_and_resume():
    tokens = torch.arange(1000)
    stream = BatchStream(tokens, seq_len=10)
    first = stream.next_batch(3)
    assert first.dtype == torch.long and torch.equal(first, torch.arange(30).reshape(3, 10))
    stream.next_batch(2)
    state = stream.state_dict()
    assert state == {"position": 50}
    ahead = [stream.next_batch(4) for _ in range(3)]
    resumed = BatchStream(tokens, seq_len=10)
    resumed.load_state_dict(state)
    assert all(
        torch.equal(a, b)
        for a, b in zip(ahead, [resumed.next_batch(4) for _ in range(3)], strict=True)
    )
    assert torch.equal(BatchStream(tokens, 10, position=50).next_batch(4), ahead[0])


def test_batch_stream_exhaustion_message():
    stream = BatchStream(torch.arange(100), seq_len=8, position=80)
    with pytest.raises(DataExhausted, match=r"100 tokens.*position 80.*3 x 8.*24.*20 are left"):
        stream.next_batch(3)
    assert isinstance(DataExhausted("x"), ValueError)
    assert stream.next_batch(2).shape == (2, 8)  # a fitting request still works


def test_validation_batches_keep_last_partial_batch():
    val = torch.arange(53)
    batches = list(validation_batches(val, seq_len=5, batch_size=4))
    assert [tuple(batch.shape) for batch in batches] == [(4, 5), (4, 5), (2, 5)]
    assert torch.equal(torch.cat(batches).reshape(-1), torch.arange(50))
    limited = list(validation_batches(val, seq_len=5, batch_size=4, max_tokens=12))
    assert [tuple(batch.shape) for batch in limited] == [(2, 5)]


def test_evaluate_loss_matches_direct_float64_computation():
    model = build_model(model_config("micro", vocab_size=64), seed=3)
    model.train()
    val = torch.randint(0, 64, (5 * 12 + 7,), generator=torch.Generator().manual_seed(0))
    loss = evaluate_loss(model, val, seq_len=12, batch_size=2)
    assert model.training  # mode restored

    model.eval()
    nll_sum, count = 0.0, 0
    with torch.no_grad():
        for window in val[:60].reshape(5, 12):
            logits = model(input_ids=window[None]).logits[0].double()
            log_probs = torch.log_softmax(logits[:-1], dim=-1)
            nll_sum -= log_probs.gather(1, window[1:, None]).sum().item()
            count += 11
    assert loss == pytest.approx(nll_sum / count, rel=1e-6)
    assert loss == pytest.approx(evaluate_loss(model, val, seq_len=12, batch_size=5), rel=1e-6)


def test_docs_examples_run(tmp_path, monkeypatch):
    page = (Path(__file__).parents[1] / "docs" / "data.md").read_text()
    examples = re.findall(r"```python\n(.*?)```", page, flags=re.DOTALL)
    assert examples
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLOCO_CACHE", str(tmp_path / "cache"))
    for example in examples:
        exec(compile(example, "docs/data.md", "exec"), {})


def test_bounded_runs_cut_only_runs_longer_than_the_limit():
    """Text without a run of non-space characters longer than MAX_TRAINING_RUN is given to the
    trainer as it was (the built-in sources' tokenizers are unchanged); a longer run is sliced."""
    limit = tokenizer_module.MAX_TRAINING_RUN
    ordinary = "def f(x):\n    return x + 1\n" + "y" * limit + " end"
    assert list(tokenizer_module.bounded_runs(ordinary)) == [ordinary]
    assert list(tokenizer_module.bounded_runs("")) == [""]
    long = "head " + "x" * (2 * limit + 3) + " tail"
    pieces = list(tokenizer_module.bounded_runs(long))
    assert pieces == ["head ", "x" * limit, "x" * limit, "xxx", " tail"]
    assert "".join(pieces) == long


def test_a_megabyte_without_a_space_trains_a_tokenizer_in_bounded_time(tmp_path):
    """A data file holding 1 MB of one letter (a blob, padding): before, the BPE trainer took
    it as one word and ran for hours (256 KB: over two minutes), deaf to SIGTERM. The guard is
    a hang guard, far above the time it takes now."""
    script = (
        "from mergekit_loco.train.tokenizer import train_tokenizer\n"
        "t = train_tokenizer([['def f(x):\\n    return x\\n' * 100, 'x' * (1 << 20)]], 300)\n"
        "print(len(t))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert 257 < int(done.stdout.strip()) <= 300  # 256 bytes and EOS, and merges learned


def test_the_tokenizer_long_run_benchmark_prints_its_table():
    script = Path(__file__).parents[1] / "benchmarks" / "tokenizer_long_run.py"
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(script), "--sizes", "2000"], capture_output=True,
                          text=True, timeout=300, env=environment)  # fmt: skip
    assert done.returncode == 0, done.stderr
    header, row = done.stdout.splitlines()[1:3]
    assert header.split() == ["run", "length", "cut", "(s)", "whole", "(s)", "whole", "/", "cut"]
    assert row.split()[0] == "2,000" and float(row.split()[1]) > 0
