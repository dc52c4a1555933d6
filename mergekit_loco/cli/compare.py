"""``mloco compare``, ``mloco report`` and ``mloco eval``: flags -> the Python API (thin)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from mergekit_loco.cli.catalog import method_names
from mergekit_loco.cli.common import (
    EXIT_INTERRUPTED,
    EXIT_RUN_FAILED,
    Debug,
    Quiet,
    check_seed,
    path_parser,
    path_text_parser,
    print_error,
    print_warning,
    user_errors,
)
from mergekit_loco.console import output_console
from mergekit_loco.run_layout import check_output_parent, check_run_folder_name
from mergekit_loco.train.config_sections import OptionError, flag_name

MODES = ("aggregators", "merge")
#: A cell's training options (flat names) -> the compare flag that sets them.
CELL_OPTIONS = {
    "workers": "--workers", "inner_steps": "--inner-steps", "seed": "--seeds",
    "outer_lr": "--outer-lr-grid", "outer_momentum": "--outer-momentum-grid",
}  # fmt: skip
DEFAULT_AGGREGATORS = "diloco,isoloco,isoloco-ns,ties,tsv,iso-cts"
DEFAULT_MERGE_METHODS = "mean,ta,ties,dare,tsv,iso-c,iso-cts"


def split_list(option: str, text: str | None, kind: type = str) -> list:
    """``"1,2,4"`` -> ``[1, 2, 4]``; names the option when a value does not parse, when it
    holds none (``","`` ran only the baseline, or failed on an empty list), or when it holds
    one value twice (:func:`~mergekit_loco.compare.check_unique`)."""
    from mergekit_loco.compare import check_unique

    if text is None:
        return []
    items = [item.strip() for item in text.split(",") if item.strip()]
    if not items:
        raise ValueError(f"{option}: {text!r} holds no values; give a comma-separated list")
    try:
        values = [kind(item) for item in items]
    except ValueError:
        raise ValueError(
            f"{option}: {text!r} is not a comma-separated list of {kind.__name__}"
        ) from None
    check_unique(option, values)
    return values


def split_paths(text: str | None) -> list[str]:
    """``"a,b"`` -> ``["a", "b"]`` (empty items dropped), keeping a path whose name holds commas
    whole where it exists (:func:`~mergekit_loco.train.sources.split_sources`)."""
    from mergekit_loco.train.sources import split_sources

    return [item for item in split_sources(text) if item] if text else []


def split_datasets(text: str | None) -> list[str]:
    """``"stdlib,pydoc"`` -> two datasets; ``"stdlib+torchsrc"`` -> one dataset of both sources,
    the spec ``train --data stdlib,torchsrc`` reads (an existing path is one source, commas or
    pluses in its name and all)."""
    from mergekit_loco.train.sources import split_sources

    return [",".join(split_sources(item, "+")) for item in split_paths(text)]


#: A count of seeds above this is taken for a seed written without its trailing comma.
MAX_SEED_COUNT = 100


def parse_seeds(text: str) -> tuple[int, ...]:
    """``"3"`` -> seeds 0, 1, 2 (a count, at most :data:`MAX_SEED_COUNT`); ``"101,202"`` or
    ``"7,"`` -> those seeds (a list)."""
    seeds = split_list("--seeds", text, int)
    if "," in text:
        if not seeds or any(not 0 <= seed < 2**63 for seed in seeds):
            raise ValueError(f"--seeds: {text!r} needs seeds in [0, 2**63)")
        return tuple(seeds)
    if len(seeds) != 1 or seeds[0] < 1:
        raise ValueError(f"--seeds: {text!r} is neither a count >= 1 nor a list like 0,1,2")
    if seeds[0] > MAX_SEED_COUNT:
        raise ValueError(
            f"--seeds {seeds[0]} would run {seeds[0]} seeds per cell (a count); for the one seed "
            f"{seeds[0]}, write it as a list: --seeds {seeds[0]},"
        )
    return tuple(range(seeds[0]))


#: The options of one mode that the other has no use for (``--data``, ``--seq-len``, ``-o``,
#: ``--figures`` serve both).
MODE_OPTIONS = {
    "aggregators": ("aggregators", "workers", "inner_steps", "seeds", "outer_lr_grid",
                    "outer_momentum_grid", "inner_lr", "weight_decay", "val_seed", "baseline",
                    "model", "tokens", "global_batch", "vocab_size", "val_tokens", "eval_every",
                    "checkpoint_every", "jobs"),
    "merge": ("base", "finetuned", "methods", "scales", "eval_tokens", "tokenizer", "seed",
              "force"),
}  # fmt: skip
#: What to say of an option of the other mode that looks like one of this mode.
INSTEAD = {("aggregators", "seed"): " (the cells' seeds are --seeds: a count, or a list like 5,)"}


def check_mode_options(ctx: typer.Context, mode: str) -> None:
    """Refuse, naming it, an option given on the command line that ``mode`` does not use (before,
    ``--seed 5`` in aggregators mode was ignored and the cells ran seed 0)."""
    for other, names in MODE_OPTIONS.items():
        if other == mode:
            continue
        for name in names:
            source = ctx.get_parameter_source(name)  # typer's own click: compared by name
            if source is None or source.name == "DEFAULT":
                continue
            param = next(p for p in ctx.command.params if p.name == name)
            flag = "/".join([max(param.opts, key=len), *getattr(param, "secondary_opts", [])])
            raise ValueError(
                f"{flag} is an option of --mode {other}, not of --mode {mode}; drop it"
                + INSTEAD.get((mode, name), "")
            )


@user_errors
def compare_command(
    ctx: typer.Context,
    output: Annotated[
        Path, typer.Option("--output", "-o", help="Results folder.", parser=path_parser)
    ],
    mode: Annotated[
        str, typer.Option(help="aggregators: DiLoCo sweep; merge: one-shot merges of fine-tunes.")
    ] = "aggregators",
    aggregators: Annotated[
        str, typer.Option(help="Training presets to sweep, comma-separated.")
    ] = DEFAULT_AGGREGATORS,
    workers: Annotated[str, typer.Option(help="Worker counts R, comma-separated.")] = "1,2,4,8",
    inner_steps: Annotated[str, typer.Option(help="Inner steps H, comma-separated.")] = "30",
    seeds: Annotated[
        str, typer.Option(help="Seeds per cell: a count N (0..N-1) or a list (101,202; one: 7,).")
    ] = "1",
    outer_lr_grid: Annotated[
        list[str] | None,
        typer.Option(
            help="Outer lrs to try: multipliers of each preset's lr (0.5,1,2), or absolute "
            "values for one aggregator (isoloco=1.2,1.8,2.4); repeatable."
        ),
    ] = None,
    outer_momentum_grid: Annotated[
        list[str] | None,
        typer.Option(
            help="Outer momenta to try, for the presets with momentum (0.8,0.9), or for one "
            "aggregator (isoloco=0.7,0.8); repeatable."
        ),
    ] = None,
    inner_lr: Annotated[
        float | None, typer.Option(help="Inner (AdamW) lr of every cell, overriding the presets'.")
    ] = None,
    weight_decay: Annotated[
        float | None,
        typer.Option(help="Inner weight decay of every cell, overriding the presets'."),
    ] = None,
    val_seed: Annotated[
        int | None,
        typer.Option(
            help="Seed of the validation documents, shared by every seed "
            "(default: each seed's own)."
        ),
    ] = None,
    baseline: Annotated[
        bool, typer.Option("--baseline/--no-baseline", help="Run the data-parallel baseline.")
    ] = True,
    model: Annotated[str | None, typer.Option(help="Model preset (default nano).")] = None,
    tokens: Annotated[
        int | None, typer.Option(help="Token budget of every cell (default 2000000).")
    ] = None,
    global_batch: Annotated[
        int | None, typer.Option(help="Sequences per inner step over all workers (default 64).")
    ] = None,
    seq_len: Annotated[int | None, typer.Option(help="Tokens per sequence (default 128).")] = None,
    data: Annotated[
        str | None,
        typer.Option(
            help="aggregators: the training data spec (default stdlib). merge: one domain per "
            "fine-tune, comma-separated, in --finetuned order (+ joins sources into one)."
        ),
    ] = None,
    vocab_size: Annotated[
        int | None, typer.Option(help="Vocabulary of the BPE trained on the data (default 4096).")
    ] = None,
    val_tokens: Annotated[
        int | None, typer.Option(help="Held-out tokens of each validation (default 65536).")
    ] = None,
    eval_every: Annotated[
        int | None, typer.Option(help="Validation every N rounds (default: about 8 per run).")
    ] = None,
    checkpoint_every: Annotated[
        int | None,
        typer.Option(
            help="Checkpoint every N rounds, the most a stopped cell redoes (default: about 4 "
            "per run)."
        ),
    ] = None,
    jobs: Annotated[int, typer.Option(help="Cells trained at once, one process each.")] = 1,
    base: Annotated[
        Path | None, typer.Option(help="merge: the pre-trained checkpoint.", parser=path_parser)
    ] = None,
    finetuned: Annotated[
        str | None,
        typer.Option(
            help="merge: fine-tuned checkpoints, comma-separated.", parser=path_text_parser
        ),
    ] = None,
    methods: Annotated[
        str, typer.Option(help=f"merge: methods, comma-separated ({', '.join(method_names())}).")
    ] = DEFAULT_MERGE_METHODS,
    scales: Annotated[
        str, typer.Option(help="merge: scales tried per method, comma-separated.")
    ] = "0.3,0.5,1.0,1.5",
    eval_tokens: Annotated[
        int, typer.Option(help="merge: held-out tokens per domain (half choose the scale).")
    ] = 32768,
    tokenizer: Annotated[
        str | None,
        typer.Option(
            help="merge: tokenizer folder (default: the base's).", parser=path_text_parser
        ),
    ] = None,
    seed: Annotated[
        int, typer.Option(help="merge: the fine-tunes' seed (it chose their held-out split).")
    ] = 0,
    force: Annotated[
        bool, typer.Option("--force", help="merge: redo merges that already exist.")
    ] = False,
    figures: Annotated[bool, typer.Option("--figures/--no-figures", help="Draw PNGs.")] = True,
    quiet: Quiet = False,
    debug: Debug = False,
) -> None:
    """Which aggregator for my R and H (a FLOP-matched sweep), or which merge method (merge)."""
    from mergekit_loco.train.guards import TrainingFailed
    from mergekit_loco.train.loop import TrainingInterrupted

    console = output_console(quiet=quiet)
    if mode not in MODES:
        raise ValueError(f"--mode must be one of {', '.join(MODES)}, not {mode!r}")
    check_mode_options(ctx, mode)
    check_output_parent(output, "-o")
    check_run_folder_name(output, "-o")
    if mode == "merge":
        if base is None or finetuned is None or data is None:
            raise ValueError("--mode merge needs --base, --finetuned and --data")
        from mergekit_loco import evaluate
        from mergekit_loco.compare import check_unique
        from mergekit_loco.compare.merges import compare_merges

        finetuned_paths, domains = split_paths(finetuned), split_datasets(data)
        check_unique("--finetuned", finetuned_paths)
        # each fine-tune against its own domain (a count mismatch is compare_merges' error)
        for path, domain in zip(finetuned_paths, domains, strict=False):
            warnings = evaluate.held_out_warnings(
                [path],
                [domain],
                eval_tokens,
                seed,
                command="compare",
                tokens_option="--eval-tokens",
            )
            for warning in warnings:
                print_warning(warning)
        compare_merges(
            base=base,
            finetuned=finetuned_paths,
            data=domains,
            methods=split_list("--methods", methods),
            scales=split_list("--scales", scales, float),
            out=output,
            eval_tokens=eval_tokens,
            seq_len=seq_len,
            tokenizer=tokenizer,
            seed=seed,
            force=force,
            console=console,
            figures=figures,
        )
        return
    given = {"model": model, "tokens": tokens, "global_batch": global_batch, "seq_len": seq_len,
             "data": data, "vocab_size": vocab_size, "val_tokens": val_tokens,
             "eval_every": eval_every, "checkpoint_every": checkpoint_every,
             "inner_lr": inner_lr, "weight_decay": weight_decay,
             "val_seed": val_seed}  # fmt: skip
    from mergekit_loco.compare import sweep as sweeping

    sweep = sweeping.Sweep(
        aggregators=split_list("--aggregators", aggregators),
        workers=split_list("--workers", workers, int),
        inner_steps=split_list("--inner-steps", inner_steps, int),
        seeds=parse_seeds(seeds),
        outer_lr_grid=sweeping.Grid.parse(outer_lr_grid or []),
        outer_momentum_grid=sweeping.Grid.parse(
            outer_momentum_grid or [], option="--outer-momentum-grid", relative=False
        ),
        baseline=baseline,
        shared={key: value for key, value in given.items() if value is not None},
    )
    try:
        sweeping.run_sweep(
            sweep, output, jobs=jobs, console=console, progress=not quiet, figures=figures
        )
    except OptionError as error:  # a cell's config refused: named by compare's flags
        names = {key: flag_name(key) for key in given} | CELL_OPTIONS
        raise ValueError(error.named(names)) from None
    except (KeyboardInterrupt, TrainingInterrupted):
        print_error("interrupted; finished cells are kept: run the same command to resume")
        raise typer.Exit(EXIT_INTERRUPTED) from None
    except (sweeping.CellDied, TrainingFailed) as failure:  # killed, or out of memory or disk
        if debug:
            raise
        print_error(str(failure))
        raise typer.Exit(EXIT_RUN_FAILED) from None


@user_errors
def report_command(
    results: Annotated[
        list[Path],
        typer.Argument(
            help="Folders written by mloco compare (merge mode: several).", parser=path_parser
        ),
    ],
    output: Annotated[
        Path | None,
        typer.Option(
            "--output",
            "-o",
            help="Where the report goes (default: the folder; several merge folders: required).",
            parser=path_parser,
        ),
    ] = None,
    figures: Annotated[bool, typer.Option("--figures/--no-figures", help="Draw PNGs.")] = True,
    debug: Debug = False,
) -> None:
    """Re-render tables and figures from saved results (no training).

    Several merge-mode folders (e.g. one per fine-tune seed) are combined into mean ± std.
    """
    for folder in results:
        if not folder.is_dir():
            what = "is not a folder" if folder.exists() else "does not exist"
            raise ValueError(f"{folder}: {what} (give a folder written by mloco compare -o)")
    if output is not None:
        check_output_parent(output, "-o")
    from mergekit_loco.compare import render

    render(results, output, console=output_console(), figures=figures)


@user_errors
def eval_command(
    models: Annotated[
        list[Path],
        typer.Argument(help="Checkpoints: HF folders or .safetensors files.", parser=path_parser),
    ],
    data: Annotated[
        str,
        typer.Option(
            help="Datasets, comma-separated (stdlib, pydoc, paths); + joins the sources of one "
            "(stdlib+torchsrc: the corpus of train --data stdlib,torchsrc)."
        ),
    ],
    tokens: Annotated[int, typer.Option(help="Held-out tokens per dataset.")] = 65536,
    seq_len: Annotated[int, typer.Option(help="Tokens per evaluated window.")] = 128,
    tokenizer: Annotated[
        str | None,
        typer.Option(help="Tokenizer folder (default: each model's own).", parser=path_text_parser),
    ] = None,
    seed: Annotated[int, typer.Option(help="Seed of the held-out split (as in training).")] = 0,
    device: Annotated[str, typer.Option(help="cpu or cuda.")] = "cpu",
    val_sets: Annotated[
        int,
        typer.Option(
            help="Cut K * --tokens held-out tokens into K disjoint sets and report each and "
            "their spread (the noise of one evaluation)."
        ),
    ] = 1,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar.")] = False,
    debug: Debug = False,
) -> None:
    """Token-weighted validation loss and perplexity of each model on each dataset."""
    from mergekit_loco import evaluate

    datasets = split_datasets(data)
    evaluate.check_request(models, datasets, tokens, seq_len, val_sets)  # before any warning
    check_seed(seed)  # the held-out split of a training run of that seed
    for warning in evaluate.held_out_warnings(models, datasets, tokens, seed, val_sets):
        print_warning(warning)
    results = evaluate.evaluate_models(
        models,
        datasets,
        tokens=tokens,
        seq_len=seq_len,
        tokenizer=tokenizer,
        seed=seed,
        device=device,
        val_sets=val_sets,
        progress=not quiet,
    )
    if as_json:
        print(json.dumps([result.record() for result in results], indent=2, allow_nan=False))
    else:
        output_console().print(evaluate.results_table(results))
