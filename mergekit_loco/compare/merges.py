"""Merge evaluation: which merge method keeps my fine-tunes? Merge, evaluate, report.

Merge fine-tunes with every method and scale, evaluate every merge on every fine-tune's domain,
choose the scale on one half of the held-out tokens, report on the other
(:mod:`mergekit_loco.compare.merge_report`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch
from rich.console import Console

from mergekit_loco import evaluate
from mergekit_loco.compare import results_lock
from mergekit_loco.compare.merge_report import EVALUATIONS, MergeRow, report_merges
from mergekit_loco.device import resolve_device
from mergekit_loco.io.atomic import check_results_folder, claim_folder, write_atomically
from mergekit_loco.io.files import read_json
from mergekit_loco.merge import merge_checkpoints
from mergekit_loco.methods import get_method
from mergekit_loco.run_layout import MERGES_KIND
from mergekit_loco.train.model import check_pretrained, check_seq_len
from mergekit_loco.train.sources import BUILTIN_SOURCES

MERGED = "merged"
#: label -> the inputs (:func:`stamp`), method and scale each merge under ``merged/`` came from
RECIPES = "merges.json"
DEFAULT_EVAL_SEQ_LEN = 128


def stamp(path: str | Path) -> list[str]:
    """What identifies a checkpoint's content cheaply: for its weights, index and config files
    (the file itself, or those in its folder), the resolved path, size and mtime."""
    path = Path(path).expanduser().resolve()
    files = [path] if path.is_file() else sorted(
        file for file in path.iterdir()
        if file.suffix in (".safetensors", ".json") and file.is_file()
    )  # fmt: skip
    return [f"{file}:{file.stat().st_size}:{file.stat().st_mtime_ns}" for file in files]


def merge_label(method: str, scale: float) -> str:
    return f"{method}-{scale:g}"


def compare_merges(
    base: str | Path,
    finetuned: Sequence[str | Path],
    data: Sequence[str],
    methods: Sequence[str],
    scales: Sequence[float],
    out: str | Path,
    eval_tokens: int = 32768,
    seq_len: int | None = None,
    tokenizer: str | Path | None = None,
    seed: int = 0,
    force: bool = False,
    console: Console | None = None,
    figures: bool = True,
    device: str = "cpu",
) -> list[MergeRow]:
    """Merge ``finetuned`` (fine-tune t trained on domain ``data[t]``) with every method and
    scale into ``out/merged/<method>-<scale>/``, evaluate the base, the fine-tunes and every
    merge on every domain's held-out tokens (split in halves: ``select`` chooses each method's
    scale, ``test`` is reported), save ``out/evaluations.json`` and write the report.

    Existing merges are reused unless ``force``, and only if ``merges.json`` says they were
    made from these checkpoints as they are now (path, size and mtime of their files).
    ``seed`` is the data seed the fine-tunes were trained with (it decides the held-out
    documents); ``eval_tokens`` should not exceed their ``val_tokens``. Every input is checked
    before ``out`` is created, and ``out`` must be new, empty or written by mloco
    (:func:`mergekit_loco.io.atomic.check_results_folder`).
    """
    out = Path(out)
    device = resolve_device(device)
    console = console or Console(quiet=True)
    seq_len = seq_len or DEFAULT_EVAL_SEQ_LEN
    if len(finetuned) != len(data):
        raise ValueError(
            f"--finetuned has {len(finetuned)} models but --data {len(data)} domains; give each "
            "fine-tune's own domain, in the same order"
        )
    if len(finetuned) < 2:
        raise ValueError("--finetuned: merging needs at least two fine-tuned models")
    if len(set(data)) != len(data):
        raise ValueError(f"--data: each fine-tune needs its own domain, got {', '.join(data)}")
    for method in methods:
        get_method(method)
    largest = torch.finfo(torch.float32).max
    if not scales or not all(0 < scale <= largest for scale in scales):  # NaN fails too
        raise ValueError(f"--scales must be positive finite numbers, got {list(scales)}")
    named = {}
    for scale in scales:
        other = named.setdefault(f"{scale:g}", scale)
        if other != scale:
            raise ValueError(
                f"--scales: {other!r} and {scale!r} would both name the merge "
                f"{merge_label(methods[0], scale)} (scales are named to 6 significant digits); "
                "give scales that differ there"
            )
    if eval_tokens < 4 * seq_len:
        raise ValueError(f"--eval-tokens {eval_tokens} is too few for two halves of windows")
    for option, path in [("--base", base)] + [("--finetuned", path) for path in finetuned]:
        if not Path(path).expanduser().exists():
            raise ValueError(f"{path}: no such checkpoint ({option})")
        # evaluated later: a model that cannot load, or hold --seq-len tokens, stops us now
        check_seq_len(check_pretrained(path, option), seq_len, path)
    folder = evaluate.tokenizer_folder(base, tokenizer)
    halves = {}
    for domain in data:
        ids = evaluate.held_out_tokens(domain, folder, eval_tokens, seed)
        middle = ids.numel() // 2
        halves[domain] = {"select": ids[:middle], "test": ids[middle:]}
    inputs = {str(base), *map(str, finetuned), *data, tokenizer} - set(BUILTIN_SOURCES)
    check_results_folder(out, MERGES_KIND, inputs, (MERGED,))
    with results_lock(out) as lock:
        lock.acquire()
        claim_folder(out, MERGES_KIND)

        models = {"base": (str(base), "base", None, None)}
        for path, domain in zip(finetuned, data, strict=True):
            models[f"finetune:{domain}"] = (str(path), "finetuned", None, None)
        recipes_file = out / RECIPES
        inputs_now = {"base": stamp(base), "finetuned": [stamp(path) for path in finetuned]}
        recipes = read_json(recipes_file, "merge recipes") if recipes_file.exists() else {}
        if not isinstance(recipes, dict):
            raise ValueError(f"{recipes_file}: not a JSON object; delete it and add --force")
        for method in methods:
            for scale in scales:
                label = merge_label(method, scale)
                target = out / MERGED / label
                wanted = {**inputs_now, "method": method, "scale": scale}
                if target.exists() and not force and recipes.get(label) != wanted:
                    raise ValueError(
                        f"{target}: this merge was made from other checkpoints than --base and "
                        "--finetuned name now (or they changed since); add --force to merge again, "
                        "or choose another -o"
                    )
                if force or not target.exists():
                    console.print(f"merging {label}")
                    merge_checkpoints(finetuned, base, method, target, scale=scale, force=force,
                                      progress=False)  # fmt: skip
                    recipes[label] = wanted
                    write_atomically(recipes_file, json.dumps(recipes, indent=2) + "\n")
                models[label] = (str(target), "merge", method, scale)

        records = []
        for label, (path, kind, method, scale) in models.items():
            console.print(f"evaluating {label}")
            model = evaluate.load_model(path, device)
            losses = {
                domain: {
                    split: evaluate.loss_on(model, ids, seq_len, device=device)
                    for split, ids in splits.items()
                }
                for domain, splits in halves.items()
            }
            records.append({"label": label, "kind": kind, "method": method, "scale": scale,
                            "path": path, "losses": losses})  # fmt: skip
        document = {
            "base": str(base),
            "finetuned": [str(path) for path in finetuned],
            "domains": list(data),
            "seed": seed,
            "eval_tokens": eval_tokens,
            "seq_len": seq_len,
            "models": records,
        }
        write_atomically(out / EVALUATIONS, json.dumps(document, indent=2) + "\n")
        return report_merges([out], out, console=console, figures=figures)
