"""The local byte-level BPE tokenizer: trained on a data spec's documents, cached, and loaded
(also a user's tokenizer folder, checked first: never downloaded, never running its code).

``<|endoftext|>`` is the only special token (EOS, BOS and padding).
"""

from __future__ import annotations

import hashlib
import json
import re
import tempfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)

from mergekit_loco.io.atomic import OutputExistsError, staged_output
from mergekit_loco.io.hf import NO_REMOTE_CODE, check_hf_folder
from mergekit_loco.train.documents import Document, fingerprint, hash_order
from mergekit_loco.train.sources import cache_root, load_documents

EOS_TOKEN = "<|endoftext|>"
TOKENIZER_TRAIN_CHARS = 4_000_000
CACHE_FORMAT = 2  # bump whenever a change alters the tokenizer or the token streams
#: The longest run of non-space characters the BPE trainer is given whole: its time grows
#: faster than the square of a word's length (a 256 KB run of one letter took minutes, 1 MB
#: hours, and no signal stopped it), so a longer run is given in slices of this length. No
#: built-in source holds a run of even 200 (format 2: the first with the cut).
MAX_TRAINING_RUN = 256
LONG_RUN = re.compile(rf"\S{{{MAX_TRAINING_RUN + 1},}}")
#: The files that make a folder hold a Hugging Face tokenizer (one of them suffices).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def train_tokenizer(
    documents: Iterable[Iterable[str]],
    vocab_size: int = 4096,
    max_chars: int = TOKENIZER_TRAIN_CHARS,
    split_like: PreTrainedTokenizerBase | None = None,
) -> PreTrainedTokenizerFast:
    """Byte-level BPE (GPT-2 pre-tokenization) trained on the first ``max_chars`` characters of
    ``documents`` (each an iterable of text pieces, e.g. ``Document.chunks()``); with
    ``split_like``, its normalizer, pre-tokenizer and decoder instead (a byte-level one).

    ``<|endoftext|>`` is the only special token and serves as EOS, BOS and padding.
    """
    if vocab_size < 257:
        raise ValueError(f"vocab_size must be >= 257 (256 bytes + EOS), got {vocab_size}")

    def sample() -> Iterator[str]:
        budget = max_chars
        for pieces in documents:
            for text in pieces:
                if budget <= 0:
                    return
                yield from bounded_runs(text[:budget])
                budget -= len(text)

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    if split_like is not None:
        template = split_like.backend_tokenizer
        backend.normalizer = template.normalizer
        backend.pre_tokenizer = template.pre_tokenizer
        backend.decoder = template.decoder
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(sample(), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=EOS_TOKEN,
        bos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        model_max_length=2**62,
    )


def bounded_runs(text: str) -> Iterator[str]:
    """``text`` in pieces in which no run of non-space characters is longer than
    :data:`MAX_TRAINING_RUN`: ``text`` itself where it holds no longer run; else the text
    between the long runs, and each long run in slices of that length."""
    start = 0
    for match in LONG_RUN.finditer(text):
        if match.start() > start:
            yield text[start : match.start()]
        for begin in range(match.start(), match.end(), MAX_TRAINING_RUN):
            yield text[begin : min(begin + MAX_TRAINING_RUN, match.end())]
        start = match.end()
    if start < len(text) or not text:
        yield text[start:]


def load_or_train_tokenizer(
    data_spec: str,
    vocab_size: int = 4096,
    cache_dir: Path | None = None,
    documents: Sequence[Document] | None = None,
    split_like: PreTrainedTokenizerBase | None = None,
) -> PreTrainedTokenizerFast:
    """The BPE tokenizer of ``data_spec``, trained once and then read from the cache.

    Keyed by (vocab size, document names and stamps, ``split_like``'s :func:`splitting`);
    stored as a Hugging Face tokenizer folder ``<cache_dir>/tokenizers/bpe<vocab>-<key>``.
    """
    documents = load_documents(data_spec) if documents is None else documents
    split = () if split_like is None else (splitting(split_like),)
    key = cache_key(CACHE_FORMAT, vocab_size, fingerprint(documents), *split)
    folder = (cache_dir or cache_root()) / "tokenizers" / f"bpe{vocab_size}-{key[:16]}"
    if not (folder / "tokenizer.json").is_file():
        texts = (doc.chunks() for doc in hash_order(documents, "tokenizer"))
        tokenizer = train_tokenizer(texts, vocab_size, split_like=split_like)
        try:
            with staged_output(folder, "tokenizer cache") as staging:
                tokenizer.save_pretrained(staging)
        except (OSError, OutputExistsError):  # another process (a parallel sweep's cell, a
            # torchrun rank) finished first: its copy, keyed by the same documents, is identical
            if not (folder / "tokenizer.json").is_file():
                raise
    return load_tokenizer(folder)


#: The files a Hugging Face tokenizer folder is read from (one of them at least).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model",
                   "vocab.txt")  # fmt: skip


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """A Hugging Face tokenizer from a local folder (never downloads, never runs its code:
    a folder asking for custom code, or with a file leading outside it, is refused)."""
    folder = check_hf_folder(path, "tokenizer")
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise ValueError(
            f"tokenizer {str(path)!r} holds no tokenizer file (one of {', '.join(TOKENIZER_FILES)})"
        )
    try:
        return AutoTokenizer.from_pretrained(folder, **NO_REMOTE_CODE)
    except (OSError, ValueError) as error:
        raise ValueError(f"tokenizer {str(path)!r} cannot be loaded: {error}") from error


def as_saved_beside(
    tokenizer: PreTrainedTokenizerBase, model_config: PretrainedConfig
) -> PreTrainedTokenizerBase:
    """``tokenizer`` as ``AutoTokenizer.from_pretrained`` reads it back from a folder that holds
    it beside ``model_config``'s config.json: the tokenizer a run trains with, so that its final/
    folder (and any merge of it) reloads to exactly that tokenizer.

    transformers picks the class by the config's model_type for some types, whatever
    tokenizer_config.json names: a qwen2 folder loads as Qwen2Tokenizer, which rebuilds its own
    normalizer and pre-tokenizer around the saved vocabulary and merges (a BPE trained with
    GPT-2's pre-tokenizer then splits text differently, losslessly). A reload that loses text
    (:data:`ROUND_TRIP_TEXT` reads back otherwise than through ``tokenizer``: a Metaspace
    tokenizer rebuilt as Qwen2Tokenizer drops its spaces) is a ``ValueError``. The result keeps
    ``tokenizer.name_or_path``.
    """
    with tempfile.TemporaryDirectory(prefix="mloco-tokenizer-") as folder:
        model_config.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        reloaded = load_tokenizer(folder)
    before, after = _round_trip(tokenizer), _round_trip(reloaded)
    if after != before:
        raise ValueError(
            f"tokenizer {tokenizer.name_or_path or '(the BPE trained on --data)'}: a "
            f"{model_config.model_type} model's folder reloads it as {type(reloaded).__name__}, "
            f"which reads {ROUND_TRIP_TEXT!r} back as {after!r}; pass --tokenizer one made for "
            f"{model_config.model_type}, or --model another model_type"
        )
    reloaded.name_or_path = tokenizer.name_or_path
    return reloaded


def tokenizer_for_model(
    data_spec: str, vocab_size: int, model_config: PretrainedConfig
) -> PreTrainedTokenizerBase:
    """The BPE of ``data_spec`` a run of ``model_config``'s model trains with: trained with the
    split (:func:`splitting`) that model's folder reloads it with (:func:`as_saved_beside`):
    GPT-2's byte-level split for most model types, Qwen2's for qwen2, so that the merges are
    learned on the pieces the run encodes."""
    tokenizer = load_or_train_tokenizer(data_spec, vocab_size)
    rebuilt = as_saved_beside(tokenizer, model_config)
    if splitting(rebuilt) == splitting(tokenizer):
        return tokenizer
    return load_or_train_tokenizer(data_spec, vocab_size, split_like=rebuilt)


def splitting(tokenizer: PreTrainedTokenizerBase) -> str:
    """How ``tokenizer`` cuts text before its model: its backend's normalizer, pre-tokenizer
    and decoder, as JSON."""
    settings = json.loads(tokenizer.backend_tokenizer.to_str())
    return json.dumps([settings.get(k) for k in ("normalizer", "pre_tokenizer", "decoder")])


#: Text whose round trip (:func:`_round_trip`) shows a tokenizer dropping or changing characters.
ROUND_TRIP_TEXT = "def f(x):\n    return  x\t+ 1\n\ncafé 中文 😀"


def _round_trip(tokenizer: PreTrainedTokenizerBase, text: str = ROUND_TRIP_TEXT) -> str:
    """``decode(encode(text))``, without special tokens or clean-up."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return tokenizer.decode(ids, clean_up_tokenization_spaces=False)


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    text = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab()))
    return hashlib.sha256(f"{type(tokenizer).__name__}\0{text}".encode()).hexdigest()


def batch_encoder(tokenizer: PreTrainedTokenizerBase) -> Callable[[list[str]], list[list[int]]]:
    """texts -> token ids, without special tokens, truncation or padding."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return lambda texts: tokenizer(texts, add_special_tokens=False)["input_ids"]
    backend = Tokenizer.from_str(backend.to_str())  # a private copy: settings changed below
    backend.no_truncation()
    backend.no_padding()
    return lambda texts: [
        encoding.ids for encoding in backend.encode_batch(texts, add_special_tokens=False)
    ]


def cache_key(*parts) -> str:
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()
