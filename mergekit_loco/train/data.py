"""Cached token streams and worker batches (the tokenizer: :mod:`mergekit_loco.train.tokenizer`).

Documents come from :mod:`mergekit_loco.train.sources` (a data spec such as ``stdlib``,
``pydoc,austen`` or a path). Documents are joined as
``doc EOS doc EOS ...``. Documents are ordered by ``sha256(seed, name)``; the first ones in that
order are held out whole for validation until ``val_tokens`` are reached, the rest form the
training stream, cut at ``max_train_tokens``. Worker ``r`` of ``R`` reads the ``r``-th of ``R``
equal contiguous slices of the training stream.
"""

from __future__ import annotations

import contextlib
import hashlib
import numbers
import os
from array import array
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from transformers import PreTrainedTokenizerBase

from mergekit_loco.io.atomic import staged_output
from mergekit_loco.train.documents import Document, fingerprint, hash_order
from mergekit_loco.train.sources import cache_root, load_documents
from mergekit_loco.train.tokenizer import (
    CACHE_FORMAT,
    batch_encoder,
    cache_key,
    load_or_train_tokenizer,
    load_tokenizer,
    tokenizer_fingerprint,
)

_ENCODE_CHUNK = 64  # documents per encode_batch call
ENCODE_BATCH_CHARS = 2**20  # characters per encode_batch call (bounds its memory)


class DataExhausted(ValueError):
    """A worker's shard has fewer tokens left than the batch it asked for."""


class NotEnoughData(ValueError):
    """The data holds fewer tokens than the split asks for; ``part``: ``"validation"`` (fewer
    than ``val_tokens`` in all) or ``"training"`` (fewer than ``max_train_tokens`` left)."""

    def __init__(self, message: str, part: str):
        super().__init__(message)
        self.part = part


@dataclass
class PreparedData:
    """Token streams ready for training: 1-D int64 ``train`` and held-out ``val`` ids."""

    tokenizer: PreTrainedTokenizerBase
    train: torch.Tensor
    val: torch.Tensor
    eos_id: int
    description: str
    val_documents: tuple[str, ...] = ()
    """Names of the documents held out for validation, in the order their tokens appear."""
    source: str = ""
    """sha256 of the documents (names, sizes and times) and the tokenizer: what a resumed run
    must find unchanged."""


# -- token streams ------------------------------------------------------------------------------
def integer_argument(argument: str, value: Any, optional: bool = False) -> Any:
    """``value`` as an int (None kept where ``optional``); TypeError naming ``argument`` for
    anything but an integer (a bool, 1.5, "8")."""
    if value is None and optional:
        return None
    if not isinstance(value, numbers.Integral) or isinstance(value, bool):
        expected = "an int or None" if optional else "an int"
        raise TypeError(f"prepare_data: {argument} must be {expected}, not {value!r}")
    return int(value)


def prepare_data(
    spec: str = "stdlib",
    tokenizer: str | Path | PreTrainedTokenizerBase | None = None,
    cache_dir: Path | None = None,
    max_train_tokens: int | None = None,
    val_tokens: int = 65536,
    vocab_size: int = 4096,
    seed: int = 0,
    val_seed: int | None = None,
) -> PreparedData:
    """Tokenize ``spec`` into ``train`` and ``val`` streams (``doc EOS doc EOS ...``), cached.

    Documents in ``sha256(seed, name)`` order: whole documents go to validation until it holds
    ``val_tokens`` (then cut to exactly that), the following ones to training until it holds
    ``max_train_tokens`` (then cut; None takes all). No held-out document's token is trained on.
    ``val_seed`` (default ``seed``) orders the documents for validation only: a fixed
    validation set shared by every ``seed``, which still orders the training documents.
    ``spec`` is a str (or a path); the counts and seeds are integers (numpy's too): else
    TypeError naming the argument.
    """
    if not isinstance(spec, str | os.PathLike):
        raise TypeError(
            "prepare_data: spec must be a data spec such as 'stdlib' or a corpus path, not "
            f"{type(spec).__name__}"
        )
    spec = os.fspath(spec)
    max_train_tokens = integer_argument("max_train_tokens", max_train_tokens, optional=True)
    val_tokens = integer_argument("val_tokens", val_tokens)
    vocab_size = integer_argument("vocab_size", vocab_size)
    seed = integer_argument("seed", seed)
    val_seed = integer_argument("val_seed", val_seed, optional=True)
    if val_tokens < 0 or (max_train_tokens is not None and max_train_tokens < 1):
        raise ValueError(
            f"need val_tokens >= 0 and max_train_tokens >= 1, got {val_tokens}, {max_train_tokens}"
        )
    cache_dir = cache_dir or cache_root()
    documents = load_documents(spec)
    if tokenizer is None:
        tokenizer_object = load_or_train_tokenizer(spec, vocab_size, cache_dir, documents)
        tokenizer_name = f"byte-level BPE {len(tokenizer_object)}"
    elif isinstance(tokenizer, PreTrainedTokenizerBase):
        tokenizer_object = tokenizer
        tokenizer_name = tokenizer.name_or_path or f"byte-level BPE {len(tokenizer)}"
    else:
        tokenizer_object = load_tokenizer(tokenizer)
        tokenizer_name = str(tokenizer)
    eos_id = tokenizer_object.eos_token_id
    if eos_id is None:
        raise ValueError(f"tokenizer {tokenizer_name!r} defines no EOS token")
    documents_digest, tokenizer_digest = (
        fingerprint(documents),
        tokenizer_fingerprint(tokenizer_object),
    )
    source = hashlib.sha256(f"{documents_digest}\0{tokenizer_digest}".encode()).hexdigest()
    key = cache_key(
        CACHE_FORMAT,
        documents_digest,
        tokenizer_digest,
        max_train_tokens,
        val_tokens,
        seed,
        *(() if val_seed is None else (val_seed,)),
    )
    path = cache_dir / "tokens" / f"{key[:24]}.pt"
    cached = load_token_cache(path)
    if cached is None:
        cached = _tokenize_split(
            documents, tokenizer_object, eos_id, spec, max_train_tokens, val_tokens, seed, val_seed
        )
        with staged_output(path, "token cache", replace=True, file=True) as staging:
            torch.save(cached, staging / path.name)
    description = (
        f"{spec}: {cached['documents']} documents ({len(cached['val_documents'])} held out), "
        f"{cached['train'].numel():,} train and {cached['val'].numel():,} val tokens, "
        f"tokenizer {tokenizer_name}"
    )
    return PreparedData(
        tokenizer=tokenizer_object,
        train=cached["train"].long(),
        val=cached["val"].long(),
        eos_id=eos_id,
        description=description,
        val_documents=tuple(cached["val_documents"]),
        source=source,
    )


def token_digest(train: torch.Tensor, val: torch.Tensor) -> str:
    """sha256 of the two lengths and the train and validation token ids as stored (int32),
    which the token cache holds to prove its tokens (torch.load checks no checksum of the data
    it reads)."""
    digest = hashlib.sha256(f"{train.numel()} {val.numel()}\n".encode())
    for tokens in (train, val):
        digest.update(tokens.contiguous().numpy().tobytes())
    return digest.hexdigest()


def load_token_cache(path: Path) -> dict | None:
    """The token cache at ``path``, or None if there is none or it does not load (cut, not
    ours, a token changed on disk, written before it held its digest): it is then rebuilt and
    replaced."""
    try:
        cached = torch.load(path, weights_only=True)
        ok = isinstance(cached, dict) and all(
            isinstance(cached.get(k), torch.Tensor) and cached[k].dtype == torch.int32
            for k in ("train", "val")
        )
        ok = ok and isinstance(cached.get("documents"), int)
        ok = ok and isinstance(cached.get("val_documents"), list)
        ok = ok and cached.get("digest") == token_digest(cached["train"], cached["val"])
    except FileNotFoundError:
        return None
    except Exception:  # noqa: BLE001 - any failure to load a cache means: rebuild it
        return None
    return cached if ok else None


def _tokenize_split(
    documents: Sequence[Document],
    tokenizer: PreTrainedTokenizerBase,
    eos_id: int,
    spec: str,
    max_train_tokens: int | None,
    val_tokens: int,
    seed: int,
    val_seed: int | None = None,
) -> dict:
    order = hash_order(documents, str(seed if val_seed is None else val_seed))
    val = array("q")
    train = array("q")

    def still_needed() -> int | None:  # caps what is tokenized: val first, then train
        if len(val) < val_tokens:
            return val_tokens - len(val)
        return None if max_train_tokens is None else max(max_train_tokens - len(train), 0)

    encoded = _encoded_documents(order, tokenizer, eos_id, still_needed)
    held_out = 0
    while len(val) < val_tokens:
        ids = next(encoded, None)
        if ids is None:
            raise NotEnoughData(
                f"data {spec!r} has only {len(val):,} tokens in all, fewer than the "
                f"{val_tokens:,} validation tokens requested",
                "validation",
            )
        val.extend(ids)
        held_out += 1
    if val_seed is not None:  # the rest in the seed's own order
        rest = hash_order(order[held_out:], str(seed))
        encoded = _encoded_documents(rest, tokenizer, eos_id, still_needed)
    for ids in encoded:
        train.extend(ids)
        if max_train_tokens is not None and len(train) >= max_train_tokens:
            break
    if not train or (max_train_tokens is not None and len(train) < max_train_tokens):
        raise NotEnoughData(
            f"data {spec!r} has {len(train):,} training tokens ({len(documents) - held_out} "
            f"documents after holding out {held_out} for {val_tokens:,} validation tokens); "
            f"{max_train_tokens or 1:,} requested",
            "training",
        )
    tokens = {
        "train": _int32_tensor(train[:max_train_tokens]),
        "val": _int32_tensor(val[:val_tokens]),
    }
    return {
        **tokens,
        "documents": len(documents),
        "val_documents": [document.name for document in order[:held_out]],
        "digest": token_digest(tokens["train"], tokens["val"]),
    }


def _int32_tensor(ids: array) -> torch.Tensor:
    if not ids:
        return torch.zeros(0, dtype=torch.int32)
    return torch.frombuffer(ids, dtype=torch.int64).to(torch.int32)


def _encoded_documents(
    documents: Sequence[Document],
    tokenizer: PreTrainedTokenizerBase,
    eos_id: int,
    still_needed: Callable[[], int | None],
) -> Iterator[list[int]]:
    """Token ids of each document followed by EOS, encoded lazily.

    Small documents are encoded in batches of up to :data:`_ENCODE_CHUNK` documents and
    :data:`ENCODE_BATCH_CHARS` characters; a document of several pieces is encoded piece by
    piece and cut (without EOS) as soon as it holds ``still_needed()`` ids, so no more text is
    tokenized than the caller will keep (``None``: no cap).
    """
    encode = batch_encoder(tokenizer)
    position = 0
    while position < len(documents):
        batch, first_pieces, chars = [], [], 0
        while position < len(documents) and len(batch) < _ENCODE_CHUNK:
            pieces = iter(documents[position].chunks())
            first = next(pieces, "")
            batch.append(pieces)
            first_pieces.append(first)
            position += 1
            chars += len(first)
            if chars >= ENCODE_BATCH_CHARS:
                break
        for pieces, ids in zip(batch, encode(first_pieces), strict=True):
            cap = still_needed()
            for piece in pieces:
                if cap is not None and len(ids) >= cap:
                    break
                ids.extend(encode([piece])[0])
            yield ids if cap is not None and len(ids) >= cap else [*ids, eos_id]


def worker_shard(tokens: torch.Tensor, worker: int, workers: int) -> torch.Tensor:
    """Worker ``r``'s contiguous slice ``tokens[r * n : (r + 1) * n]``, ``n = len // workers``."""
    if not 0 <= worker < workers:
        raise ValueError(f"worker {worker} is out of range for {workers} workers")
    size = tokens.numel() // workers
    if size == 0:
        raise ValueError(f"{tokens.numel()} tokens cannot be split among {workers} workers")
    return tokens[worker * size : (worker + 1) * size]


def worker_slice(
    tokens: torch.Tensor, worker: int, workers: int, bounds: list[int] | None = None
) -> torch.Tensor:
    """Worker ``r``'s tokens in a run whose budget grew on resume: its :func:`worker_shard` of
    each segment ``tokens[b_{k-1} : b_k]`` of ``bounds`` (``b_0 = 0``), concatenated. An
    extension appends a segment, so every token a worker was given keeps its place (its saved
    position stays valid) and the new tokens follow. One bound (or None): ``worker_shard``."""
    if bounds is None or len(bounds) <= 1:
        return worker_shard(tokens, worker, workers)
    starts = [0, *bounds[:-1]]
    return torch.cat(
        [worker_shard(tokens[a:b], worker, workers) for a, b in zip(starts, bounds, strict=True)]
    )


class BatchStream:
    """Consecutive, non-overlapping ``[batch, seq_len]`` windows of a shard, from ``position``.

    Inputs double as labels (the model shifts them). ``state_dict`` / ``load_state_dict``
    resume the stream exactly.
    """

    def __init__(self, tokens: torch.Tensor, seq_len: int, position: int = 0):
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        self.tokens = tokens
        self.seq_len = seq_len
        self.position = 0
        self.load_state_dict({"position": position})

    @property
    def tokens_left(self) -> int:
        return self.tokens.numel() - self.position

    def next_batch(self, batch_size: int) -> torch.Tensor:
        """The next ``batch_size * seq_len`` tokens as a LongTensor ``[batch_size, seq_len]``."""
        needed = batch_size * self.seq_len
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if needed > self.tokens_left:
            raise DataExhausted(
                f"data shard of {self.tokens.numel():,} tokens is exhausted: at position "
                f"{self.position:,} a batch of {batch_size} x {self.seq_len} needs {needed:,} "
                f"tokens but {self.tokens_left:,} are left (use more data or fewer steps)"
            )
        window = self.tokens[self.position : self.position + needed]
        self.position += needed
        return window.reshape(batch_size, self.seq_len).to(torch.long, copy=True)

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        position = int(state["position"])
        if not 0 <= position <= self.tokens.numel():
            raise ValueError(f"position {position} lies outside a shard of {self.tokens.numel()}")
        self.position = position


def validation_batches(
    val: torch.Tensor, seq_len: int, batch_size: int, max_tokens: int | None = None
) -> Iterator[torch.Tensor]:
    """Consecutive ``[<= batch_size, seq_len]`` windows of ``val[:max_tokens]``.

    A trailing remainder shorter than ``seq_len`` is dropped; the last batch may be smaller.
    """
    usable = val.numel() if max_tokens is None else min(max_tokens, val.numel())
    windows = usable // seq_len
    if windows == 0:
        raise ValueError(f"validation needs >= seq_len={seq_len} tokens, has {usable}")
    rows = val[: windows * seq_len].reshape(windows, seq_len)
    for start in range(0, windows, batch_size):
        yield rows[start : start + batch_size].long()


def evaluate_loss(
    model: torch.nn.Module,
    val: torch.Tensor,
    seq_len: int,
    batch_size: int = 16,
    max_tokens: int | None = None,
    device: str | torch.device = "cpu",
    on_batch: Callable[[int], None] | None = None,
) -> float:
    """Token-weighted mean NLL: sum over windows of -log p(x_t+1 | x_<=t) / predicted tokens.

    Eval mode and no grad; bf16 autocast on CUDA only. The model's train/eval mode is restored.
    ``on_batch(windows)`` is called after each batch is scored (a progress bar).
    """
    if seq_len < 2:
        raise ValueError(f"evaluating needs seq_len >= 2 (one predicted token), got {seq_len}")
    device = torch.device(device)
    autocast = (
        torch.autocast("cuda", dtype=torch.bfloat16)
        if device.type == "cuda"
        else contextlib.nullcontext()
    )
    was_training = model.training
    model.eval()
    total_nll, predicted = 0.0, 0
    try:
        with torch.no_grad():
            for batch in validation_batches(val, seq_len, batch_size, max_tokens):
                batch = batch.to(device)
                with autocast:
                    logits = model(input_ids=batch).logits
                targets = batch[:, 1:]
                nll = F.cross_entropy(
                    logits[:, :-1].float().reshape(-1, logits.shape[-1]),
                    targets.reshape(-1),
                    reduction="sum",
                )
                total_nll += nll.item()
                predicted += targets.numel()
                if on_batch is not None:
                    on_batch(batch.shape[0])
    finally:
        model.train(was_training)
    return total_nll / predicted
