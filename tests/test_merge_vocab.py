"""Fine-tunes that added tokens (embedding and lm_head rows appended), through `mloco merge`."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from checkpoint_factory import (
    finetune_of,
    load_state_dict,
    save_model,
    tiny_llama,
    write_state_dict,
)
from test_cli_merge import assert_one_line_error, run_main

BASE_VOCAB = 64
ROW_TENSORS = ("model.embed_tokens.weight", "lm_head.weight")


def with_added_tokens(model, vocab: int, seed: int):
    """``model`` with its vocabulary grown to ``vocab`` (new rows random), as `transformers`
    ``resize_token_embeddings`` does after ``tokenizer.add_tokens``."""
    model = copy.deepcopy(model)  # resizing edits the config, which fine-tunes share with the base
    torch.manual_seed(seed)
    model.resize_token_embeddings(vocab, mean_resizing=False)
    return model


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    root = tmp_path_factory.mktemp("vocab")
    base = tiny_llama(0)
    paths = {"base": save_model(base, root / "base")}
    paths["plain"] = save_model(finetune_of(base, 1), root / "plain")
    paths["added2"] = save_model(with_added_tokens(finetune_of(base, 2), 66, 2), root / "added2")
    paths["other2"] = save_model(with_added_tokens(finetune_of(base, 3), 66, 3), root / "other2")
    paths["added3"] = save_model(with_added_tokens(finetune_of(base, 4), 67, 4), root / "added3")
    return paths


def float64(path) -> dict[str, torch.Tensor]:
    return {name: tensor.double() for name, tensor in load_state_dict(path).items()}


def test_added_rows_come_from_the_model_that_has_them(family, tmp_path, capsys):
    out = tmp_path / "merged"
    code, _, err = run_main(
        capsys,
        "merge",
        family["plain"],
        family["added2"],
        "--base",
        family["base"],
        "--method",
        "ta",
        "--scale",
        "0.5",
        "-o",
        out,
        "--quiet",
    )
    assert code == 0, err
    base, plain, added = (
        float64(family["base"]),
        float64(family["plain"]),
        float64(family["added2"]),
    )
    merged = float64(out)
    for name, theta in base.items():
        rows = theta.shape[0]
        shared = theta + 0.5 * ((plain[name] - theta) + (added[name][:rows] - theta))
        torch.testing.assert_close(merged[name][:rows], shared, rtol=0, atol=1e-6)
        if name in ROW_TENSORS:
            assert merged[name].shape == (66, theta.shape[1])
            torch.testing.assert_close(merged[name][rows:], added[name][rows:], rtol=0, atol=0)
        else:
            assert merged[name].shape == theta.shape
    assert json.loads((out / "config.json").read_text())["vocab_size"] == 66


def test_rows_added_by_several_models_are_averaged(family, tmp_path, capsys):
    out = tmp_path / "merged.safetensors"
    code, _, err = run_main(
        capsys,
        "merge",
        family["added2"],
        family["other2"],
        family["plain"],
        "--base",
        family["base"],
        "--method",
        "ties",
        "--density",
        "0.5",
        "-o",
        out,
        "--quiet",
    )
    assert code == 0, err
    one, two, merged = float64(family["added2"]), float64(family["other2"]), float64(out)
    for name in ROW_TENSORS:
        expected = (one[name][BASE_VOCAB:] + two[name][BASE_VOCAB:]) / 2
        torch.testing.assert_close(merged[name][BASE_VOCAB:], expected, rtol=0, atol=1e-7)


def test_different_added_row_counts_are_one_line_errors(family, tmp_path, capsys):
    code, _, err = run_main(
        capsys,
        "merge",
        family["added2"],
        family["added3"],
        "--base",
        family["base"],
        "--method",
        "ta",
        "-o",
        tmp_path / "out",
    )
    assert code == 2
    assert_one_line_error(err, str(family["added3"]), "67 rows", "66", "same number")
    assert not (tmp_path / "out").exists()


def test_a_model_with_fewer_rows_than_the_base_is_an_error(family, tmp_path, capsys):
    code, _, err = run_main(
        capsys,
        "merge",
        family["plain"],
        "--base",
        family["added2"],
        "--method",
        "ta",
        "-o",
        tmp_path / "out",
    )
    assert code == 2
    assert_one_line_error(err, str(family["plain"]), "[64, 16]", "[66, 16]", "appended")


def test_models_of_different_vocabularies_without_a_base_are_refused(family, tmp_path, capsys):
    """Without --base the smallest model used to stand in for it, so a larger one's extra rows
    counted as appended: ``added2`` (66 rows) and ``added3`` (67) merged, 66 rows averaged,
    although each appended its own tokens (with the base: refused, different numbers). Which
    rows a model appended is known only against the base: refused in both orders, naming the
    two files, the tensor and the row counts."""
    for order in (("added2", "added3"), ("plain", "added2"), ("added2", "plain")):
        out = tmp_path / "out.safetensors"
        code, _, err = run_main(capsys, "merge", *(family[m] for m in order), "--method",
                                "mean", "-o", out)  # fmt: skip
        assert code == 2
        rows = {"plain": 64, "added2": 66, "added3": 67}
        first, second = order
        assert_one_line_error(
            err,
            f"{family[second] / 'model.safetensors'}: tensor 'lm_head.weight' has "
            f"{rows[second]} rows but {family[first] / 'model.safetensors'} has {rows[first]}",
            "give --base",
        )
        assert not out.exists()


def test_the_model_with_the_bad_shape_is_named_not_one_that_added_rows(family, tmp_path, capsys):
    """Before, the first model whose shape differed from the base's was blamed: ``added2``,
    whose appended rows are fine, rather than the model whose shape no rule allows."""
    state = {n: t.clone() for n, t in load_state_dict(family["plain"]).items()}
    state["lm_head.weight"] = state["lm_head.weight"][:, :-1]
    broken = write_state_dict(state, tmp_path / "broken.safetensors")
    code, _, err = run_main(capsys, "merge", family["added2"], broken, "--base", family["base"],
                            "-m", "ta", "-o", tmp_path / "out")  # fmt: skip
    assert code == 2
    assert_one_line_error(err, f"{broken}: tensor 'lm_head.weight' has shape [64, 15]", "[64, 16]")
    assert str(family["added2"]) not in err
