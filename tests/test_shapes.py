"""Model shapes: presets people train, shape keys on top of a preset, transformers config files."""

import json
import re

import pytest
import torch
from transformers import LlamaConfig

from srtrain.config import ConfigError, load_config
from srtrain.models import (
    PRESETS,
    build_model,
    build_model_from_config,
    count_params,
    preset_shape,
    read_hf_config,
    resolve_model_config,
    shape_config,
    shape_of,
)

# Published parameter counts at each family's own vocabulary.
PUBLISHED = [
    ("llama2-7b", 32000, 6_738_415_616),
    ("llama2-13b", 32000, 13_015_864_320),
    ("llama2-70b", 32000, 68_976_648_192),
    ("llama3-8b", 128256, 8_030_261_248),
    ("llama3-70b", 128256, 70_553_706_496),
    ("pythia-1b", 50304, 1_011_781_632),
    ("pythia-1.4b", 50304, 1_414_647_808),
    ("pythia-2.8b", 50304, 2_775_208_960),
    ("pythia-6.9b", 50432, 6_857_302_016),
    ("pythia-12b", 50688, 11_846_072_320),
]


@pytest.mark.parametrize(("preset", "vocab", "published"), PUBLISHED)
def test_presets_match_published_parameter_counts(preset, vocab, published):
    model = build_model(preset, vocab, 4096)
    assert all(p.is_meta for p in model.parameters())
    assert count_params(model) == published


def test_llama3_presets_use_grouped_query_attention_and_theta_500000():
    config = shape_config(PRESETS["llama3-70b"], 128256, 4096)
    assert (config.num_attention_heads, config.num_key_value_heads) == (64, 8)
    assert config.rope_parameters["rope_theta"] == 500000.0
    assert config.rms_norm_eps == 1e-5
    k_proj = build_model_from_config(config).model.layers[0].self_attn.k_proj.weight
    assert k_proj.shape == (8 * 128, 8192)


def _model_section(**values):
    cfg = load_config(None, [f"model.{k}={v}" for k, v in values.items()])
    return cfg.model


def test_shape_keys_change_a_preset():
    model = _model_section(
        preset="llama-tiny",
        hidden=256,
        layers=3,
        heads=8,
        kv_heads=2,
        rope_theta=250000.0,
        norm_eps=1e-5,
        tied_embeddings="true",
    )
    config = resolve_model_config(model, vocab_size=300)
    assert (config.hidden_size, config.num_hidden_layers) == (256, 3)
    assert (config.num_attention_heads, config.num_key_value_heads) == (8, 2)
    assert config.intermediate_size == PRESETS["llama-tiny"].intermediate
    assert config.rope_parameters["rope_theta"] == 250000.0
    assert config.rms_norm_eps == 1e-5 and config.tie_word_embeddings
    assert config.vocab_size == 300 and config.max_position_embeddings == 128
    model = build_model_from_config(config)
    assert model.get_input_embeddings().weight is model.get_output_embeddings().weight


def test_shape_keys_left_at_zero_keep_the_preset():
    config = resolve_model_config(_model_section(preset="neox-410m"), vocab_size=1000)
    assert shape_of(config) == preset_shape("neox-410m")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"hidden": 130}, "model.heads: 4 heads do not divide model.hidden 130"),
        ({"kv_heads": 3}, "model.kv_heads: 3 KV heads do not divide the 4 attention heads"),
        ({"preset": "neox-tiny", "kv_heads": 2}, "model.kv_heads: GPT-NeoX has no grouped-query"),
        ({"hidden": 132, "heads": 12}, "head size 132/12 = 11 is odd"),
        ({"layers": -1}, "model.layers: must be >= 0"),
        ({"preset": "llama-3b"}, "model.preset: 'llama-3b' is not allowed"),
    ],
)
def test_a_wrong_shape_is_one_line(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)) as err:
        load_config(None, [f"model.{k}={v}" for k, v in overrides.items()])
    assert "\n" not in str(err.value)


def _write_config(tmp_path, config) -> str:
    config.save_pretrained(tmp_path)
    return str(tmp_path / "config.json")


def test_hf_config_file_gives_the_whole_shape(tmp_path):
    written = LlamaConfig(
        vocab_size=515,
        hidden_size=96,
        intermediate_size=200,
        num_attention_heads=6,
        num_key_value_heads=2,
        num_hidden_layers=3,
        rope_theta=123456.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
    )
    path = _write_config(tmp_path, written)
    for source in (path, str(tmp_path)):
        model = _model_section(hf_config=source)
        config = resolve_model_config(model, vocab_size=500)
        assert config.vocab_size == 515 and config.num_key_value_heads == 2
        assert config.rope_parameters["rope_theta"] == 123456.0
        assert config.tie_word_embeddings and not config.use_cache
        assert config._attn_implementation == "sdpa"
    torch.manual_seed(0)
    ours = build_model_from_config(config, device="cpu")
    theirs = type(ours)(written)
    assert [(n, p.shape) for n, p in ours.named_parameters()] == [
        (n, p.shape) for n, p in theirs.named_parameters()
    ]


def test_hf_config_errors_are_one_line(tmp_path):
    with pytest.raises(ConfigError, match=r"model\.hf_config: model config not found"):
        load_config(None, [f"model.hf_config={tmp_path / 'missing.json'}"])
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ConfigError, match="model_type 'gpt2' is not supported"):
        load_config(None, [f"model.hf_config={tmp_path}"])
    path = _write_config(
        tmp_path,
        LlamaConfig(vocab_size=100, hidden_size=64, num_attention_heads=4, num_hidden_layers=1),
    )
    with pytest.raises(ConfigError, match=r"model\.hidden: shape keys change a preset"):
        load_config(None, [f"model.hf_config={path}", "model.hidden=128"])
    with pytest.raises(ValueError, match=r"data's vocabulary \(200 tokens\) is larger"):
        resolve_model_config(_model_section(hf_config=path), vocab_size=200)


def test_read_hf_config_round_trips_presets(tmp_path):
    for name in ("llama3-8b", "pythia-1b", "llama-tiny"):
        config = shape_config(PRESETS[name], 1000, 64)
        path = _write_config(tmp_path / name, config)
        assert shape_of(read_hf_config(path)) == shape_of(config)
