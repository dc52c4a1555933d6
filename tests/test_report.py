"""Reports from saved results: statistics, sweep tables and figures, merge scores."""

from __future__ import annotations

import csv
import dataclasses
import importlib.util
import io
import json
import math
import shutil
import sys
from pathlib import Path

import pytest
from rich.console import Console

from mergekit_loco.compare import merge_report, render, runs, sweep_report
from mergekit_loco.compare.stats import (
    format_interval,
    ordering,
    paired_difference,
    paired_interval,
    spread,
)
from mergekit_loco.train.config import preset_config

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


# -- statistics ---------------------------------------------------------------------------------
def test_spread_by_hand():
    values = [1.0, 2.0, 4.0]
    result = spread(values)
    assert math.isclose(result.mean, 7 / 3)
    # sum of squares about the mean: 16/9 + 1/9 + 25/9 = 42/9, over n - 1 = 2
    assert math.isclose(result.std, math.sqrt(42 / 9 / 2))
    assert (result.low, result.high, result.n) == (1.0, 4.0, 3)
    single = spread([3.5])
    assert single.mean == 3.5 and math.isnan(single.std) and single.n == 1
    with pytest.raises(ValueError):
        spread([])


def test_paired_difference_by_hand():
    a = {0: 1.0, 1: 2.0, 2: 3.0}
    # per-seed differences -0.5, -0.4, -0.6: mean -0.5, std 0.1 -> significant
    delta, significant = paired_difference(a, {0: 1.5, 1: 2.4, 2: 3.6})
    assert math.isclose(delta, -0.5) and significant is True
    # differences -0.1, +0.2: mean 0.05, std 0.3 / sqrt(2) = 0.212 -> within the spread
    delta, significant = paired_difference({0: 1.0, 1: 2.0}, {0: 1.1, 1: 1.8})
    assert math.isclose(delta, 0.05) and significant is False
    # only seeds both ran count; one shared seed cannot tell
    delta, significant = paired_difference({0: 1.0, 5: 9.0}, {0: 1.25, 1: 0.0})
    assert math.isclose(delta, -0.25) and significant is None
    assert math.isnan(paired_difference({0: 1.0}, {1: 1.0})[0])


# -- sweep reports --------------------------------------------------------------------------------
def write_run(root: Path, name: str, preset: str, workers: int, seed: int, val_loss: float | None,
              **overrides) -> None:  # fmt: skip
    """A run folder as the trainer leaves it: config.json and metrics.jsonl (4 rounds, eval
    every 2), the final event only when ``val_loss`` is given; ``overrides``: config fields."""
    config = preset_config(preset, model="micro", workers=workers, inner_steps=2, global_batch=4,
                           seq_len=8, tokens=256, seed=seed, **overrides)  # fmt: skip
    folder = root / "runs" / name
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config.to_dict()))
    events = []
    for completed in range(1, 5):
        events.append({"event": "round", "round": completed, "tokens": completed * 64,
                       "train_loss": 9.0 - completed})  # fmt: skip
        if completed == 2:
            events.append({"event": "eval", "round": 2, "val_loss": 8.0})
    if val_loss is not None:
        events.append({"event": "final", "round": 4, "tokens": 256, "val_loss": val_loss})
    (folder / "metrics.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))


def test_report_rerenders_a_sweep_from_saved_metrics(tmp_path):
    for seed, loss in ((0, 3.5), (1, 3.6)):
        write_run(tmp_path, f"dp-s{seed}", "dp", 1, seed, loss)
    # diloco at R = 2 with two outer lrs: 1.4 has the lower mean and is chosen
    for seed, (at_07, at_14) in enumerate(((3.0, 2.9), (3.2, 3.0))):
        write_run(tmp_path, f"diloco-R2-H2-s{seed}", "diloco", 2, seed, at_07)
        write_run(tmp_path, f"diloco-R2-H2-lr1.4-s{seed}", "diloco", 2, seed, at_14, outer_lr=1.4)
    for seed, loss in ((0, 2.5), (1, 2.6)):
        write_run(tmp_path, f"isoloco-R2-H2-s{seed}", "isoloco", 2, seed, loss)
    write_run(tmp_path, "tsv-R2-H2-s0", "tsv", 2, 0, None)  # unfinished

    output = io.StringIO()
    summary = sweep_report.report_sweep(tmp_path, console=Console(file=output, width=200))
    rows = {row.aggregator: row for row in summary}
    assert set(rows) == {"dp", "diloco", "isoloco"}  # the unfinished run has no row
    assert rows["diloco"].outer_lr == 1.4
    assert math.isclose(rows["diloco"].loss.mean, 2.95)
    assert math.isclose(rows["diloco"].loss.std, math.sqrt(2 * 0.05**2))
    assert rows["dp"].outer_lr is None and rows["dp"].workers == 1

    with open(tmp_path / "results.csv") as handle:
        table = list(csv.DictReader(handle))
    required = {"aggregator", "workers", "inner_steps", "seed", "outer_lr", "tokens", "val_loss"}
    assert required <= set(table[0]) and len(table) == 9
    tsv = next(r for r in table if r["name"] == "tsv-R2-H2-s0")
    assert tsv["status"] == "unfinished" and tsv["val_loss"] == ""
    with open(tmp_path / "summary.csv") as handle:
        by_name = {r["aggregator"]: r for r in csv.DictReader(handle)}
    assert math.isclose(float(by_name["isoloco"]["val_loss_mean"]), 2.55)
    saved = json.loads((tmp_path / "results.json").read_text())
    assert len(saved["runs"]) == 9 and len(saved["summary"]) == 3
    for figure in ("loss_vs_workers.png", "curves.png"):
        assert (tmp_path / figure).read_bytes().startswith(PNG_MAGIC)

    text = output.getvalue()
    # isoloco - diloco per seed: 2.5 - 2.9, 2.6 - 3.0 -> -0.4 with zero spread: significant
    assert "+0.4000" in text.split("diloco")[1]
    assert "Outer-lr sweep" in text and "1 unfinished run(s): tsv-R2-H2-s0" in text

    run = runs.load_run(tmp_path / "runs" / "isoloco-R2-H2-s0")
    assert run.val_curve == ((128, 8.0), (256, 2.5))
    assert run.train_curve == ((64, 8.0), (128, 7.0), (192, 6.0), (256, 5.0))


def test_a_setting_missing_seeds_cannot_win_on_fewer_runs(tmp_path):
    """lr 0.35 has only seed 0 finished (4.75) against lr 0.7's two seeds (4.76, 4.7484: mean
    4.7542): the choice is among the settings with every seed, so 0.7."""
    write_run(tmp_path, "diloco-R2-H2-s0", "diloco", 2, 0, 4.76)
    write_run(tmp_path, "diloco-R2-H2-s1", "diloco", 2, 1, 4.7484)
    write_run(tmp_path, "diloco-R2-H2-lr0.35-s0", "diloco", 2, 0, 4.75, outer_lr=0.35)
    write_run(tmp_path, "diloco-R2-H2-lr0.35-s1", "diloco", 2, 1, None, outer_lr=0.35)
    [row] = sweep_report.summarize(runs.load_runs(tmp_path))
    assert row.outer_lr == 0.7 and math.isclose(row.loss.mean, 4.7542)
    assert len(row.sweep) == 2  # the incomplete setting is still listed


def test_report_without_matplotlib_says_how_to_get_it(tmp_path, monkeypatch):
    write_run(tmp_path, "diloco-R2-H2-s0", "diloco", 2, 0, 3.0)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match=r"pip install 'mergekit_loco\[plot\]'"):
        sweep_report.report_sweep(tmp_path)
    sweep_report.report_sweep(tmp_path, figures=False)  # tables need no matplotlib
    assert (tmp_path / "results.csv").is_file()


def test_render_refuses_what_it_cannot_read(tmp_path):
    with pytest.raises(FileNotFoundError, match="no runs"):
        render([tmp_path])
    with pytest.raises(ValueError, match="several folders"):
        render([tmp_path, tmp_path])
    # a published folder: its results.csv is read (load_runs), never overwritten by a re-render
    with pytest.raises(FileNotFoundError, match="no runs to re-render"):
        render([RESULTS / "aggregators"])


# -- merge reports --------------------------------------------------------------------------------
def merge_document() -> dict:
    """Two domains a, b. The base: 4.0 and 5.0. Fine-tune a: 2.0 on a; fine-tune b: 4.0 on b.
    ties at scale 0.5 is best on the select halves, at scale 1 on the test halves."""

    def losses(a_select, a_test, b_select, b_test):
        return {"a": {"select": a_select, "test": a_test},
                "b": {"select": b_select, "test": b_test}}  # fmt: skip

    models = [
        ("base", "base", None, None, losses(4.0, 4.0, 5.0, 5.0)),
        ("finetune:a", "finetuned", None, None, losses(2.0, 2.0, 6.0, 6.0)),
        ("finetune:b", "finetuned", None, None, losses(5.0, 5.0, 4.0, 4.0)),
        ("ties-0.5", "merge", "ties", 0.5, losses(2.5, 3.0, 3.5, 4.8)),
        ("ties-1", "merge", "ties", 1.0, losses(3.0, 2.5, 4.0, 3.5)),
    ]
    return {
        "domains": ["a", "b"],
        "models": [
            {"label": label, "kind": kind, "method": method, "scale": scale, "losses": loss}
            for label, kind, method, scale, loss in models
        ],  # fmt: skip
    }


def test_merge_scores_by_hand(tmp_path):
    for index in range(2):
        folder = tmp_path / f"set{index}"
        folder.mkdir()
        (folder / merge_report.EVALUATIONS).write_text(json.dumps(merge_document()))
    output = io.StringIO()
    summary = merge_report.report_merges([tmp_path / "set0", tmp_path / "set1"], tmp_path / "out",
                                   console=Console(file=output, width=200))  # fmt: skip
    rows = {row.label: row for row in summary}
    ties = rows["ties"]
    # chosen on select: 0.5 scores (2/2.5 + 4/3.5) / 2 = 0.971 against 1.0's (2/3 + 4/4) / 2
    assert ties.scales == (0.5, 0.5)
    # reported on test at 0.5: losses 3.0 and 4.8
    assert math.isclose(ties.normalized.mean, (2.0 / 3.0 + 4.0 / 4.8) / 2)
    # gain kept, a ratio of sums: ((4 - 3) + (5 - 4.8)) / ((4 - 2) + (5 - 4)) = 1.2 / 3
    assert math.isclose(ties.gain_kept.mean, 0.4)
    assert math.isclose(ties.loss.mean, 3.9) and ties.loss.std == 0.0
    assert math.isclose(rows["finetune:a"].normalized.mean, (1.0 + 4.0 / 6.0) / 2)
    assert math.isclose(rows["finetune:a"].gain_kept.mean, (2 - 1) / 3)
    assert math.isclose(rows["base"].gain_kept.mean, 0.0)
    assert [row.kind for row in summary] == ["base", "finetuned", "finetuned", "merge"]

    with open(tmp_path / "out" / "merge_results.csv") as handle:
        table = list(csv.DictReader(handle))
    assert len(table) == 2 * 5 * 2  # sets x models x halves
    assert {row["set"] for row in table} == {"set0", "set1"}
    assert (tmp_path / "out" / "merging.png").read_bytes().startswith(PNG_MAGIC)
    assert "mean ± std over 2 fine-tune sets" in output.getvalue()

    with pytest.raises(ValueError, match="needs --output"):
        render([tmp_path / "set0", tmp_path / "set1"])


def test_paired_interval_by_hand():
    # differences -0.5, -0.4, -0.6: mean -0.5, sd 0.1, n 3. Student's t with 2 degrees of
    # freedom has the closed form t_p = (2p - 1) * sqrt(2 / (4p(1 - p))); p = 0.975.
    t_975_2 = 0.95 * math.sqrt(2 / (4 * 0.975 * 0.025))
    interval = paired_interval({0: 1.0, 1: 2.0, 2: 3.0}, {0: 1.5, 1: 2.4, 2: 3.6})
    half = t_975_2 * 0.1 / math.sqrt(3)
    assert math.isclose(interval.mean, -0.5) and interval.n == 3
    assert math.isclose(interval.low, -0.5 - half) and math.isclose(interval.high, -0.5 + half)
    assert interval.separated is True  # -0.5 +- 0.248 excludes 0
    # two seeds, differences -0.1 and -0.3: one degree of freedom, t = tan(pi * 0.475)
    interval = paired_interval({0: 1.0, 1: 2.0}, {0: 1.1, 1: 2.3})
    half = math.tan(math.pi * 0.475) * (0.2 / math.sqrt(2)) / math.sqrt(2)
    assert math.isclose(interval.half_width, half) and interval.separated is False
    assert format_interval(interval) == f"-0.2000 [{-0.2 - half:+.4f}, {-0.2 + half:+.4f}] n.s."
    # a 50% interval of the same: t = tan(pi / 4) = 1, half = 0.1
    narrow = paired_interval({0: 1.0, 1: 2.0}, {0: 1.1, 1: 2.3}, confidence=0.5)
    assert math.isclose(narrow.high, -0.1) and math.isclose(narrow.low, -0.3)
    one = paired_interval({0: 1.0, 4: 2.0}, {0: 1.5})
    assert one.separated is None and format_interval(one) == "-0.5000 ?"
    assert paired_interval({0: 1.0}, {1: 1.0}).n == 0


def test_the_same_difference_on_every_seed_is_no_interval():
    """Exactly (-0.5 on every seed) or up to float rounding (``a = b + 0.1``: an sd of about
    1e-16): no width, no evidence. Before: an ordering ``a < b`` and a printed interval
    ``[-0.5000, -0.5000]`` without n.s.; the offset copy was a "fails" with p = 2e-30."""
    b = {0: 3.8995, 1: 4.7027, 2: 4.3867}
    offset = paired_interval({s: v + 0.1 for s, v in b.items()}, b)
    assert 0 < offset.std < 1e-15 and offset.constant and offset.separated is None
    exact = {"a": {0: 4.0, 1: 4.25, 2: 4.5}, "b": {0: 4.5, 1: 4.75, 2: 5.0}}
    interval = paired_interval(exact["a"], exact["b"])
    assert interval.std == 0 and interval.constant and interval.separated is None
    assert format_interval(interval) == "-0.5000 (same on every seed)"
    assert ordering(exact) == "a ~ b"
    assert not paired_interval({0: 1.0, 1: 2.0}, {0: 1.5, 1: 2.6}).constant  # sd 0.07
    # a failed run on each side: differences +inf and -inf have no mean (before: fsum raised)
    failed = {"a": {0: math.inf, 1: 4.0, 2: 4.1}, "b": {0: 4.2, 1: math.inf, 2: 4.3}}
    assert ordering(failed) == "a ~ b"
    assert format_interval(paired_interval(failed["a"], failed["b"])) == "-"
    assert math.isnan(spread([1e308, 1e308, math.inf, -math.inf]).mean)  # overflow path too


@pytest.mark.parametrize("confidence", [95, 1.0, 0, -0.5, math.nan, True, "0.95"])
def test_a_confidence_that_is_no_probability_is_refused(confidence):
    """Before, 95 (a percentage) gave a NaN interval and ``ordering`` said "can't tell" of a
    clear gap; 0 ordered noise."""
    a, b = {0: 3.00, 1: 3.10, 2: 3.05}, {0: 3.20, 1: 3.30, 2: 3.22}
    for call in (
        lambda: paired_interval(a, b, confidence),
        lambda: ordering({"a": a, "b": b}, confidence),
    ):
        with pytest.raises(ValueError, match=r"confidence must lie in \(0, 1\) \(0.95 for 95%\)"):
            call()


def test_ordering_states_only_separations():
    # means a 2.0, b 3.0, c 3.0167. a - b per seed: -1.0, -1.1, -0.9 (mean -1, sd 0.1: the
    # interval -1 +- 0.25 excludes 0); b - c: -0.1, +0.2, -0.15 (mean -0.017, sd 0.19: holds 0)
    losses = {
        "c": {0: 2.1, 1: 2.9, 2: 4.05},
        "a": {0: 1.0, 1: 2.0, 2: 3.0},
        "b": {0: 2.0, 1: 3.1, 2: 3.9},
    }
    assert ordering(losses) == "a < b ~ c"
    assert ordering({"b": losses["b"], "a": losses["a"]}) == "a < b"
    assert ordering({}) == ""
    # b lacks seed 2, where a is far better: on every seed a ran its mean (3.867) is below b's
    # (3.945), but on the seeds both ran a - b = +0.10, +0.11 (interval [+0.041, +0.169] by
    # t_{0.975,1} = 12.706 x 0.005): b ranks first and is separated from a
    unequal = {"a": {0: 4.0, 1: 4.1, 2: 3.5}, "b": {0: 3.9, 1: 3.99}}
    assert ordering(unequal) == "b < a (seeds 0, 1: the ones all ran)"
    assert ordering({"a": {0: 1.0}, "b": {1: 2.0}}) == "a ~ b (seeds none: the ones all ran)"
    # a ~ b and b < c, but a - c = (-0.7, +0.38, -0.14): mean -0.153, sd 0.540, interval
    # -0.153 +- 4.303 x 0.540 / sqrt(3) = [-1.495, +1.188] holds 0, so no "<" may imply a < c
    chained = {"a": {0: 3.5, 1: 4.6, 2: 4.1}, "b": {0: 4.10, 1: 4.12, 2: 4.14},
               "c": {0: 4.20, 1: 4.22, 2: 4.24}}  # fmt: skip
    assert ordering(chained) == "a ~ b ~ c"
    # a and b both separate from c and d (and not from each other): a ~ b < c ~ d
    tiers = {"a": {0: 1.0, 1: 2.0, 2: 3.0}, "b": {0: 1.1, 1: 1.9, 2: 3.05},
             "c": {0: 5.0, 1: 6.1, 2: 7.0}, "d": {0: 5.2, 1: 5.9, 2: 7.1}}  # fmt: skip
    assert ordering(tiers) == "a ~ b < c ~ d"


# -- the published results reproduce from their committed data -----------------------------------
RESULTS = Path(__file__).parents[1] / "docs" / "results"


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, RESULTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_published_aggregator_tables_reproduce_from_results_csv():
    summary = sweep_report.summarize(runs.load_runs(RESULTS / "aggregators"))
    with open(RESULTS / "aggregators" / "summary.csv") as handle:
        published = {(r["aggregator"], r["workers"]): r for r in csv.DictReader(handle)}
    assert len(summary) == len(published) == 33
    for row in summary:
        saved = published[(row.aggregator, str(row.workers))]
        assert math.isclose(row.loss.mean, float(saved["val_loss_mean"]), rel_tol=1e-12)
        assert math.isclose(row.loss.std, float(saved["val_loss_std"]), rel_tol=1e-9)
    # the claims table of aggregators.md, by the rule it was published with
    claims = load_script("aggregator_claims")
    rows = {(r.aggregator, r.workers, r.inner_steps): r for r in summary}
    settings, table = claims.claim_rows(rows, rule="sd", digits=6)
    assert settings == [(10, 2), (10, 4), (10, 8), (10, 16)]
    text = (RESULTS / "aggregators.md").read_text()
    for _claim, pair, *cells in table:
        line = next(line for line in text.splitlines() if f"| {pair} |" in line)
        for shown, cell in zip(line.strip(" |").split(" | ")[2:], cells, strict=True):
            # published to 3 digits (rounded by hand from the script's 4), same n.s. marks
            assert abs(float(shown.split()[0]) - float(cell.split()[0])) < 6e-4, (pair, cell)
            assert shown.split()[1:] == cell.split()[1:], (pair, cell)


def test_claims_name_failed_seeds_and_short_pairs(tmp_path, capsys):
    """isoloco and diloco both failed on seed 0 and differ by -0.5 on seeds 1, 2; dp lacks
    seed 2. The claims show the failure (not "-", which means a cell not run, nor "+inf ?"),
    and a difference on fewer seeds than its cells ran says so."""
    for seed in (0, 1, 2):
        for aggregator, loss in (("isoloco", 4.0 + seed / 10), ("diloco", 4.5 + seed / 5)):
            folder = f"{aggregator}-R2-s{seed}"
            write_run(tmp_path, folder, aggregator, 2, seed, None if seed == 0 else loss)
            if seed == 0:
                (tmp_path / "runs" / folder / runs.FAILED_FILE).write_text("{}")
    for seed, loss in ((0, 4.4), (1, 4.5)):
        write_run(tmp_path, f"dp-s{seed}", "dp", 1, seed, loss)
    claims = load_script("aggregator_claims")
    summary = sweep_report.summarize(runs.load_runs(tmp_path))
    rows = {(r.aggregator, r.workers, r.inner_steps): r for r in summary}
    _, table = claims.claim_rows(rows)
    cells = {pair: cell for _claim, pair, cell in table}
    assert cells["isoloco - diloco"] == cells["diloco - dp"] == "failed (seeds 0)"
    assert cells["tsv - diloco"] == "-"
    claims.main(str(tmp_path), markdown=True)  # the tables as the docs publish them
    text = capsys.readouterr().out
    assert "| isoloco - diloco | failed (seeds 0) |" in text
    assert "| dp | 4.450 ± 0.071 (n=2) |" in text  # 4.4 and 4.5
    assert "| isoloco | failed (seeds 0) |" in text
    assert claims.loss_rows([rows[("dp", 1, 0)]], []) == []  # only the baseline finished yet
    assert "| 2. IsoLoCo beats DiLoCo | cannot tell (a run failed) (n=3) |" in text
    # a failure on a seed the other cell did not run is named too (before: seeds 0, 1 paired
    # up and the failure was dropped: "holds" where the .md says "cannot tell")
    ties = dataclasses.replace(rows[("dp", 1, 0)], aggregator="ties", workers=2, inner_steps=2,
                               losses={0: 4.2, 1: 4.4, 2: math.inf})  # fmt: skip
    assert sweep_report.format_difference(ties, rows[("dp", 1, 0)]) == "failed (seeds 2)"
    hidden = {**rows, ("isoloco", 2, 2): dataclasses.replace(
        rows[("isoloco", 2, 2)], losses={0: math.inf, 1: 4.0, 2: 4.1, 3: 4.05})}  # fmt: skip
    hidden[("diloco", 2, 2)] = dataclasses.replace(
        rows[("diloco", 2, 2)], losses={1: 4.3, 2: 4.45, 3: 4.4}
    )
    (found,) = [f for f in claims.verdicts(hidden) if f["claim"].startswith("2.")]
    assert found["verdict"] == "cannot tell (a run failed)"
    rows[("isoloco", 2, 2)] = dataclasses.replace(
        rows[("isoloco", 2, 2)], losses={0: 4.3, 1: 4.7, 2: 4.8}
    )  # finished on every seed: against dp, seeds 0 and 1 pair up (-0.1 and +0.2)
    _, table = claims.claim_rows(rows)
    # mean 0.05, sd 0.2121, se 0.15, half t_{0.975,1} x se = 12.7062 x 0.15 = 1.9059
    assert {pair: cell for _c, pair, cell in table}["isoloco - dp"] == (
        "+0.0500 [-1.8559, +1.9559] n.s. (n=2)"
    )


def test_claims_refuse_a_folder_that_is_not_a_report(tmp_path, capsys):
    """A report cell holds one outer setting: with leftovers of another (lr 0.497 beside the
    tuned 0.7) the reported seeds would pick the better one, so the claims refuse; with
    --seeds, a run of the tuning seed 900 is refused too."""
    claims = load_script("aggregator_claims")
    for seed, loss in enumerate((4.10, 4.12, 4.15)):
        write_run(tmp_path, f"diloco-R2-s{seed}", "diloco", 2, seed, loss, outer_lr=0.7)
        write_run(tmp_path, f"isoloco-R2-s{seed}", "isoloco", 2, seed, loss - 0.1)
    claims.main(str(tmp_path), seeds="0,1,2")
    assert "IsoLoCo beats DiLoCo" in capsys.readouterr().out
    write_run(tmp_path, "isoloco-R2-s900", "isoloco", 2, 900, 3.0)
    with pytest.raises(SystemExit, match=r"runs of seed\(s\) 900, not in --seeds"):
        claims.main(str(tmp_path), seeds="0,1,2")
    write_run(tmp_path, "diloco-R2-lr0.497-s0", "diloco", 2, 0, 4.05, outer_lr=0.497)
    with pytest.raises(SystemExit, match=r"diloco at R=2 H=\d+ has 2 outer settings \(outer lr"):
        claims.main(str(tmp_path))


def test_claim_verdicts_by_hand():
    """Verdicts per claim kind on hand-made paired losses (3 seeds; t_{0.975,2} = 4.3027):
    differences a - b of (-0.30, -0.20, -0.25) have mean -0.25, sd 0.05, half-width
    4.3027 x 0.05 / sqrt 3 = 0.1242: separated below 0."""
    from scipy.stats import ttest_rel

    claims = load_script("aggregator_claims")

    def row(name: str, losses: dict) -> sweep_report.SummaryRow:
        return sweep_report.SummaryRow(name, 1 if name == "dp" else 2, 0 if name == "dp" else 10,
                                       None, None, losses, ())  # fmt: skip

    base = {0: 4.0, 1: 4.2, 2: 4.1}
    shifted = {s: v + d for (s, v), d in zip(base.items(), (-0.30, -0.20, -0.25), strict=True)}
    near = {s: v + d for (s, v), d in zip(base.items(), (0.01, -0.01, 0.005), strict=True)}
    rows = {
        ("diloco", 2, 10): row("diloco", base),
        ("isoloco", 2, 10): row("isoloco", shifted),  # beats diloco: holds
        ("isoc-sgd", 2, 10): row("isoc-sgd", {0: 4.02, 1: 4.17, 2: 4.11}),  # base + noise
        ("diloco-sgd", 2, 10): row("diloco-sgd", shifted),  # isoc-sgd is worse: fails
        ("isoloco-ns", 2, 10): row(
            "isoloco-ns", {s: v + near[s] - base[s] for s, v in shifted.items()}
        ),  # fmt: skip
        ("tsv", 2, 10): row("tsv", near),  # vs diloco: within noise
        ("dp", 1, 0): row("dp", shifted),
    }
    found = {f["claim"]: f for f in claims.verdicts(rows)}
    assert found["2. IsoLoCo beats DiLoCo"]["verdict"] == "holds"
    assert found["1. Iso-C beats averaging without momentum"]["verdict"] == "fails"
    assert found["1. ... and momentum-DiLoCo without momentum"]["verdict"] == "cannot tell"
    # isoloco-ns - isoloco = (0.01, -0.01, 0.005): mean 0.00167, sd 0.01041, half 0.02586:
    # inside +-0.05, so "close" holds
    assert found["3. NS stays close to exact Iso-C"]["verdict"] == "holds"
    assert found["4. TSV vs DiLoCo"]["verdict"] == "cannot tell"
    assert found["DiLoCo vs data-parallel AdamW"]["verdict"] == "dp better"
    assert "4. TIES vs DiLoCo" not in found  # no ties cell
    # the same cell twice (every seed differs by exactly 0.3): named, not read as a result
    rows[("ties", 2, 10)] = row("ties", {s: v + 0.25 for s, v in base.items()})
    twice = {f["claim"]: f for f in claims.verdicts(rows)}["4. TIES vs DiLoCo"]
    assert twice["verdict"] == "cannot tell (every seed differs by the same amount: check the runs)"
    assert twice["p"] is None
    # the same up to float rounding (sd 5e-16; before: "fails", p about 1e-30)
    rows[("ties", 2, 10)] = row("ties", {s: (v * 10 + 1) / 10 for s, v in base.items()})
    assert 0 < paired_interval(rows[("ties", 2, 10)].losses, base).std < 1e-15
    offset = {f["claim"]: f for f in claims.verdicts(rows)}["4. TIES vs DiLoCo"]
    assert offset["verdict"].startswith("cannot tell (every seed differs by the same amount")
    del rows[("ties", 2, 10)]
    # p-values: scipy's paired t-test on the same numbers
    expected = ttest_rel(list(shifted.values()), list(base.values())).pvalue
    assert math.isclose(found["2. IsoLoCo beats DiLoCo"]["p"], expected, rel_tol=1e-9)
    assert found["3. NS stays close to exact Iso-C"]["p"] is None  # an equivalence, not a test
    # Holm by hand: m = 4, ascending p: reject while p_(k) <= 0.05 / (4 - k)
    assert claims.holm({"a": 0.01, "b": 0.04, "c": 0.012, "d": 0.3}) == {"a", "c"}
    assert claims.holm({"a": 0.0125, "b": 0.0166}) == {"a", "b"}  # 0.0125 <= 0.025, 0.0166 <= 0.05
    assert claims.holm({"a": 0.03, "b": 0.04}) == set()  # 0.03 > 0.025 stops at once


def test_published_merge_tables_reproduce_from_merge_results(tmp_path):
    documents = merge_report.documents_from_results(RESULTS / "merging" / "merge_results.json")
    merge_report.report_documents(documents, tmp_path, figures=False)
    for name in ("merge_results.csv", "merge_summary.csv", "merge_results.json"):
        assert (tmp_path / name).read_text() == (RESULTS / "merging" / name).read_text(), name


# -- tuning ---------------------------------------------------------------------------------------
def test_tuning_picks_the_mean_over_r_and_flags_grid_edges(tmp_path):
    # diloco at R = 2 and 4, outer lr 0.35 / 0.7 / 1.4, momentum 0.8 / 0.9; one seed.
    # Loss = 3 + (lr - best_lr(R))^2 + (momentum - 0.9)^2 with best lr 0.7 at R=2, 1.2 at R=4
    # (1.4 the nearest tried)
    lrs, momenta = (0.35, 0.7, 1.4), (0.8, 0.9)
    expected = {}
    for workers, best_lr in ((2, 0.7), (4, 1.2)):
        for lr in lrs:
            for momentum in momenta:
                loss = 3 + (lr - best_lr) ** 2 + (momentum - 0.9) ** 2
                expected[(workers, lr, momentum)] = loss
                write_run(tmp_path, f"diloco-R{workers}-lr{lr}-m{momentum}", "diloco", workers,
                          0, loss, outer_lr=lr, outer_momentum=momentum)  # fmt: skip
    output = io.StringIO()
    summary = sweep_report.report_sweep(tmp_path, console=Console(file=output, width=200),
                                        figures=False)  # fmt: skip
    by_r = {row.workers: row for row in summary}
    assert (by_r[2].outer_lr, by_r[2].outer_momentum) == (0.7, 0.9)
    assert by_r[2].grid_edges == ("outer momentum: highest tried",)
    assert by_r[4].grid_edges == ("outer lr: highest tried", "outer momentum: highest tried")
    # over R: mean of the two losses per setting, by hand
    means = {(lr, m): (expected[(2, lr, m)] + expected[(4, lr, m)]) / 2
             for lr in lrs for m in momenta}  # fmt: skip
    best = min(means, key=means.__getitem__)
    [tuned] = json.loads((tmp_path / sweep_report.TUNED_FILE).read_text())
    # lr 0.7: (0 + 0.25) / 2 against lr 1.4: (0.49 + 0.04) / 2
    assert (tuned["outer_lr"], tuned["outer_momentum"]) == best == (0.7, 0.9)
    assert tuned["workers"] == [2, 4] and math.isclose(tuned["mean_loss"], means[best])
    assert tuned["grid_edges"] == ["outer momentum: highest tried"]
    text = output.getvalue()
    assert "Tuned outer values" in text and "extend the grid" in text
    assert "report on seeds the tuning did not use" in " ".join(text.split())
    with open(tmp_path / "results.csv") as handle:
        assert {r["outer_momentum"] for r in csv.DictReader(handle)} == {"0.8", "0.9"}


def test_grid_edges_by_hand():
    """Each coordinate of the chosen setting against the values tried with the other held at
    its chosen value: lowest, highest, interior, or the only value tried there while the grid
    holds others (before: no edge, so an optimum an uneven extension left unbracketed passed);
    no momentum (outer SGD) has no momentum edge, one value in all none either."""
    edges = sweep_report.grid_edges
    full = [(lr, m) for lr in (0.5, 1.0, 2.0) for m in (0.8, 0.9)]
    assert edges(full, (0.5, 0.8)) == ("outer lr: lowest tried", "outer momentum: lowest tried")
    assert edges(full, (2.0, 0.9)) == ("outer lr: highest tried", "outer momentum: highest tried")
    assert edges(full, (1.0, 0.9)) == ("outer momentum: highest tried",)
    # momentum 0.7 tried at lr 0.5 only: lr 1.0's momenta are 0.8, 0.9; lr 0.5's, 0.7 to 0.9
    extended = [*full, (0.5, 0.7)]
    assert edges(extended, (0.5, 0.8)) == ("outer lr: lowest tried",)
    assert edges(extended, (1.0, 0.8)) == ("outer momentum: lowest tried",)
    assert edges(extended, (0.5, 0.7)) == (  # lr 0.5 alone at momentum 0.7
        "outer lr: the only one tried at this momentum",
        "outer momentum: lowest tried",
    )
    uneven = [(0.35, 0.7), (0.35, 0.8), (0.5, 0.7), (0.5, 0.8), (0.248, 0.5), (0.248, 0.6),
              (0.248, 0.7)]  # fmt: skip
    assert edges(uneven, (0.248, 0.6)) == ("outer lr: the only one tried at this momentum",)
    assert edges([(0.8, None), (1.6, None)], (0.8, None)) == ("outer lr: lowest tried",)
    assert edges([(1.6, None)], (1.6, None)) == ()


def test_tuning_uses_only_settings_finished_on_every_seed_at_every_r(tmp_path):
    # diloco at R = 2 and 4, outer lr 0.7 (preset) and 0.35, seeds 0 and 1; lr 0.35 at R = 2
    # has only seed 0 finished, with a low loss: per R and over R, lr 0.7 is chosen, and 0.35
    # is named as left out
    losses = {(2, 0.7): (4.7, 4.8), (2, 0.35): (4.6, None), (4, 0.7): (4.9, 5.0),
              (4, 0.35): (4.95, 5.05)}  # fmt: skip
    for (workers, lr), by_seed in losses.items():
        for seed, loss in enumerate(by_seed):
            write_run(tmp_path, f"diloco-R{workers}-lr{lr}-s{seed}", "diloco", workers, seed,
                      loss, outer_lr=lr)  # fmt: skip
    output = io.StringIO()
    summary = sweep_report.report_sweep(tmp_path, console=Console(file=output, width=200),
                                        figures=False)  # fmt: skip
    assert {row.workers: row.outer_lr for row in summary} == {2: 0.7, 4: 0.7}
    [tuned] = sweep_report.tuned_settings(summary)
    assert tuned["outer_lr"] == 0.7
    assert math.isclose(tuned["mean_loss"], (4.75 + 4.95) / 2)
    assert tuned["incomplete"] == ["outer lr 0.35, momentum 0.9"]
    assert "tuned without outer lr 0.35, momentum 0.9" in output.getvalue()


def test_tuning_keeps_an_r_that_finished_one_setting_and_breaks_ties_low(tmp_path):
    """R = 4 finished only lr 0.7 while R = 2 swept 0.35 / 0.7 / 1.4: R = 4 takes part and the
    settings it lacks are incomplete (before, R = 4 dropped out and R = 2 alone chose, unsaid).
    Two settings of equal mean loss: the lower lr is chosen, whatever the order of the runs."""
    for lr, loss in ((0.35, 4.5), (0.7, 4.6), (1.4, 4.4)):
        write_run(tmp_path, f"diloco-R2-lr{lr}", "diloco", 2, 0, loss, outer_lr=lr)
    write_run(tmp_path, "diloco-R4-lr0.7", "diloco", 4, 0, 4.9, outer_lr=0.7)
    summary = sweep_report.summarize(runs.load_runs(tmp_path))
    [tuned] = sweep_report.tuned_settings(summary)
    assert tuned["workers"] == [2, 4] and tuned["outer_lr"] == 0.7
    assert tuned["incomplete"] == ["outer lr 0.35, momentum 0.9", "outer lr 1.4, momentum 0.9"]
    tied = tmp_path / "tied"
    for lr in (1.4, 0.7, 0.35, 2.8):  # 0.7 and 1.4 tie at 4.3, 0.35 and 2.8 lie above
        write_run(tied, f"diloco-R2-lr{lr}", "diloco", 2, 0, 4.3 if lr in (0.7, 1.4) else 4.5,
                  outer_lr=lr)  # fmt: skip
    [tuned] = sweep_report.tuned_settings(sweep_report.summarize(runs.load_runs(tied)))
    assert tuned["outer_lr"] == 0.7


def test_tuning_says_when_no_setting_can_be_chosen_and_never_leaves_a_stale_file(tmp_path, capsys):
    """R = 2 finished lr 0.7 on seeds 0, 1 and 1.4 on seed 0; R = 4 the other way round: no
    setting has the most seeds at both R. Before, the aggregator dropped out of tuned.json
    unsaid, and a tuned.json written by an earlier report stayed, passing its values on."""
    decide = load_script("aggregators_tuned")
    seeds = {(2, 0.7): (0, 1), (2, 1.4): (0,), (4, 0.7): (0,), (4, 1.4): (0, 1)}
    for (workers, lr), finished in seeds.items():
        for seed in finished:
            write_run(tmp_path, f"diloco-R{workers}-lr{lr}-s{seed}", "diloco", workers, seed,
                      4.0 + seed / 10, outer_lr=lr)  # fmt: skip
    output = io.StringIO()
    sweep_report.report_sweep(tmp_path, console=Console(file=output, width=200), figures=False)
    [entry] = json.loads((tmp_path / sweep_report.TUNED_FILE).read_text())
    assert (entry["outer_lr"], entry["outer_momentum"], entry["mean_loss"]) == (None,) * 3
    assert entry["incomplete"] == ["outer lr 0.7, momentum 0.9", "outer lr 1.4, momentum 0.9"]
    assert "diloco H=2: not tuned yet" in output.getvalue()
    assert decide.main(["flags", str(tmp_path)]) == 1
    assert "diloco (no setting finished at every R on the same seeds)" in capsys.readouterr().err
    assert decide.main(["table", str(tmp_path)]) == 0
    assert "| diloco | not tuned yet (0.7) |" in capsys.readouterr().out
    # the sweep is cut down to one setting: nothing is tuned any more, and tuned.json goes
    for name in ("diloco-R2-lr1.4-s0", "diloco-R4-lr1.4-s0", "diloco-R4-lr1.4-s1"):
        shutil.rmtree(tmp_path / "runs" / name)
    sweep_report.report_sweep(tmp_path, figures=False)
    assert not (tmp_path / sweep_report.TUNED_FILE).exists()
    assert decide.main(["table", str(tmp_path)]) == 1
    assert "no tuned.json yet" in capsys.readouterr().err


# -- the staged protocol's decisions (docs/results/aggregators_tuned.py) ---------------------------
def test_protocol_decisions_by_hand(tmp_path, capsys):
    decide = load_script("aggregators_tuned")
    curve = [(100, 6.0), (200, 5.5), (400, 5.2), (800, 5.17), (1600, 5.16)]
    # doubling from 100 gains 0.5, from 200 0.3, from 400 0.03 < 0.05
    assert decide.flat_horizon(curve, 0.05) == 400
    assert decide.flat_horizon(curve, 0.005) is None  # 800 -> 1600 gains 0.01
    # a spike at 400 makes 200 -> 400 look flat, but 400 -> 800 and 800 -> 1600 still gain
    spiked = [(100, 6.0), (200, 5.2), (400, 5.19), (800, 4.5), (1600, 4.25)]
    assert decide.flat_horizon(spiked, 0.05) is None
    assert decide.flat_horizon([*spiked[:4], (1600, 4.48)], 0.05) == 800
    assert decide.longest_doubled(curve) == 800  # not flat: the longest budget with its double
    assert decide.longest_doubled([(100, 6.0), (300, 5.0)]) is None
    # a run validated at 128 tokens (8.0) and finished at 256 (7.0): not flat, so 128
    write_run(tmp_path / "horizon", "diloco-R4-H2-s900", "diloco", 4, 900, 7.0)
    assert decide.main(["horizon", str(tmp_path / "horizon")]) == 0
    captured = capsys.readouterr()
    assert captured.out == "128\n" and "not flat" in captured.err and "at 256" in captured.err

    # inner lr: mean of dp, diloco R=2 and R=4 per lr; 2e-3 wins inside the grid
    losses = {1e-3: (3.3, 3.4, 3.5), 2e-3: (3.0, 3.2, 3.1), 4e-3: (3.1, 3.3, 3.6)}
    folders = []
    for lr, (dp, r2, r4) in losses.items():
        folder = tmp_path / f"lr{lr:g}"
        write_run(folder, "dp-s9", "dp", 1, 9, dp, inner_lr=lr)
        write_run(folder, "diloco-R2-s9", "diloco", 2, 9, r2, inner_lr=lr)
        write_run(folder, "diloco-R4-s9", "diloco", 4, 9, r4, inner_lr=lr)
        folders.append(str(folder))
    assert decide.main(["inner", *folders]) == 0
    assert capsys.readouterr().out == "0.002\n"
    assert decide.main(["inner", *folders[:2]]) == 1  # best at the grid's high edge
    assert "extend the grid" in capsys.readouterr().err
    # a folder whose DiLoCo cells are unfinished cannot win on its (low) dp loss alone
    early = tmp_path / "lr0.003"
    write_run(early, "dp-s9", "dp", 1, 9, 2.0, inner_lr=3e-3)
    write_run(early, "diloco-R2-s9", "diloco", 2, 9, None, inner_lr=3e-3)
    assert decide.main(["inner", *folders, str(early)]) == 1
    assert "lr0.003: not finished (diloco R=2, diloco R=4)" in capsys.readouterr().err

    tuned = [{"aggregator": "isoloco", "inner_steps": 10, "outer_lr": 1.8, "outer_momentum": 0.9,
              "workers": [2, 8], "mean_loss": 5.0, "grid_edges": [], "incomplete": [],
              "grid_edges_at_R": {"2": [], "8": []}},
             {"aggregator": "tsv", "inner_steps": 10, "outer_lr": 0.6, "outer_momentum": 0.0,
              "workers": [2, 8], "mean_loss": 5.1, "grid_edges": [], "incomplete": [],
              "grid_edges_at_R": {"2": [], "8": []}}]  # fmt: skip
    (tmp_path / sweep_report.TUNED_FILE).write_text(json.dumps(tuned))
    for aggregator in ("isoloco", "tsv"):
        write_run(tmp_path, f"{aggregator}-R2-s900", aggregator, 2, 900, 5.0)
    assert decide.main(["flags", str(tmp_path)]) == 0
    assert capsys.readouterr().out == (
        "--outer-lr-grid isoloco=1.8 --outer-momentum-grid isoloco=0.9 --outer-lr-grid tsv=0.6\n"
    )
    assert decide.main(["flags", str(tmp_path), "--aggregators", "tsv"]) == 0
    assert capsys.readouterr().out == "--outer-lr-grid tsv=0.6\n"
    assert decide.main(["table", str(tmp_path)]) == 0  # beside the presets' 1.8 / 0.8, 0.6 / 0
    assert capsys.readouterr().out.splitlines()[2:] == [
        "| isoloco | 1.8 (1.8) | 0.9 (0.8) | 5.0000 (R = 2, 8) |",
        "| tsv | 0.6 (0.6) | 0 (0) | 5.1000 (R = 2, 8) |",
    ]
    assert decide.main(["flags", str(tmp_path), "--aggregators", "tsv,ties"]) == 1
    assert "no tuned values for ties" in capsys.readouterr().err
    refusals = [  # what else keeps the tuned values from stage 5
        ("grid_edges", ["outer lr: lowest tried"], "tsv (outer lr: lowest tried)"),
        ("grid_edges_at_R", {"2": [], "8": ["outer lr: highest tried"]},
         "tsv R=8 (outer lr: highest tried)"),
        ("incomplete", ["outer lr 0.3, momentum preset"],
         "tsv lacks outer lr 0.3, momentum preset"),
        ("mean_loss", math.inf, "tsv (every setting failed at some R"),
    ]  # fmt: skip
    for key, value, message in refusals:
        changed = [tuned[0], {**tuned[1], key: value}]
        (tmp_path / sweep_report.TUNED_FILE).write_text(json.dumps(changed))
        assert decide.main(["flags", str(tmp_path)]) == 1
        assert message in capsys.readouterr().err
    (tmp_path / sweep_report.TUNED_FILE).write_text(json.dumps(tuned))
    write_run(tmp_path, "ties-R2-s900", "ties", 2, 900, 5.2)  # swept, but not in tuned.json
    assert decide.main(["flags", str(tmp_path)]) == 1
    assert "no tuned values for ties" in capsys.readouterr().err
    write_run(tmp_path, "ties-R4-s900", "ties", 4, 900, None)  # and unfinished
    assert decide.main(["flags", str(tmp_path)]) == 1
    assert "1 unfinished run(s) (ties-R4-s900)" in capsys.readouterr().err
    # the lowest momentum is an edge to extend above the floor (0.1), and accepted at it
    floor = tmp_path / "floor"
    at_lowest = [
        {
            **tuned[0],
            "outer_momentum": 0.2,
            "grid_edges": ["outer momentum: lowest tried"],
            "grid_edges_at_R": {"2": ["outer momentum: lowest tried"], "8": []},
            "best_at_R": {"2": [1.8, 0.2], "8": [1.8, 0.4]},
        }
    ]
    (floor / "runs").mkdir(parents=True)
    (floor / sweep_report.TUNED_FILE).write_text(json.dumps(at_lowest))
    for momentum in (0.2, 0.4):
        write_run(floor, f"isoloco-R2-m{momentum}-s900", "isoloco", 2, 900, 5.0,
                  outer_momentum=momentum)  # fmt: skip
    assert decide.main(["flags", str(floor)]) == 1
    err = capsys.readouterr().err
    assert "isoloco (outer momentum: lowest tried)" in err
    assert "isoloco R=2 (outer momentum: lowest tried)" in err
    write_run(floor, "isoloco-R2-m0.1-s900", "isoloco", 2, 900, 5.0, outer_momentum=0.1)
    # momentum 0.1 tried, but the best still at 0.2, the lowest at its lr: still an edge
    # (before: accepted, as the floor was tested on the lowest momentum tried anywhere)
    assert decide.main(["flags", str(floor)]) == 1
    assert "isoloco R=2 (outer momentum: lowest tried)" in capsys.readouterr().err
    at_floor = {"outer_momentum": 0.1, "best_at_R": {"2": [1.8, 0.1], "8": [1.8, 0.4]}}
    (floor / sweep_report.TUNED_FILE).write_text(json.dumps([{**at_lowest[0], **at_floor}]))
    assert decide.main(["flags", str(floor)]) == 0
    captured = capsys.readouterr()
    assert captured.out == "--outer-lr-grid isoloco=1.8 --outer-momentum-grid isoloco=0.1\n"
    assert "isoloco R=2: best at the lowest momentum, 0.1, the grid's floor" in captured.err
    # a folder where nothing was swept has no tuned.json: said, not a traceback
    (floor / sweep_report.TUNED_FILE).unlink()
    assert decide.main(["flags", str(floor)]) == 1
    assert "no tuned.json" in capsys.readouterr().err

    # evaluation noise: model b is model a + (0.1, 0.3, 0.2, 0.4) on four parts
    a_losses, shifts = (4.0, 5.0, 3.0, 6.0), (0.1, 0.3, 0.2, 0.4)
    records = [{"model": name, "data": "a+b", "val_set": k, "loss": loss}
               for name, losses in (("a", a_losses),
                                    ("b", [x + d for x, d in zip(a_losses, shifts, strict=True)]))
               for k, loss in enumerate(losses)]  # fmt: skip
    (tmp_path / "noise.json").write_text(json.dumps(records))
    assert decide.main(["noise", str(tmp_path / "noise.json")]) == 0
    # shifts: mean 0.25, sample sd sqrt(((.15)^2 + (.05)^2 * 2 + (.15)^2) / 3) = 0.1291; se / 2
    assert capsys.readouterr().out == "0.0645\n"
    # records of two datasets (eval --data a,b where the run trained on a,b) are refused
    records.append({**records[0], "data": "c"})
    (tmp_path / "noise.json").write_text(json.dumps(records))
    assert decide.main(["noise", str(tmp_path / "noise.json")]) == 1
    assert "records of 2 datasets (a+b, c)" in capsys.readouterr().err


def test_protocol_grid_tables_by_hand(tmp_path, capsys):
    """isoloco (preset lr 1.8, momentum 0.8) at R = 2: lr 0.9 and 1.8 x momentum 0.8 and 0.9,
    one cell unfinished and one failed; R = 4 ran one cell. Every value tried at any R is a
    row or column at each R, the best of each R in bold."""
    decide = load_script("aggregators_tuned")
    cells = {(2, 0.9, 0.8): 4.1234, (2, 0.9, 0.9): 4.0, (2, 1.8, 0.8): None,
             (2, 1.8, 0.9): "failed", (4, 1.8, 0.8): 4.5}  # fmt: skip
    for (workers, lr, momentum), loss in cells.items():
        name = f"isoloco-R{workers}-lr{lr}-m{momentum}-s900"
        write_run(tmp_path, name, "isoloco", workers, 900, None if loss == "failed" else loss,
                  outer_lr=lr, outer_momentum=momentum)  # fmt: skip
        if loss == "failed":
            (tmp_path / "runs" / name / runs.FAILED_FILE).write_text("{}")
    assert decide.main(["grid", str(tmp_path)]) == 0
    assert capsys.readouterr().out.split("\n\n") == [
        "\nisoloco, R = 2, H = 2:",
        "| outer lr \\ momentum | 0.8 (preset) | 0.9 |\n|---|---|---|\n"
        "| 0.9 | 4.123 | **4.000** |\n| 1.8 (preset) | · | failed |",
        "isoloco, R = 4, H = 2:",
        "| outer lr \\ momentum | 0.8 (preset) | 0.9 |\n|---|---|---|\n"
        "| 0.9 | · | · |\n| 1.8 (preset) | **4.500** | · |\n",
    ]
    assert decide.main(["grid", str(tmp_path), "--aggregators", "tsv"]) == 0
    assert "no finished cell of tsv" in capsys.readouterr().err


def test_published_tuning_grids_are_the_grid_of_the_published_data(capsys):
    """aggregators_tuned.md shows stage 4's cells as `aggregators_tuned.py grid` prints them
    from the published runs: no number in those tables was typed by hand."""
    decide = load_script("aggregators_tuned")
    text = (RESULTS / "aggregators_tuned.md").read_text()
    start = "<!-- grid: docs/results/aggregators_tuned/tune -->\n"
    shown = text[text.index(start) + len(start) : text.index("<!-- end grid -->")]
    assert decide.main(["grid", str(RESULTS / "aggregators_tuned" / "tune")]) == 0
    assert shown.strip() == capsys.readouterr().out.strip()


def test_protocol_publish_copies_ended_runs_small_files_only(tmp_path, capsys):
    decide = load_script("aggregators_tuned")
    stage = tmp_path / "stage"
    write_run(stage, "dp-s9", "dp", 1, 9, 3.5)
    write_run(stage, "diloco-R2-s9", "diloco", 2, 9, None)  # unfinished: left out
    write_run(stage, "tsv-R2-s9", "tsv", 2, 9, None)
    (stage / "runs" / "tsv-R2-s9" / runs.FAILED_FILE).write_text("{}")  # failed: published
    (stage / "runs" / "dp-s9" / "checkpoints").mkdir()
    (stage / "runs" / "dp-s9" / "final").mkdir()
    (stage / "runs" / "dp-s9" / "final" / "model.safetensors").write_bytes(b"weights")
    (stage / "results.csv").write_text("name\n")
    docs = tmp_path / "docs" / "stage"
    assert decide.main(["publish", str(stage), str(docs)]) == 0
    published = sorted(str(p.relative_to(docs)) for p in docs.rglob("*") if p.is_file())
    assert published == ["results.csv", "runs/dp-s9/config.json", "runs/dp-s9/metrics.jsonl",
                         "runs/tsv-R2-s9/config.json", "runs/tsv-R2-s9/failed.json",
                         "runs/tsv-R2-s9/metrics.jsonl"]  # fmt: skip
    assert capsys.readouterr().out == f"{docs}: 6 files of 2 ended runs (1 unfinished left out)\n"
    for name in published:
        assert (docs / name).read_bytes() == (stage / name).read_bytes()


def test_protocol_restore_makes_published_cells_finished_in_a_new_work_folder(tmp_path, capsys):
    """publish, then restore on a machine without the work folder: the same small files, every
    stage and run folder marked ours, finished cells finished, a file already there kept."""
    from mergekit_loco.io.atomic import marked_kind

    decide = load_script("aggregators_tuned")
    stage = tmp_path / "work" / "inner" / "lr1e-3"
    write_run(stage, "dp-s9", "dp", 1, 9, 3.5)
    write_run(stage, "diloco-R2-s9", "diloco", 2, 9, None)  # unfinished: never published
    (stage / "eval_noise.json").write_text("[]")
    docs = tmp_path / "docs"
    assert decide.main(["publish", str(stage), str(docs / "inner" / "lr1e-3")]) == 0
    new = tmp_path / "new"
    (new / "inner" / "lr1e-3").mkdir(parents=True)
    (new / "inner" / "lr1e-3" / "eval_noise.json").write_text("[1]")
    capsys.readouterr()
    assert decide.main(["restore", str(docs), str(new)]) == 0
    assert capsys.readouterr().out == f"{new}: 1 stages, 2 files copied, 1 already there (kept)\n"
    restored = new / "inner" / "lr1e-3"
    assert (restored / "eval_noise.json").read_text() == "[1]"
    assert runs.is_finished(restored / "runs" / "dp-s9")
    assert not (restored / "runs" / "diloco-R2-s9").exists()
    assert marked_kind(restored) == "compare sweep"
    assert marked_kind(restored / "runs" / "dp-s9") == "training run"
    assert decide.main(["restore", str(tmp_path / "empty"), str(new)]) == 1
    assert "no published stage" in capsys.readouterr().err


def test_protocol_compute_sums_round_seconds(tmp_path, capsys):
    """Core-hours of a stage: the rounds' own seconds of every run, whatever the run resumed."""
    decide = load_script("aggregators_tuned")
    for name, seconds in (("dp-s9", (1000.0, 800.0)), ("diloco-R2-s9", (450.0, 450.0))):
        folder = tmp_path / "stage" / "runs" / name
        folder.mkdir(parents=True)
        events = [{"event": "round", "round": k + 1, "round_seconds": s}
                  for k, s in enumerate(seconds)] + [{"event": "eval", "round": 2}]  # fmt: skip
        (folder / "metrics.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    assert decide.main(["compute", str(tmp_path / "stage")]) == 0
    out = capsys.readouterr().out
    assert "2 runs, 0.75 core-hours" in out and "total: 0.75 core-hours" in out  # 2700 s


def test_tables_are_not_cut_when_stdout_is_not_a_terminal(tmp_path, capsys, monkeypatch):
    """``mloco report`` into a pipe, a log or CI (here pytest's capture): every cell in full
    (before: rich's 80 columns cut them to ``aggre…`` and ``[-1.0…``), sweep and merge alike."""
    from mergekit_loco.cli import main

    monkeypatch.delenv("COLUMNS", raising=False)
    sweep = tmp_path / "sweep"
    for seed, loss in ((0, 3.5), (1, 3.6)):
        write_run(sweep, f"dp-s{seed}", "dp", 1, seed, loss)
    for seed, (diloco, isoloco) in enumerate(((3.0, 2.5), (3.2, 2.6))):
        write_run(sweep, f"diloco-R2-H2-s{seed}", "diloco", 2, seed, diloco)
        write_run(sweep, f"isoloco-R2-H2-s{seed}", "isoloco", 2, seed, isoloco)
    sets = [tmp_path / "set0", tmp_path / "set1"]
    for folder in sets:
        folder.mkdir()
        (folder / merge_report.EVALUATIONS).write_text(json.dumps(merge_document()))
    outputs = []
    for args in ([sweep], [*sets, "-o", tmp_path / "merged"]):
        with pytest.raises(SystemExit) as exited:
            main(["report", *map(str, args), "--no-figures"])
        assert exited.value.code in (0, None)
        outputs.append(capsys.readouterr().out)
    assert all("…" not in out for out in outputs), outputs
    # by hand: diloco - isoloco per seed 0.5, 0.6; 95% t-interval 0.55 +- 12.706 * 0.0707 / sqrt(2)
    assert "aggregator" in outputs[0] and "+0.5500 [-0.0853, +1.1853] n.s." in outputs[0]
    assert "mean ± std over 2 fine-tune sets" in outputs[1]


def test_the_baseline_has_no_inner_steps_in_either_csv(tmp_path, capsys):
    """Before: summary.csv wrote inner_steps 0 for dp and results.csv the preset's unused H."""
    from hostile import run_cli

    for seed in (0, 1):
        write_run(tmp_path, f"dp-s{seed}", "dp", 1, seed, 3.9 + seed / 10)
        write_run(tmp_path, f"diloco-R2-H2-s{seed}", "diloco", 2, seed, 3.5 + seed / 10)
    assert run_cli(capsys, "report", tmp_path, "--no-figures")[0] == 0
    for name in ("results.csv", "summary.csv"):
        with open(tmp_path / name, newline="") as handle:
            steps = {(row["aggregator"], row["inner_steps"]) for row in csv.DictReader(handle)}
        assert steps == {("dp", ""), ("diloco", "2")}, name
    document = json.loads((tmp_path / "results.json").read_text())
    assert {r["inner_steps"] for r in document["runs"] if r["aggregator"] == "dp"} == {None}
    assert [r["inner_steps"] for r in document["summary"] if r["aggregator"] == "dp"] == [None]
    # a published results.csv reads back (the baseline's empty H as 0, as summarize keys it)
    assert {run.inner_steps for run in runs.runs_from_table(tmp_path / "results.csv")} == {0, 2}


def test_ordering_cuts_only_where_every_pair_across_separates(tmp_path, capsys):
    """docs/compare.md's rule, by hand: b - c = -0.11, -0.10, -0.09 (mean -0.1, sd 0.01, 95%
    half-width t(0.975, 2) = 4.303 x 0.01 / sqrt(3) = 0.025) separates, but a - c = -1.0, +0.5,
    0.0 (mean -0.167, sd 0.764, half-width 1.90) does not: the neighbours b, c separate, yet
    no cut puts every name before it below every name after it, so no ``<``."""
    from mergekit_loco.cli import main

    a = {0: 1.0, 1: 2.5, 2: 2.0}  # mean 1.833
    b = {0: 1.89, 1: 1.90, 2: 1.91}  # mean 1.9
    c = {0: 2.0, 1: 2.0, 2: 2.0}
    neighbours = paired_interval(b, c)
    assert neighbours.separated and neighbours.high < 0
    assert not paired_interval(a, c).separated
    assert ordering({"a": a, "b": b, "c": c}) == "a ~ b ~ c"  # a neighbour rule: a ~ b < c
    assert ordering({"b": b, "c": c}) == "b < c"
    # through the CLI: isoloco, diloco and the dp baseline as a, b, c
    for seed in a:
        write_run(tmp_path, f"isoloco-R2-H2-s{seed}", "isoloco", 2, seed, a[seed])
        write_run(tmp_path, f"diloco-R2-H2-s{seed}", "diloco", 2, seed, b[seed])
        write_run(tmp_path, f"dp-s{seed}", "dp", 1, seed, c[seed])
    with pytest.raises(SystemExit) as exited:
        main(["report", str(tmp_path), "--no-figures"])
    assert exited.value.code == 0
    assert "R=2 H=2: isoloco ~ diloco ~ dp" in capsys.readouterr().out
