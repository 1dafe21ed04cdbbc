"""Continued pretraining of a Hugging Face model, end to end on the CPU: a tiny LLaMA, Mistral,
Qwen2, Qwen3 and GPT-NeoX, each saved with its own byte-level BPE tokenizer → data prepared
with that directory as the tokenizer → 20 steps with ``model.init_from`` → export →
transformers loads the export (model, tokenizer, text-generation pipeline) and
``srtrain.eval`` gives the run's validation loss. The untrained import computes
transformers' own logits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GPTNeoXConfig,
    GPTNeoXForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    pipeline,
)

import srtrain
from srtrain.checkpoint import latest
from srtrain.config import load_config
from srtrain.data import load_meta, prepare
from srtrain.eval import evaluate, hf_source
from srtrain.export import export
from srtrain.models import build_model_from_config, read_hf_config
from srtrain.parallel import init_distributed
from srtrain.pretrained import load_pretrained

from conftest import tiny_overrides

SEQ = 64
STEPS = 20
# family: (BOS, EOS, whether its template prepends BOS) — Llama-3's and Pythia's conventions
TOKENS = {
    "llama": ("<s>", "</s>", True),
    "mistral": ("<s>", "</s>", True),
    "qwen2": ("<|endoftext|>", "<|endoftext|>", False),
    "qwen3": ("<|endoftext|>", "<|endoftext|>", False),
    "neox": ("<|endoftext|>", "<|endoftext|>", False),
}


def _sources() -> list[str]:
    """Texts to train the tokenizers and the models on: srtrain's own sources."""
    return [p.read_text() for p in sorted(Path(srtrain.__file__).parent.glob("*.py"))]


def _tokenizer(family: str) -> PreTrainedTokenizerFast:
    """A byte-level BPE of about 400 tokens trained here, as a transformers tokenizer."""
    bos, eos, prepends = TOKENS[family]
    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=list(dict.fromkeys([bos, eos])),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    raw.train_from_iterator(_sources(), trainer)
    if prepends:
        raw.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", special_tokens=[(bos, raw.token_to_id(bos))]
        )
    return PreTrainedTokenizerFast(tokenizer_object=raw, bos_token=bos, eos_token=eos)


def _model(family: str, tokenizer: PreTrainedTokenizerFast):
    """A tiny random model whose embedding is padded past the tokenizer (to a multiple of 8,
    as real models pad theirs), with the tokenizer's special ids."""
    shape = dict(
        vocab_size=-(-len(tokenizer) // 8) * 8,
        hidden_size=32,
        num_attention_heads=4,
        num_hidden_layers=2,
        max_position_embeddings=SEQ,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    grouped = dict(intermediate_size=64, num_key_value_heads=2)
    if family == "llama":
        return LlamaForCausalLM(LlamaConfig(**shape, intermediate_size=64))
    if family == "mistral":  # a window shorter than the sequence
        return MistralForCausalLM(MistralConfig(**shape, **grouped, sliding_window=SEQ // 2))
    if family == "qwen2":  # q/k/v biases, tied embeddings
        return Qwen2ForCausalLM(Qwen2Config(**shape, **grouped, tie_word_embeddings=True))
    if family == "qwen3":  # q/k norms, heads wider than hidden / heads
        config = Qwen3Config(**shape, **grouped, head_dim=16, tie_word_embeddings=True)
        return Qwen3ForCausalLM(config)
    return GPTNeoXForCausalLM(GPTNeoXConfig(**shape, intermediate_size=64, rotary_pct=0.25))


@pytest.fixture
def process_group():
    """Tear down the group of one that in-process runs start."""
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.parametrize("family", list(TOKENS))
def test_continue_pretraining_round_trip(family, tmp_path, process_group):
    from srtrain.trainer import run

    tokenizer = _tokenizer(family)
    hf_dir = tmp_path / "hf"
    original = _model(family, tokenizer).eval()
    original.save_pretrained(hf_dir)
    tokenizer.save_pretrained(hf_dir)

    # the untrained import computes transformers' own logits
    ids = torch.tensor([tokenizer.encode("def main(argv):\n    return 0\n")[:SEQ]])
    model = build_model_from_config(read_hf_config(hf_dir), device="cpu")
    load_pretrained(model, hf_dir)
    with torch.no_grad():
        want = AutoModelForCausalLM.from_pretrained(hf_dir).eval()(input_ids=ids).logits
        torch.testing.assert_close(model.eval()(input_ids=ids).logits, want, rtol=0, atol=1e-6)

    text = tmp_path / "text"
    text.mkdir()
    for i, source in enumerate(_sources()):
        (text / f"{i}.txt").write_text(source)
    data = prepare(text, tmp_path / "data", tokenizer=hf_dir, val_fraction=0.2, workers=1)
    meta = load_meta(data)
    assert (meta.vocab_size, meta.eos_id) == (len(tokenizer), tokenizer.eos_token_id)
    assert meta.tokenizer.add_bos == TOKENS[family][2]

    overrides = {
        "model.init_from": str(hf_dir),
        "model.seq_len": SEQ,
        "data.vocab_size": "null",
        "train.steps": STEPS,
        "train.val_interval": STEPS,
        "checkpoint.interval": STEPS,
    }
    result = run(load_config(None, tiny_overrides(str(data), tmp_path / "run", **overrides)))
    assert sum(result.losses[-5:]) < sum(result.losses[:5])

    out = tmp_path / "export"
    export(latest(tmp_path / "run"), out)
    config = json.loads((out / "config.json").read_text())
    generation = json.loads((out / "generation_config.json").read_text())
    for values in (config, generation):
        assert (values["bos_token_id"], values["eos_token_id"]) == (meta.bos_id, meta.eos_id)
    exported = AutoTokenizer.from_pretrained(out)
    sample = "class Config:\n    steps: int = 300  # café\n"
    # as the data was tokenized: by the class AutoTokenizer picks for the model directory
    assert exported.encode(sample) == AutoTokenizer.from_pretrained(hf_dir).encode(sample)
    assert exported.decode(exported.encode(sample), skip_special_tokens=True) == sample
    trained = AutoModelForCausalLM.from_pretrained(out)
    assert type(trained) is type(original)
    assert not torch.equal(
        trained.get_input_embeddings().weight, original.get_input_embeddings().weight
    )
    generate = pipeline("text-generation", model=str(out), device="cpu")
    generated = generate("def ", max_new_tokens=8, do_sample=False)[0]["generated_text"]
    assert generated.startswith("def ") and len(generated) > len("def ")

    # srtrain.eval of the export on the run's validation windows: the run's val loss
    settings = {"seq_len": SEQ, "batch_size": 8, "batches": 2}
    [evaluated] = evaluate(hf_source(out, settings), [data], init_distributed("cpu"))
    assert evaluated.loss == pytest.approx(result.val_losses[STEPS], rel=1e-5)
