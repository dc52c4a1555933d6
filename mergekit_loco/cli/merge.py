"""``mloco merge``: flags -> :func:`mergekit_loco.merge.merge_checkpoints`.

torch is imported when a merge runs, not for ``mloco merge --help`` or a usage error.
"""

from __future__ import annotations

import re
from fractions import Fraction
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from mergekit_loco.cli.catalog import method_catalog, method_names
from mergekit_loco.cli.command import command_line
from mergekit_loco.cli.common import (
    Debug,
    Quiet,
    check_seed,
    format_bytes,
    parse_choice,
    path_parser,
    print_warning,
    user_errors,
)
from mergekit_loco.console import output_console
from mergekit_loco.run_layout import check_output_parent

OUTPUT_DTYPES = ("float32", "bfloat16", "float16", "float64")
COMPUTE_DTYPES = ("float32", "float64")
SIZE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
SIZE_UNITS |= {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
DEFAULT_SHARD_SIZE = "5GB"  # io.DEFAULT_MAX_SHARD_BYTES, spelled for --help (a test checks it)


def parse_size(value: str) -> int:
    """``"5GB"`` -> 5e9 bytes (rounded down to whole bytes); units B, KB, MB, GB, TB (powers of
    1000) or KiB, MiB, GiB, TiB."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", value)
    if not match or match.group(2).lower() not in SIZE_UNITS:
        raise ValueError(f"--shard-size: {value!r} is not a size like 5GB, 500MB or 2GiB")
    size = int(Fraction(match.group(1)) * SIZE_UNITS[match.group(2).lower()])  # exact, any size
    if size < 1:
        raise ValueError(f"--shard-size: {value!r} is less than one byte")
    return size


def print_summary(summary, chosen: str = "") -> None:
    """The merge's summary table; ``chosen`` follows the output's name (`` (no -o given)``)."""
    table = Table(title=f"merged {summary.models} models with {summary.method}", show_header=False)
    table.add_column(style="bold")
    table.add_column()
    table.add_row("tensors merged", str(summary.tensors_merged))
    table.add_row("tensors copied", str(summary.tensors_copied))
    table.add_row("time", f"{summary.seconds:.2f} s")
    table.add_row("peak memory (RSS)", format_bytes(summary.peak_rss_bytes))
    table.add_row("output", f"{summary.out}{chosen}")
    output_console().print(table)


def default_output(
    models: list[Path], base: Path | None, method: str, lora_output: bool = False
) -> Path:
    """``merged-METHOD.safetensors`` if the base (or first model) is one file, else a folder
    (always a folder for ``--lora-output``: an adapter is one)."""
    reference = base if base is not None else models[0]
    single = reference.suffix == ".safetensors" and not lora_output
    return Path(f"merged-{method}{'.safetensors' if single else ''}")


#: Options of a full-checkpoint merge that an adapter output has no use for.
NOT_FOR_LORA_OUTPUT = {
    "device": "the adapter's factors are only scaled and stacked, on the CPU",
    "shard_size": "an adapter is one adapter_model.safetensors file",
}


def given_on_command_line(ctx: typer.Context, name: str) -> bool:
    """Whether option ``name`` was given, even at its default value."""
    source = ctx.get_parameter_source(name)  # typer's own click: compared by name
    return source is not None and source.name != "DEFAULT"


def check_lora_options(ctx: typer.Context) -> None:
    """Refuse, naming it, an option given with ``--lora-output`` that it cannot honour."""
    for name, reason in NOT_FOR_LORA_OUTPUT.items():
        if given_on_command_line(ctx, name):
            flag = f"--{name.replace('_', '-')}"
            raise ValueError(f"{flag} cannot be given with --lora-output: {reason}")


def needs_base(method: str) -> bool:
    """Whether ``method`` (a registered name) merges task vectors, which need a base."""
    return any(info.name == method and info.needs_base for info in method_catalog())


def missing_base(ctx: typer.Context, method: str) -> str | None:
    """The message for a method that needs ``--base`` run without one: the corrected command."""
    if not needs_base(method):
        return None
    return (
        f"--method {method} merges task vectors (model - base), so it needs --base: the "
        f"pre-trained checkpoint the models were fine-tuned from. Run: "
        f"{command_line(ctx, '--base', 'BASE')} (only --method mean needs no base)"
    )


def warn_if_one_model(models: list, method: str) -> None:
    """After a merge of one model (allowed): say that nothing was merged. Not before it, so
    that a merge that fails says only why. One LoRA adapter is no such slip: merging it into
    its base is how a whole model is made of it."""
    from mergekit_loco.io.lora import is_lora_adapter

    if len(models) == 1 and not is_lora_adapter(models[0]):
        print_warning(
            f"only one model given ({models[0]}): the output is --method {method} applied to it "
            "alone, nothing is merged; give two or more models to merge them"
        )


MERGE_KEYS = ("scale", "dtype", "compute_dtype")


def given_params(options: dict) -> dict:
    """The method parameters among the merge options (everything but scale and dtypes)."""
    return {key: value for key, value in options.items() if key not in MERGE_KEYS}


def from_config(
    ctx: typer.Context, config: Path, models, base, method, options: dict, lora_output: bool
):
    """(models, base, method, merge options) from a ``--config`` YAML file; the file decides
    what it describes, so MODEL, --base, --method and merge options beside it are errors (even
    at their defaults: ``--scale 1`` beside a file's ``lambda: 0.3``). A ``lambda`` other than
    1 needs ``base_model``, except for LoRA adapters (already deltas); so does a merge of
    adapters into full weights."""
    from mergekit_loco.merge_config import load_merge_config, missing_base_model

    clashes = [
        flag
        for flag, given in [
            ("MODEL", bool(models)),
            ("--base", base is not None),
            ("--method", method is not None),
            *[
                (f"--{name.replace('_', '-')}", given_on_command_line(ctx, name))
                for name in ("scale", "dtype", "compute_dtype")
            ],
            *[(f"--{name.replace('_', '-')}", True) for name in given_params(options)],
        ]
        if given
    ]
    if clashes:
        raise ValueError(f"--config {config}: {clashes[0]} cannot be given with a config file")
    configured = load_merge_config(config)
    if configured.base is None and needs_base(configured.method) and not lora_output:
        raise ValueError(missing_base_model(config, configured.method))
    from mergekit_loco.io.lora import is_lora_adapter

    adapters = [model for model in configured.models if is_lora_adapter(model)]
    if configured.base is None and adapters and not lora_output:
        raise ValueError(
            f"{config}: {adapters[0]} is a LoRA adapter (a delta): add 'base_model: BASE' to "
            f"{config}, BASE the model it adapts (or write an adapter: --lora-output)"
        )
    if configured.base is None and configured.scale != 1 and not lora_output:
        raise ValueError(
            f"{config}: lambda {configured.scale:g} needs base_model: without a base there is no "
            "task vector (model - base) to scale, and the merge is the mean of the models"
        )
    options = {
        "scale": configured.scale,
        "dtype": configured.dtype,
        "compute_dtype": configured.compute_dtype,
        **configured.params,
    }
    return configured.models, configured.base, configured.method, options


@user_errors
def merge(
    ctx: typer.Context,
    models: Annotated[
        list[Path] | None,
        typer.Argument(
            help="Fine-tuned checkpoints: .safetensors files, HF folders or LoRA adapter folders.",
            parser=path_parser,
        ),
    ] = None,
    method: Annotated[
        str | None, typer.Option("--method", "-m", help=f"One of: {', '.join(method_names())}.")
    ] = None,
    config: Annotated[
        Path | None,
        typer.Option(
            help="A mergekit-style YAML file: models, base, method and parameters.",
            parser=path_parser,
        ),
    ] = None,
    output: Annotated[
        Path | None,
        typer.Option(
            "--output",
            "-o",
            help="Output: a .safetensors file, or a folder (sharded, with index). Default: "
            "merged-METHOD.safetensors when the base (without --base: the first model) is a "
            ".safetensors file, else the folder merged-METHOD.",
            parser=path_parser,
        ),
    ] = None,
    base: Annotated[
        Path | None,
        typer.Option(
            help="The pre-trained checkpoint the models were fine-tuned from.", parser=path_parser
        ),
    ] = None,
    scale: Annotated[
        float,
        typer.Option(
            help="theta = base + scale * merged delta (needs --base, except with --lora-output)."
        ),
    ] = 1.0,
    density: Annotated[
        float | None, typer.Option(help="ties/dare/breadcrumbs: fraction kept, in (0, 1].")
    ] = None,
    gamma: Annotated[
        float | None, typer.Option(help="breadcrumbs: top-magnitude fraction dropped, in [0, 1).")
    ] = None,
    common_fraction: Annotated[
        float | None, typer.Option(help="iso-cts: common subspace fraction, in [0, 1).")
    ] = None,
    spectral: Annotated[
        str | None, typer.Option(help="iso-c/iso-cts: exact (SVD) or ns (Newton-Schulz).")
    ] = None,
    rank_aware: Annotated[
        bool,
        typer.Option("--rank-aware", help="iso-c/iso-cts/tsv: only non-zero singular directions."),
    ] = False,
    seed: Annotated[int | None, typer.Option(help="dare: seed of the drop masks.")] = None,
    option: Annotated[
        list[str] | None,
        typer.Option(help="Any method parameter as KEY=VALUE (repeatable): --option density=0.3."),
    ] = None,
    dtype: Annotated[
        str | None,
        typer.Option(
            help="Output dtype: float32, bfloat16, float16 or float64 (default: the base's; "
            "without a base, the models' common dtype; with --lora-output, float32)."
        ),
    ] = None,
    compute_dtype: Annotated[
        str,
        typer.Option(
            help="Dtype of deltas and merge math: float32 or float64 (float64 tensors: float64)."
        ),
    ] = "float32",
    device: Annotated[str, typer.Option(help="cpu or cuda.")] = "cpu",
    shard_size: Annotated[
        str, typer.Option(help="Largest shard of a folder output, e.g. 5GB, 500MB.")
    ] = DEFAULT_SHARD_SIZE,
    force: Annotated[bool, typer.Option("--force", help="Replace an existing output.")] = False,
    lora_output: Annotated[
        bool,
        typer.Option(
            "--lora-output", help="ta/mean of LoRA adapters: write one LoRA adapter folder."
        ),
    ] = False,
    quiet: Quiet = False,
    debug: Debug = False,
) -> None:
    """Merge fine-tunes of one base: theta = base + scale * method(model_t - base)."""
    if config is None and method is None:
        raise ValueError("Missing option '--method' (or give a --config file)")
    if config is None and not models:
        raise ValueError("Missing argument 'MODELS...' (or give a --config file)")
    if (
        config is None
        and base is None
        and not lora_output
        and (message := missing_base(ctx, method))
    ):
        raise ValueError(message)
    if lora_output:
        check_lora_options(ctx)
    if option and config is not None:
        raise ValueError(f"--config {config}: --option cannot be given with a config file")
    if seed is not None:
        check_seed(seed)
    given = {
        "density": density,
        "gamma": gamma,
        "common_fraction": common_fraction,
        "spectral": spectral,
        "seed": seed,
        "rank_aware": rank_aware or None,
    }
    out_dtype = parse_choice("--dtype", dtype, OUTPUT_DTYPES) if dtype is not None else None
    math_dtype = parse_choice("--compute-dtype", compute_dtype, COMPUTE_DTYPES)
    max_shard_bytes = parse_size(shard_size)

    import torch

    from mergekit_loco.io import OutputExistsError
    from mergekit_loco.merge import merge_checkpoints
    from mergekit_loco.methods import get_method, parse_options
    from mergekit_loco.methods.registry import METHODS, unknown_method

    given = {name: value for name, value in given.items() if value is not None}
    for key, value in (parse_options(method, option) if option else {}).items():
        if key in given:
            raise ValueError(f"--option {key}={value}: {key!r} is also given as a flag")
        given[key] = value
    options = {
        "scale": scale,
        "dtype": getattr(torch, out_dtype) if out_dtype is not None else None,
        "compute_dtype": getattr(torch, math_dtype),
        **given,
    }
    if config is not None:
        models, base, method, options = from_config(
            ctx, config, models, base, method, options, lora_output
        )
    if method not in METHODS:  # before a default -o is named after it
        raise unknown_method(method)
    # a default -o is named once the merge is written (the progress bar shows it meanwhile),
    # never before an error that writes nothing
    chosen = "" if output is not None else " (no -o given)"
    if output is None:
        output = default_output(models, base, method, lora_output)
    check_output_parent(output, "-o")

    try:
        if lora_output:
            from mergekit_loco.low_rank import merge_to_lora

            written = merge_to_lora(
                models,
                get_method(method, **given_params(options)),
                output,
                options["scale"],
                base,
                force,
                dtype=options["dtype"] or torch.float32,
                compute_dtype=options["compute_dtype"],
            )
            warn_if_one_model(models, method)
            if not quiet:
                output_console().print(f"wrote the merged LoRA adapter to {written}{chosen}")
            return
        summary = merge_checkpoints(
            models,
            base,
            method,
            output,
            device=device,
            force=force,
            progress=not quiet,
            max_shard_bytes=max_shard_bytes,
            **options,
        )
    except OutputExistsError:
        kind = "folder" if output.is_dir() else "file"
        raise ValueError(
            f"{output}: output {kind} exists; add --force to replace it, or choose another -o"
        ) from None
    warn_if_one_model(models, method)
    if not quiet:
        print_summary(summary, chosen)
