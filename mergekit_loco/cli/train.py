"""``mloco train``: flags -> :class:`TrainConfig` -> :func:`train`. Thin on purpose; the
defaults in the help are read from the config's dataclasses.

Under torchrun: ``torchrun --nproc_per_node 2 -m mergekit_loco train --workers 8 ...``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from mergekit_loco.cli.catalog import method_names
from mergekit_loco.cli.common import (
    EXIT_INTERRUPTED,
    EXIT_RUN_FAILED,
    Debug,
    one_line,
    path_parser,
    path_text_parser,
    print_error,
    user_errors,
)
from mergekit_loco.cli.threads import choose_threads
from mergekit_loco.option_text import option_pairs
from mergekit_loco.run_layout import check_output_parent, check_resumable, check_run_folder_name
from mergekit_loco.train.config import (
    DEFAULT_TOKENS,
    PRESETS,
    TrainConfig,
    aggregator_preset,
    default,
    given_options,
    preset_config,
    read_options,
    resolve_config,
    resumed_names,
)
from mergekit_loco.train.config_sections import OptionError, flag_name

#: --threads at most this many times the CPUs: torch starts every thread it is given.
THREADS_PER_CPU = 4


def parse_aggregator_options(pairs: list[str], flags: dict[str, object]) -> dict[str, object]:
    """``["density=0.5", "rank-aware=true"]`` -> ``{"density": "0.5", "rank_aware": "true"}``
    merged with the method flags given (``--density``); the texts take the method's types as
    merge's ``--option`` values do, once the aggregator is known (``OuterConfig``). A key given
    twice, or also as a flag, is refused."""
    options = {key: value for key, value in flags.items() if value is not None}
    for pair, key, text in option_pairs(pairs):
        if key in options:
            raise ValueError(f"--option {pair!r}: {key!r} is also given as a flag")
        options[key] = text
    return options


def preset_default(key: str) -> str:
    """A default a preset sets: ``"(default: the preset's; diloco: 0.7)"``."""
    return f"(default: the preset's; {default('preset')}: {default(key)})"


def outer_overrides(config: TrainConfig) -> list[tuple[str, str, bool]]:
    """``(option, as a flag, differs from the preset)`` of the outer lr, momentum and Nesterov:
    a resumed run's own values show as overrides though no flag gives them again."""
    outer, preset = config.outer, preset_config(config.run.preset).outer
    return [
        ("outer_lr", f"--outer-lr {outer.lr}", outer.lr != preset.lr),
        ("outer_momentum", f"--outer-momentum {outer.momentum}", outer.momentum != preset.momentum),
        (
            "nesterov",
            f"--{'' if outer.nesterov else 'no-'}nesterov",
            outer.nesterov != preset.nesterov,
        ),
    ]


def describe_outer(config: TrainConfig, given: dict[str, str]) -> str:
    """One line: the aggregator, the outer SGD settings and where they come from (``given``:
    the options the user set, named as written: :func:`given_options`)."""
    outer = config.outer
    if config.run.mode == "dp":
        return "none (data-parallel AdamW baseline)"
    momentum = f"{'Nesterov ' if outer.nesterov else ''}momentum {outer.momentum}"
    if not outer.momentum:
        momentum = "no momentum"
    if aggregator_preset(outer.aggregator) is None and "preset" not in given:
        source = f"the defaults: {outer.aggregator} has no tuned preset"
    elif PRESETS[config.run.preset].get("mode") == "dp":
        source = f"the defaults: preset {config.run.preset} has no outer step"
    else:
        source = f"preset {config.run.preset}"
    overrides = [
        given.get(key, written)
        for key, written, differs in outer_overrides(config)
        if key in given or differs
    ]
    if overrides:
        source += f", overridden by {', '.join(overrides)}"
    return (
        f"{outer.aggregator} of the worker deltas, then SGD with lr {outer.lr}, {momentum} "
        f"({source})"
    )


def check_not_resume_and_force(config_file: Path | None, flags: dict) -> None:
    """Refuse ``--resume`` with ``--force`` (as flags or in the config file): one continues the
    run in --out, the other starts it over. Checked on what the user gave, before
    :func:`resolve_config` refuses either in a config file (config.json of earlier versions
    saved ``force = true``)."""
    from_file, from_flags, names = read_options(config_file, flags)
    given = {**from_file, **from_flags}
    if given.get("resume") and given.get("force"):
        raise ValueError(
            f"{names['resume']} and {names['force']} do not go together: --resume continues the "
            "run in --out from its latest checkpoint, --force starts it over; pass one of them"
        )


@user_errors
def train_command(
    preset: Annotated[
        str | None,
        typer.Option(help=f"Tuned settings: {', '.join(PRESETS)} (default {default('preset')})."),
    ] = None,
    model: Annotated[
        str | None,
        typer.Option(
            help="micro, nano, 178m, 512m or any HF causal-LM config.json "
            f"(default {default('model')})."
        ),
    ] = None,
    workers: Annotated[
        int | None, typer.Option(help=f"R, the number of workers (default {default('workers')}).")
    ] = None,
    inner_steps: Annotated[
        int | None,
        typer.Option(help=f"H, inner steps per round (default {default('inner_steps')})."),
    ] = None,
    global_batch: Annotated[
        int | None,
        typer.Option(
            help=f"Sequences per inner step over all workers (default {default('global_batch')})."
        ),
    ] = None,
    seq_len: Annotated[
        int | None, typer.Option(help=f"Tokens per sequence (default {default('seq_len')}).")
    ] = None,
    tokens: Annotated[
        int | None, typer.Option(help=f"Token budget (default {DEFAULT_TOKENS}).")
    ] = None,
    chinchilla: Annotated[
        float | None,
        typer.Option(help="Token budget as tokens per parameter (instead of --tokens)."),
    ] = None,
    seed: Annotated[
        int | None,
        typer.Option(help=f"Seed of init, data order, DARE masks (default {default('seed')})."),
    ] = None,
    data: Annotated[
        str | None,
        typer.Option(
            help="stdlib, pydoc, torchsrc, austen, bible, a text/jsonl file, a folder, or a "
            f"comma list of these (default {default('data')})."
        ),
    ] = None,
    tokenizer: Annotated[
        str | None,
        typer.Option(
            help="A tokenizer folder (default: BPE trained on the data).", parser=path_text_parser
        ),
    ] = None,
    vocab_size: Annotated[
        int | None,
        typer.Option(help=f"Vocabulary of a trained BPE (default {default('vocab_size')})."),
    ] = None,
    val_tokens: Annotated[
        int | None,
        typer.Option(help=f"Held-out validation tokens (default {default('val_tokens')})."),
    ] = None,
    val_seed: Annotated[
        int | None,
        typer.Option(
            help="Seed of the validation documents (default: --seed); one value gives runs of "
            "several seeds the same validation set."
        ),
    ] = None,
    out: Annotated[
        Path | None,
        typer.Option(
            "--out", "-o", help=f"Run folder (default {default('out')}).", parser=path_parser
        ),
    ] = None,
    checkpoint_every: Annotated[
        int | None,
        typer.Option(
            help="Checkpoint every N rounds; 0: only at the end "
            f"(default {default('checkpoint_every')})."
        ),
    ] = None,
    keep_checkpoints: Annotated[
        int | None, typer.Option(help=f"Checkpoints kept (default {default('keep_checkpoints')}).")
    ] = None,
    eval_every: Annotated[
        int | None,
        typer.Option(
            help="Validation loss every N rounds; 0: only at the end "
            f"(default {default('eval_every')})."
        ),
    ] = None,
    stop_after: Annotated[
        int | None, typer.Option(help="Stop (with a checkpoint) after N rounds; resume later.")
    ] = None,
    resume: Annotated[
        bool, typer.Option("--resume", help="Continue the run in --out from its latest checkpoint.")
    ] = False,
    allow_config_change: Annotated[
        bool, typer.Option("--allow-config-change", help="Resume even if the config differs.")
    ] = False,
    force: Annotated[
        bool, typer.Option("--force", help="Start over in an --out that holds a run.")
    ] = False,
    init: Annotated[
        str | None,
        typer.Option(
            help="Start from this HF folder / safetensors (fine-tuning).", parser=path_text_parser
        ),
    ] = None,
    config: Annotated[
        Path | None,
        typer.Option("--config", help="A .toml, .yaml or .json config file.", parser=path_parser),
    ] = None,
    mode: Annotated[
        str | None,
        typer.Option(
            help=f"diloco, or dp: the data-parallel baseline (default {default('mode')})."
        ),
    ] = None,
    aggregator: Annotated[
        str | None,
        typer.Option(
            help=f"Merge method: {', '.join(method_names())} {preset_default('aggregator')}. "
            "Without --preset it brings its tuned preset (outer lr, momentum, inner lr), e.g. "
            "tsv -> --preset tsv."
        ),
    ] = None,
    outer_lr: Annotated[
        float | None, typer.Option(help=f"Outer learning rate {preset_default('outer_lr')}.")
    ] = None,
    outer_momentum: Annotated[
        float | None, typer.Option(help=f"Outer momentum {preset_default('outer_momentum')}.")
    ] = None,
    nesterov: Annotated[
        bool | None,
        typer.Option(
            "--nesterov/--no-nesterov",
            help="Nesterov outer momentum (default: the preset's; off in those without momentum).",
        ),
    ] = None,
    inner_lr: Annotated[
        float | None,
        typer.Option(help=f"Peak inner learning rate {preset_default('inner_lr')}."),
    ] = None,
    inner_optimizer: Annotated[
        str | None, typer.Option(help=f"adamw or muon (default {default('inner_optimizer')}).")
    ] = None,
    weight_decay: Annotated[
        float | None, typer.Option(help=f"Inner weight decay {preset_default('weight_decay')}.")
    ] = None,
    grad_clip: Annotated[
        float | None,
        typer.Option(help=f"Gradient norm clip; 0: off (default {default('grad_clip')})."),
    ] = None,
    warmup_fraction: Annotated[
        float | None,
        typer.Option(
            help=f"Warmup share of the inner steps (default {default('warmup_fraction')})."
        ),
    ] = None,
    density: Annotated[
        float | None, typer.Option(help="ties/dare/breadcrumbs aggregator: fraction kept.")
    ] = None,
    gamma: Annotated[
        float | None, typer.Option(help="breadcrumbs aggregator: top fraction dropped.")
    ] = None,
    common_fraction: Annotated[
        float | None, typer.Option(help="iso-cts aggregator: common subspace fraction.")
    ] = None,
    spectral: Annotated[
        str | None, typer.Option(help="iso-c/iso-cts aggregator: exact (SVD) or ns.")
    ] = None,
    option: Annotated[
        list[str] | None,
        typer.Option(help="Any aggregator option as KEY=VALUE, as merge takes it (repeatable)."),
    ] = None,
    timeout: Annotated[
        float | None,
        typer.Option(
            help=f"Collective timeout in seconds under torchrun (default {default('timeout')})."
        ),
    ] = None,
    compression: Annotated[
        str | None,
        typer.Option(help="Compress what the outer step sends: bf16 or int8 (default: exact)."),
    ] = None,
    device: Annotated[
        str | None, typer.Option(help=f"auto, cpu or cuda (default {default('device')}).")
    ] = None,
    threads: Annotated[
        int | None,
        typer.Option(
            help="CPU threads of torch (default: OMP_NUM_THREADS if set, else the cores idle at "
            "the start, at most the physical cores)."
        ),
    ] = None,
    quiet: Annotated[
        bool | None,
        typer.Option(
            "--quiet/--no-quiet",
            "-q",
            help="No progress bar, no summary (this invocation: a --resume shows them again; "
            "--no-quiet overrides a config file).",
        ),
    ] = None,
    debug: Debug = False,
) -> None:
    """DiLoCo training where any merge method is the aggregator (or a data-parallel baseline)."""
    max_threads = THREADS_PER_CPU * (os.cpu_count() or 1)
    if threads is not None and threads > max_threads:
        raise ValueError(
            f"--threads {threads} is more than {THREADS_PER_CPU} per CPU ({os.cpu_count()} "
            f"CPUs); choose at most {max_threads}"
        )
    named = {"density": density, "gamma": gamma, "common_fraction": common_fraction,
             "spectral": spectral}  # fmt: skip
    aggregator_options = parse_aggregator_options(option or [], named)
    flags = dict(
        preset=preset, model=model, workers=workers, inner_steps=inner_steps,
        global_batch=global_batch, seq_len=seq_len, tokens=tokens, chinchilla=chinchilla,
        seed=seed, data=data, tokenizer=tokenizer, vocab_size=vocab_size, val_tokens=val_tokens,
        val_seed=val_seed,
        out=str(out) if out is not None else None, checkpoint_every=checkpoint_every,
        keep_checkpoints=keep_checkpoints, eval_every=eval_every, stop_after=stop_after,
        resume=resume or None, allow_config_change=allow_config_change or None,
        force=force or None, init=init, mode=mode, aggregator=aggregator, outer_lr=outer_lr,
        outer_momentum=outer_momentum, nesterov=nesterov, inner_lr=inner_lr,
        inner_optimizer=inner_optimizer, weight_decay=weight_decay, grad_clip=grad_clip,
        warmup_fraction=warmup_fraction, timeout=timeout, compression=compression, device=device,
        quiet=quiet,
        aggregator_options=aggregator_options or None,
    )  # fmt: skip
    check_not_resume_and_force(config, flags)
    try:
        run_config = resolve_config(config, **flags)
    except OptionError as error:  # named as typed: --global-batch, global_batch in run.toml
        names = {key: flag_name(key) for key in flags} | resumed_names(config, **flags)
        names |= given_options(config, **flags)
        if names.get("aggregator_options", "").startswith("--"):  # --option K=V, --density
            names["aggregator_options"] = "--option"
            given = [key for key, value in named.items() if value is not None]
            names |= {f"aggregator_options.{key}": flag_name(key) for key in given}
        raise ValueError(error.named(names)) from None
    check_run_folder_name(Path(run_config.run.out), "--out")
    if run_config.checkpoint.resume:
        check_resumable(Path(run_config.run.out))
    else:
        check_output_parent(Path(run_config.run.out), "--out")
    thread_count, thread_reason = choose_threads(threads)

    import torch

    from mergekit_loco.dist import CollectiveFailed
    from mergekit_loco.train.loop import (
        TrainingDiverged,
        TrainingFailed,
        TrainingInterrupted,
        train,
    )

    torch.set_num_threads(thread_count)
    if not run_config.run.quiet and os.environ.get("RANK", "0") == "0":
        given = given_options(config, **flags)
        typer.echo(f"outer step: {describe_outer(run_config, given)}")
        typer.echo(f"threads: {thread_count} ({thread_reason}; --threads N to choose)")
        typer.echo("preparing the tokenizer, data and model (the first run on a corpus trains a "
                   "tokenizer and tokenizes it: seconds for stdlib, cached after) ...")  # fmt: skip
    try:
        result = train(run_config)
    except TrainingInterrupted as stopped:
        print_error(one_line(stopped))
        raise typer.Exit(EXIT_INTERRUPTED) from None
    except (TrainingDiverged, CollectiveFailed, TrainingFailed) as failure:
        if debug:
            raise
        print_error(one_line(failure))
        raise typer.Exit(EXIT_RUN_FAILED) from None
    if not result.finished and not run_config.run.quiet:
        typer.echo(
            f"stopped after round {result.rounds}; continue with --resume --out {result.out}"
        )
