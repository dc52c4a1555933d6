"""Held-out loss of checkpoints: token-weighted NLL (nats per predicted token) and perplexity.

The held-out tokens are those training holds out (:func:`mergekit_loco.train.data.prepare_data`):
the first documents of the data in ``sha256(seed, name)`` order, cut at ``tokens``. With
``tokens`` at most the training run's ``val_tokens`` and the run's ``seed``, no evaluated token
was trained on. ``loss = sum_t -log p(x_t+1 | x_<=t) / predicted tokens`` over windows of
``seq_len`` tokens (``seq_len - 1`` predictions each; a trailing partial window is dropped).
"""

from __future__ import annotations

import functools
import hashlib
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from transformers import PreTrainedModel

from mergekit_loco.compare.stats import Spread, spread
from mergekit_loco.console import stderr_progress
from mergekit_loco.device import resolve_device
from mergekit_loco.io import open_checkpoint
from mergekit_loco.io.files import MAX_JSON_BYTES, UnsafeInputError, read_json, read_limited, shown
from mergekit_loco.io.hf import check_hf_folder
from mergekit_loco.run_layout import CONFIG, FINAL
from mergekit_loco.train.data import NotEnoughData, evaluate_loss, prepare_data
from mergekit_loco.train.diloco import is_int
from mergekit_loco.train.model import check_seq_len, load_pretrained
from mergekit_loco.train.sources import BUILTIN_SOURCES, split_sources
from mergekit_loco.train.tokenizer import TOKENIZER_FILES, load_tokenizer


@dataclass(frozen=True)
class Evaluation:
    """The loss of ``model`` on the held-out ``tokens`` predictions of ``data``."""

    model: str
    data: str
    tokens: int
    loss: float
    #: which of ``val_sets`` disjoint validation sets (0: the first, the only one by default).
    val_set: int = 0

    @property
    def perplexity(self) -> float:
        """``exp(loss)``; ``inf`` where that overflows a float (loss above ~709.78)."""
        try:
            return math.exp(self.loss)
        except OverflowError:
            return math.inf

    def record(self) -> dict:
        """The result as strict JSON values: an infinite perplexity is ``None`` (null)."""
        perplexity = self.perplexity if math.isfinite(self.perplexity) else None
        return {"model": self.model, "data": self.data, "val_set": self.val_set,
                "tokens": self.tokens, "loss": self.loss,
                "perplexity": perplexity}  # fmt: skip


def load_model(
    path: str | Path, device: str | torch.device = "cpu", config_folder: str | Path | None = None
) -> PreTrainedModel:
    """A causal LM from a Hugging Face folder or a ``.safetensors`` file with ``config.json``
    beside it, or in ``config_folder`` (sharded folders too), in float32, in eval mode (checked
    as hostile input: :func:`~mergekit_loco.train.model.load_pretrained`)."""
    model = load_pretrained(path, config_folder=config_folder)
    return model.to(device=device, dtype=torch.float32).eval()


def model_folders(model: str | Path, tokenizer: str | Path | None = None) -> tuple[Path, Path]:
    """``(config folder, tokenizer folder)`` of ``model``: the folder of its weights, which must
    hold ``config.json`` and a tokenizer; ``tokenizer`` (a folder) for the tokenizer, and for
    the config too when the weights have none beside them and it holds one (a merge written as
    one ``.safetensors`` file, scored with the tokenizer of the model it came from). Whatever is
    still missing is one error saying how to supply it."""
    with open_checkpoint(model) as reader:
        beside = reader.config_dir
    given = check_hf_folder(tokenizer, "tokenizer") if tokenizer is not None else None
    has_config = (beside / "config.json").is_file()
    config = beside if has_config or given is None else given
    has_tokenizer = given is not None or any((beside / n).is_file() for n in TOKENIZER_FILES)
    held = {"config.json": (config / "config.json").is_file(), "tokenizer": has_tokenizer}
    missing = tuple(name for name, present in held.items() if not present)
    if missing:
        raise ValueError(
            f"{shown(model)}: no {' and no '.join(missing)} beside the weights (in "
            f"{shown(beside)}); {MISSING_ADVICE[missing]}"
        )
    return config, given or check_hf_folder(beside, "tokenizer")


#: What to do when a model's config.json, tokenizer or both are missing (:func:`model_folders`).
MISSING_ADVICE = {
    ("config.json", "tokenizer"): "merge to a folder instead (-o DIR: it gets the base's config "
    "and tokenizer), or copy the config.json and tokenizer files of the model it came from beside "
    "it, or pass --tokenizer FOLDER of that model (its config.json is used too)",
    ("config.json",): "merge to a folder instead (-o DIR), or copy the config.json of the model "
    "it came from beside it, or pass --tokenizer FOLDER of that model (its config.json is used "
    "too)",
    ("tokenizer",): "pass --tokenizer FOLDER (the tokenizer of the model it came from), or copy "
    "its tokenizer files beside it",
}


def tokenizer_folder(model: str | Path, tokenizer: str | Path | None = None) -> Path:
    """``tokenizer`` if given, else the folder of ``model``'s weights, which must hold one
    (:func:`model_folders`)."""
    return model_folders(model, tokenizer)[1]


def held_out_tokens(data: str, tokenizer: str | Path, tokens: int, seed: int = 0) -> torch.Tensor:
    """The first ``tokens`` held-out token ids of ``data`` (1-D int64), as training splits it."""
    fingerprint = _file_digest(Path(tokenizer) / "tokenizer.json")
    return _held_out(data, str(tokenizer), fingerprint, tokens, seed)


@functools.lru_cache(maxsize=32)
def _held_out(data: str, tokenizer: str, fingerprint: str, tokens: int, seed: int) -> torch.Tensor:
    """Cached by tokenizer content, so copies of one tokenizer (merge outputs) tokenize once."""
    _check_tokenizer(Path(tokenizer))
    prepared = prepare_data(
        data, tokenizer=tokenizer, max_train_tokens=1, val_tokens=tokens, seed=seed
    )
    return prepared.val


def _check_tokenizer(folder: Path) -> None:
    """Refuse, naming its file, a tokenizer folder transformers cannot load; it raises all kinds
    of errors on a malformed file (``KeyError: 'added_tokens'`` for a ``tokenizer.json`` of
    ``{}``)."""
    try:
        load_tokenizer(folder)
    except ValueError:  # already one line naming the tokenizer
        raise
    except Exception as error:
        file = next((folder / n for n in TOKENIZER_FILES if (folder / n).is_file()), folder)
        cause = (str(error).strip().splitlines() or [""])[0][:200]
        raise ValueError(
            f"{shown(file)}: not a tokenizer transformers can read ({type(error).__name__}: "
            f"{cause})"
        ) from None


def _check_vocab(
    ids: torch.Tensor, tokenizer: str | Path, model: PreTrainedModel, path: str | Path
) -> None:
    """Refuse token ids the model's embedding has no row for (a tokenizer of another model)."""
    vocab_size = model.get_input_embeddings().num_embeddings
    if ids.numel() and int(ids.max()) >= vocab_size:
        raise ValueError(
            f"{shown(tokenizer)}: the tokenizer's ids reach {int(ids.max())}, beyond the "
            f"vocab_size {vocab_size} of model {shown(path)}"
        )


def _file_digest(path: Path) -> str:
    if not path.is_file():
        return str(path)
    return hashlib.sha256(read_limited(path, MAX_JSON_BYTES, "tokenizer file")).hexdigest()


def predicted_tokens(tokens: int, seq_len: int) -> int:
    """Predictions in ``tokens`` held-out tokens: ``(tokens // seq_len) * (seq_len - 1)``."""
    return (tokens // seq_len) * (seq_len - 1)


def loss_on(
    model: PreTrainedModel,
    tokens: torch.Tensor,
    seq_len: int,
    batch_size: int = 16,
    device: str | torch.device = "cpu",
    on_batch: Callable[[int], None] | None = None,
) -> float:
    """Token-weighted mean NLL of ``model`` on the 1-D token ids ``tokens``; ``on_batch(windows)``
    after each batch."""
    return evaluate_loss(model, tokens, seq_len, batch_size, None, device, on_batch)


def eval_progress(enabled: bool) -> Progress:
    """A bar per evaluation (model, dataset, validation set) over its windows, on stderr, drawn
    only on a terminal and cleared when done; what it evaluates comes last, cut to the width."""
    return stderr_progress(
        enabled,
        TextColumn("[bold]evaluating"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("windows"),
        TimeElapsedColumn(),
        TextColumn("{task.description}"),
    )


def check_request(
    models: Sequence[str | Path], datasets: Sequence[str], tokens: int, seq_len: int, val_sets: int
) -> None:
    """Refuse an evaluation that names no model or no dataset (or one path or name where a
    list belongs), or tokens, windows or sets too few."""
    for name, given in (("models", models), ("datasets", datasets)):
        if isinstance(given, str | Path):
            raise TypeError(f"{name}: a list ([{str(given)!r}, ...]), not one {name[:-1]}")
    for name, count in (("tokens", tokens), ("seq_len", seq_len), ("val_sets", val_sets)):
        if not is_int(count):
            raise TypeError(f"{name} must be an int, not {count!r}")
    if not models or not datasets:
        raise ValueError("give at least one model and one dataset (--data)")
    if tokens < 1:
        raise ValueError(f"--tokens must be >= 1, got {tokens}")
    if seq_len < 2:
        raise ValueError(f"--seq-len must be >= 2, got {seq_len}")
    if val_sets < 1:
        raise ValueError(f"--val-sets must be >= 1, got {val_sets}")


def evaluate_models(
    models: Sequence[str | Path],
    datasets: Sequence[str],
    tokens: int = 65536,
    seq_len: int = 128,
    tokenizer: str | Path | None = None,
    seed: int = 0,
    batch_size: int = 16,
    device: str | torch.device = "cpu",
    val_sets: int = 1,
    progress: bool = False,
) -> list[Evaluation]:
    """The held-out loss of every model on every dataset (model-major order). With
    ``val_sets = K`` each dataset's first ``K * tokens`` held-out tokens are cut into K disjoint
    validation sets of ``tokens`` each, evaluated one by one: their spread
    (:func:`val_set_spreads`) is the noise of a ``tokens``-token evaluation. ``progress``: a
    bar per evaluation on a terminal (:func:`eval_progress`)."""
    check_request(models, datasets, tokens, seq_len, val_sets)
    if not is_int(batch_size) or batch_size < 1:
        raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
    device = resolve_device(device)
    results = []
    with eval_progress(progress) as bars:
        for path in models:
            config_folder, folder = model_folders(path, tokenizer)
            model = load_model(path, device, config_folder)
            check_seq_len(model.config, seq_len, path)
            for data in datasets:
                try:
                    held_out = held_out_tokens(data, folder, tokens * val_sets, seed)
                except NotEnoughData as error:
                    raise ValueError(f"{error}; lower --tokens (or --val-sets)") from None
                _check_vocab(held_out, folder, model, path)
                for val_set, ids in enumerate(held_out.split(tokens)):
                    if ids.numel() < seq_len:
                        raise ValueError(
                            f"{data}: {ids.numel()} held-out tokens, fewer than --seq-len"
                        )
                    what = f"{shown(path)} on {shown(data)}"
                    what += f" (set {val_set + 1})" if val_sets > 1 else ""
                    bar = bars.add_task(escape(what), total=ids.numel() // seq_len)
                    loss = loss_on(model, ids, seq_len, batch_size, device,
                                   functools.partial(bars.advance, bar))  # fmt: skip
                    bars.remove_task(bar)
                    if not math.isfinite(loss):
                        raise ValueError(
                            f"{shown(path)}: loss {loss} on {data}: the model's logits are not "
                            "finite (NaN or infinite weights, or a config.json that makes them)"
                        )
                    predicted = predicted_tokens(ids.numel(), seq_len)
                    results.append(Evaluation(str(path), data, predicted, loss, val_set))
            del model
        return results


def run_config_of(model: str | Path) -> tuple[Path, dict] | None:
    """``(config.json, its options)`` of the training run whose final model ``model`` is (a
    ``final/`` folder, or a file in it, beside the run's ``config.json``); None for any other
    model, or a run config that does not read as a JSON object."""
    folder = Path(model) if Path(model).is_dir() else Path(model).parent
    config_file = folder.parent / CONFIG
    if folder.name != FINAL or not config_file.is_file():
        return None
    try:
        options = read_json(config_file, "run config")
    except (UnsafeInputError, ValueError):
        return None
    return (config_file, options) if isinstance(options, dict) else None


def same_data(run_spec: str, spec: str) -> bool:
    """Whether a run's data spec and ``spec`` (comma-separated) name the same sources, in order
    (:func:`same_source`). A spec that cannot be read here (a name too long, a folder we may
    not enter) counts as the same: no warning without evidence."""
    try:
        theirs, ours = split_sources(run_spec), split_sources(spec)
        return len(theirs) == len(ours) and all(map(same_source, theirs, ours))
    except (OSError, ValueError):
        return True


def same_source(run_source: str, source: str) -> bool:
    """Equal names; or paths that are one file or folder. A built-in corpus is only itself. A
    run's path that does not exist from here counts as the same: it is relative to where the
    run started, which ``config.json`` does not say."""
    if run_source == source:
        return True
    if run_source in BUILTIN_SOURCES or source in BUILTIN_SOURCES:
        return False
    run_path, path = Path(run_source).expanduser(), Path(source).expanduser()
    if not run_path.exists():
        return True
    return path.exists() and os.path.samefile(run_path, path)


def held_out_warnings(
    models: Sequence[str | Path],
    datasets: Sequence[str],
    tokens: int,
    seed: int,
    val_sets: int = 1,
    command: str = "eval",
    tokens_option: str = "--tokens",
) -> list[str]:
    """Why an evaluation of a training run's final model would score tokens other than the
    run's validation set (read from its ``config.json``): more than its ``val_tokens``, another
    seed than its validation seed, other data. Warnings, not errors: scoring other data is a
    fair question, but not the run's held-out loss. ``command`` and ``tokens_option``: how the
    advice names the command and its token count (``compare``, ``--eval-tokens``)."""
    warnings = []
    for model in models:
        found = run_config_of(model)
        if found is None:
            continue
        config_file, run = found
        held_out, asked = run.get("val_tokens"), tokens * val_sets
        if isinstance(held_out, int) and asked > held_out:
            fitting = (
                f"{tokens_option} {held_out // val_sets}"
                if held_out >= val_sets
                else f"at most {held_out:,} tokens in all (--val-sets x {tokens_option})"
            )
            warnings.append(
                f"{shown(model)}: the run held out {held_out:,} validation tokens "
                f"({shown(config_file)}), so {asked:,} evaluated tokens include tokens it "
                f"trained on; pass {fitting}"
            )
        val_seed = run.get("val_seed") if run.get("val_seed") is not None else run.get("seed")
        if isinstance(val_seed, int) and val_seed != seed:
            warnings.append(
                f"{shown(model)}: the run held out its validation tokens with seed {val_seed} "
                f"({shown(config_file)}), so --seed {seed} evaluates other documents, some of "
                f"them trained on; pass --seed {val_seed}"
            )
        data = run.get("data")
        if isinstance(data, str) and not any(same_data(data, d) for d in datasets):
            mixture = "+".join(split_sources(data))  # how eval names the run's mixture
            warnings.append(
                f"{shown(model)}: the run trained on --data {shown(data)} ({shown(config_file)}; "
                f"{command} --data {shown(mixture)}); the held-out tokens of "
                f"{', '.join(shown(d) for d in datasets)} are not its validation set"
            )
    return warnings


def val_set_spreads(results: Sequence[Evaluation]) -> dict[tuple[str, str], Spread]:
    """Per (model, data): mean, sd (ddof 1), min and max of the loss over its validation sets."""
    losses: dict[tuple[str, str], list[float]] = {}
    for result in results:
        losses.setdefault((result.model, result.data), []).append(result.loss)
    return {key: spread(values) for key, values in losses.items()}


def results_table(results: Sequence[Evaluation]) -> Table:
    """Model x dataset: loss (perplexity); with several validation sets, one column per set
    (``data #k``) and the spread over the sets in the caption."""
    several = any(result.val_set for result in results)

    def column(result: Evaluation) -> str:
        return f"{result.data} #{result.val_set}" if several else result.data

    datasets = list(dict.fromkeys(column(result) for result in results))
    table = Table(title="Held-out loss, nats per token (perplexity)")
    table.add_column("model")
    for data in datasets:
        table.add_column(data, justify="right")
    by_model: dict[str, dict[str, Evaluation]] = {}
    for result in results:
        by_model.setdefault(result.model, {})[column(result)] = result
    for model, row in by_model.items():
        cells = [
            f"{row[d].loss:.4f} ({row[d].perplexity:.1f})" if d in row else "-" for d in datasets
        ]
        table.add_row(model, *cells)
    tokens = {result.tokens for result in results}
    table.caption = f"{', '.join(f'{t:,}' for t in sorted(tokens))} predicted tokens per dataset"
    if several:
        table.caption += "".join(
            f"\n{model} on {data}: {s.mean:.4f} ± {s.std:.4f} (min {s.low:.4f}, max {s.high:.4f})"
            f" over {s.n} validation sets"
            for (model, data), s in val_set_spreads(results).items()
        )
    return table
