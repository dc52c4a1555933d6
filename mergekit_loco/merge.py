"""One-shot merge of checkpoints, streamed one tensor name at a time.

For each tensor of the base: ``tau_t = theta_t - theta_base`` (in ``compute_dtype``),
``theta = theta_base + scale * method.merge_tensor(name, [tau_1 .. tau_T])``, cast, written.
Only one name's tensors are in memory at once: about (T + 2) x the largest tensor, plus whatever
the method allocates for that tensor.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from mergekit_loco.io import (
    DEFAULT_MAX_SHARD_BYTES,
    CheckpointError,
    CheckpointReader,
    CheckpointWriter,
    open_checkpoint,
)
from mergekit_loco.methods import MergeMethod, get_method
from mergekit_loco.task_vector import is_mergeable


class MissingBaseError(ValueError):
    """The method merges task vectors (model - base) but no base checkpoint was given."""


@dataclass(frozen=True)
class MergeSummary:
    """What :func:`merge_checkpoints` did. ``peak_rss_bytes`` is the process's high-water mark."""

    out: Path
    method: str
    models: int
    tensors_merged: int
    tensors_copied: int
    seconds: float
    peak_rss_bytes: int


def peak_rss_bytes() -> int:
    """Peak resident set size of this process (VmHWM, else ``ru_maxrss``), in bytes."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def missing_base_message(method: str, models: Sequence[Path], out: str | Path) -> str:
    model_args = " ".join(str(path) for path in models)
    return (
        f"method {method!r} needs --base: the pre-trained checkpoint the models were fine-tuned "
        f"from (task vectors are model - base); run: mloco merge {model_args} --base BASE "
        f"--method {method} -o {out} (only --method mean needs no base)"
    )


def dtype_kind(dtype: torch.dtype) -> str:
    if dtype.is_floating_point:
        return "float"
    if dtype.is_complex:
        return "complex"
    return "bool" if dtype == torch.bool else "integer"


def check_compatible(base: CheckpointReader, models: Sequence[CheckpointReader]) -> None:
    """Same tensor names, shapes and dtype kinds in every model as in the base (headers only)."""
    for model in models:
        if model is base:
            continue
        for name in base.names():
            if name not in model:
                raise CheckpointError(
                    f"{model.path}: tensor {name!r} of the base ({base.path}) is missing"
                )
        extra = next((name for name in model.names() if name not in base), None)
        if extra is not None:
            raise CheckpointError(
                f"{model.path}: tensor {extra!r} is not in the base ({base.path})"
            )
        for name in base.names():
            if model.shape(name) != base.shape(name):
                raise CheckpointError(
                    f"{model.file_of(name)}: tensor {name!r} has shape {list(model.shape(name))}"
                    f" but the base ({base.file_of(name)}) has {list(base.shape(name))}"
                )
            kind, base_kind = dtype_kind(model.dtype(name)), dtype_kind(base.dtype(name))
            if kind != base_kind:
                raise CheckpointError(
                    f"{model.file_of(name)}: tensor {name!r} is {kind} ({model.dtype(name)}) but "
                    f"the base's is {base_kind} ({base.dtype(name)})"
                )


def all_finite(tensor: torch.Tensor) -> bool:
    """NaN and Inf propagate into a sum, so a finite sum proves every entry finite (and is
    several times cheaper than ``isfinite``); only an overflowing sum needs the full check.
    8-bit floats (F8_E4M3, F8_E5M2), which torch cannot sum, are checked in float32."""
    if tensor.dtype.itemsize == 1:
        tensor = tensor.float()
    return bool(torch.isfinite(tensor.sum())) or bool(torch.isfinite(tensor).all())


def read_finite(reader: CheckpointReader, name: str) -> torch.Tensor:
    """``reader.get(name)``, raising if a floating tensor holds NaN or Inf."""
    tensor = reader.get(name)
    if tensor.is_floating_point() and not all_finite(tensor):
        what = "NaN" if torch.isnan(tensor).any() else "Inf"
        raise CheckpointError(f"{reader.file_of(name)}: tensor {name!r} contains {what}")
    return tensor


def merge_one(
    name: str,
    base: CheckpointReader,
    models: Sequence[CheckpointReader],
    method: MergeMethod,
    scale: float,
    out_dtype: torch.dtype | None,
    compute_dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor | None:
    """``base + scale * merge(models - base)`` for tensor ``name``; None if it is not floating."""
    base_tensor = read_finite(base, name)
    if not is_mergeable(base_tensor):
        return None
    out_dtype = out_dtype or base_tensor.dtype
    theta = base_tensor.to(device=device, dtype=compute_dtype)
    del base_tensor
    deltas = []
    for model in models:
        if model is base:
            deltas.append(torch.zeros_like(theta))
            continue
        tuned = read_finite(model, name).to(device=device, dtype=compute_dtype)
        deltas.append(tuned.sub_(theta))  # the tensor just read is ours to overwrite
    merged_delta = method.merge_tensor(name, deltas)
    del deltas
    theta.add_(merged_delta, alpha=scale)
    del merged_delta
    theta = theta.to(out_dtype)
    if not all_finite(theta):
        raise ValueError(
            f"{method.name}: merged tensor {name!r} is not finite in {out_dtype} (overflow?)"
        )
    return theta


def resolve_method(method: str | MergeMethod, params: dict) -> MergeMethod:
    if isinstance(method, MergeMethod):
        if params:
            raise ValueError(
                f"pass parameters {sorted(params)} to get_method, not with a MergeMethod object"
            )
        return method
    return get_method(method, **params)


def resolve_device(device: str | torch.device) -> torch.device:
    try:
        resolved = torch.device(device)
    except RuntimeError:
        raise ValueError(f"--device: {device!r} is not a device (use cpu or cuda)") from None
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available here")
    return resolved


def merge_progress(enabled: bool) -> Progress:
    """A progress bar over tensors on stderr (only drawn on a terminal)."""
    console = Console(stderr=True)
    return Progress(
        TextColumn("[bold]merging"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.fields[tensor]}"),
        console=console,
        transient=True,
        disable=not (enabled and console.is_terminal),
    )


def merge_checkpoints(
    models: Sequence[str | Path],
    base: str | Path | None,
    method: str | MergeMethod,
    out: str | Path,
    scale: float = 1.0,
    dtype: torch.dtype | None = None,
    compute_dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    force: bool = False,
    progress: bool = True,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    **method_params,
) -> MergeSummary:
    """Merge fine-tuned checkpoints into ``out``, streaming one tensor name at a time.

    ``theta = theta_base + scale * method([theta_t - theta_base])`` for every floating tensor of
    the base; other tensors are copied from the base. ``dtype`` is the output dtype of floating
    tensors (default: the base's); deltas and the merge run in ``compute_dtype`` on ``device``.
    8-bit float inputs (F8_E4M3, F8_E5M2) are merged in ``compute_dtype`` and written back in
    their dtype (a merged value beyond its range is an error, not a silent NaN).
    ``base=None`` is allowed for methods that need none (``mean``): the first model serves as
    base, so the result is ``mean(models)`` at scale 1. ``out`` ending in ``.safetensors`` is a
    file, anything else a Hugging Face folder with the base's config and tokenizer files.

    Raises :class:`MissingBaseError`, :class:`CheckpointError` (unreadable, mismatched or
    non-finite inputs, output exists) or ``ValueError`` (bad method or parameter); nothing is
    left at ``out`` on failure.
    """
    started = time.perf_counter()
    merge_method = resolve_method(method, method_params)
    model_paths = [Path(model) for model in models]
    if not model_paths:
        raise ValueError("no models to merge: give at least one MODEL")
    if base is None and merge_method.needs_base:
        raise MissingBaseError(missing_base_message(merge_method.name, model_paths, out))
    if not compute_dtype.is_floating_point:
        raise ValueError(f"compute dtype must be floating point, not {compute_dtype}")
    if dtype is not None and not dtype.is_floating_point:
        raise ValueError(f"output dtype must be floating point, not {dtype}")
    if not (isinstance(scale, int | float) and abs(scale) <= torch.finfo(compute_dtype).max):
        raise ValueError(f"--scale: {scale!r} is not a finite number in {compute_dtype}")
    target = resolve_device(device)
    merged_count = copied_count = 0
    with ExitStack() as stack:
        readers = [stack.enter_context(open_checkpoint(path)) for path in model_paths]
        base_reader = stack.enter_context(open_checkpoint(base)) if base is not None else readers[0]
        check_compatible(base_reader, readers)
        writer = stack.enter_context(
            CheckpointWriter(
                out,
                max_shard_bytes,
                force,
                config_dir=base_reader.config_dir,
                inputs=[*model_paths, base],
            )
        )
        bar = stack.enter_context(merge_progress(progress))
        task = bar.add_task("merge", total=len(base_reader), tensor="")
        for name in base_reader.names():
            bar.update(task, tensor=name)
            merged = merge_one(
                name, base_reader, readers, merge_method, scale, dtype, compute_dtype, target
            )
            if merged is None:
                writer.write(name, base_reader.get(name))
                copied_count += 1
            else:
                writer.write(name, merged)
                merged_count += 1
            del merged
            bar.advance(task)
    return MergeSummary(
        out=Path(out),
        method=merge_method.name,
        models=len(model_paths),
        tensors_merged=merged_count,
        tensors_copied=copied_count,
        seconds=time.perf_counter() - started,
        peak_rss_bytes=peak_rss_bytes(),
    )
