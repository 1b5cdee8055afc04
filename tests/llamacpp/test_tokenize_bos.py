"""``/tokenize`` with ``add_special`` starts the ids with BOS only where the model's texts start
with one, as llama-server decides it: a GGUF's ``tokenizer.ggml.add_bos_token``, a
``tokenizer_config.json``'s ``add_bos_token``."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from ninfer.engine.frontend.hf_tokenizer import HFTokenizer
from ninfer.server.llamacpp.protocol import TokenizeRequest
from ninfer.server.llamacpp.serving import tokenize
from support.tiny import save_tokenizer


@pytest.mark.parametrize("config, starts_with_bos", [
    ({"bos_token": "<|im_start|>"}, True),
    ({"bos_token": "<|im_start|>", "add_bos_token": True}, True),
    ({"bos_token": "<|im_start|>", "add_bos_token": False}, False),
    ({"bos_token": None}, False),
])
def test_add_special_follows_the_tokenizer_config(tmp_path, config, starts_with_bos):
    save_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", **config}))
    tok = HFTokenizer.from_dir(tmp_path)
    state = SimpleNamespace(tokenizer=tok)
    plain = tokenize(state, TokenizeRequest(content="Hello world!"))["tokens"]
    special = tokenize(state, TokenizeRequest(content="Hello world!", add_special=True))["tokens"]
    assert special == ([tok.token_to_id("<|im_start|>")] + plain if starts_with_bos else plain)
