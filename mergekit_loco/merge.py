"""One-shot merge of checkpoints, streamed one tensor name at a time.

For each tensor of the base: ``tau_t = theta_t - theta_base`` (in ``compute_dtype``),
``theta = theta_base + scale * method.merge_tensor(name, [tau_1 .. tau_T])``, cast, written.
Only one name's tensors are in memory at once: about (T + 2) x the largest tensor, plus whatever
the method allocates for that tensor.
"""

from __future__ import annotations

import inspect
import math
import numbers
import os
import sys
import time
from collections.abc import Iterable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from mergekit_loco.console import stderr_progress
from mergekit_loco.device import resolve_device
from mergekit_loco.io import (
    DEFAULT_MAX_SHARD_BYTES,
    CheckpointError,
    CheckpointReader,
    CheckpointWriter,
    open_checkpoint,
)
from mergekit_loco.io.lora import LoraAdapter, is_lora_adapter
from mergekit_loco.io.prefetch import Prefetcher
from mergekit_loco.low_rank import LowRankDelta, from_factors, merge_from_factors
from mergekit_loco.merge_checks import (
    check_compatible,
    check_distinct,
    checked_scale,
    config_source,
    floating_shapes,
)
from mergekit_loco.methods import MergeMethod, get_method
from mergekit_loco.methods.base import check_implemented, promoted_dtype, sum_of
from mergekit_loco.methods.registry import check_keyword_typos
from mergekit_loco.task_vector import all_finite, is_mergeable


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


def scale_without_base(scale: float) -> str:
    """Why ``--scale`` needs ``--base``: without one, the merge is ``mean(models)`` itself."""
    return (
        f"--scale {scale:g} needs --base: without a base there is no task vector (model - base) "
        "to scale, and the merge is the mean of the models; give --base or drop --scale"
    )


def check_same_values(name: str, inputs: list, stand_in: CheckpointReader) -> None:
    """Without a base a tensor that is not merged (integer, bool) is copied from the stand-in
    model, so every model must hold the same values in the same dtype (else the model order
    would decide)."""
    for tensor in inputs[1:]:
        if tensor is None:
            continue
        if tensor.dtype != inputs[0].dtype:
            raise CheckpointError(
                f"{stand_in.file_of(name)}: tensor {name!r} (not merged) is {inputs[0].dtype} "
                f"here but {tensor.dtype} in another model; without --base neither can be "
                "chosen: give --base"
            )
        if not torch.equal(tensor, inputs[0]):
            raise CheckpointError(
                f"{stand_in.file_of(name)}: tensor {name!r} ({inputs[0].dtype}, not merged) "
                "differs between the models; without --base none of them can be chosen: give "
                "--base"
            )


def at_least(compute_dtype: torch.dtype, dtype: torch.dtype) -> torch.dtype:
    """The compute dtype for a tensor of ``dtype``: never below its precision (a float64 base is
    not rounded through float32; torch has no promotion rules for 8-bit floats)."""
    return dtype if dtype.itemsize > compute_dtype.itemsize else compute_dtype


def read_finite(reader: CheckpointReader, name: str) -> torch.Tensor:
    """``reader.get(name)``, raising if a floating tensor holds NaN or Inf."""
    tensor = reader.get(name)
    if tensor.is_floating_point() and not all_finite(tensor):
        what = "NaN" if torch.isnan(tensor).any() else "Inf"
        raise CheckpointError(f"{reader.file_of(name)}: tensor {name!r} contains {what}")
    return tensor


def read_inputs(
    name: str,
    base: CheckpointReader,
    models: Sequence[CheckpointReader | LoraAdapter],
    compute_dtype: torch.dtype,
) -> list:
    """``[base tensor, model_1 input, ..]`` of ``name``: a model's tensor, None for a model that
    is the base, a :class:`LowRankDelta` for a LoRA adapter (its factors in the compute dtype of
    the base's tensor, :func:`at_least`: a float64 base is not rounded through float32)."""
    inputs: list = [read_finite(base, name)]
    factor_dtype = at_least(compute_dtype, inputs[0].dtype)
    for model in models:
        if isinstance(model, LoraAdapter):
            factors = model.factors(name, factor_dtype) if name in model else (None, None)
            inputs.append(LowRankDelta(*factors))
        else:
            inputs.append(None if model is base else read_finite(model, name))
    return inputs


def summing_dtype(compute_dtype: torch.dtype, base_free: bool) -> torch.dtype:
    """``compute_dtype``, or float64 for a merge without a base: exact sums of float32 (and
    narrower) models, so that no model order rounds differently."""
    return torch.float64 if base_free else compute_dtype


def merge_one(
    name: str,
    inputs: list[torch.Tensor | None],
    method: MergeMethod,
    scale: float,
    out_dtype: torch.dtype | None,
    compute_dtype: torch.dtype,
    device: torch.device,
    base_free: bool = False,
) -> torch.Tensor:
    """``base + scale * merge(models - base)`` for floating tensor ``name`` from ``inputs`` (see
    :func:`read_inputs`; the list is emptied as tensors are used, so each raw input is freed as
    soon as its delta exists).

    ``base_free``: the first input is only the stand-in model of a merge without a base (its
    own entry is None); the base is then zero, ``theta = method(models)``, written in the dtype
    the models' dtypes promote to (the caller sums in float64: :func:`summing_dtype`), so
    neither the models' order nor which of them stands in changes a bit of the result.

    Rows the models appended beyond the base's (added tokens) are not merged: the result's
    extra rows are the mean of those rows over the models that have them.
    """
    base_tensor = inputs.pop(0)
    if base_free:
        inputs[:] = [base_tensor if item is None else item for item in inputs]
        dtype = promoted_dtype(inputs)  # one exists: merge_checks.check_common_dtype
        base_tensor = torch.zeros(base_tensor.shape, dtype=dtype)
    out_dtype = out_dtype or base_tensor.dtype
    compute_dtype = at_least(compute_dtype, base_tensor.dtype)
    # Deltas are formed against the base in the compute dtype: mixed-dtype kernels are slow.
    base_on_device = base_tensor.to(device=device, dtype=compute_dtype)
    # A method given all T deltas holds them while it runs: the base meanwhile stays in its
    # (narrower) input dtype, converted again to finish.
    narrower = base_tensor.dtype.itemsize < compute_dtype.itemsize and not method.is_sum()
    base_input = base_tensor if narrower else None
    del base_tensor
    rows = base_on_device.shape[0] if base_on_device.ndim else 0
    if all(isinstance(item, LowRankDelta) for item in inputs) and from_factors(method):
        merged = merge_from_factors(
            method, name, inputs, base_on_device.shape, compute_dtype, device
        )
        return finish_one(name, method, base_on_device, merged, scale, [], out_dtype)
    # A sum method (merged = finish(sum_t local_term(tau_t, t))) is summed as the deltas come,
    # so one running sum is held instead of T deltas; any other method gets the T deltas.
    summing = method.is_sum()
    deltas, appended, total = [], [], None
    for index in range(len(inputs)):
        tuned = inputs.pop(0)
        if isinstance(tuned, LowRankDelta):
            delta = tuned.dense(base_on_device)
        else:
            tuned = tuned.to(device=device, dtype=compute_dtype)  # a fresh read: ours
            if base_on_device.ndim and tuned.shape[0] > rows:
                appended.append(tuned[rows:])
                tuned = tuned[:rows]
            delta = tuned.sub_(base_on_device)
        del tuned
        if not summing:
            deltas.append(delta)
            continue
        term = method.local_term(name, delta, index)
        del delta
        total = term if total is None else total.add_(term)
        del term
    if summing:
        if not all_finite(total):  # finite inputs whose differences overflow compute_dtype
            raise ValueError(
                f"{method.name}: the deltas of tensor {name!r} overflow {compute_dtype} (a model "
                "and the base differ by more than it holds); try --compute-dtype float64"
            )
        merged = method.finish(name, total, index + 1).to(compute_dtype)
    else:
        if base_input is not None:
            del base_on_device
        merged = method.merge_tensor(name, deltas)
        if base_input is not None:
            base_on_device = base_input.to(device=device, dtype=compute_dtype)
    del deltas, total, base_input
    return finish_one(name, method, base_on_device, merged, scale, appended, out_dtype)


def finish_one(name, method, base_tensor, merged, scale, appended, out_dtype) -> torch.Tensor:
    """``base + scale * merged`` (in ``merged``'s memory), appended rows averaged below it,
    cast to ``out_dtype`` and checked finite."""
    theta = torch.add(base_tensor, merged, alpha=scale, out=merged)
    del base_tensor
    if appended:
        theta = torch.cat([theta, sum_of(appended).div_(len(appended))])
    theta = theta.to(out_dtype)
    if not all_finite(theta):
        raise ValueError(
            f"{method.name}: merged tensor {name!r} is not finite in {out_dtype} (overflow?)"
        )
    return theta


def prefetched_inputs(
    base: CheckpointReader,
    models: Sequence[CheckpointReader],
    compute_dtype: torch.dtype,
    out_dtype: torch.dtype | None,
) -> Prefetcher:
    """``(name, read_inputs(name))`` over the base's tensors, the next name read while the
    current one merges whenever both fit in the streaming bound.

    The bound is the largest no-prefetch working set of one name (counted generously): its raw
    inputs; the base, T deltas and the result in the compute dtype; the output cast. That is
    about (T + 2) x the largest tensor; what the method allocates comes on top.
    """
    readers = [base] + [m for m in models if m is not base and isinstance(m, CheckpointReader)]

    def input_bytes(name: str) -> int:
        return sum(r.entry(name).end - r.entry(name).begin for r in readers)  # adapters: small

    def working_bytes(name: str) -> int:
        numel = max(math.prod(r.shape(name)) for r in readers)
        out_itemsize = (out_dtype or base.dtype(name)).itemsize
        compute_itemsize = at_least(compute_dtype, base.dtype(name)).itemsize
        return input_bytes(name) + numel * (compute_itemsize * (len(models) + 2) + out_itemsize)

    names = base.names()
    budget = max((working_bytes(name) for name in names), default=0)
    return Prefetcher(
        names,
        lambda name: read_inputs(name, base, models, compute_dtype),
        input_bytes,
        working_bytes,
        budget,
    )


def resolve_method(method: str | MergeMethod, params: dict) -> MergeMethod:
    """``get_method(method, **params)``, or a method object as given once it provides what a
    merge needs (:func:`~mergekit_loco.methods.base.check_implemented`: a name and its math),
    so that nothing is written for a method that cannot finish."""
    if isinstance(method, MergeMethod):
        if params:
            raise ValueError(
                f"pass parameters {sorted(params)} to get_method, not with a MergeMethod object"
            )
        check_implemented(method)
        return method
    return get_method(method, **params)


def merge_progress(enabled: bool, out: Path) -> Progress:
    """A progress bar over tensors into ``out`` on stderr (only drawn on a terminal)."""
    shown_out = escape(str(out)).replace("{", "{{").replace("}", "}}")  # markup, then format
    return stderr_progress(
        enabled,
        TextColumn(f"[bold]merging into {shown_out}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.fields[tensor]}"),
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
    tensors (default: the base's); deltas and the merge run in ``compute_dtype`` (float64 for a
    float64 tensor of the base) on ``device``.
    8-bit float inputs (F8_E4M3, F8_E5M2) are merged in ``compute_dtype`` and written back in
    their dtype (a merged value beyond its range is an error, not a silent NaN).
    ``base=None`` is allowed for methods that need none (``mean``): the result is
    ``mean(models)`` in the dtype the models' dtypes promote to (``scale`` must be 1; a tensor
    that is not merged must be equal in every model, and every model must have the same
    shapes), and the first model gives the tensor list and the config files.
    ``out`` ending in ``.safetensors`` is a file, anything else a Hugging Face folder with the
    base's config and tokenizer files.

    Raises :class:`MissingBaseError`, :class:`CheckpointError` (unreadable, mismatched or
    non-finite inputs, output exists) or ``ValueError`` (bad method or parameter); nothing is
    left at ``out`` on failure.
    """
    started = time.perf_counter()
    keywords = list(inspect.signature(merge_checkpoints).parameters)
    check_keyword_typos(method_params, keywords, "merge_checkpoints")
    merge_method = resolve_method(method, method_params)
    if isinstance(models, str | Path):
        raise TypeError(f"models: a list of checkpoints ([{str(models)!r}, ...]), not one path")
    for name, given in (("dtype", dtype), ("compute_dtype", compute_dtype)):
        if given is not None and not isinstance(given, torch.dtype):
            raise TypeError(f"{name}: a torch.dtype (torch.bfloat16), not {given!r}")
    for name, given in (("force", force), ("progress", progress)):
        if not isinstance(given, bool):  # force="no" is truthy: it overwrote an output
            raise TypeError(f"{name} must be True or False, not {given!r}")
    if not isinstance(models, Iterable):
        raise TypeError(f"models: a list of checkpoints (paths), not {models!r}")
    if isinstance(max_shard_bytes, bool) or not isinstance(max_shard_bytes, numbers.Integral):
        raise TypeError(f"max_shard_bytes: an int (bytes per shard), not {max_shard_bytes!r}")
    models = list(models)  # any iterable, read once
    for what, given in (*(("models", model) for model in models), ("base", base), ("out", out)):
        if not isinstance(given, str | os.PathLike) and not (what == "base" and given is None):
            raise TypeError(f"{what}: a path (str or Path), not {given!r}")
        if isinstance(given, str) and not given.strip():
            raise ValueError(f"{what}: an empty path (it would mean the current folder)")
    model_paths = [Path(model) for model in models]
    if not model_paths:
        raise ValueError("no models to merge: give at least one MODEL")
    merge_method.check_tasks(len(model_paths))
    if base is None and merge_method.needs_base:
        raise MissingBaseError(missing_base_message(merge_method.name, model_paths, out))
    check_distinct(model_paths, Path(base) if base is not None else None)
    if not compute_dtype.is_floating_point:
        raise ValueError(f"compute dtype must be floating point, not {compute_dtype}")
    if dtype is not None and not dtype.is_floating_point:
        raise ValueError(f"output dtype must be floating point, not {dtype}")
    scale = checked_scale(scale, compute_dtype)
    if base is None and scale != 1:
        raise ValueError(scale_without_base(scale))
    target = resolve_device(device)
    merged_count = copied_count = 0
    with ExitStack() as stack:
        readers = [
            stack.enter_context(
                LoraAdapter(path) if is_lora_adapter(path) else open_checkpoint(path)
            )
            for path in model_paths
        ]
        adapters = [reader for reader in readers if isinstance(reader, LoraAdapter)]
        if adapters and base is None:
            raise MissingBaseError(
                f"{adapters[0].path} is a LoRA adapter (a delta): give --base, the model it adapts"
            )
        # without a base the first model stands in for it: its names, shapes and config files
        base_reader = stack.enter_context(open_checkpoint(base)) if base is not None else readers[0]
        full = [reader for reader in readers if reader not in adapters]
        appended = check_compatible(base_reader, full, stand_in=base is None)
        for adapter in adapters:
            adapter.check_against(base_reader)
        merge_method.check_shapes(floating_shapes(base_reader), len(model_paths))
        writer = stack.enter_context(
            CheckpointWriter(
                out,
                max_shard_bytes,
                force,
                config_dir=config_source(base_reader, readers, appended),
                inputs=[*model_paths, base],
            )
        )
        compute_dtype = summing_dtype(compute_dtype, base is None)
        stream = prefetched_inputs(base_reader, readers, compute_dtype, dtype)
        bar = stack.enter_context(merge_progress(progress, out))
        task = bar.add_task("merge", total=len(base_reader), tensor="")
        for name, inputs in stream:
            bar.update(task, tensor=name)
            if is_mergeable(inputs[0]):
                merged = merge_one(name, inputs, merge_method, scale, dtype, compute_dtype,
                                   target, base_free=base is None)  # fmt: skip
                writer.write(name, merged)
                merged_count += 1
                del merged
            else:
                if base is None:
                    check_same_values(name, inputs, base_reader)
                writer.write(name, inputs[0])
                copied_count += 1
            del inputs
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
