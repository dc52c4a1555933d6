"""The decisions between the stages of aggregators_tuned.sh, read off finished sweeps.

    python docs/results/aggregators_tuned.py horizon HORIZON_DIR [--tolerance 0.05]
    python docs/results/aggregators_tuned.py inner INNER_DIR...
    python docs/results/aggregators_tuned.py flags TUNE_DIR [--aggregators A,B]
    python docs/results/aggregators_tuned.py noise EVAL_JSON
    python docs/results/aggregators_tuned.py compute STAGE_DIR...
    python docs/results/aggregators_tuned.py table TUNE_DIR
    python docs/results/aggregators_tuned.py grid TUNE_DIR [--aggregators A,B]
    python docs/results/aggregators_tuned.py publish STAGE_DIR DOCS_DIR
    python docs/results/aggregators_tuned.py restore DOCS_DIR WORK_DIR

Each prints its answer on stdout (what the script passes on) and its reasoning on stderr, and
exits with 1 when the answer cannot be given yet (a curve not flat, an optimum on a grid edge):
then the protocol says to extend that stage, not to go on.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import sys
from pathlib import Path

from mergekit_loco import run_layout
from mergekit_loco.compare.runs import (
    BASELINE,
    FAILED_FILE,
    load_runs,
    read_metrics,
    read_run_config,
)
from mergekit_loco.compare.sweep_report import TUNED_FILE, summarize
from mergekit_loco.compare.tables import format_number
from mergekit_loco.io.atomic import mark_output


def say(text: str) -> None:
    print(text, file=sys.stderr)


def flat_horizon(curve: list[tuple[int, float]], tolerance: float) -> int | None:
    """The fewest tokens ``t`` on the validation curve from which every doubling gains less
    than ``tolerance`` nats: ``loss(u) - loss(2u) < tolerance`` for ``t`` and every later ``u``
    whose ``2u`` is on the curve (so one upward spike at ``2t`` cannot pass for flatness while
    later doublings still gain; the curve of one long run, so before its learning rate has
    decayed: a conservative reading). None when no point qualifies."""
    losses = dict(curve)
    doublings = sorted(t for t in losses if 2 * t in losses)
    for index, tokens in enumerate(doublings):
        if all(losses[u] - losses[2 * u] < tolerance for u in doublings[index:]):
            return tokens
    return None


def longest_doubled(curve: list[tuple[int, float]]) -> int | None:
    """The most tokens ``t`` on the curve whose double ``2t`` is on it too (None if none)."""
    tokens = {t for t, _ in curve}
    return max((t for t in tokens if 2 * t in tokens), default=None)


def horizon(folder: str, tolerance: float) -> int:
    """The budget: the flat point of DiLoCo's curve (:func:`flat_horizon`); where the curve does
    not flatten within the run (the data's training tokens, seen once), the longest budget
    whose double the run reached, so that stage 6 can test the verdicts at twice the budget on
    data never seen twice."""
    found = [r for r in load_runs(folder) if r.aggregator == "diloco" and r.status == "finished"]
    if len(found) != 1:
        say(f"{folder}: {len(found)} finished diloco runs; the horizon reads exactly one")
        return 1
    [run] = found
    for tokens, loss in run.val_curve:
        say(f"{run.name}: {tokens:>10,} tokens  val loss {loss:.4f}")
    tokens = flat_horizon(list(run.val_curve), tolerance)
    if tokens is not None:
        say(f"every doubling from {tokens:,} tokens gains < {tolerance} nats")
        print(tokens)
        return 0
    tokens = longest_doubled(list(run.val_curve))
    if tokens is None:
        say("no point of the curve has its double on it: validate more often (--eval-every)")
        return 1
    losses = dict(run.val_curve)
    gain = losses[tokens] - losses[2 * tokens]
    say(
        f"not flat: from no point does every doubling gain < {tolerance} nats (from "
        f"{tokens:,} tokens: {gain:.3f}); "
        f"the budget is the longest whose double the data holds, {tokens:,} tokens, and "
        f"stage 6 checks the verdicts at {2 * tokens:,}"
    )
    print(tokens)
    return 0


def inner(folders: list[str]) -> int:
    """The inner lr (of the folders, one per ``--inner-lr``) with the lowest mean loss over the
    baseline and DiLoCo at every R swept. Every folder must hold the same cells, all finished
    (a failed run counts as an infinite loss): a mean over fewer cells is not comparable."""
    runs = {folder: load_runs(folder) for folder in folders}
    cells = {(r.aggregator, r.workers) for found in runs.values() for r in found}
    scores = {}
    for folder, found in runs.items():
        present = {(r.aggregator, r.workers) for r in found}
        pending = {(r.aggregator, r.workers) for r in found if r.status == "unfinished"}
        if present != cells or pending:
            missing = sorted(f"{a} R={w}" for a, w in (cells - present) | pending)
            say(f"{folder}: not finished ({', '.join(missing)}); rerun the sweep to finish it")
            return 1
        rows = [r for r in summarize(found) if r.aggregator in ("diloco", BASELINE)]
        [lr] = {run_config_lr(folder)}
        scores[lr] = sum(row.loss.mean for row in rows) / len(rows)
        say(f"inner lr {lr:g}: " + ", ".join(
            f"{row.aggregator} R={row.workers} {row.loss.mean:.4f}" for row in rows
        ) + f"; mean {scores[lr]:.4f}")  # fmt: skip
    best = min(scores, key=scores.__getitem__)
    if best in (min(scores), max(scores)):
        say(f"best inner lr {best:g} is at the grid edge: extend the grid")
        return 1
    print(f"{best:g}")
    return 0


def run_config_lr(folder: str) -> float:
    runs = Path(folder) / run_layout.SWEEP_RUNS
    lrs = {read_run_config(run)["inner_lr"] for run in runs.iterdir() if run.is_dir()}
    if len(lrs) != 1:
        raise ValueError(f"{folder}: expected one inner lr, found {sorted(lrs)}")
    return lrs.pop()


#: The momentum grid ends here: an optimum at a lowest momentum of this or below is not an
#: edge to extend (the next step down, 0, is outer SGD: the ``-sgd`` presets, tuned on their own).
MOMENTUM_FLOOR = 0.1
AT_LOWEST_MOMENTUM = "outer momentum: lowest tried"


def flags(folder: str, aggregators: str | None = None) -> int:
    """``--outer-lr-grid name=lr ... --outer-momentum-grid name=m ...`` of tuned.json (of the
    comma-separated ``aggregators`` only, when given). Refused while a run of the folder is
    unfinished, a setting was left out of the tuning, or an optimum (over R, or at any one R)
    sits on a grid edge, except the lowest momentum once that chosen momentum (over R, or the
    R's own) is :data:`MOMENTUM_FLOOR` or below."""
    runs = load_runs(folder)
    pending = [run.name for run in runs if run.status == "unfinished"]
    if pending:
        say(f"{folder}: {len(pending)} unfinished run(s) ({', '.join(pending[:4])}); rerun the "
            "sweep to finish them")  # fmt: skip
        return 1
    if not (Path(folder) / TUNED_FILE).exists():
        say(f"{folder}: no {TUNED_FILE} (no aggregator was swept over several settings; "
            f"`mloco report {folder}` writes it)")  # fmt: skip
        return 1
    tuned = json.loads((Path(folder) / TUNED_FILE).read_text())
    swept = {run.aggregator for run in runs if run.aggregator != BASELINE}
    wanted = set(aggregators.split(",")) if aggregators is not None else swept
    missing = sorted(wanted - {entry["aggregator"] for entry in tuned})
    if missing:
        say(f"{folder}: {TUNED_FILE} holds no tuned values for {', '.join(missing)}")
        return 1
    tuned = [entry for entry in tuned if entry["aggregator"] in wanted]
    words, problems = [], []
    for entry in tuned:
        name = entry["aggregator"]
        if entry["mean_loss"] is None:
            problems.append(f"{name} (no setting finished at every R on the same seeds)")
            continue
        chosen = {"": entry["outer_momentum"]}  # the momentum each edge is about
        chosen |= {f" R={r}": best[1] for r, best in entry.get("best_at_R", {}).items()}
        say(f"{name}: outer lr {entry['outer_lr']:g}, momentum {entry['outer_momentum']}, mean "
            f"loss {float(entry['mean_loss']):.4f} over R {entry['workers']}")  # fmt: skip
        words.append(f"--outer-lr-grid {name}={entry['outer_lr']:g}")
        if entry["outer_momentum"]:
            words.append(f"--outer-momentum-grid {name}={entry['outer_momentum']:g}")
        edges = [("", edge) for edge in entry["grid_edges"]]
        edges += [(f" R={workers}", edge)
                  for workers, edges_at_r in entry.get("grid_edges_at_R", {}).items()
                  for edge in edges_at_r]  # fmt: skip
        for where, edge in edges:
            momentum = chosen.get(where)
            if edge == AT_LOWEST_MOMENTUM and momentum is not None and momentum <= MOMENTUM_FLOOR:
                say(f"{name}{where}: best at the lowest momentum, {momentum:g}, the grid's "
                    f"floor (momentum 0 is outer SGD)")  # fmt: skip
            else:
                problems.append(f"{name}{where} ({edge})")
        problems += [f"{name} lacks {setting}" for setting in entry.get("incomplete", [])]
        if not math.isfinite(float(entry["mean_loss"])):  # written "inf" (tables.json_value)
            problems.append(f"{name} (every setting failed at some R: widen the grid downward)")
    if problems:
        say(f"not tuned yet: extend the grid or finish the sweep, and tune again: "
            f"{', '.join(problems)}")  # fmt: skip
        return 1
    print(" ".join(words))
    return 0


def noise(path: str) -> int:
    """Evaluation noise from ``mloco eval --val-sets K --json`` of several models: per model,
    ``sd / sqrt(K)`` of its K part losses (how much the absolute loss depends on which documents
    validate); per model after the first, the same of its per-part difference to the first model
    (the noise of a paired comparison on the whole validation set, which is what the report's
    differences are). Prints the largest paired standard error."""
    records = json.loads(Path(path).read_text())
    datasets = sorted({record["data"] for record in records})
    if len(datasets) != 1:
        say(
            f"{path}: records of {len(datasets)} datasets ({', '.join(datasets)}); evaluate on "
            "the training spec as one dataset (mloco eval --data a+b for train --data a,b)"
        )
        return 1
    parts: dict[str, dict[int, float]] = {}
    for record in records:
        parts.setdefault(record["model"], {})[record["val_set"]] = record["loss"]
    models = list(parts)
    if len(models) < 2:
        say(f"{path}: one model; the paired noise needs two (evaluate both final models)")
        return 1
    sets = sorted(parts[models[0]])

    def spread(values: list[float]) -> str:
        sd = statistics.stdev(values)
        return (
            f"mean {statistics.mean(values):.4f}, sd {sd:.4f}, se {sd / math.sqrt(len(values)):.4f}"
        )

    for model in models:
        say(f"{model}: {spread([parts[model][k] for k in sets])} over {len(sets)} parts")
    paired = []
    for model in models[1:]:
        differences = [parts[model][k] - parts[models[0]][k] for k in sets]
        paired.append(statistics.stdev(differences) / math.sqrt(len(sets)))
        say(f"{model} - {models[0]}: {spread(differences)}")
    print(f"{max(paired):.4f}")
    return 0


def compute(folders: list[str]) -> int:
    """Training time of each stage folder: the sum of every run's ``round_seconds`` (one thread
    per job, so core-seconds; evaluations and start-up not counted), in core-hours."""
    total = 0.0
    for folder in folders:
        runs = sorted(p for p in (Path(folder) / run_layout.SWEEP_RUNS).iterdir() if p.is_dir())
        seconds = sum(
            event["round_seconds"]
            for run in runs
            for event in read_metrics(run)
            if event.get("event") == "round" and isinstance(event.get("round_seconds"), float)
        )
        total += seconds
        print(f"{folder}: {len(runs)} runs, {seconds / 3600:.2f} core-hours of training rounds")
    print(f"total: {total / 3600:.2f} core-hours")
    return 0


def table(folder: str) -> int:
    """The tuned values of ``folder``'s tuned.json as a markdown table, beside each preset's
    (the seed paper's) values: what the report's cells train with."""
    from mergekit_loco.train.config import preset_config

    if not (Path(folder) / TUNED_FILE).exists():
        say(f"{folder}: no {TUNED_FILE} yet (`mloco report {folder}` writes it)")
        return 1
    tuned = json.loads((Path(folder) / TUNED_FILE).read_text())
    print("| aggregator | outer lr (preset's) | outer momentum (preset's) | mean loss over R |")
    print("|---|---|---|---|")
    for entry in tuned:
        preset = preset_config(entry["aggregator"]).outer
        if entry["mean_loss"] is None:
            print(f"| {entry['aggregator']} | not tuned yet ({preset.lr:g}) | "
                  f"({preset.momentum:g}) | |")  # fmt: skip
            continue
        lr, momentum = entry["outer_lr"], entry["outer_momentum"]
        momentum = preset.momentum if momentum is None else momentum
        workers = ", ".join(map(str, entry["workers"]))
        loss = float(entry["mean_loss"])
        print(f"| {entry['aggregator']} | {lr:g} ({preset.lr:g}) | {momentum:g} "
              f"({preset.momentum:g}) | {loss:.4f} (R = {workers}) |")  # fmt: skip
    return 0


def grid(folder: str, aggregators: str | None = None) -> int:
    """The finished cells of a tuning folder as markdown, one table per aggregator and R: the
    final validation loss (mean over finished seeds) by outer lr (rows) and momentum (columns),
    over every value tried at any R of that aggregator; ``·`` not finished (yet), ``failed``
    diverged; in bold the setting :func:`summarize` keeps at that R (the lowest among those
    with the most seeds). What the protocol's write-up shows while stage 4 runs."""
    from mergekit_loco.train.config import preset_config

    rows = [row for row in summarize(load_runs(folder)) if row.aggregator != BASELINE]
    wanted = aggregators.split(",") if aggregators else sorted({row.aggregator for row in rows})
    for name in wanted:
        mine = sorted((row for row in rows if row.aggregator == name), key=lambda r: r.workers)
        if not mine:
            say(f"{folder}: no finished cell of {name}")
            continue
        preset = preset_config(name).outer
        settings = {setting for row in mine for setting, _ in row.sweep}
        lrs = sorted({lr for lr, _ in settings})
        momenta = sorted({momentum for _, momentum in settings})

        def label(value: float, preset_value: float) -> str:
            return f"{value:g} (preset)" if math.isclose(value, preset_value) else f"{value:g}"

        for row in mine:
            losses = dict(row.sweep)
            print(f"\n{name}, R = {row.workers}, H = {row.inner_steps}:\n")
            print("| outer lr \\ momentum | "
                  + " | ".join(label(m, preset.momentum) for m in momenta) + " |")  # fmt: skip
            print("|---" * (len(momenta) + 1) + "|")
            for lr in lrs:
                cells = []
                for momentum in momenta:
                    loss = losses.get((lr, momentum))
                    text = "·" if loss is None else format_number(loss.mean, 3)
                    best = (lr, momentum) == (row.outer_lr, row.outer_momentum)
                    cells.append(f"**{text}**" if best else text)
                print(f"| {label(lr, preset.lr)} | " + " | ".join(cells) + " |")
    return 0


#: What a stage folder publishes: its tables and figures, and each finished (or failed) run's
#: config and metrics; never checkpoints or models.
PUBLISHED_FILES = ("results.csv", "summary.csv", "results.json", "tuned.json", "tuned.md",
                   "claims.md", "eval_noise.json", "data.json", "loss_vs_workers.png",
                   "curves.png")  # fmt: skip
PUBLISHED_RUN_FILES = (run_layout.CONFIG, run_layout.METRICS, FAILED_FILE)


def publish(folder: str, destination: str) -> int:
    """Copy the small files of a stage ``folder`` to ``destination`` (a folder under
    docs/results): :data:`PUBLISHED_FILES`, and per run that ended :data:`PUBLISHED_RUN_FILES`
    (unfinished runs are left out: their data is not final). Prints what it copied."""
    source, target = Path(folder), Path(destination)
    copied = []
    for name in PUBLISHED_FILES:
        if (source / name).is_file():
            copied.append(name)
    runs = load_runs(folder)
    ended = [run for run in runs if run.status != "unfinished"]
    for run in ended:
        for name in PUBLISHED_RUN_FILES:
            if (source / run_layout.SWEEP_RUNS / run.name / name).is_file():
                copied.append(f"{run_layout.SWEEP_RUNS}/{run.name}/{name}")
    for name in copied:
        (target / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source / name, target / name)
    print(f"{destination}: {len(copied)} files of {len(ended)} ended runs "
          f"({len(runs) - len(ended)} unfinished left out)")  # fmt: skip
    return 0


def restore(published: str, work: str) -> int:
    """Copy the published stages under ``published`` (every folder holding ``runs/``) into
    ``work``, marked as mergekit_loco's sweep and run folders, so that rerunning the protocol
    there skips their finished cells. A file already in ``work`` is kept, never overwritten."""
    source, target = Path(published), Path(work)
    stages = sorted(folder.parent for folder in source.rglob(run_layout.SWEEP_RUNS))
    if not stages:
        say(f"{published}: no published stage (no folder holds {run_layout.SWEEP_RUNS}/)")
        return 1
    copied = kept = 0
    for path in sorted(source.rglob("*")):
        if not path.is_file():
            continue
        destination = target / path.relative_to(source)
        if destination.exists():
            kept += 1
            continue
        destination.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, destination)
        copied += 1
    for stage in stages:
        sweep = target / stage.relative_to(source)
        mark_output(sweep, run_layout.SWEEP_KIND)
        for run in (sweep / run_layout.SWEEP_RUNS).iterdir():
            mark_output(run, run_layout.RUN_KIND)
    print(f"{work}: {len(stages)} stages, {copied} files copied, {kept} already there (kept)")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    found = commands.add_parser("horizon")
    found.add_argument("folder")
    found.add_argument("--tolerance", type=float, default=0.05)
    commands.add_parser("inner").add_argument("folders", nargs="+")
    found = commands.add_parser("flags")
    found.add_argument("folder")
    found.add_argument("--aggregators", help="comma-separated: only these aggregators' flags")
    commands.add_parser("noise").add_argument("path")
    commands.add_parser("compute").add_argument("folders", nargs="+")
    commands.add_parser("table").add_argument("folder")
    found = commands.add_parser("grid")
    found.add_argument("folder")
    found.add_argument("--aggregators", help="comma-separated: only these aggregators' tables")
    found = commands.add_parser("publish")
    found.add_argument("folder")
    found.add_argument("destination")
    found = commands.add_parser("restore")
    found.add_argument("published")
    found.add_argument("work")
    arguments = parser.parse_args(argv)
    if arguments.command == "horizon":
        return horizon(arguments.folder, arguments.tolerance)
    if arguments.command == "inner":
        return inner(arguments.folders)
    if arguments.command == "noise":
        return noise(arguments.path)
    if arguments.command == "compute":
        return compute(arguments.folders)
    if arguments.command == "table":
        return table(arguments.folder)
    if arguments.command == "grid":
        return grid(arguments.folder, arguments.aggregators)
    if arguments.command == "publish":
        return publish(arguments.folder, arguments.destination)
    if arguments.command == "restore":
        return restore(arguments.published, arguments.work)
    return flags(arguments.folder, arguments.aggregators)


if __name__ == "__main__":
    sys.exit(main())
