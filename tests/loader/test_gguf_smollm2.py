"""The embedded SmolLM2-135M-Instruct GGUF: config, tokenizer (against transformers' reading of the
same file), chat template, stop ids."""
from __future__ import annotations

import pytest

from ninfer.engine.loader import load_checkpoint
from ninfer.engine.loader.embedded import EMBEDDED_MODEL_ID, embedded_model_path

TEXTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "  leading spaces,\ttabs\nand\n\nnewlines   ",
    "Numbers: 3.14159, 2024-11-29, 1,000,000 and x^2 + y^2 = z^2",
    "Ünïcödé: héllo wörld — “quotes” … 日本語のテキスト 🤖🚀",
    "def f(x):\n    return x ** 2  # comment\n",
    "don't won't I'm you're they'll we've she'd",
]


@pytest.fixture(scope="module")
def hf_tokenizer(smollm2_path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(smollm2_path.parent), gguf_file=smollm2_path.name)


def test_embedded_path():
    path = embedded_model_path()
    assert path.is_file() and path.suffix == ".gguf"
    assert EMBEDDED_MODEL_ID == "smollm2-135m-instruct"


def test_config(smollm2):
    c = smollm2.config
    assert (c.model_type, c.family) == ("llama", "llama")
    assert c.num_hidden_layers == 30 and c.hidden_size == 576 and c.intermediate_size == 1536
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (9, 3, 64)
    assert c.vocab_size == 49152 and c.tie_word_embeddings
    assert c.rope_theta == 100000.0 and c.max_position_embeddings == 8192


def test_tokenizer_special_tokens(smollm2):
    tok = smollm2.tokenizer
    im_start, im_end = tok.token_to_id("<|im_start|>"), tok.token_to_id("<|im_end|>")
    assert (im_start, im_end) == (1, 2)
    ids = tok.encode("<|im_start|>user\nHello<|im_end|>")
    assert ids[0] == im_start and ids[-1] == im_end
    assert ids.count(im_start) == ids.count(im_end) == 1
    assert tok.decode(ids) == "<|im_start|>user\nHello<|im_end|>"
    assert (tok.bos_token, tok.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert tok.vocab_size == 49152


def test_tokenizer_matches_transformers(smollm2, hf_tokenizer):
    tok = smollm2.tokenizer
    for text in TEXTS + ["<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>assistant\n"]:
        ids = tok.encode(text)
        assert ids == hf_tokenizer.encode(text, add_special_tokens=False), text
        assert tok.decode(ids) == text


def test_digits_split_one_by_one(smollm2):
    """SmolLM's pre-tokenizer ('smollm' in the file) isolates every digit."""
    tok = smollm2.tokenizer
    assert [tok.decode([i]) for i in tok.encode(" 2024")] == [" ", "2", "0", "2", "4"]


def test_chat_template_and_stop_ids(smollm2):
    assert "<|im_start|>" in smollm2.chat_template and "add_generation_prompt" in smollm2.chat_template
    assert smollm2.generation.eos_token_ids == [2]
    assert smollm2.config.eos_token_ids == [2]


def test_load_checkpoint_defaults_to_embedded_model():
    ckpt = load_checkpoint(None)
    assert ckpt.source == str(embedded_model_path())
    assert ckpt.config.num_hidden_layers == 30
