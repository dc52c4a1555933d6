"""``mloco train`` as a newcomer meets it: which outer step an aggregator brings, the threads,
a line before the first bar, the resolved config, and a Ctrl-C after any round kept."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch
from conftest import stdlib_corpus

from mergekit_loco.cli import COMMANDS, main
from mergekit_loco.train import loop

#: aggregator -> (outer lr, momentum, nesterov, inner lr, preset): the seed paper's tuned
#: values at R = 8 (ta and breadcrumbs have none and keep DiLoCo's defaults).
TUNED = {
    "mean": (0.7, 0.9, True, 1.38e-3, "diloco"),
    "iso-c": (1.8, 0.8, True, 1.38e-3, "isoloco"),
    "iso-cts": (3.1, 0.0, False, 3.91e-3, "iso-cts"),
    "tsv": (0.6, 0.0, False, 2.76e-3, "tsv"),
    "ties": (0.7, 0.0, False, 2.76e-3, "ties"),
    "dare": (1.5, 0.0, False, 2.76e-3, "dare"),
    "ta": (0.7, 0.9, True, 1.38e-3, None),
    "breadcrumbs": (0.7, 0.9, True, 1.38e-3, None),
}
TINY_FLAGS = [
    "--model", "micro", "--workers", "2", "--inner-steps", "2", "--global-batch", "4",
    "--seq-len", "32", "--vocab-size", "512", "--val-tokens", "1024", "--device", "cpu",
]  # fmt: skip


@pytest.fixture
def captured_run(monkeypatch) -> Iterator[list]:
    """Replace the training itself: ``mloco train`` parses, resolves, prints, sets the threads
    and calls ``train(config)``; the config and torch's thread count at that moment are kept."""
    calls = []
    threads = torch.get_num_threads()

    def fake_train(config, progress=True):
        calls.append((config, torch.get_num_threads()))
        return SimpleNamespace(finished=True)

    monkeypatch.setattr(loop, "train", fake_train)
    yield calls
    torch.set_num_threads(threads)


def run_main(capsys, *args) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exited:
        main([str(arg) for arg in args])
    captured = capsys.readouterr()
    return exited.value.code, captured.out, captured.err


@pytest.mark.parametrize("aggregator", list(TUNED))
def test_an_aggregator_brings_its_tuned_outer_step_and_says_so(captured_run, capsys, aggregator):
    code, stdout, _ = run_main(capsys, "train", "--aggregator", aggregator, "--threads", "1")
    assert code == 0
    ((config, _),) = captured_run
    flat = config.to_dict()
    lr, momentum, nesterov, inner_lr, preset = TUNED[aggregator]
    assert (flat["outer_lr"], flat["outer_momentum"], flat["nesterov"]) == (lr, momentum, nesterov)
    assert flat["inner_lr"] == inner_lr
    outer_line = stdout.splitlines()[0]
    assert outer_line.startswith(f"outer step: {aggregator} of the worker deltas, then SGD")
    assert f"lr {lr}," in outer_line
    if preset is None:
        assert outer_line.endswith(f"(the defaults: {aggregator} has no tuned preset)")
    else:
        assert flat["preset"] == preset and outer_line.endswith(f"(preset {preset})")


def test_flags_override_the_aggregators_preset(captured_run, capsys):
    args = ["train", "--aggregator", "tsv", "--outer-lr", "0.3", "--threads", "1"]
    code, stdout, _ = run_main(capsys, *args)
    assert code == 0
    ((config, _),) = captured_run
    flat = config.to_dict()
    assert (flat["outer_lr"], flat["outer_momentum"], flat["preset"]) == (0.3, 0.0, "tsv")
    assert "lr 0.3, no momentum (preset tsv, overridden by --outer-lr)" in stdout
    captured_run.clear()
    run_main(capsys, "train", "--preset", "isoloco", "--aggregator", "tsv", "--threads", "1")
    ((config, _),) = captured_run
    flat = config.to_dict()
    assert (flat["aggregator"], flat["outer_lr"], flat["outer_momentum"]) == ("tsv", 1.8, 0.8)


def test_the_outer_line_names_config_file_values_as_such(captured_run, capsys, tmp_path):
    config_file = tmp_path / "outer.toml"
    config_file.write_text('preset = "isoloco"\nouter_momentum = 0.5\n')
    code, stdout, _ = run_main(capsys, "train", "--config", config_file, "--outer-lr", "1.1",
                               "--threads", "1")  # fmt: skip
    assert code == 0
    ((config, _),) = captured_run
    assert (config.outer.lr, config.outer.momentum, config.run.preset) == (1.1, 0.5, "isoloco")
    assert stdout.splitlines()[0].endswith(
        f"(preset isoloco, overridden by --outer-lr, outer_momentum in {config_file})"
    )
    captured_run.clear()
    config_file.write_text('preset = "diloco"\n')  # a preset named in the file is a choice
    _, stdout, _ = run_main(capsys, "train", "--config", config_file, "--aggregator", "ta",
                            "--threads", "1")  # fmt: skip
    assert stdout.splitlines()[0].endswith("(preset diloco)")


def test_a_resumed_run_shows_its_own_outer_values_and_aggregator(corpus, tmp_path, capsys):
    """Resumed with no flags, the header still marks the run's --outer-lr as an override of
    its preset (before: "(preset diloco)" for lr 1.0), and the summary's title names the
    aggregator the run used (before: "diloco on micro" for a tsv run)."""
    run = tmp_path / "run"
    flags = ["--data", corpus, "--tokens", 1024, "--out", run, "--preset", "diloco",
             "--aggregator", "tsv", "--outer-lr", "1.0"]  # fmt: skip
    code, _, err = run_main(capsys, "train", *TINY_FLAGS, *flags, "-q", "--stop-after", 1)
    assert code == 0, err
    code, stdout, err = run_main(capsys, "train", "--out", run, "--resume", "--threads", "1")
    assert code == 0, err
    assert stdout.splitlines()[0] == (
        "outer step: tsv of the worker deltas, then SGD with lr 1.0, Nesterov momentum 0.9 "
        "(preset diloco, overridden by --outer-lr 1.0)"
    )
    assert "tsv (preset diloco) on micro" in stdout


def test_tuple_options_are_given_as_merge_takes_them_and_resume(corpus, tmp_path, capsys):
    """``--option weights=3,1`` (merge's syntax) and a TOML list both give the tuple (before:
    refused, and a run with it in config.json could not resume); a key given twice, or also as
    a flag, is refused. 4 rounds: 1024 tokens / (4 sequences x 32 tokens x 2 inner steps)."""
    run = tmp_path / "run"
    flags = ["--data", corpus, "--tokens", 1024, "--out", run, "-q", "--aggregator", "mean"]
    code, _, err = run_main(capsys, "train", *TINY_FLAGS, *flags, "--option", "weights=3, 1",
                            "--stop-after", 1)  # fmt: skip
    assert code == 0, err
    assert json.loads((run / "config.json").read_text())["aggregator_options"] == {
        "weights": [3.0, 1.0]
    }
    code, _, err = run_main(capsys, "train", "--resume", "--out", run, "-q")
    assert code == 0, err
    rounds = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [e["round"] for e in rounds if e["event"] == "round"] == [1, 2, 3, 4]

    config_file = tmp_path / "weights.toml"
    config_file.write_text('aggregator = "ties"\n[aggregator_options]\ndensity = [0.5, 0.25]\n')
    code, _, err = run_main(capsys, "train", *TINY_FLAGS, "--data", corpus, "--tokens", 256,
                            "--config", config_file, "--out", tmp_path / "toml", "-q")  # fmt: skip
    assert code == 0, err
    saved = json.loads((tmp_path / "toml" / "config.json").read_text())
    assert saved["aggregator_options"] == {"density": [0.5, 0.25]}

    for extra, message in [
        (["--option", "density=0.2", "--option", "density=0.3"], "'density' is given twice"),
        (["--density", "0.3", "--option", "density=0.2"], "'density' is also given as a flag"),
        (["--option", "density=0.5,x"], "'x' is not a finite number"),
    ]:
        code, _, err = run_main(capsys, "train", "--aggregator", "ties", *extra)
        assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_mode_dp_is_the_dp_preset_and_refuses_what_it_would_ignore(captured_run, capsys, tmp_path):
    code, stdout, _ = run_main(capsys, "train", "--mode", "dp", "--threads", "1")
    assert code == 0
    ((config, _),) = captured_run
    flat = config.to_dict()
    assert (flat["preset"], flat["inner_lr"], flat["weight_decay"]) == ("dp", 1.95e-3, 0.15)
    assert stdout.splitlines()[0] == "outer step: none (data-parallel AdamW baseline)"
    config_file = tmp_path / "dp.yaml"
    config_file.write_text("outer-momentum: 0.5\n")
    refused = {
        ("--preset", "dp", "--outer-lr", "2"): "--outer-lr would be ignored",
        ("--mode", "dp", "--aggregator", "tsv"): "--aggregator would be ignored",
        ("--preset", "dp", "--density", "0.5"): "aggregator option density would be ignored",
        ("--preset", "dp", "--compression", "bf16"): "--compression would be ignored",
        ("--preset", "dp", "--no-nesterov"): "--nesterov would be ignored",
        ("--preset", "dp", "--config", config_file): f"outer-momentum in {config_file} would",
        ("--preset", "tsv", "--mode", "dp"): "preset tsv (--preset) is a DiLoCo preset, but "
        "mode dp (--mode) asks",
    }
    for args, message in refused.items():
        captured_run.clear()
        code, _, stderr = run_main(capsys, "train", *args, "--threads", "1")
        assert code == 2 and message in " ".join(stderr.split()), args
        assert not captured_run
    _, stdout, _ = run_main(
        capsys, "train", "--preset", "dp", "--outer-lr", "0.7", "--threads", "1"
    )
    assert len(captured_run) == 1  # the value the run has anyway: nothing is ignored
    assert stdout.splitlines()[0] == "outer step: none (data-parallel AdamW baseline)"
    _, stdout, _ = run_main(capsys, "train", "--preset", "dp", "--mode", "diloco", "--threads", "1")
    assert stdout.splitlines()[0].endswith("(the defaults: preset dp has no outer step)")


def test_the_help_examples_resolve(captured_run, capsys):
    """Every ``mloco train`` example of ``--help`` is a config that can run (the budget holds
    a round, the options exist), as a newcomer copies it."""
    for example in COMMANDS["train"].examples:
        args = shlex.split(example.split("  #")[0])[1:]
        if "--resume" in args:
            continue  # needs a run to resume
        captured_run.clear()
        code, _, stderr = run_main(capsys, *args, "--threads", "1")
        assert code == 0 and len(captured_run) == 1, (example, stderr)


def test_o_names_the_run_folder_as_in_merge_and_compare(captured_run, capsys, tmp_path):
    code, _, _ = run_main(capsys, "train", "-o", tmp_path / "run", "--threads", "1")
    assert code == 0
    ((config, _),) = captured_run
    assert config.run.out == str(tmp_path / "run")


def test_val_seed_flag_sets_the_validation_documents_seed(captured_run, capsys):
    code, _, _ = run_main(capsys, "train", "--seed", "3", "--val-seed", "1000", "--threads", "1")
    assert code == 0
    ((config, _),) = captured_run
    assert (config.run.seed, config.data.val_seed) == (3, 1000)
    code, _, stderr = run_main(capsys, "train", "--val-seed", "-1", "--threads", "1")
    assert code == 2 and "--val-seed must be an integer in [0, 2**63)" in stderr


def test_resolved_defaults_threads_and_the_preparing_line(captured_run, capsys, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    code, stdout, _ = run_main(capsys, "train", "--threads", "2")
    assert code == 0
    ((config, threads),) = captured_run
    assert threads == 2
    saved = config.to_dict()
    assert saved["tokens"] == 2_000_000 and saved["chinchilla"] is None
    assert (saved["checkpoint_every"], saved["keep_checkpoints"]) == (1, 1)
    lines = stdout.splitlines()
    assert lines[1] == "threads: 2 (--threads; --threads N to choose)"
    assert lines[2].startswith("preparing the tokenizer, data and model")
    captured_run.clear()
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    run_main(capsys, "train", "--chinchilla", "20")
    ((config, threads),) = captured_run
    assert threads == 1 and (config.data.tokens, config.data.chinchilla) == (None, 20.0)


# -- nothing lost ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Iterator[str]:
    files = ("textwrap.py", "string.py", "json/decoder.py", "csv.py", "heapq.py", "shlex.py")
    with stdlib_corpus(tmp_path_factory.mktemp("corpus"), files) as corpus:
        yield corpus


def test_ctrl_c_after_any_round_resumes_with_default_flags(corpus, tmp_path):
    """No checkpoint flag given: SIGINT once round 2 is saved, then ``--resume`` finishes."""
    out = tmp_path / "run"
    command = [sys.executable, "-m", "mergekit_loco", "train", *TINY_FLAGS, "--data", corpus,
               "--tokens", str(30 * 2 * 4 * 32), "--out", str(out)]  # fmt: skip
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    while not (out / "checkpoints" / "round-000002").exists() and process.poll() is None:
        assert time.monotonic() < deadline, "no checkpoint after round 2"
        time.sleep(0.01)
    assert process.poll() is None, "the run ended before it could be interrupted"
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 130, stderr
    saved = sorted(p.name for p in (out / "checkpoints").iterdir() if p.name.startswith("round"))
    assert len(saved) == 1, saved  # only the latest is kept
    stopped_at = int(saved[0].split("-")[1])
    assert stopped_at >= 2 and "--resume" in stderr
    resume = [*command, "--resume"]
    env = {**os.environ, "COLUMNS": "400"}  # the summary's rows unwrapped
    resumed = subprocess.run(resume, capture_output=True, text=True, timeout=600, env=env)
    assert resumed.returncode == 0, resumed.stderr
    summary = re.search(r"final model\s+│ (\S+) \(AutoModelForCausalLM", resumed.stdout)
    assert summary and summary.group(1) == str(out / "final"), resumed.stdout
    rounds = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [e["round"] for e in rounds if e.get("event") == "round"] == list(range(1, 31))
    assert (out / "final" / "model.safetensors").is_file()


def test_init_weights_that_do_not_fit_the_model_are_one_line_before_the_tokenizer(
    corpus, tmp_path, capsys, monkeypatch
):
    """``--init weights.safetensors`` (no config.json beside it) of another shape than --model:
    one line naming the file, the first tensor that does not fit, both shapes and the preset
    that fits, before a tokenizer is trained (before: a 60-line load_state_dict traceback after
    it); weights that fit train, with their own vocabulary rows (more than the tokenizer's)."""
    from safetensors.torch import save_file

    from mergekit_loco.train.model import build_model, model_config

    weights = tmp_path / "merged.safetensors"
    model = build_model(model_config("micro", 600), seed=1)
    save_file({name: t.contiguous() for name, t in model.state_dict().items()}, weights)
    monkeypatch.setenv("MLOCO_CACHE", str(tmp_path / "cache"))
    flags = [*TINY_FLAGS, "--data", corpus, "--tokens", str(2 * 2 * 4 * 32), "--quiet"]
    code, _, err = run_main(capsys, "train", *flags, "--model", "nano", "--init", weights,
                            "--out", tmp_path / "nano")  # fmt: skip
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert err.strip() == (
        f"error: --init {weights}: tensor 'model.embed_tokens.weight' is [600, 32] in the weights "
        "but [600, 128] by --model nano; it fits --model micro"
    )
    assert not (tmp_path / "cache").exists() and not (tmp_path / "nano").exists()
    empty = tmp_path / "empty.safetensors"  # an embedding of no rows: the file is at fault
    save_file({**{n: t.contiguous() for n, t in model.state_dict().items()},
               "model.embed_tokens.weight": torch.zeros(0, 32)}, empty)  # fmt: skip
    code, _, err = run_main(capsys, "train", *flags, "--init", empty, "--out", tmp_path / "e")
    assert code == 2 and err.startswith(f"error: --init {empty}: tensor 'model.embed_tokens."), err
    code, _, err = run_main(capsys, "train", *flags, "--init", weights, "--out", tmp_path / "micro")
    assert code in (0, None), err
    rows = re.search(r"note: --init .* has 600 vocabulary rows and the tokenizer (\d+): ", err)
    assert rows and int(rows[1]) < 600, err  # said, since a tokenizer mismatch would be silent
    assert (
        json.loads((tmp_path / "micro" / "final" / "config.json").read_text())["vocab_size"] == 600
    )


def test_resume_says_where_it_continues_from_and_what_to_do_when_it_cannot(
    corpus, tmp_path, capsys
):
    """``--resume`` into a missing --out is refused before anything else (before: after the
    header and the data); a resumed run says the round and checkpoint it continues from, or
    that it had finished; a ``latest`` pointer naming a deleted folder gives way to the newest
    checkpoint left, with a note (before: an error with no advice), and runs to the end: the
    first invocation's --stop-after 2 is not carried into the resume (before: it stopped at
    round 2 again); with no checkpoint left the error says how to start over."""
    missing = tmp_path / "runs" / "nonexist"
    code, out, err = run_main(capsys, "train", "--resume", "--out", missing)
    assert (code, out) == (2, "")
    assert (
        err
        == f"error: {missing} does not exist: nothing to resume (drop --resume to start a run)\n"
    )

    run = tmp_path / "run"
    flags = ["--data", corpus, "--tokens", 4 * 256, "--keep-checkpoints", 2, "--stop-after", 2]
    code, _, err = run_main(capsys, "train", *TINY_FLAGS, *flags, "--out", run)
    assert code in (0, None), err
    checkpoints = run / "checkpoints"
    shutil.rmtree(checkpoints / "round-000002")
    code, out, err = run_main(capsys, "train", "--resume", "--out", run)
    assert code in (0, None), err
    assert err == (f"note: {checkpoints / 'latest'} names round-000002, which does not exist; "
                   "resuming from round-000001, the newest checkpoint left\n")  # fmt: skip
    assert f"resuming after round 1 of 4 ({checkpoints / 'round-000001'})\n" in out
    assert (run / "final" / "model.safetensors").is_file()
    code, out, _ = run_main(capsys, "train", "--resume", "--out", run)
    assert code in (0, None)
    assert (f"the run already finished its 4 rounds ({checkpoints / 'round-000004'}): nothing "
            "left to train; its final model is evaluated and saved again") in out  # fmt: skip

    for folder in checkpoints.glob("round-*"):
        shutil.rmtree(folder)
    code, out, err = run_main(capsys, "train", "--resume", "--out", run)
    assert code == 2 and err == (
        f"error: nothing to resume: {checkpoints} holds no checkpoint; run the same command with "
        "--force (and without --resume) to start over\n"
    )


def test_quiet_is_one_invocations_and_no_quiet_undoes_a_config_file(corpus, tmp_path, capsys):
    """A run started with ``-q`` and stopped: its ``--resume`` talks again (before: quiet for
    good, with no flag to undo it), a ``--resume -q`` is quiet; ``--no-quiet`` overrides
    ``quiet: true`` in a config file. --timeout and --device describe the run: they carry over.
    4 rounds: 1024 tokens / (4 sequences x 32 tokens x 2 inner steps)."""
    run = tmp_path / "run"
    flags = ["--data", corpus, "--tokens", 1024, "--timeout", 77, "--out", run]
    code, out, _ = run_main(capsys, "train", *TINY_FLAGS, *flags, "-q", "--stop-after", 1)
    assert (code, out) == (0, "")
    code, out, _ = run_main(capsys, "train", "--resume", "--out", run, "-q", "--stop-after", 2)
    assert (code, out) == (0, "")
    code, out, err = run_main(capsys, "train", "--resume", "--out", run)
    assert code == 0, err
    assert f"resuming after round 2 of 4 ({run / 'checkpoints' / 'round-000002'})\n" in out
    assert "final val loss" in out
    saved = json.loads((run / "config.json").read_text())
    assert (saved["quiet"], saved["timeout"], saved["device"]) == (False, 77, "cpu")

    config_file = tmp_path / "quiet.yml"
    config_file.write_text("quiet: true\n")
    flags = ["--data", corpus, "--tokens", 512, "--config", config_file]
    code, out, _ = run_main(capsys, "train", *TINY_FLAGS, *flags, "--out", tmp_path / "q")
    assert (code, out) == (0, "")
    code, out, err = run_main(capsys, "train", *TINY_FLAGS, *flags, "--no-quiet",
                              "--out", tmp_path / "loud")  # fmt: skip
    assert code == 0, err
    assert "final val loss" in out and "rounds" in out


def test_init_file_reads_the_config_and_tokenizer_beside_it_as_its_folder_does(
    corpus, tmp_path, capsys
):
    """``--init FOLDER/model.safetensors`` is ``--init FOLDER``: the config.json beside the file
    builds the model (a Llama of hidden size 16, no preset: before, 'put that config.json beside
    the weights' although it was there) and the tokenizer beside it tokenizes the data (before:
    ignored, a BPE trained on the data instead). Each file run ends on the folder run's
    parameters and tokenizer, bit for bit."""
    from safetensors.torch import load_file
    from transformers import LlamaConfig, LlamaForCausalLM

    llama = tmp_path / "llama"  # weights and config.json, no tokenizer
    LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=16, intermediate_size=32,
                                 num_hidden_layers=2, num_attention_heads=2,
                                 num_key_value_heads=2)).save_pretrained(llama)  # fmt: skip
    flags = [*TINY_FLAGS, "--data", corpus, "--tokens", 512, "-q"]
    code, _, err = run_main(capsys, "train", *flags, "--out", tmp_path / "base")
    assert code == 0, err
    trained = tmp_path / "base" / "final"  # weights, config.json and tokenizer
    assert (trained / "tokenizer.json").is_file()
    for name, init in (("llama", llama), ("trained", trained)):
        for given in (init, init / "model.safetensors"):
            out = tmp_path / f"{name}-{given.name}"
            code, _, err = run_main(capsys, "train", *flags, "--init", given, "--out", out)
            assert code == 0, err
        folder, file = tmp_path / f"{name}-{init.name}", tmp_path / f"{name}-model.safetensors"
        assert (folder / "final" / "config.json").read_text() == (
            file / "final" / "config.json"
        ).read_text()
        expected = load_file(folder / "final" / "model.safetensors")
        for tensor_name, tensor in load_file(file / "final" / "model.safetensors").items():
            assert torch.equal(tensor, expected[tensor_name]), tensor_name
    hidden = json.loads((tmp_path / "llama-model.safetensors/final/config.json").read_text())
    assert hidden["hidden_size"] == 16
    tokenizer = (trained / "tokenizer.json").read_text()
    assert (tmp_path / "trained-model.safetensors/final/tokenizer.json").read_text() == tokenizer
