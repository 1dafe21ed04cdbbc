"""Model presets: sizes, seeded init, rotary buffers, parameter groups and FLOP counts."""

import math

import pytest
import torch

from srtrain.models import (
    PRESETS,
    build_model,
    build_model_from_config,
    count_params,
    decoder_layers,
    flops_per_token,
    init_weights,
    model_config,
    no_decay,
)
from srtrain.param_groups import GROUPS, param_group_of

LLAMA_VOCAB = 32000
PYTHIA_VOCAB = 50304


@pytest.mark.parametrize(
    ("preset", "vocab", "low", "high"),
    [
        ("llama-60m", LLAMA_VOCAB, 55e6, 65e6),
        ("llama-100m", LLAMA_VOCAB, 95e6, 105e6),
        ("llama-350m", LLAMA_VOCAB, 340e6, 380e6),
        ("llama-1b", LLAMA_VOCAB, 1.2e9, 1.4e9),
        ("llama-7b", LLAMA_VOCAB, 6.6e9, 6.8e9),
        ("neox-160m", PYTHIA_VOCAB, 155e6, 170e6),
        ("neox-410m", PYTHIA_VOCAB, 395e6, 415e6),
        ("llama-tiny", 4096, 0.5e6, 2e6),
        ("neox-tiny", 4096, 0.5e6, 2e6),
    ],
)
def test_preset_parameter_counts(preset, vocab, low, high):
    model = build_model(preset, vocab, 2048)
    assert all(p.is_meta for p in model.parameters())
    assert low <= count_params(model) <= high


def test_llama_7b_matches_published_count():
    assert count_params(build_model("llama-7b", LLAMA_VOCAB, 4096)) == 6_738_415_616


def test_config_shapes_and_untied_embeddings():
    llama = model_config("llama-350m", 1000, 256)
    assert (llama.hidden_size, llama.intermediate_size) == (1024, 2736)
    assert (llama.num_attention_heads, llama.num_hidden_layers) == (16, 24)
    assert llama.max_position_embeddings == 256 and llama.vocab_size == 1000
    neox = model_config("neox-410m", 1000, 512)
    assert neox.intermediate_size == 4 * neox.hidden_size == 4096
    assert neox.rope_parameters["partial_rotary_factor"] == 0.25
    assert neox.use_parallel_residual
    for config in (llama, neox):
        assert not config.tie_word_embeddings
        assert config._attn_implementation == "sdpa"
    model = build_model("neox-tiny", 300, 32)
    assert model.get_input_embeddings().weight is not model.get_output_embeddings().weight


def test_unknown_preset_lists_allowed_names():
    with pytest.raises(ValueError, match="unknown model preset 'llama-3b'") as err:
        build_model("llama-3b", 100, 16)
    for name in PRESETS:
        assert name in str(err.value)


@pytest.mark.parametrize(("vocab", "seq"), [(0, 16), (100, 0)])
def test_bad_sizes_are_rejected(vocab, seq):
    with pytest.raises(ValueError, match="must be a positive integer"):
        build_model("llama-tiny", vocab, seq)


@pytest.mark.parametrize("preset", ["llama-tiny", "neox-tiny"])
def test_rotary_buffers_correct_after_to_empty_and_init(preset):
    reference = build_model(preset, 300, 64, device="cpu")
    model = build_model(preset, 300, 64)
    model.to_empty(device="cpu")
    for buf in model.buffers():
        buf.fill_(float("nan"))
    init_weights(model, 0)
    want = dict(reference.named_buffers())
    got = dict(model.named_buffers())
    assert got.keys() == want.keys() and len(want) == 2
    for name, buf in want.items():
        assert got[name].dtype == torch.float32
        assert torch.equal(got[name], buf), name
    rotary, ref_rotary = model.base_model.rotary_emb, reference.base_model.rotary_emb
    assert rotary.attention_scaling == ref_rotary.attention_scaling == 1.0


def test_init_on_meta_parameters_is_refused():
    with pytest.raises(ValueError, match=r"meta device; call model\.to_empty"):
        init_weights(build_model("llama-tiny", 100, 16), 0)


@pytest.mark.parametrize("preset", ["llama-tiny", "neox-tiny"])
def test_init_statistics(preset):
    model = build_model(preset, 4096, 64, device="cpu")
    init_weights(model, 1)
    scaled_std = 0.02 / math.sqrt(2 * model.config.num_hidden_layers)
    output_names = ("o_proj", "down_proj", "attention.dense", "dense_4h_to_h")
    for name, p in model.named_parameters():
        if name.endswith(".bias"):
            assert torch.equal(p, torch.zeros_like(p)), name
        elif param_group_of(name) == "norms":
            assert torch.equal(p, torch.ones_like(p)), name
        else:
            std = scaled_std if any(f"{o}.weight" in name for o in output_names) else 0.02
            # The sample std of n normals has relative standard error 1/sqrt(2n).
            tol = 5 * std / math.sqrt(2 * p.numel())
            assert abs(p.std().item() - std) < tol, name
            assert abs(p.mean().item()) < 5 * std / math.sqrt(p.numel()), name


@pytest.mark.slow
def test_init_is_seeded_per_parameter():
    a, b, c = (build_model("llama-tiny", 500, 32, device="cpu") for _ in range(3))
    init_weights(a, 5)
    init_weights(b, 5)
    init_weights(c, 6)
    for (name, pa), pb, pc in zip(
        a.named_parameters(), b.parameters(), c.parameters(), strict=True
    ):
        assert torch.equal(pa, pb), name
        if param_group_of(name) != "norms":
            assert not torch.equal(pa, pc), name
    layer = decoder_layers(a)[0].self_attn
    assert not torch.equal(layer.q_proj.weight, layer.k_proj.weight)


def test_bf16_parameters_hold_the_fp32_init_rounded():
    fp32 = build_model("neox-tiny", 300, 32, device="cpu")
    bf16 = build_model("neox-tiny", 300, 32, device="cpu").to(torch.bfloat16)
    init_weights(fp32, 2)
    init_weights(bf16, 2)
    for (name, want), got in zip(fp32.named_parameters(), bf16.parameters(), strict=True):
        assert got.dtype == torch.bfloat16, name
        assert torch.equal(got, want.to(torch.bfloat16)), name


def test_initial_loss_is_near_uniform():
    vocab = 1000
    model = build_model("neox-tiny", vocab, 64, device="cpu")
    init_weights(model, 0)
    ids = torch.randint(0, vocab, (4, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        loss = model(input_ids=ids, labels=ids).loss.item()
    assert abs(loss - math.log(vocab)) < 0.05


@pytest.mark.parametrize("preset", ["llama-1b", "neox-410m"])
def test_param_groups_cover_every_parameter(preset):
    model = build_model(preset, 1000, 128)
    layers = model.config.num_hidden_layers
    groups = {g: 0 for g in GROUPS}
    for name, _ in model.named_parameters():
        groups[param_group_of(name)] += 1
    per_layer_norms = 2 if preset.startswith("llama") else 4  # NeoX LayerNorms have biases
    assert groups["norms"] == per_layer_norms * layers + (1 if preset.startswith("llama") else 2)
    assert groups["embeddings"] == 1 and groups["head"] == 1
    assert groups["attention"] == 4 * layers  # q,k,v,o or qkv and dense with biases
    assert groups["mlp"] == layers * (3 if preset.startswith("llama") else 4)


@pytest.mark.parametrize(
    ("name", "group"),
    [
        ("model.embed_tokens.weight", "embeddings"),
        ("model.layers.3.self_attn.o_proj.weight", "attention"),
        ("model.layers.3.mlp.gate_proj.weight", "mlp"),
        ("model.layers.3.input_layernorm.weight", "norms"),
        ("model.norm.weight", "norms"),
        ("lm_head.weight", "head"),
        ("gpt_neox.embed_in.weight", "embeddings"),
        ("gpt_neox.layers.0.attention.query_key_value.bias", "attention"),
        ("gpt_neox.layers.0.mlp.dense_4h_to_h.weight", "mlp"),
        ("gpt_neox.layers.0.post_attention_layernorm.bias", "norms"),
        ("gpt_neox.final_layer_norm.weight", "norms"),
    ],
)
def test_param_group_of_names(name, group):
    assert param_group_of(name) == group


def test_param_group_of_unknown_name():
    with pytest.raises(ValueError, match=r"'model\.adapter\.weight' is not a known"):
        param_group_of("model.adapter.weight")


def test_no_decay_is_norms_and_biases():
    model = build_model("neox-tiny", 100, 16)
    exempt = {name for name, p in model.named_parameters() if no_decay(name, p)}
    want = {
        name
        for name, p in model.named_parameters()
        if name.endswith(".bias") or param_group_of(name) == "norms"
    }
    assert exempt == want
    assert "gpt_neox.final_layer_norm.weight" in exempt
    assert "gpt_neox.embed_in.weight" not in exempt
    assert "gpt_neox.layers.1.attention.query_key_value.bias" in exempt
    assert "gpt_neox.layers.1.attention.query_key_value.weight" not in exempt


@pytest.mark.parametrize("preset", ["llama-60m", "neox-160m"])
def test_flops_per_token_formula(preset):
    seq, vocab = 1024, 32000
    model = build_model(preset, vocab, seq)
    c = model.config
    n = count_params(model) - vocab * c.hidden_size
    want = 6 * n + 12 * c.num_hidden_layers * c.hidden_size * seq
    assert flops_per_token(model, seq) == want
    assert flops_per_token(c, seq) == want
    # The 6N term dominates at this size; the attention term is a few percent.
    assert 0.01 < 12 * c.num_hidden_layers * c.hidden_size * seq / want < 0.2


def test_flops_per_token_counts_the_attention_width_a_config_sets():
    """Qwen3 sets head_dim wider than hidden / heads: the attention term uses heads × head_dim,
    and the q/k norms and the tied head count as they are built."""
    from transformers import Qwen3Config

    seq = 256
    config = Qwen3Config(
        vocab_size=512,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_hidden_layers=2,
        tie_word_embeddings=True,
    )
    model = build_model_from_config(config)
    n = count_params(model) - 512 * 32
    assert flops_per_token(config, seq) == 6 * n + 12 * 2 * (4 * 16) * seq
    assert any(name.endswith("self_attn.q_norm.weight") for name, _ in model.named_parameters())
