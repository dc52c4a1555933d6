"""The training loop end to end on the micro model: outputs, resume exactness, errors, CLI."""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import stdlib_corpus
from transformers import AutoTokenizer, LlamaForCausalLM
from typer.testing import CliRunner

from mergekit_loco.cli import app
from mergekit_loco.train import rounds
from mergekit_loco.train.checkpoint import CheckpointCorrupt, latest_checkpoint
from mergekit_loco.train.config import PRESETS, TrainConfig, preset_config, resolve_config
from mergekit_loco.train.data import prepare_data
from mergekit_loco.train.loop import TrainingDiverged, TrainingInterrupted, train
from mergekit_loco.train.model import build_model, model_config, parameter_checksum
from mergekit_loco.train.workers import InnerOptimizer

CORPUS_FILES = (
    "textwrap.py", "string.py", "json/__init__.py", "json/decoder.py", "json/encoder.py",
    "csv.py", "fractions.py", "heapq.py", "bisect.py", "shlex.py", "glob.py", "fnmatch.py",
)  # fmt: skip
#: micro model, R = 4, H = 2, 8 sequences of 32 tokens per inner step (2 per worker):
#: 512 tokens a step, 4 rounds of 2 steps.
TINY = dict(
    model="micro", workers=4, inner_steps=2, global_batch=8, seq_len=32, tokens=2048,
    vocab_size=512, val_tokens=1024, device="cpu",
)  # fmt: skip


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Iterator[str]:
    with stdlib_corpus(tmp_path_factory.mktemp("corpus"), CORPUS_FILES) as corpus:
        yield corpus


def tiny_config(corpus: str, out: Path, **overrides) -> TrainConfig:
    return resolve_config(None, **{**TINY, "data": corpus, "out": str(out), **overrides})


def read_metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def reference_run(corpus, tmp_path_factory):
    """An uninterrupted isoloco run (momentum, Iso-C) of 4 rounds, checkpoint every round."""
    out = tmp_path_factory.mktemp("reference")
    config = tiny_config(corpus, out, preset="isoloco", checkpoint_every=1, eval_every=2)
    return train(config, progress=False)


# -- config ----------------------------------------------------------------------------------------
def test_presets_hold_the_tuned_paper_values():
    expected = {  # preset: aggregator, outer lr, momentum, nesterov, inner lr
        "diloco": ("mean", 0.7, 0.9, True, 1.38e-3),
        "diloco-sgd": ("mean", 1.6, 0.0, False, 1.38e-3),
        "isoloco": ("iso-c", 1.8, 0.8, True, 1.38e-3),
        "isoloco-ns": ("iso-c", 1.8, 0.8, True, 1.38e-3),
        "isoc-sgd": ("iso-c", 2.1, 0.0, False, 3.91e-3),
        "iso-cts": ("iso-cts", 3.1, 0.0, False, 3.91e-3),
        "tsv": ("tsv", 0.6, 0.0, False, 2.76e-3),
        "ties": ("ties", 0.7, 0.0, False, 2.76e-3),
        "dare": ("dare", 1.5, 0.0, False, 2.76e-3),
    }
    for preset, values in expected.items():
        config = resolve_config(preset=preset)
        outer = config.outer
        got = (outer.aggregator, outer.lr, outer.momentum, outer.nesterov, config.inner.lr)
        assert got == values, preset
    assert resolve_config(preset="isoloco-ns").outer.aggregator_options == {"spectral": "ns"}
    assert resolve_config(preset="ties").outer.aggregator_options == {"density": 0.9}
    assert resolve_config(preset="dare").outer.aggregator_options == {"density": 0.9}
    dp = resolve_config(preset="dp")
    assert (dp.run.mode, dp.inner.lr, dp.inner.weight_decay) == ("dp", 1.95e-3, 0.15)
    assert set(expected) | {"dp"} == set(PRESETS)


def test_config_file_then_flags(tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text(
        'preset = "ties"\nworkers = 4\nouter-lr = 0.5\n[aggregator_options]\ndensity = 0.5\n'
    )
    config = resolve_config(toml, outer_lr=0.9)
    assert (config.outer.aggregator, config.run.workers, config.outer.lr) == ("ties", 4, 0.9)
    assert config.outer.aggregator_options == {"density": 0.5}
    yaml = tmp_path / "run.yaml"
    yaml.write_text("aggregator: iso-c\naggregator_options: {spectral: exact}\nbetas: [0.8, 0.9]\n")
    config = resolve_config(yaml, aggregator_options={"rank_aware": True})
    assert config.outer.aggregator_options == {"spectral": "exact", "rank_aware": True}
    assert config.inner.betas == (0.8, 0.9)
    # the resolved config survives a round trip through config.json
    assert TrainConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config
    (tmp_path / "bad.toml").write_text("wokers = 4\n")
    with pytest.raises(ValueError, match="bad.toml: unknown option 'wokers'"):
        resolve_config(tmp_path / "bad.toml")


@pytest.mark.parametrize(
    ("name", "content", "fragment"),
    [
        ("bad.json", b'{"workers": ', "cannot be parsed: Expecting value"),
        ("bad.toml", b"workers = = 4", "cannot be parsed: "),
        ("bad.yaml", b"workers: [4", "cannot be parsed: "),
        ("latin.toml", b'preset = "caf\xe9"', "cannot be parsed: 'utf-8' codec"),
        ("huge.json", b'{"workers": ' + b"9" * 5000 + b"}", "cannot be parsed: Exceeds the limit"),
        ("huge.yaml", b"workers: " + b"9" * 5000, "cannot be parsed: Exceeds the limit"),
        ("list.json", b"[1, 2]", "must hold a table of options"),
        ("run.ini", b"workers=4", "use .toml, .yaml, .yml or .json"),
        ("big.yaml", b"#" * (2**20 + 1), "more than a config file may hold"),
    ],
)
def test_a_config_file_that_cannot_be_read_is_one_line_naming_it(tmp_path, name, content, fragment):
    path = tmp_path / name
    path.write_bytes(content)
    result = CliRunner().invoke(app, ["train", "--config", str(path), "--out", str(tmp_path / "o")])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and str(path) in lines[0] and fragment in lines[0], lines
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            dict(global_batch=10),
            r"global batch of 10 \(global_batch\) is not divisible by 4 workers",
        ),
        (dict(inner_steps=0), "inner_steps must be >= 1"),
        (dict(aggregator="iso-c", aggregator_options={"densty": 0.5}), "does not take 'densty'"),
        (dict(tokens=500), "less than one round"),
        (dict(tokens=100, chinchilla=20.0), "tokens or chinchilla, not both"),
        (dict(preset="diloco-sgd", nesterov=True), "nesterov needs outer_momentum > 0"),
        (dict(compression="int8"), "compression='int8' compresses what ranks send each other"),
    ],
)
def test_bad_config_is_refused_before_anything_runs(corpus, tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        train(tiny_config(corpus, tmp_path / "run", **overrides), progress=False)
    assert not (tmp_path / "run").exists()


def test_aggregator_that_cannot_fit_the_model_fails_before_training(corpus, tmp_path):
    """TSV keeps min(m, n) // R components: 64 workers leave none for the 32-wide micro model."""
    config = tiny_config(corpus, tmp_path, aggregator="tsv", workers=64, global_batch=64,
                         tokens=64 * 32 * 2)  # fmt: skip
    with pytest.raises(ValueError, match="tsv: tensor"):
        train(config, progress=False)
    assert not (tmp_path / "metrics.jsonl").exists()


def test_data_too_small_for_the_budget(corpus, tmp_path):
    with pytest.raises(ValueError, match="needs 40,960,000 training tokens"):
        train(tiny_config(corpus, tmp_path, tokens=40_960_000), progress=False)


# -- a run -----------------------------------------------------------------------------------------
def test_run_writes_metrics_config_and_a_loadable_final_model(corpus, reference_run):
    out = reference_run.out
    events = read_metrics(out)
    assert [e["event"] for e in events] == ["round", "round", "eval", "round", "round", "final"]
    assert [e["round"] for e in events if e["event"] == "round"] == [1, 2, 3, 4]
    assert [e["tokens"] for e in events if e["event"] == "round"] == [512, 1024, 1536, 2048]
    round_event = events[0]
    for key in ("train_loss", "outer_step_seconds", "comm_bytes_sent", "tokens_per_second"):
        assert key in round_event
    final = events[-1]
    assert final["val_loss"] == reference_run.val_loss and reference_run.finished
    assert json.loads((out / "config.json").read_text())["aggregator"] == "iso-c"

    model = LlamaForCausalLM.from_pretrained(out / "final")
    params = dict(model.named_parameters())
    assert params["lm_head.weight"].dtype == torch.float32
    assert parameter_checksum(params) == reference_run.checksum == final["checksum"]
    tokenizer = AutoTokenizer.from_pretrained(out / "final")
    # comm bytes: Iso-C needs one ring all-reduce of the float32 deltas, 2 (R-1)/R N 4 bytes per
    # worker-as-rank (R = 4), while gathering every delta everywhere sends N 4
    model_bytes = 4 * sum(p.numel() for p in params.values())
    assert round_event["comm_bytes_sent"] == 2 * 3 / 4 * model_bytes
    assert round_event["comm_bytes_naive"] == 3 * model_bytes
    assert round_event["comm_plan"] == "all-reduce"

    # the reported val loss is the token-weighted NLL of the final model, computed here by hand
    val = prepare_data(corpus, max_train_tokens=2048, val_tokens=1024, vocab_size=512).val
    windows = val[:1024].reshape(32, 32)
    with torch.no_grad():
        log_probs = F.log_softmax(model(input_ids=windows).logits[:, :-1].double(), dim=-1)
    nll = -log_probs.gather(-1, windows[:, 1:, None]).mean().item()
    assert final["val_loss"] == pytest.approx(nll, rel=1e-5)
    assert len(tokenizer) == model.config.vocab_size


def test_one_worker_with_plain_outer_step_equals_data_parallel(corpus, tmp_path):
    """R = 1, mean, outer lr 1, no momentum: theta_new = theta_1, so DiLoCo must reproduce the
    data-parallel loop (same tokens, same AdamW, same schedule; inner states persist)."""
    shared = dict(workers=1, global_batch=2, tokens=4 * 2 * 2 * 32, inner_lr=3e-3)
    diloco = tiny_config(corpus, tmp_path / "diloco", preset="diloco-sgd", outer_lr=1.0, **shared)
    dp = tiny_config(corpus, tmp_path / "dp", preset="dp", weight_decay=0.1, **shared)
    diloco_params = load_final(train(diloco, progress=False).out)
    dp_params = load_final(train(dp, progress=False).out)
    for name, param in dp_params.items():
        torch.testing.assert_close(diloco_params[name], param, rtol=1e-5, atol=1e-6)
    assert any((p != 0).any() for p in diloco_params.values())


def load_final(out: Path) -> dict[str, torch.Tensor]:
    model = LlamaForCausalLM.from_pretrained(out / "final")
    return {name: p.detach() for name, p in model.named_parameters()}


def test_muon_inner_optimizer_trains(corpus, tmp_path):
    """Muon takes the 7 hidden matrices of each of the 2 layers; AdamW the rest."""
    config = tiny_config(corpus, tmp_path, inner_optimizer="muon", tokens=2048)
    model = build_model(model_config("micro", 512), seed=0)
    adamw, muon = InnerOptimizer(model, config, total_steps=8).optimizers
    in_muon = {id(p) for group in muon.param_groups for p in group["params"]}
    muon_names = [name for name, p in model.named_parameters() if id(p) in in_muon]
    assert len(muon_names) == 14 and all("_proj" in name for name in muon_names)
    assert isinstance(adamw, torch.optim.AdamW) and isinstance(muon, torch.optim.Muon)
    result = train(config, progress=False)
    assert result.finished and 0 < result.val_loss < 10


def test_inner_adamw_steps_the_bits_of_torchs_per_tensor_loop(corpus, tmp_path):
    """The inner AdamW keeps the published runs' numbers: 5 steps equal torch's per-tensor CPU
    AdamW (foreach off) bit for bit (fused would not: benchmarks/inner_optimizer_bench.py)."""
    config = tiny_config(corpus, tmp_path, tokens=2048)
    models = [build_model(model_config("micro", 512), seed=0) for _ in range(2)]
    (ours,) = InnerOptimizer(models[0], config, total_steps=8).optimizers
    reference = torch.optim.AdamW(
        models[1].parameters(),
        lr=ours.param_groups[0]["lr"],
        betas=config.inner.betas,
        weight_decay=config.inner.weight_decay,
        foreach=False,
    )
    generator = torch.Generator().manual_seed(3)
    for _ in range(5):
        batch = torch.randint(0, 512, (2, 16), generator=generator)
        for model, optimizer in zip(models, (ours, reference), strict=True):
            model(input_ids=batch, labels=batch).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    pairs = zip(models[0].parameters(), models[1].parameters(), strict=True)
    assert all(torch.equal(a, b) for a, b in pairs)
    untrained = build_model(model_config("micro", 512), seed=0).model.embed_tokens.weight
    assert not torch.equal(models[0].model.embed_tokens.weight, untrained)


# -- resume ----------------------------------------------------------------------------------------
def test_stop_then_resume_equals_uninterrupted_run(corpus, tmp_path, reference_run):
    config = tiny_config(corpus, tmp_path, preset="isoloco", checkpoint_every=1, eval_every=2)
    stopped = train(config.replace(stop_after=2), progress=False)
    assert (stopped.finished, stopped.rounds) == (False, 2)
    resumed = train(resolve_config(None, out=str(tmp_path), resume=True), progress=False)
    assert resumed.checksum == reference_run.checksum
    assert resumed.val_loss == reference_run.val_loss
    losses = [e.get("train_loss") for e in read_metrics(tmp_path) if e["event"] == "round"]
    reference = [e.get("train_loss") for e in read_metrics(reference_run.out)]
    assert losses == [loss for loss in reference if loss is not None][:4]


def test_a_run_resumed_after_its_last_round_writes_the_same_final_line(tmp_path, reference_run):
    """Killed during the final evaluation (after round 4's checkpoint), or resumed once
    finished: the final line again holds round 4's train loss (before: null)."""
    shutil.copytree(reference_run.out, tmp_path / "run")
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert json.loads(lines[-1])["event"] == "final"
    for kept in (lines, lines[:-1]):  # finished; killed before the final line
        (tmp_path / "run" / "metrics.jsonl").write_text("".join(f"{line}\n" for line in kept))
        config = resolve_config(None, out=str(tmp_path / "run"), resume=True)
        resumed = train(config, progress=False)
        assert resumed.checksum == reference_run.checksum
        final = read_metrics(tmp_path / "run")[-1]
        expected = json.loads(lines[-1])
        assert final["train_loss"] is not None
        assert {k: v for k, v in final.items() if k != "seconds"} == {
            k: v for k, v in expected.items() if k != "seconds"
        }


def test_resume_from_a_checkpoint_written_before_the_driver(corpus, tmp_path, reference_run):
    """A checkpoint whose shared.pt holds the former OuterOptimizer state (steps taken, Nesterov
    buffers by parameter name) resumes to the same parameters as the uninterrupted run."""
    config = tiny_config(corpus, tmp_path, preset="isoloco", checkpoint_every=1, eval_every=2)
    train(config.replace(stop_after=2), progress=False)
    checkpoint = latest_checkpoint(tmp_path)
    shared = torch.load(checkpoint / "shared.pt", weights_only=True)
    names = [name for name, _ in build_model(model_config("micro", 512), 0).named_parameters()]
    buffers = {names[i]: state["momentum_buffer"] for i, state in shared["outer"]["state"].items()}
    assert len(buffers) == len(names)
    torch.save({"steps_taken": 2, "momentum_buffers": buffers}, checkpoint / "shared.pt")
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    digest = hashlib.sha256((checkpoint / "shared.pt").read_bytes()).hexdigest()
    manifest["files"]["shared.pt"] = digest
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))
    resumed = train(config.replace(resume=True), progress=False)
    assert resumed.checksum == reference_run.checksum


def test_sigint_stops_and_resume_continues_exactly(corpus, tmp_path, reference_run, monkeypatch):
    """SIGINT during round 3: stop after the next inner step; resume from round 2's checkpoint."""
    real_turn, calls = rounds.worker_turn, []

    def interrupted_turn(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2 * 4 + 2:  # third round, second worker
            os.kill(os.getpid(), signal.SIGINT)
        return real_turn(*args, **kwargs)

    config = tiny_config(corpus, tmp_path, preset="isoloco", checkpoint_every=1, eval_every=2)
    monkeypatch.setattr(rounds, "worker_turn", interrupted_turn)
    with pytest.raises(TrainingInterrupted, match="round-000002"):
        train(config, progress=False)
    monkeypatch.setattr(rounds, "worker_turn", real_turn)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    resumed = train(config.replace(resume=True), progress=False)
    assert resumed.checksum == reference_run.checksum


def test_a_second_ctrl_c_names_the_checkpoint_to_resume_from(
    corpus, tmp_path, reference_run, monkeypatch
):
    """A KeyboardInterrupt (a second Ctrl-C) mid-round 3, then one in the final evaluation:
    each names the checkpoint --resume continues from (before: "nothing was written")."""
    real_turn, real_evaluate, calls = rounds.worker_turn, rounds.evaluate, []

    def interrupted_turn(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2 * 4 + 2:  # third round, second worker
            raise KeyboardInterrupt
        return real_turn(*args, **kwargs)

    def interrupted_evaluate(*args, **kwargs):
        raise KeyboardInterrupt

    config = tiny_config(corpus, tmp_path, preset="isoloco", checkpoint_every=1, eval_every=2)
    monkeypatch.setattr(rounds, "worker_turn", interrupted_turn)
    with pytest.raises(
        TrainingInterrupted, match=r"at once; --resume continues from .*round-000002"
    ):
        train(config, progress=False)
    monkeypatch.setattr(rounds, "worker_turn", real_turn)
    monkeypatch.setattr(rounds, "evaluate", interrupted_evaluate)
    with pytest.raises(TrainingInterrupted, match=r"continues from .*round-000004 \(after round 4"):
        train(config.replace(resume=True), progress=False)
    monkeypatch.setattr(rounds, "evaluate", real_evaluate)
    resumed = train(config.replace(resume=True), progress=False)
    assert resumed.checksum == reference_run.checksum
    assert resumed.val_loss == reference_run.val_loss


def test_extending_a_finished_run_keeps_its_history_and_its_time(corpus, tmp_path):
    """A 2-round run, then the same run extended to 4 rounds: the first run's final validation
    loss stays in the log (as the eval of round 2), and the final event's seconds add the
    second invocation's wall time to what the run had taken when it saved round 2."""
    config = tiny_config(corpus, tmp_path, preset="isoloco", tokens=1024, eval_every=1)
    first = train(config, progress=False)
    saved = json.loads((latest_checkpoint(tmp_path) / "state.json").read_text())
    assert first.rounds == saved["round"] == 2 and 0 < saved["seconds"] <= first.seconds
    extended = config.replace(tokens=2048, resume=True, allow_config_change=True)
    started = time.perf_counter()
    second = train(extended, progress=False)
    took = time.perf_counter() - started
    assert saved["seconds"] + took - 0.05 <= second.seconds <= saved["seconds"] + took
    events = [(e["event"], e["round"], e.get("val_loss")) for e in read_metrics(tmp_path)]
    evals = [e for e in events if e[0] != "round"]
    assert evals == [("eval", 1, evals[0][2]), ("eval", 2, first.val_loss),
                     ("eval", 3, evals[2][2]), ("final", 4, second.val_loss)]  # fmt: skip
    assert read_metrics(tmp_path)[-1]["seconds"] == second.seconds
    again = train(config.replace(tokens=2048, resume=True), progress=False)  # nothing to train
    assert [e[:2] for e in events] == [
        (e["event"], e["round"]) for e in read_metrics(tmp_path)
    ] and again.val_loss == second.val_loss


def test_a_dp_run_started_with_a_diloco_preset_resumes_with_its_own_flags(corpus, tmp_path):
    """Earlier versions accepted ``--preset diloco --mode dp``; such a run resumes with the
    same flags, while a new run with them is refused."""
    old_style = {**tiny_config(corpus, tmp_path).to_dict(), "mode": "dp", "stop_after": 2}
    stopped = train(TrainConfig.from_dict(old_style), progress=False)
    assert not stopped.finished
    flags = dict(preset="diloco", mode="dp", out=str(tmp_path))
    resumed = train(resolve_config(None, **flags, resume=True), progress=False)
    assert resumed.finished
    with pytest.raises(ValueError, match=r"preset diloco \(--preset\) is a DiLoCo preset"):
        resolve_config(None, **flags, force=True)


def test_resume_refuses_another_config(corpus, tmp_path, reference_run):
    changed = tiny_config(corpus, reference_run.out, preset="isoloco", workers=2, resume=True)
    with pytest.raises(ValueError, match=r"4 workers.*cannot change on resume.*--workers 4 -> 2"):
        train(changed, progress=False)


def test_resume_with_allow_config_change_trains_with_the_new_settings(corpus, tmp_path):
    """Resumed through the CLI with ``--allow-config-change`` and new outer / inner settings,
    round 2 trains with them (torch's ``load_state_dict`` used to put the saved ones back
    while config.json said the new ones). Outer SGD without momentum: from the same round-1
    state the round-2 deltas are the same, so ``(theta_2 - theta_1) / outer_lr`` agrees between
    two outer lrs; the inner lr scales by new / old at the same schedule step."""
    stopped = tmp_path / "stopped"
    config = tiny_config(corpus, stopped, preset="diloco-sgd", checkpoint_every=1, stop_after=1)
    train(config, progress=False)
    theta_1 = read_global(latest_checkpoint(stopped))
    runs = {}
    for name, flags in {
        "same": [],
        "slow": ["--outer-lr", "0.5", "--inner-lr", "2e-3", "--allow-config-change"],
        "fast": ["--outer-lr", "1.0", "--inner-lr", "2e-3", "--allow-config-change"],
    }.items():
        runs[name] = tmp_path / name
        shutil.copytree(stopped, runs[name])
        result = CliRunner().invoke(
            app, ["train", "--out", str(runs[name]), "--resume", "--stop-after", "2", "--quiet",
                  *flags],
        )  # fmt: skip
        assert result.exit_code == 0, result.output
    steps = {name: (read_global(latest_checkpoint(out)), read_metrics(out)[1]["inner_lr"])
             for name, out in runs.items()}  # fmt: skip
    slow, fast = (
        {n: (t - theta_1[n]) / lr for n, t in steps[name][0].items()}
        for name, lr in (("slow", 0.5), ("fast", 1.0))
    )
    largest = 0.0
    for name, step in slow.items():  # float32 theta_2 - theta_1: a few ulps of theta, / lr
        tolerance = 4 * torch.finfo(torch.float32).eps * max(theta_1[name].abs().max(), 1) / 0.5
        torch.testing.assert_close(step, fast[name], rtol=0, atol=float(tolerance))
        largest = max(largest, float(step.abs().max() / tolerance))
    assert largest > 1000  # the steps are far above the rounding (the old lr: a factor of 2)
    assert steps["slow"][1] == pytest.approx(steps["same"][1] * 2e-3 / 1.38e-3, rel=1e-12)
    shared = torch.load(latest_checkpoint(runs["slow"]) / "shared.pt", weights_only=True)
    assert shared["outer"]["param_groups"][0]["lr"] == 0.5


def read_global(checkpoint: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(checkpoint / "global.safetensors")


def test_a_value_typed_from_its_printed_form_is_no_config_change():
    saved = preset_config("diloco").replace(outer_lr=0.71 * 0.7, betas=[0.9, 0.95]).to_dict()
    typed = preset_config("diloco").replace(outer_lr=0.497, betas=[0.9, 0.95 + 1e-12])
    assert saved["outer_lr"] != 0.497 and typed.differences(saved) == []
    assert preset_config("diloco").replace(outer_lr=0.4971).differences(saved) == [
        "outer_lr: 0.49699999999999994 -> 0.4971"
    ]
    assert typed.replace(betas=[0.9, 0.951]).differences(saved) == [
        "betas: [0.9, 0.95] -> [0.9, 0.951]"
    ]


def test_existing_run_is_not_clobbered(corpus, reference_run):
    with pytest.raises(ValueError, match="already holds a run"):
        train(tiny_config(corpus, reference_run.out, preset="isoloco"), progress=False)


def test_non_finite_loss_stops_naming_round_and_checkpoint(corpus, tmp_path, monkeypatch):
    real_turn, calls = rounds.worker_turn, []

    def poisoned_turn(*args, **kwargs):
        loss = real_turn(*args, **kwargs)
        calls.append(1)
        return float("nan") if len(calls) > 4 else loss

    monkeypatch.setattr(rounds, "worker_turn", poisoned_turn)
    with pytest.raises(TrainingDiverged, match=r"round 2: train loss is nan.*round-000001"):
        train(tiny_config(corpus, tmp_path, checkpoint_every=1), progress=False)
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "round-000001"


@pytest.mark.parametrize("poisoned_at", [2, 4])  # an eval mid-run, the final one
def test_non_finite_validation_loss_stops_the_run(corpus, tmp_path, monkeypatch, poisoned_at):
    """A validation loss that is inf is refused as a divergence, never written to the log
    (where a reader could not parse it, and the run would look unfinished)."""
    real_evaluate, calls = rounds.evaluate, []

    def poisoned_evaluate(*args, **kwargs):
        calls.append(1)
        return float("inf") if 2 * len(calls) == poisoned_at else real_evaluate(*args, **kwargs)

    monkeypatch.setattr(rounds, "evaluate", poisoned_evaluate)
    config = tiny_config(corpus, tmp_path, checkpoint_every=1, eval_every=2)
    message = {  # mid-run: before this round's checkpoint; the final: after the last one
        2: r"round 2: validation loss is inf; stopping. The last good checkpoint is .*round-000001",
        4: r"round 4: validation loss is inf; stopping. The checkpoint .*round-000004 holds the "
        r"parameters that give it; no final model",
    }[poisoned_at]
    with pytest.raises(TrainingDiverged, match=message):
        train(config, progress=False)
    assert all(math.isfinite(e.get("val_loss", 0.0)) for e in read_metrics(tmp_path))
    assert not (tmp_path / "final").exists()


# -- command line ----------------------------------------------------------------------------------
TINY_FLAGS = [
    "--model", "micro", "--workers", "4", "--inner-steps", "2", "--global-batch", "8",
    "--seq-len", "32", "--tokens", "1024", "--vocab-size", "512", "--val-tokens", "1024",
    "--device", "cpu",
]  # fmt: skip


def test_cli_help_lists_every_flag():
    result = CliRunner().invoke(app, ["train", "--help"], env={"COLUMNS": "200"})
    for flag in (
        "--preset", "--model", "--workers", "--inner-steps", "--global-batch", "--seq-len",
        "--tokens", "--chinchilla", "--seed", "--data", "--out", "--checkpoint-every",
        "--resume", "--timeout", "--allow-config-change", "--init", "--config", "--aggregator",
        "--outer-lr", "--outer-momentum", "--no-nesterov", "--inner-lr", "--density",
        "--common-fraction", "--spectral", "--inner-optimizer", "--eval-every", "--device",
        "--quiet",
    ):  # fmt: skip
        assert flag in result.output, flag


def test_docs_flags_exist_and_the_config_example_loads(tmp_path):
    docs = (Path(__file__).parents[1] / "docs" / "training.md").read_text()
    rows = [line for line in docs.splitlines() if line.startswith("| `--")]
    flags = {flag for row in rows for flag in re.findall(r"--[a-z][a-z-]*", row.split("|")[1])}
    help_text = CliRunner().invoke(app, ["train", "--help"], env={"COLUMNS": "200"}).output
    assert len(flags) > 40
    for flag in flags:
        assert flag in help_text, flag
    example = tmp_path / "example.toml"
    example.write_text(re.search(r"```toml\n(.*?)```", docs, re.DOTALL).group(1))
    config = resolve_config(example)
    assert (config.outer.aggregator, config.run.workers) == ("ties", 16)
    assert (config.data.tokens, config.outer.aggregator_options) == (20_000_000, {"density": 0.5})


def test_cli_runs_and_reports_errors_on_one_line(corpus, tmp_path):
    runner = CliRunner()
    args = [*TINY_FLAGS, "--data", corpus, "--out", str(tmp_path), "--preset", "ties"]
    result = runner.invoke(app, ["train", *args, "--density", "0.5", "--quiet"])
    assert result.exit_code == 0, result.output
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["aggregator_options"] == {"density": 0.5} and saved["outer_lr"] == 0.7
    result = runner.invoke(app, ["train", *args, "--option", "gamma=0.1"])
    assert result.exit_code == 2
    assert "error: --option: method 'ties' does not take 'gamma'" in result.output
    assert "Traceback" not in result.output


@pytest.mark.parametrize(
    ("aggregator", "workers", "message"),
    [("tsv", 64, "leaves no singular component for each of 64 tasks"),
     ("iso-cts", 40, "cannot hold 40 task-specific blocks")],
)  # fmt: skip
def test_an_aggregator_that_cannot_merge_the_shapes_fails_before_training(
    corpus, tmp_path, aggregator, workers, message
):
    """micro's smallest matrices are 32 wide: TSV keeps int(32 / 64) = 0 components; Iso-CTS
    with common_fraction 0 needs k = 32 - round(32 / 40) * 40 = -8 common directions."""
    flags = [*TINY_FLAGS, "--workers", str(workers), "--global-batch", str(workers),
             "--tokens", str(2 * workers * 32), "--aggregator", aggregator]  # fmt: skip
    if aggregator == "iso-cts":
        flags += ["--option", "common_fraction=0"]
    out = tmp_path / "run"
    result = CliRunner().invoke(app, ["train", *flags, "--data", corpus, "--out", str(out)])
    assert result.exit_code == 2, result.output
    assert message in result.output and "Traceback" not in result.output
    assert not (out / "checkpoints").exists() and not (out / "metrics.jsonl").exists()


def test_cli_as_a_module_then_init_from_its_final_model(corpus, tmp_path):
    """``python -m mergekit_loco train`` (torchrun's entry point), then fine-tune its
    final folder with the dp preset: the init folder's tokenizer is used."""
    env = {**os.environ, "MLOCO_CACHE": os.environ["MLOCO_CACHE"]}
    command = [sys.executable, "-m", "mergekit_loco", "train", *TINY_FLAGS, "--data", corpus]
    first = subprocess.run([*command, "--out", str(tmp_path / "a"), "--quiet"], env=env,
                           capture_output=True, text=True, timeout=300)  # fmt: skip
    assert first.returncode == 0, first.stderr
    assert (tmp_path / "a" / "final" / "model.safetensors").is_file()
    config = tiny_config(corpus, tmp_path / "b", preset="dp", init=str(tmp_path / "a" / "final"))
    result = train(config, progress=False)
    tuned = load_final(result.out)
    start = load_final(tmp_path / "a")
    assert tuned.keys() == start.keys()
    assert not torch.equal(tuned["lm_head.weight"], start["lm_head.weight"])
    assert (
        result.val_loss
        < json.loads((tmp_path / "a" / "metrics.jsonl").read_text().splitlines()[-1])["val_loss"]
    )


def test_resume_from_a_corrupt_checkpoint_names_the_file(tmp_path, reference_run):
    shutil.copytree(reference_run.out, tmp_path / "run")
    latest = latest_checkpoint(tmp_path / "run")
    data = bytearray((latest / "global.safetensors").read_bytes())
    data[-1] ^= 0xFF
    (latest / "global.safetensors").write_bytes(bytes(data))
    with pytest.raises(CheckpointCorrupt, match=r"global\.safetensors is corrupt"):
        train(resolve_config(None, out=str(tmp_path / "run"), resume=True), progress=False)


def test_config_sections_validate_once_and_hold_the_only_defaults():
    """Each section checks its own fields when built; the CLI help shows the sections'
    defaults; config.json stays flat, and a flat file rebuilds the same nested config."""
    from mergekit_loco.train.config import InnerConfig, OuterConfig, default

    with pytest.raises(ValueError, match="outer_lr must be > 0, got 0"):
        OuterConfig(lr=0)
    with pytest.raises(ValueError, match="compression must be bf16 or int8, not 'fp8'"):
        OuterConfig(compression="fp8")
    with pytest.raises(ValueError, match="inner_steps must be >= 1, got 0"):
        InnerConfig(steps=0)
    assert (default("outer_lr"), default("inner_steps")) == (OuterConfig().lr, InnerConfig().steps)
    help_text = CliRunner().invoke(app, ["train", "--help"], env={"COLUMNS": "300"}).output
    help_text = " ".join(help_text.split())  # as read, whatever the wrapping
    assert f"Outer learning rate (default: the preset's; diloco: {OuterConfig().lr})" in help_text
    config = resolve_config(preset="isoloco", workers=4, checkpoint_every=3)
    flat = config.to_dict()
    assert (flat["aggregator"], flat["outer_lr"], flat["keep_checkpoints"]) == ("iso-c", 1.8, 1)
    assert TrainConfig.from_dict(flat) == config
    assert config.replace(outer_lr=0.5).outer.lr == 0.5 and config.outer.lr == 1.8
