"""Wall time and peak memory of `mloco merge`, side by side with mergekit.

Builds a Llama-shaped checkpoint with random bfloat16 weights (~106M parameters; ~23M with
--small) and 3 fine-tunes (base + noise) in a temporary folder, then merges them with mean, ta,
ties, iso-c, tsv and iso-cts, each in a fresh process forked from a small wrapper, so that its
peak RSS (``ru_maxrss`` from ``wait4``) belongs to that merge alone. With mergekit available
(its own interpreter via --mergekit-python, or ``mergekit-yaml`` on PATH / --mergekit-bin) the
shared merges (mean = mergekit's linear, ta, ties) run from one YAML file through mloco
(``load_merge_config``) and then mergekit, and a table of ratios is printed, with the largest
difference between the two outputs. ``cat`` of the four
input files is timed too: the I/O floor.

    python benchmarks/merge_bench.py [--small] [--mergekit-python PY] [--repeat N]
        [--methods mean ta ties ...] [--workdir DIR]

Deltas are computed in float32 by both tools (mergekit: ``dtype: float32``, ``out_dtype:
bfloat16``); the output is bfloat16 like the inputs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from common import llama_shapes, machine
from safetensors.torch import save_file

from mergekit_loco.io import open_checkpoint

SHAPES = {
    "full": {"hidden": 768, "layers": 8, "intermediate": 2048, "vocab": 32000, "heads": 12},
    "small": {"hidden": 512, "layers": 4, "intermediate": 1024, "vocab": 16000, "heads": 8},
}
FINETUNES = 3
DELTA_STD = 0.002
#: label -> (mloco method, method parameters, with a base?, mergekit method or None)
RUNS = {
    "mean": ("mean", {}, False, "linear"),
    "ta": ("ta", {}, True, "task_arithmetic"),
    "ties": ("ties", {"density": 0.2}, True, "ties"),
    "iso-c": ("iso-c", {}, True, None),
    "tsv": ("tsv", {}, True, None),
    "iso-cts": ("iso-cts", {}, True, None),
}
MLOCO_CHILD = """
import json, sys
from mergekit_loco.merge import merge_checkpoints, peak_rss_bytes
from mergekit_loco.merge_config import load_merge_config
spec = json.loads(sys.argv[1])
floor = peak_rss_bytes()
if spec["config"]:  # the YAML mergekit runs, read by mloco
    c = load_merge_config(spec["config"])
    summary = merge_checkpoints(c.models, c.base, c.method, spec["out"], scale=c.scale,
                                dtype=c.dtype, compute_dtype=c.compute_dtype, progress=False,
                                force=True, **c.params)
else:
    summary = merge_checkpoints(spec["models"], spec["base"], spec["method"], spec["out"],
                                progress=False, force=True, **spec["params"])
print(json.dumps({"merge_seconds": summary.seconds, "floor_bytes": floor}))
"""


def llama_config(shape: dict) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": shape["hidden"],
        "intermediate_size": shape["intermediate"],
        "num_hidden_layers": shape["layers"],
        "num_attention_heads": shape["heads"],
        "num_key_value_heads": shape["heads"],
        "vocab_size": shape["vocab"],
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }


def tensor_shapes(shape: dict) -> dict[str, tuple[int, ...]]:
    return llama_shapes(shape["hidden"], shape["layers"], shape["intermediate"], shape["vocab"])


def write_checkpoints(root: Path, shape: dict) -> tuple[Path, list[Path]]:
    """A random bf16 base and FINETUNES fine-tunes (base + N(0, DELTA_STD^2)), as HF folders."""
    generator = torch.Generator().manual_seed(0)
    tensors = tensor_shapes(shape)
    base = {n: (torch.randn(s, generator=generator) * 0.02).bfloat16() for n, s in tensors.items()}
    folders = [root / "base"] + [root / f"ft{i}" for i in range(1, FINETUNES + 1)]
    for index, folder in enumerate(folders):
        folder.mkdir(parents=True)
        (folder / "config.json").write_text(json.dumps(llama_config(shape), indent=2))
        state = base
        if index:
            state = {
                n: (t.float() + torch.randn(t.shape, generator=generator) * DELTA_STD).bfloat16()
                for n, t in base.items()
            }
        save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    return folders[0], folders[1:]


#: Runs argv[2:] as its only child and writes that child's ru_maxrss (KiB) to argv[1]. A child
#: forked from a large process reports at least that process's high-water mark (Linux keeps
#: the old memory's peak across exec), so the merge is forked from this small interpreter,
#: never from the benchmark that built the checkpoints.
PEAK_WRAPPER = """
import os, sys
pid = os.fork()
if pid == 0:
    os.execvp(sys.argv[2], sys.argv[2:])
_, status, usage = os.wait4(pid, 0)
with open(sys.argv[1], "w") as peak:
    peak.write(str(usage.ru_maxrss))
sys.exit(os.waitstatus_to_exitcode(status) % 256)
"""


def run_measured(command: list[str], keep_stdout: bool = True) -> tuple[float, int, str]:
    """Run ``command``: (wall seconds, peak RSS of that command alone in bytes, its stdout).

    The command is the only child of a fresh ``python -S`` (:data:`PEAK_WRAPPER`), which reaps
    it with ``wait4`` and reports its ``ru_maxrss``; the wrapper's start (~20 ms) is in the wall
    time.
    """
    with (
        tempfile.TemporaryFile("w+") as stdout,
        tempfile.TemporaryFile("w+") as stderr,
        tempfile.NamedTemporaryFile("r") as peak,
    ):
        started = time.perf_counter()
        process = subprocess.run(
            [sys.executable, "-S", "-c", PEAK_WRAPPER, peak.name, *command],
            stdout=stdout if keep_stdout else subprocess.DEVNULL,
            stderr=stderr,
            text=True,
        )
        seconds = time.perf_counter() - started
        stdout.seek(0)
        stderr.seek(0)
        if process.returncode != 0:
            raise RuntimeError(
                f"{command[0]} failed ({process.returncode}):\n{stderr.read()[-3000:]}"
            )
        return seconds, int(peak.read()) * 1024, stdout.read()


@dataclass
class Result:
    label: str
    tool: str
    seconds: float
    peak_rss_bytes: int
    merge_seconds: float | None = None
    floor_bytes: int | None = None


def run_mloco(label, base, models, out, workdir) -> Result:
    """mloco's merge: from the same YAML file as mergekit's where the method is shared."""
    method, params, with_base, shared = RUNS[label]
    config = None
    if shared:
        config = workdir / f"mergekit-{label}.yml"
        config.write_text(mergekit_config(label, base, models))
    spec = {
        "models": [str(m) for m in models],
        "base": str(base) if with_base else None,
        "method": method,
        "out": str(out),
        "params": params,
        "config": str(config) if config else None,
    }
    seconds, peak, stdout = run_measured([sys.executable, "-c", MLOCO_CHILD, json.dumps(spec)])
    child = json.loads(stdout.strip().splitlines()[-1])
    return Result(label, "mloco", seconds, peak, child["merge_seconds"], child["floor_bytes"])


def mergekit_config(label: str, base: Path, models: list[Path]) -> str:
    """The YAML for mergekit: weight 1 per model (the same file runs `mloco merge --config`)."""
    _, params, with_base, method = RUNS[label]
    lines = [f"merge_method: {method}"] + ([f"base_model: {base}"] if with_base else [])
    lines.append("models:")
    for model in models:
        parameters = {"weight": 1.0} | params
        lines += [f"  - model: {model}", f"    parameters: {json.dumps(parameters)}"]
    return "\n".join(lines + ["dtype: float32", "out_dtype: bfloat16"]) + "\n"


def run_mergekit(command, label, base, models, out, workdir) -> Result:
    config = workdir / f"mergekit-{label}.yml"
    config.write_text(mergekit_config(label, base, models))
    shutil.rmtree(out, ignore_errors=True)
    seconds, peak, _ = run_measured([*command, str(config), str(out), "--no-copy-tokenizer"])
    return Result(label, "mergekit", seconds, peak)


def largest_difference(ours: Path, theirs: Path) -> tuple[float, float]:
    """(max |ours - theirs| over all entries, fraction of entries that differ)."""
    worst, differing, total = 0.0, 0, 0
    with open_checkpoint(ours) as left, open_checkpoint(theirs) as right:
        for name in left.names():
            difference = (left.get(name).double() - right.get(name).double()).abs()
            worst = max(worst, float(difference.max()))
            differing += int((difference > 0).sum())
            total += difference.numel()
    return worst, differing / total


def median_result(results: list[Result]) -> Result:
    """The run with the median wall time (its own peak RSS and merge time)."""
    ordered = sorted(results, key=lambda r: r.seconds)
    return ordered[(len(ordered) - 1) // 2]


def print_tables(results, ratios, cat_seconds, differences, shape_line, largest_bytes, loads):
    megabyte = 2**20
    print(f"\n{shape_line}")
    print(f"machine: {machine()}")
    print(f"load average before / after: {loads[0]} / {loads[1]}\n")
    header = (
        f"{'method':<9} {'tool':<9} {'wall s':>7} {'merge s':>8} {'peak RSS MB':>12}"
        f" {'(peak-floor)/largest':>21} {'wall/cat':>9}"
    )
    print(header)
    print("-" * len(header))
    for r in results:
        merge_s = f"{r.merge_seconds:.2f}" if r.merge_seconds is not None else "-"
        above = (
            f"{(r.peak_rss_bytes - r.floor_bytes) / largest_bytes:.1f}" if r.floor_bytes else "-"
        )
        print(
            f"{r.label:<9} {r.tool:<9} {r.seconds:>7.2f} {merge_s:>8}"
            f" {r.peak_rss_bytes / megabyte:>12.0f} {above:>21} {r.seconds / cat_seconds:>9.1f}"
        )
    floors = [r.floor_bytes for r in results if r.floor_bytes]
    print(
        f"\ncat of the 4 inputs: {cat_seconds:.2f} s. floor = RSS of the mloco child after "
        f"imports: {max(floors) / megabyte:.0f} MB. wall s = whole process incl. imports."
    )
    if ratios:
        print(
            f"\n{'method':<8} {'wall mloco/mergekit':>20} {'peak RSS mloco/mergekit':>24}"
            f" {'max |mloco-mergekit|':>21} {'entries differing':>18}"
        )
        for label, (wall, peak) in ratios.items():
            worst, fraction = differences[label]
            print(f"{label:<8} {wall:>20.2f} {peak:>24.2f} {worst:>21.2e} {fraction:>17.2%}")
        print("(ratios: median over the repeats of each back-to-back pair of runs)")


def paired_ratios(runs: dict) -> dict[str, tuple[float, float]]:
    """label -> (median wall ratio, median peak RSS ratio) of each mloco run over the mergekit
    run right after it."""
    ratios = {}
    for (label, tool), ours in runs.items():
        theirs = runs.get((label, "mergekit"))
        if tool == "mloco" and theirs:
            pairs = list(zip(ours, theirs, strict=True))
            ratios[label] = (
                statistics.median(a.seconds / b.seconds for a, b in pairs),
                statistics.median(a.peak_rss_bytes / b.peak_rss_bytes for a, b in pairs),
            )
    return ratios


def mergekit_command(args) -> list[str] | None:
    if args.mergekit_python:
        return [args.mergekit_python, "-m", "mergekit.scripts.run_yaml"]
    binary = args.mergekit_bin or shutil.which("mergekit-yaml")
    return [binary] if binary else None


def load_line() -> str:
    return ", ".join(f"{value:.1f}" for value in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", action="store_true", help="~23M parameters instead of ~106M")
    parser.add_argument("--mergekit-python", help="python of a venv with mergekit installed")
    parser.add_argument("--mergekit-bin", help="path of mergekit-yaml (default: look on PATH)")
    parser.add_argument("--methods", nargs="+", choices=list(RUNS), default=list(RUNS))
    parser.add_argument("--repeat", type=int, default=1, help="runs per merge; median reported")
    parser.add_argument("--workdir", type=Path, help="where to build checkpoints (kept)")
    args = parser.parse_args()
    shape = SHAPES["small" if args.small else "full"]
    mergekit = mergekit_command(args)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="merge-bench-"))
    try:
        base, models = workdir / "models" / "base", []
        if base.exists():
            models = sorted((workdir / "models").glob("ft*"))
        else:
            print(f"writing checkpoints to {workdir} ...", flush=True)
            base, models = write_checkpoints(workdir / "models", shape)
        tensors = tensor_shapes(shape)
        parameters = sum(torch.Size(s).numel() for s in tensors.values())
        largest_bytes = max(torch.Size(s).numel() for s in tensors.values()) * 4
        model_bytes = (base / "model.safetensors").stat().st_size
        inputs = [str(folder / "model.safetensors") for folder in [base, *models]]
        loads = [load_line()]
        runs: dict[tuple[str, str], list[Result]] = {}
        cat_times = []
        for _ in range(args.repeat):
            cat_times.append(run_measured(["cat", *inputs], keep_stdout=False)[0])
            for label in args.methods:
                print(f"merging with {label} ...", flush=True)
                out = workdir / f"out-{label}"
                runs.setdefault((label, "mloco"), []).append(
                    run_mloco(label, base, models, out, workdir)
                )
                if mergekit and RUNS[label][3]:
                    out = workdir / f"out-mergekit-{label}"
                    result = run_mergekit(mergekit, label, base, models, out, workdir)
                    runs.setdefault((label, "mergekit"), []).append(result)
        loads.append(load_line())
        results = [median_result(group) for group in runs.values()]
        differences = {
            label: largest_difference(workdir / f"out-{label}", workdir / f"out-mergekit-{label}")
            for label, tool in runs
            if tool == "mergekit"
        }
        shape_line = (
            f"model: {parameters / 1e6:.0f}M parameters, {model_bytes / 2**20:.0f} MB per"
            f" checkpoint (bf16), largest tensor {largest_bytes / 2**20:.0f} MB in float32;"
            f" {FINETUNES} fine-tunes; median of {args.repeat} run(s)"
        )
        print_tables(
            results,
            paired_ratios(runs),
            statistics.median(cat_times),
            differences,
            shape_line,
            largest_bytes,
            loads,
        )
        if not mergekit:
            print(
                "\nmergekit not found; to compare, install it in its own venv:\n"
                "  python -m venv /tmp/mk && /tmp/mk/bin/pip install mergekit\n"
                "  python benchmarks/merge_bench.py --mergekit-python /tmp/mk/bin/python"
            )
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
