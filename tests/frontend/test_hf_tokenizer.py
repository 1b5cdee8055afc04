"""A checkpoint directory's tokenizer.json, tokenizer_config.json and chat template."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from ninfer.engine.frontend.hf_tokenizer import HFTokenizer, chat_template_from_dir


def write_checkpoint(path: Path, config: dict | None = None) -> Backend:
    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=280, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<s>", "</s>", "<|im_end|>"],
    )
    backend.train_from_iterator(["hello world", "你好 世界"] * 3, trainer)
    # a post-processor that would add BOS if asked: encode() must not ask
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    backend.save(str(path / "tokenizer.json"))
    if config is not None:
        (path / "tokenizer_config.json").write_text(json.dumps(config))
    return backend


def test_from_dir_reads_special_token_strings_and_dicts(tmp_path: Path) -> None:
    write_checkpoint(tmp_path, {"bos_token": {"content": "<s>", "lstrip": False}, "eos_token": "<|im_end|>"})
    tok = HFTokenizer.from_dir(tmp_path)
    assert tok.bos_token == "<s>" and tok.bos_token_id == 0
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2
    assert tok.vocab_size == len(tok.backend.get_vocab(with_added_tokens=True)) > 256


def test_encode_adds_nothing_and_recognises_special_tokens(tmp_path: Path) -> None:
    write_checkpoint(tmp_path)
    tok = HFTokenizer.from_dir(tmp_path)
    assert tok.bos_token is None and tok.eos_token_id is None
    ids = tok.encode("hello<|im_end|>你好")
    assert tok.backend.encode("hello").ids[0] == 0  # the post-processor would add <s>
    assert 0 not in ids  # ... but encode() adds no BOS
    assert 2 in ids
    assert tok.decode(ids) == "hello<|im_end|>你好"  # special tokens kept
    assert tok.token_to_id("<|im_end|>") == 2 and tok.token_to_id("<nope>") is None


def test_missing_tokenizer_json(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        HFTokenizer.from_dir(tmp_path)


def test_chat_template_sources(tmp_path: Path) -> None:
    assert chat_template_from_dir(tmp_path) is None
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "A"}))
    assert chat_template_from_dir(tmp_path) == "A"
    named = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": named}))
    assert chat_template_from_dir(tmp_path) == "D"
    (tmp_path / "chat_template.jinja").write_text("J", encoding="utf-8")
    assert chat_template_from_dir(tmp_path) == "J"  # the .jinja file wins
