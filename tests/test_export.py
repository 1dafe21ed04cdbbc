"""Export: checkpoint → Hugging Face directory that transformers loads with the same logits
and a tokenizer that encodes like the run's SentencePiece model."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import sentencepiece as spm
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, pipeline

from srtrain.checkpoint import CHECKPOINTS_DIR, CheckpointManager
from srtrain.data import prepare
from srtrain.export import ExportError, export, main
from srtrain.models import build_model, init_weights
from srtrain.optim import SRAdamW

VOCAB = 512
SEQ = 32
TEXTS = [
    "def foo(x):\n    return x + 42  # café 東京 λx\t\n\nEnd.",
    " leading space",
    "a  b   c",
    "12345 digits",
    "🙂 emoji ☃",
    "",
]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("data") / "builtin"
    return prepare("builtin", out, vocab_size=VOCAB, max_bytes=200_000, val_fraction=0.1)


def _trained(preset: str):
    """A model after two SRAdamW steps, and a token batch."""
    model = build_model(preset, VOCAB, SEQ, device="cpu")
    init_weights(model, 3)
    opt = SRAdamW(model.parameters(), lr=1e-2, m_format="fp8", v_format="fp4_e2m2", backend="torch")
    ids = torch.randint(0, VOCAB, (3, SEQ), generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model, opt, ids


def _checkpoint(run_dir: Path, preset: str, data: Path | None):
    model, opt, ids = _trained(preset)
    with CheckpointManager(run_dir, keep=1, data_dir=data) as manager:
        path = manager.save(2, model, opt, {"step": 2})
    return path, model.eval(), ids


@pytest.mark.parametrize("preset", ["llama-tiny", "neox-tiny"])
def test_exported_model_gives_the_training_logits(tmp_path, data_dir, preset):
    path, model, ids = _checkpoint(tmp_path / "run", preset, data_dir)
    assert main([str(path), str(tmp_path / "hf")]) == 0
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer.model",
        "tokenizer_config.json",
    ]
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert (
        type(hf).__name__
        == {"llama-tiny": "LlamaForCausalLM", "neox-tiny": "GPTNeoXForCausalLM"}[preset]
    )
    assert hf.dtype == torch.float32
    with torch.no_grad():
        want = model(input_ids=ids).logits
        got = hf(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (config["vocab_size"], config["max_position_embeddings"]) == (VOCAB, SEQ)
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (1, 2, 3)
    generation = GenerationConfig.from_pretrained(tmp_path / "hf")
    assert (generation.bos_token_id, generation.eos_token_id, generation.pad_token_id) == (1, 2, 3)
    generate = pipeline("text-generation", model=str(tmp_path / "hf"), device="cpu")
    prompt = "def foo(x):"
    text = generate(prompt, max_new_tokens=5, do_sample=False)[0]["generated_text"]
    assert text.startswith(prompt) and len(text) > len(prompt)


def test_tokenizer_encodes_and_decodes_like_sentencepiece(tmp_path, data_dir):
    copy = Path(shutil.copytree(data_dir, tmp_path / "data"))
    path, _, _ = _checkpoint(tmp_path / "run", "llama-tiny", copy)
    shutil.rmtree(copy)  # export needs only the checkpoint's own copy of the tokenizer
    export(path, tmp_path / "hf")
    sp = spm.SentencePieceProcessor(model_file=str(data_dir / "tokenizer.model"))
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "hf")
    for text in TEXTS:
        ids = tokenizer.encode(text)
        assert ids == sp.encode(text), text
        assert tokenizer.decode(ids) == text == sp.decode(ids)
    assert (tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.unk_token_id) == (2, 3, 0)
    assert tokenizer.model_max_length == SEQ


def test_cast_export_from_a_run_dir_with_the_tokenizer_of_a_data_dir(tmp_path, data_dir):
    _, model, _ = _checkpoint(tmp_path / "run", "llama-tiny", None)
    umask = os.umask(0o027)
    try:  # the run dir's latest checkpoint, which holds no tokenizer
        export(tmp_path / "run", tmp_path / "hf", dtype="bfloat16", tokenizer=data_dir)
    finally:
        os.umask(umask)
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "hf").iterdir()}
    assert modes == {  # 0666 less the umask
        name: 0o640
        for name in (
            "config.json",
            "generation_config.json",
            "model.safetensors",
            "tokenizer.json",
            "tokenizer.model",
            "tokenizer_config.json",
        )
    }
    weights = load_file(tmp_path / "hf" / "model.safetensors")
    for name, p in model.named_parameters():
        assert torch.equal(weights[name], p.detach().to(torch.bfloat16)), name
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert hf.dtype == torch.bfloat16


def test_refusals_are_one_line(tmp_path, capsys):
    path, _, _ = _checkpoint(tmp_path / "run", "llama-tiny", None)
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "file").write_text("x")
    with pytest.raises(SystemExit) as exit_info:
        main([str(path), str(tmp_path / "busy")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "busy exists and is not an empty directory" in err
    with pytest.raises(SystemExit):
        main([str(tmp_path / "nowhere"), str(tmp_path / "out")])
    assert "nowhere' does not exist" in capsys.readouterr().err
    incomplete = Path(shutil.copytree(path, tmp_path / "incomplete"))
    (incomplete / "COMPLETE").unlink()  # a save that never finished
    with pytest.raises(SystemExit):
        main([str(incomplete), str(tmp_path / "out")])
    assert "is neither a complete checkpoint (no COMPLETE marker)" in capsys.readouterr().err
    (path / "__0_0.distcp").write_bytes(b"garbage")
    with pytest.raises(ExportError, match="not supported"):
        export(path, tmp_path / "out", dtype="int8")
    with pytest.raises(SystemExit):
        main([str(path), str(tmp_path / "out")])
    assert "__0_0.distcp has 7 bytes" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    assert [p.name for p in (tmp_path / "run" / CHECKPOINTS_DIR).iterdir()] == ["step-2"]


def _error_line(capsys, argv: list[str]) -> str:
    """The one line a refused export prints; exit code 2."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ")
    return err.removeprefix("error: ").strip()


def test_missing_or_bad_tokenizers_are_one_line_and_write_nothing(tmp_path, data_dir, capsys):
    path, _, _ = _checkpoint(tmp_path / "run", "llama-tiny", None)
    out = str(tmp_path / "out")
    assert _error_line(capsys, [str(path), out]) == (
        f"checkpoint {path} holds no tokenizer and its data dir (none recorded) none either; "
        "pass --tokenizer DATA_DIR (the prepared data the run trained on)"
    )
    message = _error_line(capsys, [str(path), out, "--tokenizer", str(tmp_path / "nowhere")])
    assert message.startswith(f"--tokenizer: no prepared data at {tmp_path / 'nowhere'}")

    garbled = Path(shutil.copytree(data_dir, tmp_path / "garbled"))
    (garbled / "tokenizer.model").write_bytes(b"not a model")
    message = _error_line(capsys, [str(path), out, "--tokenizer", str(garbled)])
    assert message.startswith(f"the tokenizer of data dir {garbled} cannot be read (")

    larger = prepare("builtin", tmp_path / "larger", vocab_size=VOCAB * 2, max_bytes=200_000)
    assert _error_line(capsys, [str(path), out, "--tokenizer", str(larger)]) == (
        f"the tokenizer of data dir {larger} has {VOCAB * 2} tokens, more than the model's "
        f"{VOCAB}: it is not the run's; pass --tokenizer DATA_DIR (the prepared data the run "
        "trained on)"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["garbled", "larger", "run"]


@pytest.mark.slow
def test_module_entry_point(tmp_path, data_dir):
    path, _, _ = _checkpoint(tmp_path / "run", "neox-tiny", data_dir)
    done = subprocess.run(
        [sys.executable, "-m", "srtrain.export", str(path), str(tmp_path / "hf")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"srtrain.export: wrote {tmp_path / 'hf'}"
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "hf").config.model_type == "gpt_neox"
