"""The tokenizer layer: one interface over SentencePiece models and Hugging Face tokenizers.

Every part of srtrain that turns text into token ids, or ids back into text, goes through a
:class:`Tokenizer`:

- ``load_tokenizer(data_dir) -> Tokenizer``: the tokenizer that produced a prepared data
  directory's tokens, loaded from the copy inside it (``srtrain.data.load_tokenizer``).
- ``open_tokenizer(path) -> Tokenizer``: a user's tokenizer, whose kind is decided from the
  path alone: a SentencePiece ``.model`` file, a ``tokenizer.json`` file (the ``tokenizers``
  library), or a transformers tokenizer/model directory (``AutoTokenizer``, local files only,
  never remote code). A path that is none of them raises DataError in one line.

A Tokenizer has:

- ``kind``: ``"sentencepiece"``, ``"tokenizer.json"`` or ``"transformers"``;
- ``files``: the tokenizer's files. For a tokenizer loaded from a data dir they lie inside it:
  ``DATA_DIR/tokenizer.model`` (SentencePiece, loadable by ``SentencePieceProcessor``) or the
  files of ``DATA_DIR/tokenizer/``, a directory that ``AutoTokenizer.from_pretrained`` loads
  (``tokenizer.json`` kinds get a ``tokenizer_config.json`` naming their BOS/EOS there);
- ``vocab_size`` (ids lie in ``[0, vocab_size)``), ``bos_id``, ``eos_id``, ``pad_id``
  (None where the tokenizer has no such token; ``eos_id`` always exists);
- ``add_bos``: whether a document starts with ``bos_id`` (the tokenizer's own special-token
  template prepends it, as Llama-3's ``<|begin_of_text|>``); every document ends with
  ``eos_id`` (Pythia's ``<|endoftext|>``, Llama-3's ``<|end_of_text|>``);
- ``encode_batch(texts) -> list[list[int]]``: the ids of each text, without special tokens;
- ``encoder_spec()``: what :func:`encoder` needs to encode alike in a worker process;
- ``decode(ids) -> str``: the text of ids (special tokens left out).

Training: :func:`train_sentencepiece` and :func:`train_bpe` (byte-level BPE with
``tokenizers``) write a new tokenizer that :func:`open_tokenizer` then loads.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from srtrain.corpus import DataError

SENTENCEPIECE = "sentencepiece"
TOKENIZER_JSON = "tokenizer.json"
TRANSFORMERS = "transformers"
KINDS = (SENTENCEPIECE, TOKENIZER_JSON, TRANSFORMERS)
_BACKEND = "tokenizers-backend"  # an encoder spec: a tokenizers backend's JSON
# Where a data dir holds its tokenizer: the SentencePiece model, or a transformers directory.
SENTENCEPIECE_FILE = "tokenizer.model"
HF_DIR = "tokenizer"
# Files of a transformers tokenizer directory that are copied into a data dir.
HF_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "spiece.model",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
)
# End-of-document token of a byte-level BPE trained here (GPT-NeoX's).
BPE_EOS = "<|endoftext|>"
_TRAIN_LINE_CHARS = 4096

__all__ = [
    "KINDS",
    "Tokenizer",
    "install_tokenizer",
    "load_tokenizer_files",
    "open_tokenizer",
    "tokenizer_kind",
    "train_bpe",
    "train_sentencepiece",
]


class Tokenizer:
    """A loaded tokenizer (see the module docstring for the contract)."""

    kind: str
    files: tuple[Path, ...]
    vocab_size: int
    bos_id: int | None
    eos_id: int
    pad_id: int | None
    unk_id: int | None
    add_bos: bool

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """The ids of each text, without special tokens."""
        raise NotImplementedError

    def decode(self, ids: Sequence[int]) -> str:
        """The text of ``ids``, special tokens left out."""
        raise NotImplementedError

    def encoder_spec(self) -> tuple[str, str]:
        """A small picklable description from which :func:`encoder` rebuilds this
        tokenizer's ``encode_batch`` in another process (without importing transformers where
        the tokenizer has a ``tokenizers`` backend)."""
        raise NotImplementedError

    def record(self) -> dict[str, Any]:
        """The ids of meta.json's tokenizer record."""
        return {
            "vocab_size": self.vocab_size,
            "bos_id": self.bos_id,
            "eos_id": self.eos_id,
            "pad_id": self.pad_id,
            "unk_id": self.unk_id,
            "add_bos": self.add_bos,
        }


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece model; documents get EOS and no BOS."""

    kind = SENTENCEPIECE

    def __init__(self, model_file: Path) -> None:
        import sentencepiece as spm

        try:
            self._sp = spm.SentencePieceProcessor(model_file=str(model_file))
        except (RuntimeError, OSError) as e:
            raise DataError(f"{model_file} is not a SentencePiece model ({_first_line(e)})") from e
        if self._sp.eos_id() < 0:
            raise DataError(f"tokenizer {model_file} defines no EOS piece; one is required")
        self.files = (model_file,)
        self.vocab_size = self._sp.get_piece_size()
        self.bos_id = _optional_id(self._sp.bos_id())
        self.eos_id = self._sp.eos_id()
        self.pad_id = _optional_id(self._sp.pad_id())
        self.unk_id = _optional_id(self._sp.unk_id())
        self.add_bos = False

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return self._sp.encode(list(texts), num_threads=1)

    def decode(self, ids: Sequence[int]) -> str:
        return self._sp.decode([int(i) for i in ids])

    def encoder_spec(self) -> tuple[str, str]:
        return (SENTENCEPIECE, str(self.files[0]))


class HFTokenizer(Tokenizer):
    """A transformers tokenizer (a directory, or a bare tokenizer.json); fast tokenizers
    encode through their ``tokenizers`` backend in one batch call."""

    def __init__(self, kind: str, path: Path) -> None:
        self.kind = kind
        if kind == TOKENIZER_JSON:
            self._tok = _tokenizer_json(path)
            self.files = (path,)
        else:
            self._tok = _auto_tokenizer(path)
            self.files = tuple(path / name for name in _tokenizer_files(path))
        tok = self._tok
        self._backend = getattr(tok, "backend_tokenizer", None)
        self.vocab_size = len(tok)
        self.bos_id = tok.bos_token_id
        self.eos_id = tok.eos_token_id
        self.pad_id = tok.pad_token_id
        self.unk_id = tok.unk_token_id
        if self.eos_id is None:
            raise DataError(
                f"tokenizer {path} names no end-of-document token (eos_token); set eos_token "
                "in its tokenizer_config.json"
            )
        with_special = tok("a", add_special_tokens=True)["input_ids"]
        without = tok("a", add_special_tokens=False)["input_ids"]
        self.add_bos = (
            self.bos_id is not None
            and len(with_special) > len(without)
            and with_special[0] == self.bos_id
        )

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        if self._backend is not None:
            return [
                e.ids for e in self._backend.encode_batch(list(texts), add_special_tokens=False)
            ]
        return self._tok(list(texts), add_special_tokens=False)["input_ids"]

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def encoder_spec(self) -> tuple[str, str]:
        if self._backend is not None:
            return (_BACKEND, self._backend.to_str())
        return (TRANSFORMERS, str(self.files[0].parent))

    def save(self, directory: Path) -> None:
        """Write this tokenizer as a transformers directory (a tokenizer.json kind gets its
        tokenizer_config.json with its BOS/EOS beside the copied file)."""
        directory.mkdir(parents=True, exist_ok=True)
        if self.kind == TOKENIZER_JSON:
            shutil.copyfile(self.files[0], directory / TOKENIZER_JSON)
            config = {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": self._tok.bos_token,
                "eos_token": self._tok.eos_token,
                "pad_token": self._tok.pad_token,
                "unk_token": self._tok.unk_token,
            }
            config = {k: v for k, v in config.items() if v is not None}
            (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
            return
        for file in self.files:
            shutil.copyfile(file, directory / file.name)


def encoder(spec: tuple[str, str]) -> Callable[[Sequence[str]], list[list[int]]]:
    """The ``encode_batch`` of the tokenizer that :meth:`Tokenizer.encoder_spec` described,
    one core only."""
    kind, value = spec
    if kind == _BACKEND:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
        from tokenizers import Tokenizer as RawTokenizer

        raw = RawTokenizer.from_str(value)
        return lambda texts: [
            e.ids for e in raw.encode_batch(list(texts), add_special_tokens=False)
        ]
    if kind == SENTENCEPIECE:
        return SentencePieceTokenizer(Path(value)).encode_batch
    return HFTokenizer(TRANSFORMERS, Path(value)).encode_batch


def _tokenizer_files(directory: Path) -> list[str]:
    """The names of a transformers directory's tokenizer files (its config.json too where
    tokenizer_config.json names no class: AutoTokenizer then finds it from the model)."""
    names = [n for n in HF_TOKENIZER_FILES if (directory / n).is_file()]
    config_file = directory / "tokenizer_config.json"
    if (directory / "config.json").is_file() and (
        not config_file.is_file() or "tokenizer_class" not in _read_json(config_file)
    ):
        names.append("config.json")
    return names


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _optional_id(value: int) -> int | None:
    return value if value >= 0 else None


def _read_json(path: Path) -> dict[str, Any]:
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise DataError(f"{path} is not valid JSON ({_first_line(e)})") from e
    if not isinstance(raw, dict):
        raise DataError(f"{path} is not a JSON object")
    return raw


def _quiet_transformers() -> None:
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")


def _auto_tokenizer(directory: Path) -> Any:
    _quiet_transformers()
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(
            str(directory), local_files_only=True, trust_remote_code=False
        )
    except Exception as e:  # transformers raises OSError, ValueError, KeyError, ...
        raise DataError(
            f"cannot load the transformers tokenizer in {directory} ({_first_line(e)}); "
            "a tokenizer directory holds tokenizer.json or tokenizer.model with "
            "tokenizer_config.json"
        ) from e


def _tokenizer_json(path: Path) -> Any:
    """A PreTrainedTokenizerFast over a bare tokenizer.json, its BOS/EOS read from the file's
    own post-processor template (what it adds around a text) and special tokens."""
    _quiet_transformers()
    from tokenizers import Tokenizer as RawTokenizer
    from transformers import PreTrainedTokenizerFast

    try:
        raw = RawTokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises its own Exception subclass
        raise DataError(f"{path} is not a tokenizers tokenizer.json ({_first_line(e)})") from e
    with_special = raw.encode("a", add_special_tokens=True).ids
    without = raw.encode("a", add_special_tokens=False).ids
    extra = len(with_special) - len(without)
    bos = eos = None
    if extra > 0 and with_special[len(with_special) - len(without) :] == without:
        bos = raw.id_to_token(with_special[0])
    elif extra > 0 and with_special[: len(without)] == without:
        eos = raw.id_to_token(with_special[-1])
    elif extra > 1:
        bos, eos = raw.id_to_token(with_special[0]), raw.id_to_token(with_special[-1])
    specials = [t.content for t in raw.get_added_tokens_decoder().values() if t.special]
    if eos is None:
        if len(specials) != 1:
            raise DataError(
                f"{path} does not say which token ends a document (its special tokens: "
                f"{specials or 'none'}); pass a transformers tokenizer directory whose "
                "tokenizer_config.json names eos_token"
            )
        eos = specials[0]
    return PreTrainedTokenizerFast(tokenizer_object=raw, bos_token=bos, eos_token=eos)


def tokenizer_kind(path: str | os.PathLike[str]) -> str:
    """The kind of the tokenizer at ``path`` (see KINDS); DataError in one line when it is
    none of them. Reads only the path's name and directory listing."""
    path = Path(path)
    if not path.exists():
        raise DataError(
            f"tokenizer {path} not found; --tokenizer takes a SentencePiece .model, a "
            "tokenizer.json or a transformers tokenizer directory"
        )
    if path.is_dir():
        if not any((path / name).is_file() for name in HF_TOKENIZER_FILES):
            raise DataError(
                f"tokenizer directory {path} holds none of "
                f"{', '.join(HF_TOKENIZER_FILES[:5])}, ...; pass a transformers tokenizer "
                "or model directory"
            )
        return TRANSFORMERS
    if path.suffix == ".json":
        return TOKENIZER_JSON
    if path.suffix == ".model":
        return SENTENCEPIECE
    raise DataError(
        f"tokenizer {path} is neither a SentencePiece .model, a tokenizer.json nor a "
        "transformers tokenizer directory"
    )


def open_tokenizer(path: str | os.PathLike[str]) -> Tokenizer:
    """The tokenizer at ``path`` (kind decided by :func:`tokenizer_kind`)."""
    path = Path(path)
    kind = tokenizer_kind(path)
    if kind == SENTENCEPIECE:
        return SentencePieceTokenizer(path)
    return HFTokenizer(kind, path)


def install_tokenizer(tokenizer: Tokenizer, data_dir: Path) -> list[str]:
    """Copy ``tokenizer`` into ``data_dir`` (see the module docstring for where); returns the
    copied files' paths relative to ``data_dir``."""
    if isinstance(tokenizer, SentencePieceTokenizer):
        target = data_dir / SENTENCEPIECE_FILE
        if not target.exists() or not target.samefile(tokenizer.files[0]):
            shutil.copyfile(tokenizer.files[0], target)
        return [SENTENCEPIECE_FILE]
    assert isinstance(tokenizer, HFTokenizer)
    target = data_dir / HF_DIR
    if target.resolve() != tokenizer.files[0].parent.resolve():
        shutil.rmtree(target, ignore_errors=True)
        tokenizer.save(target)
    return sorted(p.relative_to(data_dir).as_posix() for p in target.iterdir() if p.is_file())


def load_tokenizer_files(data_dir: Path, kind: str, files: Iterable[str]) -> Tokenizer:
    """The tokenizer of kind ``kind`` whose ``files`` (relative paths) lie in ``data_dir``."""
    paths = [data_dir / f for f in files]
    if kind == SENTENCEPIECE:
        return SentencePieceTokenizer(paths[0])
    tokenizer = HFTokenizer(TRANSFORMERS, data_dir / HF_DIR)
    tokenizer.kind = kind
    return tokenizer


# ---------------------------------------------------------------- training


def _lines(texts: Iterable[str]) -> Iterator[str]:
    for text in texts:
        for line in text.split("\n"):
            for i in range(0, len(line), _TRAIN_LINE_CHARS):
                yield line[i : i + _TRAIN_LINE_CHARS]


def train_sentencepiece(
    texts: Iterable[str], vocab_size: int, seed: int, model_file: Path, *, threads: int
) -> None:
    """Train a byte-fallback SentencePiece BPE of ``vocab_size`` pieces (unk 0, bos 1, eos 2,
    pad 3, "\\n" a piece of its own) on ``texts`` into ``model_file``, on ``threads``
    threads."""
    import sentencepiece as spm

    spm.set_random_generator_seed(seed)
    try:
        with model_file.open("wb") as writer:
            spm.SentencePieceTrainer.train(
                sentence_iterator=_lines(texts),
                model_writer=writer,
                model_type="bpe",
                vocab_size=vocab_size,
                hard_vocab_limit=False,
                byte_fallback=True,
                character_coverage=0.9999,
                normalization_rule_name="identity",
                remove_extra_whitespaces=False,
                add_dummy_prefix=False,
                allow_whitespace_only_pieces=True,
                split_digits=True,
                user_defined_symbols=["\n"],
                unk_id=0,
                bos_id=1,
                eos_id=2,
                pad_id=3,
                input_sentence_size=0,
                max_sentence_length=4 * _TRAIN_LINE_CHARS,
                num_threads=threads,
                minloglevel=2,
            )
    except RuntimeError as e:
        message = str(e).strip().splitlines()[-1] if str(e).strip() else "unknown error"
        raise DataError(f"tokenizer training failed for vocab_size={vocab_size}: {message}") from e


def train_bpe(texts: Iterable[str], vocab_size: int, directory: Path) -> None:
    """Train a byte-level BPE (GPT-2 style: every byte a token, no unknown token) of
    ``vocab_size`` tokens with ``tokenizers`` on ``texts``, with ``<|endoftext|>`` (id 0) as
    its end-of-document token, into the transformers directory ``directory``."""
    _quiet_transformers()
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    raw = RawTokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + 1:
        raise DataError(
            f"vocab_size={vocab_size} is too small for a byte-level BPE; it needs at least "
            f"{len(alphabet) + 1} (256 bytes and {BPE_EOS})"
        )
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BPE_EOS],
        initial_alphabet=alphabet,
        show_progress=False,
    )
    raw.train_from_iterator(texts, trainer)
    directory.mkdir(parents=True, exist_ok=True)
    raw.save(str(directory / TOKENIZER_JSON))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BPE_EOS,
        "eos_token": BPE_EOS,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
