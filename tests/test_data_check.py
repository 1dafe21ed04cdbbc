"""Shard verification before training: checksums, token range, the cache, and the one-line
refusal on every rank and through ./train."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch.multiprocessing as mp
from transformers import GPTNeoXConfig, LlamaConfig, LlamaForCausalLM

from srtrain import data_check
from srtrain.data import BatchLoader, DataError, DataMeta, TokenData, load_meta
from srtrain.data_check import CACHE_FILE, check_model_vocabulary, verify_data

from conftest import TINY_DATA, tiny_overrides
from distributed import free_port, set_worker_env

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def data(tiny_data: str, tmp_path: Path) -> Path:
    """A private copy of the tiny corpus (new inodes: nothing in it is remembered)."""
    return Path(
        shutil.copytree(tiny_data, tmp_path / "builtin", ignore=shutil.ignore_patterns(CACHE_FILE))
    )


@pytest.fixture
def scans(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The shard files that verification reads, in order."""
    seen: list[str] = []
    real = data_check._scan

    def spy(path: Path, dtype: str) -> tuple[str, int]:
        seen.append(path.name)
        return real(path, dtype)

    monkeypatch.setattr(data_check, "_scan", spy)
    return seen


def _again(data: Path) -> str:
    return (
        f"prepare the data again: python -m srtrain.data prepare --source builtin --out {data}"
        f" --vocab-size {TINY_DATA['data.vocab_size']} --val-fraction "
        f"{TINY_DATA['data.val_fraction']} --max-bytes {TINY_DATA['data.max_bytes']} "
        "--overwrite"
    )


def _checksum_error(data: Path, shard: str) -> str:
    return (
        f"data shard {data / shard} does not match its checksum in {data / 'meta.json'} "
        f"(corrupted or changed after preparation); {_again(data)}"
    )


def _flip_byte(path: Path, index: int = 100) -> bytes:
    """Flip one bit of the file in place (same size); returns the original bytes."""
    original = path.read_bytes()
    with path.open("r+b") as f:
        f.seek(index)
        f.write(bytes([original[index] ^ 1]))
    return original


def _one_line(error: pytest.ExceptionInfo[BaseException]) -> str:
    message = str(error.value)
    assert "\n" not in message
    return message


def test_verification_is_remembered_until_a_shard_changes(data: Path, scans: list[str]) -> None:
    meta = load_meta(data)
    train, val = (meta.splits[s].shards[0].file for s in ("train", "val"))
    assert verify_data(meta) == data_check.Verification((train, val), ())
    cache = json.loads((data / CACHE_FILE).read_text())
    assert cache["shards"][train]["sha256"] == meta.splits["train"].shards[0].sha256
    assert cache["shards"][train]["max_id"] == TINY_DATA["data.vocab_size"] - 1
    assert verify_data(meta) == data_check.Verification((), (train, val))
    assert sorted(scans) == sorted([train, val])  # read on threads, in any order

    stat = (data / train).stat()
    os.utime(data / train, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))
    assert verify_data(meta) == data_check.Verification((train,), (val,))
    (data / "copy.bin").write_bytes((data / val).read_bytes())
    os.replace(data / "copy.bin", data / val)  # same bytes, another inode
    assert verify_data(meta) == data_check.Verification((val,), (train,))
    assert sorted(scans) == sorted([train, val, train, val])  # read on threads, in any order

    # corrupted in place with size and mtime kept: the ctime still gives it away
    stat = (data / val).stat()
    original = _flip_byte(data / val)
    os.utime(data / val, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    with pytest.raises(DataError) as error:
        verify_data(meta)
    assert _one_line(error) == _checksum_error(data, val)
    with pytest.raises(DataError):  # a failed pass is not remembered
        verify_data(meta)
    (data / val).write_bytes(original)
    assert verify_data(meta) == data_check.Verification((val,), (train,))
    assert sorted(scans) == sorted([train, val, train, val, val, val, val])


def test_shards_read_on_threads_name_the_first_bad_one(tmp_path: Path, tiny_data: str) -> None:
    """Many shards read on 1 and 4 threads: the same verdicts; with two shards corrupted the
    error names the first in meta.json's order, and the passes before it are remembered."""
    from srtrain.data import prepare

    tokenizer = Path(tiny_data) / "tokenizer.model"
    data = prepare(
        "builtin", tmp_path / "many", tokenizer=tokenizer, max_bytes=400_000, shard_tokens=4_000
    )
    meta = load_meta(data)
    names = tuple(s.file for split in meta.splits.values() for s in split.shards)
    assert len(names) >= 8
    assert verify_data(meta, threads=4) == data_check.Verification(names, ())
    (data / CACHE_FILE).unlink()
    assert verify_data(meta, threads=1) == data_check.Verification(names, ())
    (data / CACHE_FILE).unlink()
    third, last = names[2], names[-2]
    _flip_byte(data / third)
    _flip_byte(data / last)
    for threads in (4, 1):
        with pytest.raises(DataError) as error:
            verify_data(meta, threads=threads)
        assert _one_line(error).startswith(f"data shard {data / third} does not match")
    remembered = json.loads((data / CACHE_FILE).read_text())["shards"]
    assert sorted(remembered) == sorted(names[:2])
    with pytest.raises(ValueError, match="at least one thread"):
        verify_data(meta, threads=0)


def test_cache_falls_back_to_the_run_dir(data: Path, tmp_path: Path, scans: list[str]) -> None:
    (data / CACHE_FILE).mkdir()  # the data dir's cache cannot be written
    meta = load_meta(data)
    names = tuple(meta.splits[s].shards[0].file for s in ("train", "val"))
    assert verify_data(meta).hashed == names
    assert verify_data(meta).hashed == names  # nowhere to remember: read again
    run_dir = tmp_path / "run"
    assert verify_data(meta, fallback_dir=run_dir).hashed == names
    assert verify_data(meta, fallback_dir=run_dir) == data_check.Verification((), names)
    assert [p.name for p in run_dir.iterdir()] == [data_check.cache_files(data, run_dir)[1].name]
    assert sorted(p.name for p in data.iterdir() if p.name.startswith(".")) == [CACHE_FILE]
    assert len(scans) == 6


def test_token_id_outside_the_vocabulary(data: Path, scans: list[str]) -> None:
    """A shard whose checksum matches (meta.json was updated) but holds id == vocab_size."""
    vocab = TINY_DATA["data.vocab_size"]
    meta = load_meta(data)
    val = meta.splits["val"].shards[0].file
    tokens = np.fromfile(data / val, dtype=meta.dtype)
    tokens[70] = vocab
    tokens.tofile(data / val)
    raw = json.loads((data / "meta.json").read_text())
    raw["splits"]["val"]["shards"][0]["sha256"] = data_check._scan(data / val, meta.dtype)[0]
    (data / "meta.json").write_text(json.dumps(raw))
    meta = load_meta(data, verify=True)  # the checksum alone cannot catch it
    scans.clear()

    expected = (
        f"data shard {data / val} holds token id {vocab}, outside the vocabulary of "
        f"{vocab} tokens in {data / 'meta.json'}; {_again(data)}"
    )
    for _ in range(2):  # the second time from the remembered largest id
        with pytest.raises(DataError) as error:
            verify_data(meta)
        assert _one_line(error) == expected
    assert scans == [meta.splits["train"].shards[0].file, val]
    # loaders refuse it too, so the id can never reach an embedding
    with pytest.raises(DataError) as error:
        TokenData(data, "val").read(64, 16)
    assert _one_line(error) == expected
    loader = BatchLoader(data, "val", global_batch_size=4, seq_len=64)
    with pytest.raises(DataError) as error:
        list(loader.val_batches())
    assert _one_line(error) == expected
    assert TokenData(data, "val").read(71, 200).max() < vocab


def _run_train(overrides: list[str]) -> subprocess.CompletedProcess:
    """``./train`` with ``overrides`` in a process of its own; its output captured."""
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"), OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, str(REPO / "train"), *overrides],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )


def _worker(rank: int, world: int, port: int, overrides: list[str], out: str) -> None:
    set_worker_env(rank, world, port, OMP_NUM_THREADS="1")
    import torch.distributed as dist

    from srtrain.config import load_config
    from srtrain.errors import user_message
    from srtrain.trainer import run

    try:
        run(load_config(None, overrides))
        outcome = "trained"
    except Exception as err:  # the data error, or the other ranks' report of it
        outcome = f"{type(err).__name__}: {user_message(err)}"
    Path(f"{out}.{rank}").write_text(outcome)
    dist.barrier()  # every rank ends together (errors are agreed): no teardown race
    dist.destroy_process_group()


@pytest.mark.slow
def test_corrupted_shard_stops_training_on_every_rank_and_in_train(
    data: Path, tmp_path: Path
) -> None:
    """Local rank 0 verifies and raises the flipped byte's one line; the other rank raises it
    as rank 0's; the ./train command prints that line and exits with 2."""
    shard = load_meta(data).splits["train"].shards[0].file
    _flip_byte(data / shard)
    expected = _checksum_error(data, shard)
    overrides = tiny_overrides(str(data), tmp_path / "run", **{"train.steps": 2})
    out = tmp_path / "outcome"
    mp.spawn(_worker, args=(2, free_port(), overrides, str(out)), nprocs=2, join=True)
    assert [Path(f"{out}.{r}").read_text() for r in range(2)] == [
        f"DataError: {expected}",
        f"RankFailedError: {expected} (on rank 0)",
    ]

    proc = _run_train(overrides)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == f"error: {expected}\n"


# ---------------------------------------------------------------- tokenizer against the model


def _meta_with(data: Path, **changes: object) -> DataMeta:
    meta = load_meta(data)
    return dataclasses.replace(meta, **changes)


def test_model_vocabulary_check_compares_special_ids(tiny_data: str) -> None:
    meta = load_meta(tiny_data)  # SentencePiece: eos 2, bos 1 not written into documents
    assert (meta.eos_id, meta.tokenizer.add_bos) == (2, False)
    shape = dict(hidden_size=32, num_attention_heads=4, num_hidden_layers=1)
    # a padded embedding, and a BOS the data does not carry, both fit
    check_model_vocabulary(
        meta, GPTNeoXConfig(vocab_size=1024, bos_token_id=0, eos_token_id=2, **shape), "m"
    )
    check_model_vocabulary(meta, LlamaConfig(vocab_size=512, eos_token_id=[7, 2], **shape), "m")
    with pytest.raises(DataError) as error:
        check_model_vocabulary(
            meta, GPTNeoXConfig(vocab_size=512, eos_token_id=0, **shape), "hf/pythia"
        )
    assert str(error.value) == (
        f"{meta.data_dir} ends documents with token 2, model.init_from hf/pythia has "
        "eos_token_id 0: another tokenizer; prepare the data with the model's tokenizer: "
        "python -m srtrain.data prepare --tokenizer hf/pythia --source ... --out ..."
    )
    with_bos = _meta_with(
        Path(tiny_data), tokenizer=dataclasses.replace(meta.tokenizer, add_bos=True)
    )
    check_model_vocabulary(with_bos, LlamaConfig(vocab_size=512, bos_token_id=1, **shape), "m")
    with pytest.raises(
        DataError, match=r"starts documents with token 1, model\.init_from m has bos_token_id 5"
    ):
        check_model_vocabulary(with_bos, LlamaConfig(vocab_size=512, bos_token_id=5, **shape), "m")


@pytest.mark.slow
def test_train_refuses_data_of_another_tokenizer(tiny_data: str, tmp_path: Path) -> None:
    """A model whose EOS is not the data's stops ./train before step 1 in one line."""
    config = LlamaConfig(
        vocab_size=TINY_DATA["data.vocab_size"],
        hidden_size=32,
        intermediate_size=48,
        num_attention_heads=4,
        num_hidden_layers=1,
        eos_token_id=0,
    )
    LlamaForCausalLM(config).save_pretrained(tmp_path / "hf")
    overrides = tiny_overrides(
        tiny_data, tmp_path / "run", **{"train.steps": 2, "model.init_from": str(tmp_path / "hf")}
    )
    proc = _run_train(overrides)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith(
        f"error: {tiny_data} ends documents with token 2, model.init_from {tmp_path / 'hf'} "
        "has eos_token_id 0"
    )
    assert proc.stderr.count("\n") == 1
    assert "step 1" not in proc.stdout
