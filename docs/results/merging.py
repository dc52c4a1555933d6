"""The merging experiment of docs/results/merging.md, end to end (about an hour on 2 CPU cores).

For each seed: pre-train a nano base (data-parallel AdamW) on a mix of three embedded domains,
fine-tune it on each domain, then ``compare_merges`` merges the three fine-tunes with every
method and scale and evaluates every model on every domain's held-out tokens. The base holds
out every document the evaluation uses (checked below), so no evaluated token was trained on.
Finally the seeds are combined into docs/results/merging/; seeds already published there are
read back, not rerun, so adding a seed to SEEDS runs just that seed.

    MLOCO_AUSTEN_DIR=... MLOCO_BIBLE_DIR=... python docs/results/merging.py WORK_DIR

``python docs/results/merging.py --report [OUT]`` re-renders the published tables from the
committed docs/results/merging/merge_results.json (into OUT, default that folder).
"""

from __future__ import annotations

import sys
from pathlib import Path

from rich.console import Console

from mergekit_loco.compare.merge_report import EVALUATIONS, documents_from_results, report_documents
from mergekit_loco.compare.merges import compare_merges
from mergekit_loco.io.files import read_json
from mergekit_loco.train.config import preset_config
from mergekit_loco.train.data import prepare_data
from mergekit_loco.train.loop import train
from mergekit_loco.train.tokenizer import load_or_train_tokenizer

DOMAINS = ["stdlib", "austen", "bible"]  # Python code, novels, scripture
SEEDS = [0, 1, 2]
METHODS = ["mean", "ta", "ties", "dare", "tsv", "iso-c", "iso-cts"]
SCALES = [0.1, 0.2, 0.3, 0.5, 1.0, 1.5]
EVAL_TOKENS = 32768  # per domain: 16384 choose the scale, 16384 are reported
SHAPE = {"model": "nano", "global_batch": 16, "seq_len": 128}
BASE_TOKENS = 1_048_576  # 512 steps of 16 x 128
FINETUNE_TOKENS = 262_144  # 128 steps
RESULTS = Path(__file__).parent / "merging"


def base_val_tokens(tokenizer: Path, seed: int) -> int:
    """The fewest held-out tokens of the mix whose documents include every domain's evaluation
    documents, so that the base never trains on them."""
    needed = set()
    for domain in DOMAINS:
        held_out = prepare_data(domain, str(tokenizer), None, 1, EVAL_TOKENS, seed=seed)
        needed |= set(held_out.val_documents)
    tokens = 65536
    while True:
        mix = prepare_data(",".join(DOMAINS), str(tokenizer), None, 1, tokens, seed=seed)
        if needed <= set(mix.val_documents):
            return tokens
        tokens += 65536


def run_seed(work: Path, seed: int, console: Console) -> Path:
    mix = ",".join(DOMAINS)
    tokenizer = work / "tokenizer"
    if not (tokenizer / "tokenizer.json").is_file():
        load_or_train_tokenizer(mix, 4096).save_pretrained(tokenizer)
    base_out = work / f"base-s{seed}"
    if not (base_out / "final").is_dir():
        val_tokens = base_val_tokens(tokenizer, seed)
        console.print(f"seed {seed}: the base holds out {val_tokens:,} tokens")
        config = preset_config(
            "dp",
            data=mix,
            tokenizer=str(tokenizer),
            seed=seed,
            tokens=BASE_TOKENS,
            inner_steps=32,
            val_tokens=val_tokens,
            out=str(base_out),
            force=True,
            **SHAPE,
        )
        console.print(f"base: val loss {train(config, progress=False).val_loss:.4f}")
    finetuned = []
    for domain in DOMAINS:
        out = work / f"ft-{domain}-s{seed}"
        if not (out / "final").is_dir():
            config = preset_config(
                "dp",
                data=domain,
                init=str(base_out / "final"),
                seed=seed,
                tokens=FINETUNE_TOKENS,
                inner_steps=16,
                val_tokens=EVAL_TOKENS,
                out=str(out),
                force=True,
                **SHAPE,
            )
            console.print(
                f"fine-tune {domain}: val loss {train(config, progress=False).val_loss:.4f}"
            )
        finetuned.append(out / "final")
    merge_out = work / f"merge-s{seed}"
    compare_merges(
        base_out / "final",
        finetuned,
        DOMAINS,
        METHODS,
        SCALES,
        merge_out,
        eval_tokens=EVAL_TOKENS,
        seq_len=SHAPE["seq_len"],
        seed=seed,
        console=console,
    )
    return merge_out


def main(work: Path) -> None:
    """Run every seed the published results do not hold yet, then report all of them (a seed
    already published is read back from merge_results.json, not rerun)."""
    console = Console()
    published = RESULTS / "merge_results.json"
    documents = documents_from_results(published) if published.is_file() else {}
    for seed in SEEDS:
        name = f"merge-s{seed}"
        if name not in documents:
            folder = run_seed(work, seed, console)
            documents[name] = read_json(folder / EVALUATIONS, "merge evaluations")
    report_documents(documents, RESULTS, console=console)


def rerender(out: Path) -> None:
    """The published report again, from its own merge_results.json."""
    documents = documents_from_results(RESULTS / "merge_results.json")
    report_documents(documents, out, console=Console(width=200))


if __name__ == "__main__":
    if sys.argv[1] == "--report":
        rerender(Path(sys.argv[2]) if len(sys.argv) > 2 else RESULTS)
    else:
        main(Path(sys.argv[1]))
