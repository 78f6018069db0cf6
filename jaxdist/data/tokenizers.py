"""Tokenizers for ``prepare``: bytes (built in), Hugging Face ``tokenizers`` JSON, SentencePiece.

    load_tokenizer(None | "byte")          -> ByteTokenizer (UTF-8 bytes 0..255, EOD 256)
    load_tokenizer("tokenizer.json")       -> Hugging Face tokenizers (pip install tokenizers)
    load_tokenizer("spm.model")            -> SentencePiece (pip install sentencepiece)

Every tokenizer has ``vocab_size`` (ids the model must embed: max id + 1, EOD included),
``eod_id`` (the end-of-document id written after each document), ``encode(text)`` (ids,
no special tokens, no EOD) and ``describe()`` (what goes into the prepared data's
meta.json). The optional libraries are imported only when such a file is used; nothing
is ever downloaded.
"""

from __future__ import annotations

import hashlib
import importlib
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from jaxdist.errors import JaxdistError

# End-of-document candidates in a Hugging Face vocabulary, in order of preference.
HF_EOD_TOKENS = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "[SEP]")
IDS_DTYPE = np.int32  # what encode() returns


class Tokenizer:
    """Base class: text -> int ids. Subclasses set the attributes and implement ``encode``."""

    kind: str = ""
    name: str = ""
    path: str | None = None  # absolute path of the tokenizer file (None: built in)
    vocab_size: int = 0
    eod_id: int = 0

    def encode(self, text: str) -> np.ndarray:
        raise NotImplementedError

    def encode_prompt(self, text: str) -> np.ndarray:
        """Ids of a prompt, with the special tokens the tokenizer adds to one (e.g. a BOS)."""
        return self.encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        raise NotImplementedError

    def encode_with_offsets(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        """``encode``'s ids and each id's [start, end) character span in ``text`` ([n, 2]):
        what tells a chat's assistant tokens from the rest (``jaxdist.data.chat``)."""
        raise NotImplementedError

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """Ids for each text, in order (libraries with a batch API use their threads)."""
        return [self.encode(t) for t in texts]

    def encode_flat(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """All texts' ids concatenated (an integer array) and each text's number of ids (int64)."""
        arrays = self.encode_batch(texts)
        lengths = np.fromiter(map(len, arrays), dtype=np.int64, count=len(arrays))
        return (np.concatenate(arrays) if arrays else np.zeros(0, IDS_DTYPE)), lengths

    def describe(self) -> dict:
        return {
            "kind": self.kind,
            "name": self.name,
            "path": self.path,
            "sha256": file_sha256(self.path) if self.path else None,
            "vocab_size": self.vocab_size,
            "eod_id": self.eod_id,
        }

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, vocab_size={self.vocab_size}, eod_id={self.eod_id})"


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as ids 0..255; EOD is 256."""

    kind = name = "byte"
    vocab_size = 257
    eod_id = 256

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(IDS_DTYPE)

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids if int(i) < 256).decode("utf-8", errors="replace")

    def encode_with_offsets(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        ids = self.encode(text)
        chars = _char_of_each_byte(ids.astype(np.uint8).tobytes())
        return ids, np.stack([chars, chars + 1], axis=1)

    def encode_flat(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        encoded = [t.encode("utf-8") for t in texts]
        lengths = np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded))
        return np.frombuffer(b"".join(encoded), dtype=np.uint8), lengths


class HFTokenizer(Tokenizer):
    """A Hugging Face ``tokenizers`` JSON file (``tokenizer.json``)."""

    kind = "huggingface"

    def __init__(self, path: str):
        tokenizers = _import("tokenizers", "tokenizers")
        try:
            self._tok = tokenizers.Tokenizer.from_file(path)
        except Exception as e:  # the Rust library raises plain Exception
            raise _invalid(path, e) from None
        self.path, self.name = path, f"huggingface:{os.path.basename(path)}"
        ids = self._tok.get_vocab(with_added_tokens=True).values()
        n = max(ids) + 1 if ids else 0
        eod = next((i for i in map(self._tok.token_to_id, HF_EOD_TOKENS) if i is not None), None)
        self.eod_id = n if eod is None else eod
        self.vocab_size = max(n, self.eod_id + 1)

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, dtype=IDS_DTYPE)

    def encode_prompt(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text).ids, dtype=IDS_DTYPE)

    def encode_with_offsets(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        encoding = self._tok.encode(text, add_special_tokens=False)  # offsets in characters
        return np.asarray(encoding.ids, dtype=IDS_DTYPE), np.asarray(encoding.offsets, dtype=np.int64).reshape(-1, 2)

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids])

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        encode = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)  # _fast: no offsets (tokenizers >= 0.20)
        encodings = encode(list(texts), add_special_tokens=False)
        return [np.asarray(e.ids, dtype=IDS_DTYPE) for e in encodings]


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece model file (``*.model``)."""

    kind = "sentencepiece"

    def __init__(self, path: str):
        spm = _import("sentencepiece", "sentencepiece")
        try:
            self._sp = spm.SentencePieceProcessor(model_file=path)
        except Exception as e:
            raise _invalid(path, e) from None
        self.path, self.name = path, f"sentencepiece:{os.path.basename(path)}"
        n = self._sp.get_piece_size()
        eos = self._sp.eos_id()
        self.eod_id = eos if eos >= 0 else n
        self.vocab_size = max(n, self.eod_id + 1)

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._sp.encode(text, out_type=int), dtype=IDS_DTYPE)

    def encode_prompt(self, text: str) -> np.ndarray:
        bos = [self._sp.bos_id()] if self._sp.bos_id() >= 0 else []
        return np.asarray(bos + self._sp.encode(text, out_type=int), dtype=IDS_DTYPE)

    def encode_with_offsets(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        try:
            pieces = self._sp.encode(text, return_type="proto").pieces
        except TypeError:  # sentencepiece < 0.2.1 names it otherwise
            pieces = self._sp.encode(text, out_type="immutable_proto").pieces
        chars = np.append(_char_of_each_byte(text.encode("utf-8")), len(text))  # its offsets are in UTF-8 bytes
        spans = np.asarray([(p.begin, p.end) for p in pieces], dtype=np.int64).reshape(-1, 2)
        return np.asarray([p.id for p in pieces], dtype=IDS_DTYPE), chars[spans]

    def decode(self, ids: Sequence[int]) -> str:
        return self._sp.decode([int(i) for i in ids])

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [np.asarray(ids, dtype=IDS_DTYPE) for ids in self._sp.encode(list(texts), out_type=int)]


def load_tokenizer(path: str | os.PathLike | None) -> Tokenizer:
    """``None``/``"byte"``: bytes; ``*.json``: Hugging Face tokenizers; ``*.model``: SentencePiece."""
    if path is None or str(path) == "byte":
        return ByteTokenizer()
    path = os.path.abspath(os.path.expanduser(str(path)))
    suffix = Path(path).suffix.lower()
    if suffix not in (".json", ".model"):
        raise JaxdistError(
            f"invalid tokenizer file {path}: expected 'byte', a Hugging Face tokenizers .json or a SentencePiece .model file"
        )
    if not os.path.isfile(path):
        raise JaxdistError(f"invalid tokenizer file {path}: {'is a directory' if os.path.isdir(path) else 'no such file'}")
    return HFTokenizer(path) if suffix == ".json" else SentencePieceTokenizer(path)


def _import(module: str, package: str):
    try:
        return importlib.import_module(module)
    except ImportError:
        raise JaxdistError(f"this tokenizer needs the '{package}' package: pip install {package}") from None


def _invalid(path: str, error: Exception) -> JaxdistError:
    message = " ".join(str(error).split()) or type(error).__name__
    return JaxdistError(f"invalid tokenizer file {path}: {message[:300]}")


def _char_of_each_byte(data: bytes) -> np.ndarray:
    """For each byte of UTF-8 ``data``, the index of the character it belongs to."""
    starts_char = (np.frombuffer(data, dtype=np.uint8) & 0xC0) != 0x80  # continuation bytes are 10xxxxxx
    return np.cumsum(starts_char, dtype=np.int64) - 1


def file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()
