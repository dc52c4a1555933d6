"""Model presets, config files, seeded construction and the parameter checksum."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import LlamaForCausalLM

from mergekit_loco.train.model import (
    MODEL_PRESETS,
    build_model,
    count_parameters,
    model_config,
    parameter_checksum,
)


def llama_parameters(vocab: int, hidden: int, layers: int, ffn: int) -> int:
    """Untied embeddings + lm_head, q/k/v/o, gate/up/down, two RMSNorms a layer, final norm."""
    return 2 * vocab * hidden + layers * (4 * hidden**2 + 3 * hidden * ffn + 2 * hidden) + hidden


@pytest.mark.parametrize(
    ("preset", "vocab", "hidden", "layers", "ffn", "low", "high"),
    [
        ("micro", 4096, 32, 2, 64, 1e5, 1e6),
        ("nano", 4096, 128, 4, 352, 1e6, 5e6),
        ("178m", 32000, 1024, 9, 2688, 170e6, 185e6),
        ("512m", 32000, 1536, 12, 5440, 500e6, 525e6),
    ],
)
def test_preset_parameter_counts(preset, vocab, hidden, layers, ffn, low, high):
    config = model_config(preset, vocab_size=vocab)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    expected = llama_parameters(vocab, hidden, layers, ffn)
    assert count_parameters(model) == expected
    assert low <= expected <= high


@pytest.mark.parametrize("preset", sorted(MODEL_PRESETS))
def test_presets_share_the_reference_architecture(preset):
    config = model_config(preset, vocab_size=1000, bos_id=0, eos_id=0)
    assert config.vocab_size == 1000 and config.eos_token_id == 0 and config.bos_token_id == 0
    assert config.tie_word_embeddings is False
    assert config.rms_norm_eps == 1e-5
    assert config.num_key_value_heads == config.num_attention_heads
    assert not config.attention_bias and not config.mlp_bias
    assert config.hidden_act == "silu"
    assert config._attn_implementation in ("sdpa", "eager")


def test_build_model_is_seeded_float32_and_leaves_global_rng_alone():
    config = model_config("micro", vocab_size=128)
    rng_before = torch.get_rng_state()
    first = build_model(config, seed=7)
    assert torch.equal(torch.get_rng_state(), rng_before)
    again = build_model(config, seed=7)
    other = build_model(config, seed=8)
    checksum = parameter_checksum(dict(first.named_parameters()))
    assert checksum == parameter_checksum(dict(again.named_parameters()))
    assert checksum != parameter_checksum(dict(other.named_parameters()))
    assert all(p.dtype == torch.float32 for p in first.parameters())
    assert first.lm_head.weight.data_ptr() != first.model.embed_tokens.weight.data_ptr()
    assert not torch.equal(first.lm_head.weight, other.lm_head.weight)


def test_checksum_sees_every_bit_and_ignores_mapping_order():
    params = {"b": torch.randn(3, 4), "a": torch.arange(5, dtype=torch.bfloat16)}
    reordered = {"a": params["a"].clone(), "b": params["b"].clone()}
    assert parameter_checksum(params) == parameter_checksum(reordered)
    nudged = dict(reordered, b=reordered["b"].clone())
    nudged["b"][2, 3] = torch.nextafter(nudged["b"][2, 3], torch.tensor(float("inf")))
    assert parameter_checksum(params) != parameter_checksum(nudged)
    renamed = {"c": params["b"], "a": params["a"]}
    assert parameter_checksum(params) != parameter_checksum(renamed)
    reshaped = dict(params, b=params["b"].reshape(4, 3))
    assert parameter_checksum(params) != parameter_checksum(reshaped)


def test_config_json_file_and_folder(tmp_path):
    path = tmp_path / "tiny.json"
    path.write_text(
        json.dumps(
            {
                "model_type": "llama",
                "hidden_size": 48,
                "num_hidden_layers": 1,
                "num_attention_heads": 3,
                "intermediate_size": 96,
                "vocab_size": 999,
            }
        )
    )
    config = model_config(str(path), vocab_size=100, eos_id=5)
    assert (config.hidden_size, config.num_attention_heads, config.num_key_value_heads) == (
        48,
        3,
        3,
    )
    assert config.vocab_size == 100 and config.eos_token_id == 5
    assert config.tie_word_embeddings is False and config.rms_norm_eps == 1e-5
    model = build_model(config, seed=0)
    assert count_parameters(model) == llama_parameters(100, 48, 1, 96)

    folder = tmp_path / "checkpoint"
    folder.mkdir()
    (folder / "config.json").write_text(path.read_text())
    assert model_config(str(folder), vocab_size=100).hidden_size == 48


def test_bad_model_specs_name_the_problem(tmp_path):
    with pytest.raises(ValueError, match=r"unknown model 'giant'.*micro, nano, 178m, 512m"):
        model_config("giant", vocab_size=10)
    with pytest.raises(ValueError, match="missing.json"):
        model_config(str(tmp_path / "missing.json"), vocab_size=10)
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(ValueError, match="broken.json.*not valid JSON"):
        model_config(str(broken), vocab_size=10)
    unknown = tmp_path / "unknown.json"
    unknown.write_text(json.dumps({"model_type": "not-a-model"}))
    with pytest.raises(ValueError, match="transformers knows no model_type 'not-a-model'"):
        model_config(str(unknown), vocab_size=10)
    vision = tmp_path / "vit.json"
    vision.write_text(json.dumps({"model_type": "vit"}))
    with pytest.raises(ValueError, match="model_type 'vit' is not a causal language model"):
        model_config(str(vision), vocab_size=10)
    odd_heads = tmp_path / "odd.json"
    odd_heads.write_text(json.dumps({"hidden_size": 50, "num_attention_heads": 3}))
    with pytest.raises(ValueError, match=r"model .*odd.json.*invalid 'llama' config"):
        model_config(str(odd_heads), vocab_size=10)
