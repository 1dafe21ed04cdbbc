"""Config loading, overrides and validation messages."""

from __future__ import annotations

import json

import pytest

from srtrain.config import Config, ConfigError, data_source, load_config, validate_world


def test_defaults_and_overrides(tmp_path):
    cfg = load_config(
        None,
        [
            "optim.lr=3e-4",
            "optim.v_format=fp4",
            "optim.m_format=fp4",
            "train.steps=7",
            "parallel.bf16_params=true",
        ],
    )
    assert cfg.optim.lr == 3e-4 and cfg.train.steps == 7 and cfg.parallel.bf16_params is True
    assert (cfg.optim.m_format, cfg.optim.v_format) == ("fp4_e2m1", "fp4_e2m2")
    base = tmp_path / "base.yaml"
    base.write_text("optim:\n  lr: 0.002\n  v_format: fp8\ntrain:\n  steps: 11\n")
    child = tmp_path / "child.yaml"
    child.write_text("base: base.yaml\noptim:\n  m_format: fp8\n")
    cfg = load_config(child, ["train.steps=5"])
    assert (cfg.optim.lr, cfg.optim.m_format, cfg.optim.v_format, cfg.train.steps) == (
        0.002,
        "fp8",
        "fp8",
        5,
    )
    assert Config().to_dict()["model"]["preset"] == "llama-tiny"


@pytest.mark.parametrize(
    "override,message",
    [
        ("optim.lrr=1", "unknown config key 'optim.lrr'; allowed in optim: lr"),
        ("optimizer.lr=1", "unknown config section 'optimizer'"),
        ("optim.lr=fast", "optim.lr: expected float, got 'fast'"),
        ("train.steps=1.5", "train.steps: expected int, got 1.5"),
        ("optim.m_format=fp4_e2m2", "optim.m_format: fp4_e2m2 holds only non-negative values"),
        ("optim.v_format=fp6", "optim.v_format: unknown format 'fp6'"),
        ("optim.block_size=24", "optim.block_size: block_size must be a power of two"),
        ("optim.m_rounding=up", "optim.m_rounding: 'up' is not allowed; choose one of nearest"),
        ("resets.mode=periodic", "needs resets.m_period or resets.v_period"),
        ("model.preset=gpt5", "model.preset: 'gpt5' is not allowed"),
        ("optim.beta2=1.0", "optim.beta2: must be in [0, 1)"),
        ("train.seed=-1", "train.seed: must be in [0, 2**63), got -1"),
        ("train.seed=99999999999999999999", "train.seed: must be in [0, 2**63), got 9999"),
        ("optim.seed=9223372036854775808", "optim.seed: must be in [0, 2**63)"),
        ("optim.eps=0", "optim.eps: must be > 0, got 0.0"),
        ("data.max_bytes=-1", "data.max_bytes: must be > 0, got -1"),
        ("train.steps=[1", "override 'train.steps=[1': value is not valid YAML (while parsing"),
        ("model.init_from=/dev/null", "model.init_from: /dev/null is not a directory"),
        ("lr=3", "must look like section.key=value"),
        ("train.max_skipped_fraction=1.5", "train.max_skipped_fraction: must be in [0, 1]"),
        ("optim.lr=.inf", "optim.lr: must be a finite number, got inf"),
        ("optim.lr=.nan", "optim.lr: must be a finite number, got nan"),
        ("optim.eps=.nan", "optim.eps: must be a finite number, got nan"),
        ("optim.weight_decay=.nan", "optim.weight_decay: must be a finite number"),
        ("optim.grad_clip=.nan", "optim.grad_clip: must be a finite number"),
        ("optim.beta1=-.inf", "optim.beta1: must be a finite number, got -inf"),
        ("train.peak_flops=nan", "train.peak_flops: must be a finite number"),
        ("train.run_dir=", "train.run_dir: empty; give a directory"),
        ("data.dir=' '", "data.dir: empty; give a directory"),
    ],
)
def test_bad_values_give_one_line_naming_the_key(override, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert message in str(err.value) and "\n" not in str(err.value)


def test_world_size_checks():
    cfg = load_config(None, ["train.global_batch_size=6", "train.micro_batch_size=2"])
    validate_world(cfg, 3)
    with pytest.raises(ConfigError, match="does not divide by the 4 ranks"):
        validate_world(cfg, 4)
    with pytest.raises(ConfigError, match="micro_batch_size: 2 does not divide the per-rank"):
        validate_world(cfg, 2)


def test_missing_and_broken_files(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("optim: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML") as err:
        load_config(bad)
    assert "\n" not in str(err.value)
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"\x00\xff\xfe")
    with pytest.raises(ConfigError, match="is not UTF-8 text"):
        load_config(binary)


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("hidden_size", "big", "hidden_size"),
        ("hidden_size", 130, "not a multiple of the number of attention heads"),
    ],
)
def test_a_model_config_transformers_refuses_is_one_line(tmp_path, field, value, message):
    values = {
        "model_type": "llama",
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "vocab_size": 100,
    }
    (tmp_path / "config.json").write_text(json.dumps({**values, field: value}))
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"model.hf_config={tmp_path}"])
    assert str(err.value).startswith("model.hf_config: model config ")
    assert message in str(err.value) and "\n" not in str(err.value)


def test_data_source_is_named_or_the_default_jobs(tmp_path, monkeypatch):
    """A missing data.dir is prepared from data.source when the config names it, from builtin
    when it is the default job's data/builtin, and from nothing otherwise."""
    monkeypatch.chdir(tmp_path)
    source = {
        overrides: data_source(load_config(None, overrides).data)
        for overrides in [
            (),
            ("data.dir=./data/builtin",),
            (f"data.dir={tmp_path}/data/builtin",),
            ("data.dir=data/bultin",),
            ("data.dir=data/bultin", "data.source=builtin"),
            ("data.source=packages",),
        ]
    }
    assert list(source.values()) == ["builtin", "builtin", "builtin", "", "builtin", "packages"]
    assert load_config(None).data.source == ""  # not named
    named = tmp_path / "named.yaml"
    named.write_text("data:\n  dir: data/mine\n  source: allenai/c4:en\n")
    assert data_source(load_config(named).data) == "allenai/c4:en"
