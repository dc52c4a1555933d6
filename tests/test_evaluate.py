"""mloco eval: held-out loss against a direct float64 computation on a tiny model."""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM

from mergekit_loco import cli
from mergekit_loco.compare.merges import compare_merges
from mergekit_loco.evaluate import (
    evaluate_models,
    held_out_tokens,
    held_out_warnings,
    val_set_spreads,
)
from mergekit_loco.train.model import build_model, model_config
from mergekit_loco.train.tokenizer import load_or_train_tokenizer

SEQ_LEN = 16
TOKENS = 600


@pytest.fixture(autouse=True)
def cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("MLOCO_CACHE", str(tmp_path_factory.getbasetemp() / "mloco-cache"))


@pytest.fixture
def corpus(tmp_path) -> str:
    folder = tmp_path / "corpus"
    folder.mkdir()
    words = "one two three four five six seven eight nine ten".split()
    for doc in range(30):
        text = " ".join(words[(doc * 3 + k * k) % len(words)] for k in range(60))
        (folder / f"doc{doc:02d}.txt").write_text(text + "\n")
    return str(folder)


@pytest.fixture
def model_folder(tmp_path, corpus) -> Path:
    """A random micro Llama with the BPE of ``corpus``, saved as a Hugging Face folder."""
    tokenizer = load_or_train_tokenizer(corpus, vocab_size=300)
    model = build_model(model_config("micro", len(tokenizer)), seed=3)
    folder = tmp_path / "model"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def direct_loss(folder: Path, ids: torch.Tensor) -> tuple[float, int]:
    """sum_t -log softmax(logits_t)[x_t+1] over windows of SEQ_LEN, in float64, by hand."""
    model = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    windows = ids[: ids.numel() // SEQ_LEN * SEQ_LEN].reshape(-1, SEQ_LEN)
    with torch.no_grad():
        logits = model(input_ids=windows).logits.double()
    shifted = logits - logits.amax(dim=-1, keepdim=True)
    log_probs = shifted - shifted.exp().sum(dim=-1, keepdim=True).log()
    targets = windows[:, 1:]
    nll = -log_probs[:, :-1].gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return nll.sum().item() / targets.numel(), targets.numel()


def test_eval_matches_a_direct_computation(model_folder, corpus, tmp_path):
    ids = held_out_tokens(corpus, model_folder, TOKENS)
    assert ids.numel() == TOKENS and ids.dtype == torch.int64
    expected, predicted = direct_loss(model_folder, ids)
    assert predicted == (TOKENS // SEQ_LEN) * (SEQ_LEN - 1)

    # the same weights as a bare .safetensors file with config.json (and tokenizer) beside it
    loose = tmp_path / "loose"
    shutil.copytree(model_folder, loose)
    weights = loose / "weights.safetensors"
    (loose / "model.safetensors").rename(weights)

    results = evaluate_models([model_folder, weights], [corpus], tokens=TOKENS, seq_len=SEQ_LEN)
    assert [r.model for r in results] == [str(model_folder), str(weights)]
    for result in results:
        assert result.tokens == predicted
        assert math.isclose(result.loss, expected, rel_tol=1e-6)
        assert math.isclose(result.perplexity, math.exp(expected), rel_tol=1e-6)
    # an untrained model over a vocabulary of V sits near log(V)
    assert abs(expected - math.log(300)) < 0.5


def test_eval_command_json_and_errors(model_folder, corpus, tmp_path, capsys):
    args = ["eval", str(model_folder), "--data", corpus, "--tokens", str(TOKENS),
            "--seq-len", str(SEQ_LEN), "--json"]  # fmt: skip
    with pytest.raises(SystemExit) as exit_info:
        cli.main(args)
    assert exit_info.value.code == 0
    [record] = json.loads(capsys.readouterr().out)
    expected, _ = direct_loss(model_folder, held_out_tokens(corpus, model_folder, TOKENS))
    assert record["data"] == corpus and math.isclose(record["loss"], expected, rel_tol=1e-6)

    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(model_folder / "config.json", bare)
    shutil.copy(model_folder / "model.safetensors", bare)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["eval", str(bare), "--data", corpus])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert error.startswith("error:") and "no tokenizer" in error and "--tokenizer" in error
    assert len(error.strip().splitlines()) == 1


def test_eval_shows_a_progress_bar_on_a_terminal_only(model_folder, corpus, capsys, monkeypatch):
    """On a terminal (rich told so by TTY_COMPATIBLE=1) stderr shows a bar naming the model and
    the dataset and counting windows; -q, or stderr not a terminal, shows none. The loss is the
    same either way."""
    args = ["eval", str(model_folder), "--data", corpus, "--tokens", str(TOKENS),
            "--seq-len", str(SEQ_LEN), "--json"]  # fmt: skip
    monkeypatch.setenv("COLUMNS", "400")  # the whole line: what is evaluated comes last
    losses = []
    for terminal, quiet in ((True, False), (True, True), (False, False)):
        monkeypatch.setenv("TTY_COMPATIBLE", str(int(terminal)))
        with pytest.raises(SystemExit) as exit_info:
            cli.main(args + ["-q"] * quiet)
        assert exit_info.value.code == 0
        captured = capsys.readouterr()
        losses.append(json.loads(captured.out)[0]["loss"])
        drawn = f"{model_folder} on {corpus}" in captured.err and "windows" in captured.err
        assert drawn == (terminal and not quiet), (terminal, quiet, captured.err)
    assert len(set(losses)) == 1


def test_val_sets_are_disjoint_slices_and_their_spread(model_folder, corpus, capsys, monkeypatch):
    """K validation sets: consecutive slices of K * tokens held-out tokens; spread by hand."""
    sets, tokens = 3, 200
    ids = held_out_tokens(corpus, model_folder, sets * tokens)
    expected = [direct_loss(model_folder, ids[k * tokens : (k + 1) * tokens])[0] for k in range(3)]
    results = evaluate_models([model_folder], [corpus], tokens=tokens, seq_len=SEQ_LEN,
                              val_sets=sets)  # fmt: skip
    assert [r.val_set for r in results] == [0, 1, 2]
    for result, loss in zip(results, expected, strict=True):
        assert math.isclose(result.loss, loss, rel_tol=1e-6)
    [noise] = val_set_spreads(results).values()
    mean = sum(expected) / 3
    std = math.sqrt(sum((loss - mean) ** 2 for loss in expected) / 2)
    assert math.isclose(noise.mean, mean, rel_tol=1e-6) and math.isclose(
        noise.std, std, rel_tol=1e-4
    )
    assert (noise.low, noise.high) == (min(r.loss for r in results), max(r.loss for r in results))

    monkeypatch.setenv("COLUMNS", "400")  # one table line per row
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["eval", str(model_folder), "--data", corpus, "--tokens", str(tokens),
                  "--seq-len", str(SEQ_LEN), "--val-sets", "3"])  # fmt: skip
    assert exit_info.value.code == 0
    output = capsys.readouterr().out
    assert f"{corpus} #2" in output and f"{mean:.4f} ± {std:.4f}" in output
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["eval", str(model_folder), "--data", corpus, "--val-sets", "0"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == "error: --val-sets must be >= 1, got 0\n"


def test_evaluate_models_names_an_argument_of_the_wrong_kind(model_folder, corpus):
    """Before: one path was read character by character (``/: no model.safetensors``),
    ``batch_size=0`` ended in ``range() arg 3 must not be zero`` and ``tokens=True`` in a
    torch TypeError."""
    cases = [
        ((str(model_folder), [corpus]), {}, TypeError, "models: a list ("),
        (([model_folder], corpus), {}, TypeError, "datasets: a list ("),
        (([model_folder], [corpus]), {"tokens": True}, TypeError, "tokens must be an int"),
        (
            ([model_folder], [corpus]),
            {"batch_size": 0},
            ValueError,
            "batch_size must be an int >= 1",
        ),
        (
            ([model_folder], [corpus]),
            {"batch_size": -1},
            ValueError,
            "batch_size must be an int >= 1",
        ),
    ]
    for args, options, error, message in cases:
        with pytest.raises(error, match=re.escape(message)):
            evaluate_models(*args, **{"tokens": TOKENS, "seq_len": SEQ_LEN, **options})


def test_plus_joins_sources_into_the_one_dataset_training_reads(model_folder, corpus, capsys):
    """``--data a,b`` is two datasets; ``--data a+b`` is the corpus ``train --data a,b`` holds
    out from, so its loss is that of ``held_out_tokens("a,b")``, computed directly."""
    second = Path(corpus).parent / "second"
    second.mkdir()
    for doc in range(10):
        (second / f"{doc}.txt").write_text("ten nine eight seven six five four\n" * (20 + doc))
    spec = f"{corpus},{second}"
    expected, _ = direct_loss(model_folder, held_out_tokens(spec, model_folder, TOKENS))
    with pytest.raises(SystemExit) as exited:
        cli.main(["eval", str(model_folder), "--data", f"{corpus}+{second}", "--tokens",
                  str(TOKENS), "--seq-len", str(SEQ_LEN), "--json"])  # fmt: skip
    assert exited.value.code == 0
    [record] = json.loads(capsys.readouterr().out)
    assert record["data"] == spec and math.isclose(record["loss"], expected, rel_tol=1e-5)
    with pytest.raises(SystemExit):
        cli.main(["eval", str(model_folder), "--data", spec, "--tokens", "200", "--json"])
    assert [r["data"] for r in json.loads(capsys.readouterr().out)] == [corpus, str(second)]


@pytest.mark.parametrize(
    ("name", "given", "datasets"),
    [
        ("code,2024", "{odd},{corpus}", ["{odd}", "{corpus}"]),  # beside a second dataset
        ("code+2024", "{corpus}+{odd}", ["{corpus},{odd}"]),  # joined to another source
    ],
)
def test_a_data_path_with_a_separator_in_its_name_stays_whole(
    name, given, datasets, model_folder, corpus, tmp_path, capsys
):
    """``--data`` of eval keeps an existing path whose name holds commas or pluses whole (as
    train's does); each dataset's loss is the direct one on its held-out tokens."""
    odd = tmp_path / name
    shutil.copytree(corpus, odd)
    with pytest.raises(SystemExit) as exited:
        cli.main(["eval", str(model_folder), "--data", given.format(odd=odd, corpus=corpus),
                  "--tokens", "200", "--seq-len", str(SEQ_LEN), "--json"])  # fmt: skip
    assert exited.value.code == 0
    records = json.loads(capsys.readouterr().out)
    specs = [spec.format(odd=odd, corpus=corpus) for spec in datasets]
    assert [r["data"] for r in records] == specs
    expected, _ = direct_loss(model_folder, held_out_tokens(specs[0], model_folder, 200))
    assert math.isclose(records[0]["loss"], expected, rel_tol=1e-5)


def eval_cli(capsys, *args) -> tuple[int, str, str]:
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["eval", *map(str, args), "--seq-len", str(SEQ_LEN), "--json"])
    captured = capsys.readouterr()
    return exit_info.value.code, captured.out, captured.err


def test_a_single_file_model_names_all_it_lacks_and_takes_the_tokenizers_config(
    model_folder, corpus, tmp_path, capsys
):
    """``mloco eval soup.safetensors`` (a merge written as one file): one error naming both the
    config and the tokenizer it lacks and how to supply them (before: the tokenizer first, then,
    once given, the config); ``--tokenizer`` of a model folder supplies its config.json too."""
    soup = tmp_path / "merges" / "soup.safetensors"
    soup.parent.mkdir()
    shutil.copy(model_folder / "model.safetensors", soup)
    code, _, err = eval_cli(capsys, soup, "--data", corpus, "--tokens", TOKENS)
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert err.startswith(f"error: {soup}: no config.json and no tokenizer beside the weights")
    assert "merge to a folder instead (-o DIR" in err and "--tokenizer FOLDER" in err

    tokenizer_only = tmp_path / "tokenizer"
    shutil.copytree(model_folder, tokenizer_only)
    (tokenizer_only / "config.json").unlink()
    code, _, err = eval_cli(capsys, soup, "--data", corpus, "--tokenizer", tokenizer_only)
    assert code == 2 and err.startswith(f"error: {soup}: no config.json beside the weights")

    code, out, err = eval_cli(
        capsys, soup, model_folder, "--data", corpus, "--tokens", TOKENS,
        "--tokenizer", model_folder,
    )  # fmt: skip
    assert code == 0, err
    soup_record, folder_record = json.loads(out)
    assert soup_record["loss"] == folder_record["loss"]


def test_eval_of_a_run_warns_when_it_would_score_trained_tokens(corpus, tmp_path, capsys):
    """``mloco eval RUN/final`` with more --tokens than the run held out, another --seed or other
    --data: one warning each on stderr (from RUN/config.json), and the evaluation still runs;
    the run's own settings give none."""
    run = tmp_path / "run"
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["train", "--model=micro", "--workers=2", "--inner-steps=2", "--global-batch=4",
                  f"--seq-len={SEQ_LEN}", "--tokens=256", "--vocab-size=300", "--val-tokens=300",
                  f"--data={corpus}", f"--out={run}", "--quiet", "--device=cpu"])  # fmt: skip
    assert exit_info.value.code in (0, None)
    final = run / "final"
    code, _, err = eval_cli(capsys, final, "--data", corpus, "--tokens", 300)
    assert code == 0 and err == ""
    code, _, err = eval_cli(capsys, run, "--data", corpus, "--tokens", 300)  # the run, not final/
    assert code == 2 and err.rstrip().endswith(f"(a training run: its model is {final})"), err
    other = tmp_path / "other"
    shutil.copytree(corpus, other)
    code, out, err = eval_cli(capsys, final, "--data", other, "--tokens", 600, "--seed", 4)
    assert code == 0 and json.loads(out)[0]["data"] == str(other)
    warnings = err.strip().splitlines()
    assert len(warnings) == 3 and all(w.startswith(f"warning: {final}: the run ") for w in warnings)
    assert "held out 300 validation tokens" in warnings[0]
    assert warnings[0].endswith(
        "600 evaluated tokens include tokens it trained on; pass --tokens 300"
    )
    assert warnings[1].endswith("--seed 4 evaluates other documents, some of them trained on; "
                                "pass --seed 0")  # fmt: skip
    assert f"trained on --data {corpus}" in warnings[2]
    # a run's relative --data is relative to where it started: from elsewhere it is not
    # compared; a path this machine cannot even look at (a name too long) is no error either
    config_file = run / "config.json"
    saved = json.loads(config_file.read_text())
    for data in ("corpus", "x" * 5000):
        config_file.write_text(json.dumps({**saved, "data": data}))
        code, _, err = eval_cli(capsys, final, "--data", corpus, "--tokens", 300)
        assert code == 0 and err == "", err
    config_file.write_text(json.dumps({**saved, "data": f"{corpus},{other}"}))
    code, _, err = eval_cli(capsys, final, "--data", f"{corpus}+{other}", "--tokens", 300)
    assert code == 0 and err == "", err  # eval's a+b is train's a,b
    code, _, err = eval_cli(capsys, final, "--data", corpus, "--tokens", 300)
    assert f"; eval --data {corpus}+{other}); the held-out tokens of {corpus} are" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_device_errors_are_one_line_in_every_command(model_folder, corpus, tmp_path, capsys):
    """One --device check (mergekit_loco.device) for eval, merge, train and compare's merges:
    an unknown device or CUDA on a CPU machine is one line, exit 2 (before: eval printed an
    AssertionError or RuntimeError traceback)."""
    for device, message in (
        ("cuda", "--device cuda: no CUDA device is available here"),
        ("tpu", "--device: 'tpu' is not a device (use cpu or cuda)"),
        ("meta", "--device meta: mloco runs on cpu or cuda, not meta"),
    ):
        code, _, err = eval_cli(capsys, model_folder, "--data", corpus, "--device", device)
        assert (code, err) == (2, f"error: {message}\n")
        with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
            compare_merges(model_folder, [model_folder] * 2, [corpus, "stdlib"], ["mean"], [1.0],
                           tmp_path / "cmp", device=device)  # fmt: skip
        assert not (tmp_path / "cmp").exists()
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["train", "--model=micro", "--device=cuda", f"--data={corpus}",
                  f"--out={tmp_path / 'run'}", "--quiet"])  # fmt: skip
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == "error: --device cuda: no CUDA device is available here\n"


@pytest.mark.parametrize(
    ("tokens", "val_sets", "advice"),
    [
        (600, 1, "pass --tokens 300"),
        (200, 3, "pass --tokens 100"),
        # fewer held-out tokens than sets: no --tokens fits (before: "pass --tokens 0", refused)
        (512, 1000, "pass at most 300 tokens in all (--val-sets x --tokens)"),
    ],
)
def test_the_held_out_advice_is_a_count_eval_takes(tmp_path, tokens, val_sets, advice):
    run = tmp_path / "run"
    (run / "final").mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({"val_tokens": 300, "val_seed": 0}))
    warnings = held_out_warnings([run / "final"], [], tokens, 0, val_sets)
    assert len(warnings) == 1 and warnings[0].endswith(advice), warnings
