"""The report of a merge comparison: scores of every merge on every fine-tune's domain.

Reads the ``evaluations.json`` that :func:`mergekit_loco.compare.merges.compare_merges` saved
(one per fine-tune set), so ``mloco report`` re-renders without evaluating.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

from mergekit_loco.compare.stats import Spread, format_interval, paired_interval, spread
from mergekit_loco.compare.tables import csv_text, format_loss, json_value
from mergekit_loco.io.atomic import check_free_or_ours, claim_folder, write_atomically
from mergekit_loco.io.files import read_json
from mergekit_loco.run_layout import MERGE_REPORT_KIND, MERGES_KIND

EVALUATIONS = "evaluations.json"
MERGE_SPLITS = ("select", "test")


@dataclass(frozen=True)
class MergeRow:
    """One model on the test halves, over one or more fine-tune sets: per-domain loss, mean loss
    over domains, normalized score ``mean_d(L_ft_d(d) / L(d))`` (1 = each fine-tune's own loss on
    its domain) and gain kept ``sum_d (L_base(d) - L(d)) / sum_d (L_base(d) - L_ft_d(d))`` (0 =
    the base, 1 = the fine-tunes). Merges at the scale with the best normalized score on the
    select halves (``scales``: the one chosen per fine-tune set)."""

    label: str
    kind: str
    scales: tuple[float, ...]
    domain_loss: Mapping[str, Spread]
    loss: Spread
    normalized_by_set: Mapping[str, float]
    gain_kept: Spread

    @property
    def normalized(self) -> Spread:
        return spread(list(self.normalized_by_set.values()))


#: the reference merge of the report's "vs mean" column: plain averaging (DiLoCo's aggregator).
REFERENCE_MERGE = "mean"
MODEL_KINDS = ("base", "finetuned", "merge")


def check_evaluations(document: object, where: str) -> None:
    """Refuse, naming ``where`` and the entry, evaluations a report cannot read: ``domains`` a
    non-empty list of distinct names; ``models`` with one ``base``, a ``finetune:DOMAIN`` for
    every domain, and for each model a distinct label, a kind, a method name (not another
    model's label) and finite scale for merges (one merge per method and scale) and neither for
    the others, and a positive finite loss per domain and split."""
    if not isinstance(document, dict):
        raise ValueError(f"{where}: not a JSON object")
    domains, models = document.get("domains"), document.get("models")
    if not (isinstance(domains, list) and domains and all(isinstance(d, str) for d in domains)):
        raise ValueError(f"{where}: 'domains' must be a non-empty list of names")
    if len(set(domains)) != len(domains) or not isinstance(models, list):
        raise ValueError(f"{where}: 'domains' names one twice, or 'models' is not a list")
    for index, model in enumerate(models):
        entry = f"{where}: models[{index}]"
        if not isinstance(model, dict) or not isinstance(model.get("label"), str):
            raise ValueError(f"{entry} needs a 'label' string")
        if model.get("kind") not in MODEL_KINDS:
            raise ValueError(f"{entry}: 'kind' must be one of {', '.join(MODEL_KINDS)}")
        method, scale = model.get("method"), model.get("scale")
        if model["kind"] != "merge" and (method, scale) != (None, None):
            raise ValueError(f"{entry}: a {model['kind']} model has no 'method' or 'scale' (null)")
        if model["kind"] == "merge" and not (
            isinstance(method, str) and method and is_finite_number(scale)
        ):
            raise ValueError(f"{entry}: a merge needs a 'method' name and a finite 'scale'")
        losses = model.get("losses")
        if not isinstance(losses, dict) or set(losses) != set(domains):
            raise ValueError(f"{entry}: 'losses' must hold exactly the domains {domains}")
        for domain in domains:
            for split in MERGE_SPLITS:
                loss = losses[domain].get(split) if isinstance(losses[domain], dict) else None
                if not (is_finite_number(loss) and loss > 0):
                    raise ValueError(
                        f"{entry}: the {split} loss on {domain!r} must be a positive number"
                    )
    labels = [model["label"] for model in models]
    if [model["kind"] for model in models].count("base") != 1:
        raise ValueError(f"{where}: 'models' must hold exactly one base")
    others = {model["label"] for model in models if model["kind"] != "merge"}
    first: dict[str, int] = {}  # label -> the first entry holding it
    merges: dict[tuple[str, float], int] = {}  # (method, scale) -> the first such merge
    for index, model in enumerate(models):
        entry = f"{where}: models[{index}]"
        label = model["label"]
        if first.setdefault(label, index) != index:
            raise ValueError(f"{entry}: label {label!r} is models[{first[label]}]'s too")
        if model["kind"] == "merge":
            method, scale = model["method"], model["scale"]
            if merges.setdefault((method, scale), index) != index:
                raise ValueError(
                    f"{entry}: a second merge of method {method!r} at scale {scale:g} (the first "
                    f"is models[{merges[method, scale]}])"
                )
            if method in others:
                raise ValueError(
                    f"{entry}: method {method!r} is the label of a model that is not a merge"
                )
    for domain in domains:
        if f"finetune:{domain}" not in labels:
            raise ValueError(f"{where}: no model 'finetune:{domain}' (the fine-tune of {domain!r})")


def is_finite_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def merge_scores(document: Mapping, losses: Mapping[str, Mapping[str, float]], split: str) -> dict:
    """One model's scores on ``split`` from its ``losses[domain][split]``: per domain the loss,
    the normalized score ``L_ft_d(d) / L(d)`` and the gain ``L_base(d) - L(d)``; averaged, the
    mean loss and normalized score, and the gain kept ``sum_d gain(d) / sum_d (L_base(d) -
    L_ft_d(d))`` (a ratio of sums, so that a domain the fine-tune barely improved does not
    dominate)."""
    base = next(m for m in document["models"] if m["kind"] == "base")["losses"]
    scores: dict = {"loss": {}, "normalized": {}, "gain": {}}
    fine_tuning_gain = 0.0
    for domain in document["domains"]:
        own = next(m for m in document["models"] if m["label"] == f"finetune:{domain}")["losses"]
        loss, tuned, start = losses[domain][split], own[domain][split], base[domain][split]
        scores["loss"][domain] = loss
        scores["normalized"][domain] = tuned / loss
        scores["gain"][domain] = start - loss
        fine_tuning_gain += start - tuned
    for key in ("loss", "normalized"):
        scores[f"mean_{key}"] = math.fsum(scores[key].values()) / len(scores[key])
    kept = math.fsum(scores["gain"].values())
    scores["gain_kept"] = kept / fine_tuning_gain if fine_tuning_gain > 0 else math.nan
    return scores


def merge_records(document: Mapping) -> list[dict]:
    """Every model and split of one comparison with its scores (rows of merge_results.csv)."""
    rows = []
    for model in document["models"]:
        for split in MERGE_SPLITS:
            scores = merge_scores(document, model["losses"], split)
            row = {key: model.get(key) for key in ("label", "kind", "method", "scale")}
            row["split"] = split
            for domain in document["domains"]:
                row[f"loss_{domain}"] = scores["loss"][domain]
                row[f"normalized_{domain}"] = scores["normalized"][domain]
            row |= {"loss": scores["mean_loss"], "normalized": scores["mean_normalized"],
                    "gain_kept": scores["gain_kept"]}  # fmt: skip
            rows.append(row)
    return rows


def chosen_rows(records: Sequence[dict]) -> list[dict]:
    """Test rows of the base, the fine-tunes, and each method at its best select-half scale."""
    test = [r for r in records if r["split"] == "test"]
    chosen = [r for r in test if r["kind"] != "merge"]
    for method in dict.fromkeys(r["method"] for r in records if r["kind"] == "merge"):
        select = [r for r in records if r["method"] == method and r["split"] == "select"]
        scale = max(select, key=lambda r: r["normalized"])["scale"]
        chosen.append(next(r for r in test if r["method"] == method and r["scale"] == scale))
    return chosen


def summarize_merges(documents: Mapping[str, Mapping]) -> list[MergeRow]:
    """One row per model (merges: per method) over the fine-tune sets ``documents`` (by name)."""
    domains = next(iter(documents.values()))["domains"]
    if any(document["domains"] != domains for document in documents.values()):
        raise ValueError("merge comparisons over different domains cannot be combined")
    grouped: dict[str, dict[str, dict]] = defaultdict(dict)
    for name, document in documents.items():
        for row in chosen_rows(merge_records(document)):
            grouped[row["method"] or row["label"]][name] = row
    summary = []
    for label, by_set in grouped.items():
        rows = list(by_set.values())
        summary.append(
            MergeRow(
                label=label,
                kind=rows[0]["kind"],
                scales=tuple(row["scale"] for row in rows if row["scale"] is not None),
                domain_loss={d: spread([row[f"loss_{d}"] for row in rows]) for d in domains},
                loss=spread([row["loss"] for row in rows]),
                normalized_by_set={name: row["normalized"] for name, row in by_set.items()},
                gain_kept=spread([row["gain_kept"] for row in rows]),
            )
        )
    order = {"base": 0, "finetuned": 1, "merge": 2}
    return sorted(summary, key=lambda r: (order[r.kind], -r.normalized.mean))


def normalized_difference(row: MergeRow, reference: MergeRow | None) -> str:
    """``row - reference`` in normalized score, paired by fine-tune set, with its t-interval;
    empty for the reference itself or the non-merges."""
    if reference is None or row is reference or row.kind != "merge":
        return ""
    return format_interval(paired_interval(row.normalized_by_set, reference.normalized_by_set))


def merge_table(summary: Sequence[MergeRow], domains: Sequence[str], sets: int) -> Table:
    title = "Merged models on the held-out test halves"
    if sets > 1:
        title += f" (mean ± std over {sets} fine-tune sets)"
    table = Table(title=title)
    table.add_column("model")
    table.add_column("scale", justify="right")
    for domain in domains:
        table.add_column(f"loss {domain}", justify="right")
    for column in ("mean loss", "normalized", f"vs {REFERENCE_MERGE}", "gain kept"):
        table.add_column(column, justify="right")
    reference = next((row for row in summary if row.label == REFERENCE_MERGE), None)
    for row in summary:
        table.add_row(
            row.label,
            "/".join(f"{scale:g}" for scale in row.scales) or "-",
            *(format_loss(row.domain_loss[domain]) for domain in domains),
            format_loss(row.loss),
            format_loss(row.normalized),
            normalized_difference(row, reference),
            format_loss(row.gain_kept),
        )
    table.caption = (
        "normalized = mean over domains of (fine-tune's loss on its domain / model's loss); "
        "gain kept = sum of (base - model) / sum of (base - fine-tune) over domains; "
        "1 = as good as the fine-tunes. Scale chosen per method on the select halves. "
        f"vs {REFERENCE_MERGE}: normalized difference paired by fine-tune set, 95% t-interval; "
        "n.s. = the interval holds 0; ? = one set."
    )
    return table


def merge_summary_records(summary: Sequence[MergeRow]) -> list[dict]:
    records = []
    for row in summary:
        record = {"model": row.label, "kind": row.kind, "scales": "/".join(map(str, row.scales))}
        for domain, loss in row.domain_loss.items():
            record[f"loss_{domain}"] = json_value(loss.mean)
        for key in ("loss", "normalized", "gain_kept"):
            value = getattr(row, key)
            record[f"{key}_mean"] = json_value(value.mean)
            record[f"{key}_std"] = json_value(value.std)
        records.append(record)
    return records


def report_merges(
    folders: Sequence[str | Path],
    out: str | Path,
    console: Console | None = None,
    figures: bool = True,
) -> list[MergeRow]:
    """:func:`report_documents` of the ``evaluations.json`` of one or more merge comparisons
    (fine-tune sets, e.g. seeds), named by their folders; into the one comparison's own folder
    when ``out`` is it, else into a report folder (:data:`MERGE_REPORT_KIND`)."""
    documents = {}
    for folder in folders:
        path = Path(folder) / EVALUATIONS
        if not path.is_file():
            raise FileNotFoundError(
                f"{path}: not a merge comparison (run mloco compare --mode merge)"
            )
        if Path(folder).name in documents:
            raise ValueError(f"merge folders need distinct names: {Path(folder).name} twice")
        documents[Path(folder).name] = read_json(path, "merge evaluations")
        check_evaluations(documents[Path(folder).name], str(path))
    into_own = len(folders) == 1 and Path(out).resolve() == Path(folders[0]).resolve()
    kind = MERGES_KIND if into_own else MERGE_REPORT_KIND
    return report_documents(documents, out, console, figures, kind)


def documents_from_results(path: str | Path) -> dict[str, dict]:
    """The evaluations of each fine-tune set, rebuilt from the ``merge_results.json`` that a
    report wrote (every model's loss per domain and half), so a published report re-renders
    from its own data."""
    saved = read_json(Path(path), "merge results")
    documents: dict[str, dict] = {}
    for record in saved["models"]:
        document = documents.setdefault(record["set"], {"domains": saved["domains"], "models": []})
        models = {model["label"]: model for model in document["models"]}
        if record["label"] not in models:
            model = {key: record[key] for key in ("label", "kind", "method", "scale")}
            document["models"].append(model | {"losses": {d: {} for d in saved["domains"]}})
            models[record["label"]] = document["models"][-1]
        for domain in saved["domains"]:
            models[record["label"]]["losses"][domain][record["split"]] = record[f"loss_{domain}"]
    return documents


def report_documents(
    documents: Mapping[str, Mapping],
    out: str | Path,
    console: Console | None = None,
    figures: bool = True,
    kind: str = MERGE_REPORT_KIND,
) -> list[MergeRow]:
    """Tables (merge_results.csv: every model, scale and split; merge_summary.csv and
    merge_results.json: the chosen rows) and merging.png of the merge comparisons
    ``documents`` (by fine-tune set name), written to ``out``: a new or empty folder, one of
    ours marked ``kind`` (a comparison's own folder: ``compare merges``), or one holding
    nothing but ``evaluations.json`` (then marked ``kind``), never another
    (:func:`~mergekit_loco.io.atomic.check_free_or_ours`)."""
    out = Path(out)
    check_free_or_ours(out, "the report folder", (kind,), reads=(EVALUATIONS,), has_force=False)
    summary = summarize_merges(documents)
    domains = next(iter(documents.values()))["domains"]
    records = [
        {"set": name, **row}
        for name, document in documents.items()
        for row in merge_records(document)
    ]
    columns = ["set", "label", "kind", "method", "scale", "split"]
    columns += [f"loss_{d}" for d in domains] + [f"normalized_{d}" for d in domains]
    columns += ["loss", "normalized", "gain_kept"]
    table = merge_table(summary, domains, len(documents))  # all computed before a file is written
    claim_folder(out, kind, reads=(EVALUATIONS,))
    write_atomically(out / "merge_results.csv", csv_text(records, columns))
    summary_rows = merge_summary_records(summary)
    write_atomically(out / "merge_summary.csv", csv_text(summary_rows, list(summary_rows[0])))
    document = {
        "sets": list(documents),
        "domains": domains,
        "summary": summary_rows,
        "models": [{key: json_value(value) for key, value in r.items()} for r in records],
    }
    write_atomically(out / "merge_results.json", json.dumps(document, indent=2) + "\n")
    if figures:
        from mergekit_loco.compare.figures import plot_merges

        plot_merges(documents, summary, out / "merging.png")
    if console is not None:
        console.print(table)
    return summary
