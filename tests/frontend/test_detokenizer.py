"""Incremental detokenization with byte-level BPE and SentencePiece-style tokenizers."""
from __future__ import annotations

import json
from typing import Sequence

import pytest
from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models, pre_tokenizers, trainers

from ninfer.engine.frontend.detokenizer import IncrementalDetokenizer
from ninfer.engine.frontend.hf_tokenizer import HFTokenizer
from ninfer.engine.frontend.tokenizer import Tokenizer

CORPUS = [
    "Hello world, this is a tiny corpus for a tiny tokenizer.",
    "你好，世界！今天天气很好。我们去公园吧。",
    "Emoji 👩‍💻 🇫🇷 😀 🤖 are fun to tokenize",
    "def f(x):\n    return x + 1",
    "café naïve résumé",
] * 4
TEXTS = [
    "Hello world! 你好，世界。 👩‍💻 🇫🇷 😀👍🏽",
    "unseen 日本語 and 한국어 text ✓ with new words",
    "def g(y):\n    return y * 2  # 🤖<eos>after",
    "  leading spaces and trailing  ",
]


def byte_level_bpe() -> HFTokenizer:
    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=["<eos>"]
    )
    backend.train_from_iterator(CORPUS, trainer)
    return HFTokenizer(backend, eos_token="<eos>")


def sentencepiece_style(byte_fallback: bool) -> HFTokenizer:
    """Metaspace ("▁" marks a space; the first one is dropped on decode), optionally byte fallback."""
    backend = Backend(models.BPE(byte_fallback=byte_fallback))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=400, limit_alphabet=60, special_tokens=["<unk>", "<eos>"])
    backend.train_from_iterator(CORPUS, trainer)
    data = json.loads(backend.to_str())
    vocab = data["model"]["vocab"]
    data["model"]["unk_token"] = "<unk>"
    if byte_fallback:  # Llama-style: <0xE4> tokens and a decoder that fuses them back into text
        for b in range(256):
            vocab.setdefault(f"<0x{b:02X}>", len(vocab))
        data["decoder"] = {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
            {"type": "ByteFallback"}, {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 1, "stop": 0},
        ]}
    else:
        data["decoder"] = {
            "type": "Metaspace", "replacement": "▁", "prepend_scheme": "always", "split": True
        }
    return HFTokenizer(Backend.from_str(json.dumps(data)), eos_token="<eos>")


TOKENIZERS = {
    "byte_level": byte_level_bpe,
    "metaspace_bytes": lambda: sentencepiece_style(True),
    "metaspace": lambda: sentencepiece_style(False),
}


@pytest.fixture(scope="module", params=sorted(TOKENIZERS))
def tok(request: pytest.FixtureRequest) -> HFTokenizer:
    return TOKENIZERS[request.param]()


def stream(tok: Tokenizer, ids: Sequence[int], prompt: Sequence[int] = ()) -> list[str]:
    detok = IncrementalDetokenizer(tok, prompt)
    return [detok.push(i) for i in ids] + [detok.flush()]


@pytest.mark.parametrize("text", TEXTS)
def test_pieces_are_whole_characters_and_join_to_decode(tok: HFTokenizer, text: str) -> None:
    ids = tok.encode(text)
    expected = tok.decode(ids)
    pieces = stream(tok, ids)
    assert "".join(pieces) == expected
    if "\ufffd" not in expected:
        assert all("\ufffd" not in p for p in pieces)


def test_split_characters_are_held_back(tok: HFTokenizer) -> None:
    text = "a 日本語 👋🏽 你好"  # characters outside the training corpus
    if "<unk>" in tok.decode(tok.encode(text)):
        pytest.skip("no byte tokens in this vocabulary")
    ids = tok.encode(text)
    assert any("\ufffd" in tok.decode([i]) for i in ids)  # the hold-back path really runs
    detok = IncrementalDetokenizer(tok)
    held = False
    for i in ids:
        piece = detok.push(i)
        held = held or (piece == "" and detok.pending > 0)
        assert "\ufffd" not in piece
    assert held
    assert detok.flush() == ""


def test_prompt_context_keeps_leading_space(tok: HFTokenizer) -> None:
    prompt = tok.encode("Hello")
    ids = tok.encode("Hello world 你好")[len(prompt):]
    assert tok.encode("Hello") + ids == tok.encode("Hello world 你好")
    text = "".join(stream(tok, ids, prompt))
    assert text == " world 你好"


def test_special_tokens_pass_through(tok: HFTokenizer) -> None:
    eos = tok.eos_token_id
    assert eos is not None
    ids = tok.encode("done") + [eos]
    assert "".join(stream(tok, ids)) == tok.decode(ids)
    assert tok.decode(ids).endswith("<eos>")


def byte_token(tok: HFTokenizer, b: int) -> int:
    """The id of the single-byte token for byte ``b`` in a ByteLevel vocabulary."""
    found = tok.token_to_id(_bytes_to_unicode()[b])
    assert found is not None
    return found


def _bytes_to_unicode() -> dict[int, str]:
    """The GPT-2 byte -> printable character table used by the ByteLevel pre-tokenizer."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def test_flush_releases_genuinely_invalid_bytes() -> None:
    tok = byte_level_bpe()
    detok = IncrementalDetokenizer(tok)
    assert "".join(detok.push(i) for i in tok.encode("ok")) == "ok"
    assert detok.push(byte_token(tok, 0xE4)) == ""  # the first byte of a 3-byte character
    assert detok.push(byte_token(tok, 0xBD)) == ""
    assert detok.pending == 2
    assert detok.flush() == "\ufffd"  # never completed: one replacement for the broken sequence
    assert detok.flush() == ""


def test_long_invalid_run_is_released_in_bounded_chunks() -> None:
    tok = byte_level_bpe()
    bad = [byte_token(tok, 0xFF)] * 40
    tail = tok.encode("fine 你好")
    ids = bad + tail
    detok = IncrementalDetokenizer(tok)
    pieces, max_pending = [], 0
    for i in ids:
        pieces.append(detok.push(i))
        max_pending = max(max_pending, detok.pending)
    pieces.append(detok.flush())
    assert "".join(pieces) == tok.decode(ids)
    assert max_pending <= 10  # invalid bytes do not pile up until the end
    assert "".join(pieces[:40]).count("\ufffd") >= 30


class CountingTokenizer(Tokenizer):
    """Wraps a tokenizer and records how many ids each decode call received."""

    def __init__(self, inner: Tokenizer) -> None:
        self.inner, self.sizes = inner, []

    @property
    def vocab_size(self) -> int:
        return self.inner.vocab_size

    def encode(self, text: str) -> list[int]:
        return self.inner.encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        self.sizes.append(len(ids))
        return self.inner.decode(ids)

    def token_to_id(self, token: str) -> int | None:
        return self.inner.token_to_id(token)


def test_cost_per_token_is_constant() -> None:
    counting = CountingTokenizer(byte_level_bpe())
    ids = counting.encode(" ".join(TEXTS) * 20)
    prompt = counting.encode("a long prompt " * 50)
    pieces = stream(counting, ids, prompt)
    assert "".join(pieces) == counting.inner.decode(ids)
    assert max(counting.sizes) <= 16
    assert len(counting.sizes) <= 3 * len(ids) + 2
