"""Data preparation with Hugging Face tokenizers (tokenizer.json, transformers directories),
byte-level BPE training, wide vocabularies, and the one tokenizer interface."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from srtrain.console import Ticker
from srtrain.data import DataError, TokenData, load_meta, load_tokenizer, prepare

BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"


def _texts(count: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    words = ["alpha", "beta", "gamma", "naïve", "café", "東京", "λx", "  ", "\t", "42", "def"]
    return [
        f"doc {i}\n" + "\n".join(" ".join(rng.choice(words, size=8)) for _ in range(4)) + "\n"
        for i in range(count)
    ]


def _jsonl(path: Path, docs: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
    return path


def _byte_bpe(specials: list[str], vocab_size: int = 400) -> RawTokenizer:
    raw = RawTokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    raw.train_from_iterator(_texts(200, seed=1), trainer)
    return raw


@pytest.fixture(scope="module")
def llama3_style(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A transformers directory whose template prepends BOS (as Llama-3's does)."""
    raw = _byte_bpe([BOS, EOS])
    raw.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", special_tokens=[(BOS, raw.token_to_id(BOS))]
    )
    out = tmp_path_factory.mktemp("llama3") / "tok"
    PreTrainedTokenizerFast(tokenizer_object=raw, bos_token=BOS, eos_token=EOS).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def neox_json(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A bare tokenizer.json with one special token (GPT-NeoX's end of text)."""
    out = tmp_path_factory.mktemp("neox") / "tokenizer.json"
    _byte_bpe(["<|endoftext|>"]).save(str(out))
    return out


def _documents(data_dir: Path, split: str) -> list[list[int]]:
    meta = load_meta(data_dir)
    data = TokenData(data_dir, split)
    tokens = data.read(0, len(data)).tolist()
    docs, current = [], []
    for token in tokens:
        current.append(token)
        if token == meta.eos_id:
            docs.append(current)
            current = []
    assert current == []
    return docs


def test_transformers_dir_adds_its_bos_and_eos(llama3_style: Path, tmp_path: Path) -> None:
    docs = _texts(40, seed=2)
    out = prepare(_jsonl(tmp_path / "rows.jsonl", docs), tmp_path / "out", tokenizer=llama3_style)
    meta = load_meta(out, verify=True)
    hf = AutoTokenizer.from_pretrained(llama3_style, local_files_only=True)
    assert (meta.bos_id, meta.eos_id) == (
        hf.convert_tokens_to_ids(BOS),
        hf.convert_tokens_to_ids(EOS),
    )
    assert meta.tokenizer.kind == "transformers" and meta.tokenizer.add_bos
    assert meta.vocab_size == len(hf) and meta.dtype == "uint16"
    for file, sha in meta.tokenizer.files.items():
        assert file.startswith("tokenizer/")
        assert hashlib.sha256((out / file).read_bytes()).hexdigest() == sha
    # every document is BOS + the tokenizer's own ids + EOS, in source order
    got = _documents(out, "train") + _documents(out, "val")
    assert len(got) == len(docs)
    expected = {tuple(hf(d)["input_ids"] + [meta.eos_id]) for d in docs}
    assert {tuple(d) for d in got} == expected
    # the data dir's copy loads by itself, through the interface and through AutoTokenizer
    tok = load_tokenizer(out)
    assert (tok.kind, tok.vocab_size, tok.bos_id, tok.eos_id) == (
        "transformers",
        meta.vocab_size,
        meta.bos_id,
        meta.eos_id,
    )
    assert all(f.is_relative_to(out) for f in tok.files)
    copy = AutoTokenizer.from_pretrained(tok.files[0].parent, local_files_only=True)
    assert copy(docs[0])["input_ids"] == hf(docs[0])["input_ids"]
    assert tok.decode(got[0]) in docs


def test_tokenizer_json_ends_documents_with_its_special_token(
    neox_json: Path, tmp_path: Path
) -> None:
    docs = _texts(30, seed=3)
    out = prepare(_jsonl(tmp_path / "rows.jsonl", docs), tmp_path / "out", tokenizer=neox_json)
    meta = load_meta(out)
    raw = RawTokenizer.from_file(str(neox_json))
    assert meta.eos_id == raw.token_to_id("<|endoftext|>") and not meta.tokenizer.add_bos
    assert meta.tokenizer.kind == "tokenizer.json"
    assert (out / "tokenizer" / "tokenizer.json").read_bytes() == neox_json.read_bytes()
    tok = load_tokenizer(out)
    decoded = sorted(tok.decode(d) for d in _documents(out, "train") + _documents(out, "val"))
    assert decoded == sorted(docs)
    hf = AutoTokenizer.from_pretrained(out / "tokenizer", local_files_only=True)
    assert hf.eos_token == "<|endoftext|>"


def test_wide_vocabulary_is_stored_as_uint32(tmp_path: Path) -> None:
    vocab = {"[UNK]": 0, "<eos>": 1, **{f"w{i}": i + 2 for i in range(70_000)}}
    raw = RawTokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    raw.add_special_tokens(["<eos>"])
    raw.save(str(tmp_path / "tokenizer.json"))
    docs = [" ".join(f"w{(i * 7919 + j * 104729) % 70_000}" for j in range(50)) for i in range(20)]
    out = prepare(
        _jsonl(tmp_path / "rows.jsonl", docs),
        tmp_path / "out",
        tokenizer=tmp_path / "tokenizer.json",
        val_fraction=0,
    )
    meta = load_meta(out, verify=True)
    assert meta.dtype == "uint32" and meta.vocab_size == 70_002
    data = TokenData(out, "train")
    tokens = data.read(0, len(data))
    assert tokens.max() > 65_535
    expected = [vocab[w] for d in docs for w in [*d.split(), "<eos>"]]
    assert tokens.tolist() == expected


def test_bad_tokenizer_fails_before_the_source_is_read(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    (tmp_path / "notes.txt").write_text("hello")
    (tmp_path / "broken.json").write_text("{not json")
    cases = {
        tmp_path / "gone.model": "not found",
        tmp_path / "empty": "holds none of tokenizer.json",
        tmp_path / "notes.txt": "is neither a SentencePiece .model",
        tmp_path / "broken.json": "is not a tokenizers tokenizer.json",
    }
    for path, message in cases.items():
        # the source does not exist either: the tokenizer is what is reported
        with pytest.raises(DataError) as error:
            prepare(tmp_path / "gone.jsonl", tmp_path / "out", tokenizer=path)
        assert message in str(error.value) and "\n" not in str(error.value)
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "srtrain.data",
            "prepare",
            "--source",
            "builtin",
            "--out",
            str(tmp_path / "o"),
            "--tokenizer",
            str(tmp_path / "empty"),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.startswith(f"error: tokenizer directory {tmp_path / 'empty'} holds none")
    assert bad.stderr.count("\n") == 1


def test_byte_level_bpe_is_trained_on_a_bounded_sample(tmp_path: Path) -> None:
    docs = _texts(300, seed=4)
    source = _jsonl(tmp_path / "rows.jsonl", docs)
    lines: list[str] = []
    out = prepare(
        source,
        tmp_path / "out",
        tokenizer_kind="bpe",
        vocab_size=500,
        tokenizer_sample_bytes=10_000,
        progress=Ticker(lines.append, every_s=3600),
    )
    meta = load_meta(out)
    # a small sample runs out of merges before 500 tokens
    assert meta.tokenizer.kind == "transformers" and 257 < meta.vocab_size <= 500
    assert meta.prepare["tokenizer_kind"] == "bpe"
    sampled = next(line for line in lines if line.startswith("data: sampled "))
    taken = float(sampled.split()[2]) * 1e6
    assert 9_000 <= taken <= 10_000 or sampled.startswith("data: sampled 0.0 MB")
    assert " of train text (" in sampled and "documents) for the tokenizer" in sampled
    tok = load_tokenizer(out)
    decoded = sorted(tok.decode(d) for d in _documents(out, "train") + _documents(out, "val"))
    assert decoded == sorted(docs)
    again = prepare(
        source,
        tmp_path / "again",
        tokenizer_kind="bpe",
        vocab_size=500,
        tokenizer_sample_bytes=10_000,
    )
    for file in meta.tokenizer.files:
        assert (out / file).read_bytes() == (again / file).read_bytes()


def test_model_directory_gives_only_its_tokenizer_files(tmp_path: Path) -> None:
    """A downloaded model directory (weights, config.json, tokenizer) as --tokenizer: the
    data dir gets the tokenizer's files, not the weights."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    raw = _byte_bpe(["<|endoftext|>"])
    model_dir = tmp_path / "pythia-tiny"
    eos = "<|endoftext|>"
    PreTrainedTokenizerFast(tokenizer_object=raw, bos_token=eos, eos_token=eos).save_pretrained(
        model_dir
    )
    config = GPTNeoXConfig(
        vocab_size=512, hidden_size=32, num_attention_heads=4, num_hidden_layers=1
    )
    GPTNeoXForCausalLM(config).save_pretrained(model_dir)
    docs = _texts(20, seed=9)
    out = prepare(_jsonl(tmp_path / "rows.jsonl", docs), tmp_path / "out", tokenizer=model_dir)
    meta = load_meta(out)
    assert sorted(meta.tokenizer.files) == [
        "tokenizer/tokenizer.json",
        "tokenizer/tokenizer_config.json",
    ]
    assert meta.tokenizer.source == str(model_dir) and not meta.tokenizer.add_bos
    assert meta.eos_id == raw.token_to_id(eos)
    assert [f.name for f in load_tokenizer(out).files] == [
        "tokenizer.json",
        "tokenizer_config.json",
    ]
