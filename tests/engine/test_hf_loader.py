"""Reading Hugging Face directories: shards, renamed and skipped tensors, config errors, defaults."""
from __future__ import annotations

import json
import logging

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from ninfer.engine.config import UnsupportedModelError
from ninfer.engine.loader.hf_loader import load_hf_dir
from ninfer.engine.models.base import ForwardBatch
from ninfer.engine.models.registry import build_model

SMALL = dict(
    vocab_size=256, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, intermediate_size=64, eos_token_id=2,
)


def _save_llama(path, **save_kwargs) -> transformers.LlamaForCausalLM:
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL)).eval()
    model.save_pretrained(path, **save_kwargs)
    return model


def _logits_match(hf, path) -> None:
    ckpt = load_hf_dir(path)
    ours = build_model(ckpt.config)
    ours.load_weights(ckpt.weights())
    ids = torch.arange(10, 40)
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    got = ours.compute_logits(ours(ids, ForwardBatch.single(30, ours.new_cache())))
    assert (got - ref).abs().max().item() < 1e-4


def _rewrite_single_file(path, edit) -> None:
    file = path / "model.safetensors"
    tensors = edit(load_file(file))
    save_file(tensors, file, metadata={"format": "pt"})


def test_sharded_checkpoint_loads(tmp_path):
    hf = _save_llama(tmp_path, max_shard_size="40KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert not (tmp_path / "model.safetensors").exists()
    _logits_match(hf, tmp_path)


def test_mtp_and_visual_tensors_skipped_with_one_log_line_each(tmp_path, caplog):
    hf = _save_llama(tmp_path)

    def add_extra(tensors):
        tensors["mtp.fc.weight"] = torch.zeros(32, 64)
        tensors["mtp.layers.0.input_layernorm.weight"] = torch.zeros(32)
        tensors["model.visual.patch_embed.proj.weight"] = torch.zeros(4, 4)
        return tensors

    _rewrite_single_file(tmp_path, add_extra)
    with caplog.at_level(logging.INFO, logger="ninfer.loader"):
        ckpt = load_hf_dir(tmp_path)
    lines = [r.getMessage() for r in caplog.records if r.name == "ninfer.loader"]
    assert len([m for m in lines if "'mtp.'" in m]) == 1
    assert len([m for m in lines if "'model.visual.'" in m]) == 1
    assert any("2 tensors" in m and "'mtp.'" in m for m in lines)
    assert set(ckpt.skipped_prefixes) == {"mtp.", "model.visual."}
    names = [name for name, _ in ckpt.weights()]
    assert not any(n.startswith(("mtp.", "model.visual.")) for n in names)
    _logits_match(hf, tmp_path)


def test_language_model_prefix_is_normalised(tmp_path):
    hf = _save_llama(tmp_path)
    _rewrite_single_file(
        tmp_path,
        lambda t: {("model.language_model." + k[len("model."):] if k.startswith("model.") else k): v for k, v in t.items()},
    )
    names = [name for name, _ in load_hf_dir(tmp_path).weights()]
    assert "model.embed_tokens.weight" in names and "lm_head.weight" in names
    _logits_match(hf, tmp_path)


def test_unknown_model_type_names_it_and_the_supported_ones(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mamba2", **SMALL}))
    with pytest.raises(UnsupportedModelError) as err:
        load_hf_dir(tmp_path)
    message = str(err.value)
    assert "mamba2" in message
    for supported in ("llama", "qwen3", "qwen3_5", "qwen3_5_moe", "qwen3_next"):
        assert supported in message


def test_load_weights_rejects_bad_checkpoints(tmp_path):
    _save_llama(tmp_path)
    ckpt = load_hf_dir(tmp_path)
    weights = dict(ckpt.weights())

    def load(tensors):
        build_model(ckpt.config).load_weights(tensors.items())

    missing = {k: v for k, v in weights.items() if k != "model.norm.weight"}
    with pytest.raises(ValueError, match="model.norm.weight"):
        load(missing)
    wrong_shape = dict(weights, **{"model.layers.1.mlp.up_proj.weight": torch.zeros(3, 3)})
    with pytest.raises(ValueError, match="model.layers.1.mlp.up_proj.weight"):
        load(wrong_shape)
    unknown = dict(weights, **{"model.layers.0.extra.weight": torch.zeros(1)})
    with pytest.raises(ValueError, match="model.layers.0.extra.weight"):
        load(unknown)
    with pytest.raises(ValueError, match="twice"):
        build_model(ckpt.config).load_weights(list(weights.items()) + [("model.norm.weight", weights["model.norm.weight"])])


def test_generation_defaults_and_fallback(tmp_path):
    _save_llama(tmp_path)
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [2, 7], "temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.0})
    )
    gen = load_hf_dir(tmp_path).generation
    assert gen.eos_token_ids == [2, 7]
    assert (gen.temperature, gen.top_p, gen.top_k, gen.min_p, gen.repetition_penalty) == (0.6, 0.95, 20, 0.0, None)

    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.7}))
    ckpt = load_hf_dir(tmp_path)
    assert ckpt.generation.eos_token_ids == [2]  # from config.json
    assert ckpt.tokenizer is None and ckpt.chat_template is None  # no tokenizer.json here


def test_tokenizer_and_chat_template_read_when_tokenizer_json_present(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    _save_llama(tmp_path)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "hello": 3, "world": 4}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "chat_template": "{{ x }}"}))
    ckpt = load_hf_dir(tmp_path)
    assert ckpt.tokenizer.encode("hello world") == [3, 4]
    assert ckpt.tokenizer.eos_token_id == 2
    assert ckpt.chat_template == "{{ x }}"
