"""``mloco merge`` and ``mloco methods``."""

from __future__ import annotations

import re
from dataclasses import fields
from pathlib import Path
from typing import Annotated

import torch
import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from mergekit_loco.cli.common import Debug, Quiet, format_bytes, parse_choice, user_errors
from mergekit_loco.io import DEFAULT_MAX_SHARD_BYTES
from mergekit_loco.low_rank import merge_to_lora
from mergekit_loco.merge import MergeSummary, merge_checkpoints
from mergekit_loco.merge_config import load_merge_config
from mergekit_loco.methods import METHODS, get_method, list_methods, parse_options

OUTPUT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
COMPUTE_DTYPES = {"float32": torch.float32, "float64": torch.float64}
SIZE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
SIZE_UNITS |= {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(value: str) -> int:
    """``"5GB"`` -> 5e9 bytes; units B, KB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", value)
    if not match or match.group(2).lower() not in SIZE_UNITS or float(match.group(1)) <= 0:
        raise ValueError(f"--shard-size: {value!r} is not a size like 5GB, 500MB or 2GiB")
    return int(float(match.group(1)) * SIZE_UNITS[match.group(2).lower()])


MERGE_KEYS = ("scale", "dtype", "compute_dtype")


def given_params(options: dict) -> dict:
    """The method parameters among the merge options (everything but scale and dtypes)."""
    return {key: value for key, value in options.items() if key not in MERGE_KEYS}


def from_config(config: Path, models, base, method, options: dict):
    """(models, base, method, merge options) from a ``--config`` YAML file; the file decides
    what it describes, so MODEL, --base, --method and merge options beside it are errors."""
    clashes = [
        flag
        for flag, given in [
            ("MODEL", bool(models)),
            ("--base", base is not None),
            ("--method", method is not None),
            ("--scale", options["scale"] != 1.0),
            ("--dtype", options["dtype"] is not None),
            ("--compute-dtype", options["compute_dtype"] != torch.float32),
            *[(f"--{name.replace('_', '-')}", True) for name in options if name not in MERGE_KEYS],
        ]
        if given
    ]
    if clashes:
        raise ValueError(f"--config {config}: {clashes[0]} cannot be given with a config file")
    configured = load_merge_config(config)
    options = {
        "scale": configured.scale,
        "dtype": configured.dtype,
        "compute_dtype": configured.compute_dtype,
        **configured.params,
    }
    return configured.models, configured.base, configured.method, options


def print_summary(summary: MergeSummary) -> None:
    table = Table(title=f"merged {summary.models} models with {summary.method}", show_header=False)
    table.add_column(style="bold")
    table.add_column()
    table.add_row("tensors merged", str(summary.tensors_merged))
    table.add_row("tensors copied", str(summary.tensors_copied))
    table.add_row("time", f"{summary.seconds:.2f} s")
    table.add_row("peak memory (RSS)", format_bytes(summary.peak_rss_bytes))
    table.add_row("output", str(summary.out))
    Console().print(table)


@user_errors
def merge(
    output: Annotated[
        Path,
        typer.Option(
            "--output", "-o", help="Output: a .safetensors file, or a folder (sharded, with index)."
        ),
    ],
    models: Annotated[
        list[Path] | None,
        typer.Argument(help="Fine-tuned checkpoints: .safetensors files or HF folders."),
    ] = None,
    method: Annotated[
        str | None, typer.Option("--method", "-m", help=f"One of: {', '.join(list_methods())}.")
    ] = None,
    config: Annotated[
        Path | None,
        typer.Option(help="A mergekit-style YAML file: models, base, method and parameters."),
    ] = None,
    base: Annotated[
        Path | None,
        typer.Option(help="The pre-trained checkpoint the models were fine-tuned from."),
    ] = None,
    scale: Annotated[float, typer.Option(help="theta = base + scale * merged delta.")] = 1.0,
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
        bool, typer.Option("--rank-aware", help="iso-c: keep only non-zero singular directions.")
    ] = False,
    seed: Annotated[int | None, typer.Option(help="dare: seed of the drop masks.")] = None,
    option: Annotated[
        list[str] | None,
        typer.Option(help="Any method parameter as KEY=VALUE (repeatable): --option density=0.3."),
    ] = None,
    dtype: Annotated[
        str | None,
        typer.Option(help="Output dtype: float32, bfloat16 or float16 (default: the base's)."),
    ] = None,
    compute_dtype: Annotated[
        str, typer.Option(help="Dtype of deltas and merge math: float32 or float64.")
    ] = "float32",
    device: Annotated[str, typer.Option(help="cpu or cuda.")] = "cpu",
    shard_size: Annotated[
        str, typer.Option(help="Largest shard of a folder output, e.g. 5GB, 500MB.")
    ] = f"{DEFAULT_MAX_SHARD_BYTES // 10**9}GB",
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
    given = {
        "density": density,
        "gamma": gamma,
        "common_fraction": common_fraction,
        "spectral": spectral,
        "seed": seed,
        "rank_aware": rank_aware or None,
    }
    given = {name: value for name, value in given.items() if value is not None}
    if option and method is None:
        raise ValueError("--option needs --method (a config file sets parameters itself)")
    for key, value in (parse_options(method, option) if option else {}).items():
        if key in given:
            raise ValueError(f"--option {key}={value}: {key!r} is also given as a flag")
        given[key] = value
    options = {
        "scale": scale,
        "dtype": parse_choice("--dtype", dtype, OUTPUT_DTYPES) if dtype is not None else None,
        "compute_dtype": parse_choice("--compute-dtype", compute_dtype, COMPUTE_DTYPES),
        **given,
    }
    if config is not None:
        models, base, method, options = from_config(config, models, base, method, options)
    elif not models or method is None:
        raise ValueError("give MODEL... and --method (or a --config file)")
    if lora_output:
        merge_method = get_method(method, **given_params(options))
        written = merge_to_lora(models, merge_method, output, options["scale"], base, force)
        if not quiet:
            Console().print(f"wrote the merged LoRA adapter to {written}")
        return
    summary = merge_checkpoints(
        models,
        base,
        method,
        output,
        device=device,
        force=force,
        progress=not quiet,
        max_shard_bytes=parse_size(shard_size),
        **options,
    )
    if not quiet:
        print_summary(summary)


def method_parameters(method_class: type) -> str:
    defaults = [f"{field.name}={field.default}" for field in fields(method_class)]
    return ", ".join(defaults) or "none"


def method_math(method_class: type) -> str:
    """The first paragraph of the method's docstring, on one line, without RST quotes."""
    paragraph = (method_class.__doc__ or "").strip().split("\n\n")[0]
    return " ".join(paragraph.replace("``", "").split())


@user_errors
def methods(debug: Debug = False) -> None:
    """List the merge methods with their parameters (defaults) and math."""
    console = Console(highlight=False)
    for name, method_class in METHODS.items():
        base_note = "" if method_class.needs_base else "  (no --base needed)"
        console.print(f"[bold]{name}[/bold]{base_note}")
        console.print(escape(f"  parameters: {method_parameters(method_class)}"))
        console.print(escape(f"  {method_math(method_class)}"))
