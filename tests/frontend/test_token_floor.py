"""``Tokenizer.min_tokens``: a token count found without tokenizing, never above the real one, and
exact for the tokenizer's longest token; no floor where the pipeline may drop or shrink text; and
an HF tokenizer's encode lets other threads run while it works on a long text."""
from __future__ import annotations

import random
import threading
import time

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers

from ninfer.engine.frontend.hf_tokenizer import HFTokenizer
from ninfer.engine.frontend.qwen_tiktoken import load_qwen_tiktoken
from ninfer.engine.loader import load_checkpoint
from ninfer.engine.loader.embedded import EmbeddedModelMissing, embedded_model_path
from support.tiny import longest_token_text, train_tokenizer

PIECES = ["the", " quick", " brown", "fox", "12345", "9", " ", "   ", "\n", "\n\n    ", "\t", ",", ";", "!!",
          "你好", "世界", "😀", "🚀", "é", "e\u0301", "\u1100\u1161\u11a8", "한국어", "Ω", "\u2126",
          "<|im_end|>", "<|im_start|>", "<think>", "</think>", "<|endoftext|>", "#" * 80, " " * 200, "-" * 64,
          "\ue000"]


@pytest.fixture(scope="module")
def smollm2():
    try:
        return load_checkpoint(str(embedded_model_path())).tokenizer
    except EmbeddedModelMissing as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="module", params=["smollm2", "qwen", "tiny"])
def tokenizer(request):
    if request.param == "smollm2":
        return request.getfixturevalue("smollm2")
    if request.param == "qwen":
        return load_qwen_tiktoken("qwen3.6")
    return HFTokenizer(train_tokenizer(), eos_token="<|im_end|>")


def test_the_floor_never_exceeds_the_count(tokenizer):
    rng = random.Random(7)
    for _ in range(300):
        text = "".join(rng.choice(PIECES) for _ in range(rng.randint(1, 60)))
        assert 0 < tokenizer.min_tokens(text) <= len(tokenizer.encode(text)), repr(text)
    assert tokenizer.min_tokens("") == 0


def test_the_floor_is_exact_for_the_longest_token(tokenizer):
    longest = longest_token_text(tokenizer)
    assert len(longest.encode()) == tokenizer.max_token_bytes
    for k in (1, 2, 7, 300):
        assert len(tokenizer.encode(longest * k)) == k
        assert tokenizer.min_tokens(longest * k) == k
        assert tokenizer.min_tokens(longest * k + "a") == k + 1  # one byte more needs one token more


def test_nfc_shortening_is_counted_for_qwen():
    qwen = load_qwen_tiktoken("qwen3.6")
    decomposed = "\u1100\u1161\u11a8" * 1000  # 9 bytes each, one 3-byte syllable after NFC
    assert qwen.min_tokens(decomposed) <= len(qwen.encode(decomposed))
    assert qwen.min_tokens(decomposed) == -(-3000 // qwen.max_token_bytes)


def _bpe(**parts) -> Tokenizer:
    tok = Tokenizer(models.BPE(vocab={"a": 0, "b": 1, "c": 2, "ab": 3, " ": 4, "▁": 5}, merges=[("a", "b")]))
    for name, value in parts.items():
        setattr(tok, name, value)
    return tok


@pytest.mark.parametrize("backend, why", [
    (_bpe(pre_tokenizer=pre_tokenizers.Whitespace()), "whitespace splitting drops the spaces"),
    (_bpe(normalizer=normalizers.NFKC()), "NFKC may shorten text"),
    (_bpe(normalizer=normalizers.Lowercase()), "lowercasing may shorten text"),
    (_bpe(normalizer=normalizers.Replace("ab", "c")), "a Replace that shortens"),
    (_bpe(pre_tokenizer=pre_tokenizers.Split(" ", "removed")), "a split that removes"),
    (Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]")), "an unknown word of any length"),
    (Tokenizer(models.BPE(vocab={"a": 0, "<unk>": 1}, merges=[], unk_token="<unk>", fuse_unk=True)),
     "a fused unknown run of any length"),
])
def test_no_floor_where_text_may_drop_or_shrink(backend, why):
    tok = HFTokenizer(backend)
    assert tok.max_token_bytes is None, why
    assert tok.min_tokens("ab " * 1000) == 0


def test_an_added_token_that_strips_whitespace_leaves_no_floor():
    backend = _bpe()
    backend.add_special_tokens([AddedToken("<mask>", lstrip=True)])
    assert HFTokenizer(backend).max_token_bytes is None


def test_a_sentencepiece_style_pipeline_keeps_its_floor():
    """Spaces written as '▁' (3 bytes for 1) only lengthen the text: the floor still holds."""
    backend = _bpe(normalizer=normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]),
                   decoder=decoders.Metaspace())
    tok = HFTokenizer(backend)
    assert tok.max_token_bytes == 3
    for text in ("ab ab c", "a" * 50, "   ", "abc" * 100):
        assert tok.min_tokens(text) <= len(tok.encode(text))


def test_a_long_encode_lets_other_threads_run(smollm2):
    """The event loop and the engine thread need the GIL while a prompt is tokenized."""
    text = "the quick brown fox jumps over the lazy dog 12345, and then; " * 16000  # ~1 MB
    worker = threading.Thread(target=smollm2.encode, args=(text,))
    start = last = time.monotonic()
    worker.start()  # returns only once this thread has the GIL again
    longest = 0.0
    while worker.is_alive():
        time.sleep(0.001)
        now = time.monotonic()
        longest, last = max(longest, now - last), now
    worker.join()
    took = time.monotonic() - start
    assert longest < took / 4, f"this thread waited {longest:.2f} s at once during a {took:.2f} s encode"
