"""``load_gguf`` on small GGUF files written here: config, tensor names and layout, errors, and the
SentencePiece-style tokenizer compared with transformers' reading of the same file."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from ninfer.engine.config import UnsupportedModelError
from ninfer.engine.loader.gguf_loader import load_gguf

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, LAYERS, VOCAB = 16, 4, 2, 4, 24, 2, 40


def llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's converter reorders q/k rows from rotate-half to interleaved pairs."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tiny_llama(tied: bool = True, extra: dict | None = None, rope_freqs: np.ndarray | None = None):
    """(HF-named tensors, GGUF tensor specs, metadata) of a 2-layer llama."""
    rng = np.random.default_rng(0)
    hf: dict[str, np.ndarray] = {"model.embed_tokens.weight": rng.standard_normal((VOCAB, HIDDEN)),
                                 "model.norm.weight": rng.standard_normal(HIDDEN)}
    specs = [("token_embd.weight", "model.embed_tokens.weight"), ("output_norm.weight", "model.norm.weight")]
    if not tied:
        hf["lm_head.weight"] = rng.standard_normal((VOCAB, HIDDEN))
        specs.append(("output.weight", "lm_head.weight"))
    shapes = {"attn_q": (HEADS * HEAD_DIM, HIDDEN), "attn_k": (KV_HEADS * HEAD_DIM, HIDDEN),
              "attn_v": (KV_HEADS * HEAD_DIM, HIDDEN), "attn_output": (HIDDEN, HEADS * HEAD_DIM),
              "ffn_gate": (FFN, HIDDEN), "ffn_up": (FFN, HIDDEN), "ffn_down": (HIDDEN, FFN),
              "attn_norm": (HIDDEN,), "ffn_norm": (HIDDEN,)}
    names = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
             "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
             "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
    for i in range(LAYERS):
        for short, shape in shapes.items():
            name = f"model.layers.{i}.{names[short]}.weight"
            hf[name] = rng.standard_normal(shape)
            specs.append((f"blk.{i}.{short}.weight", name))
    hf = {k: v.astype(np.float32) for k, v in hf.items()}
    tensors = []
    for gguf_name, name in specs:
        w = hf[name]
        if gguf_name.endswith("attn_q.weight"):
            w = llama_cpp_permute(w, HEADS)
        elif gguf_name.endswith("attn_k.weight"):
            w = llama_cpp_permute(w, KV_HEADS)
        tensors.append((gguf_name, np.ascontiguousarray(w), None))
    if rope_freqs is not None:
        tensors.append(("rope_freqs.weight", rope_freqs.astype(np.float32), None))
    meta = {
        "llama.block_count": LAYERS, "llama.context_length": 2048, "llama.embedding_length": HIDDEN,
        "llama.feed_forward_length": FFN, "llama.attention.head_count": HEADS,
        "llama.attention.head_count_kv": KV_HEADS, "llama.rope.freq_base": 500000.0,
        "llama.attention.layer_norm_rms_epsilon": 1e-5, "llama.rope.dimension_count": HEAD_DIM,
        "llama.vocab_size": VOCAB, "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
        **(extra or {}),
    }
    return hf, tensors, meta


def test_config_and_weights_in_hf_layout(gguf_writer):
    hf, tensors, meta = tiny_llama(tied=True, extra={"tokenizer.chat_template": "{{ x }}",
                                                     "tokenizer.ggml.eot_token_id": 7})
    ckpt = load_gguf(gguf_writer(tensors, meta))
    c = ckpt.config
    assert (c.model_type, c.family) == ("llama", "llama")
    assert (c.num_hidden_layers, c.hidden_size, c.intermediate_size) == (LAYERS, HIDDEN, FFN)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.vocab_size) == (HEADS, KV_HEADS, HEAD_DIM, VOCAB)
    assert c.rope_theta == 500000.0 and c.rope_scaling is None and c.partial_rotary_factor == 1.0
    assert math.isclose(c.rms_norm_eps, 1e-5, rel_tol=1e-6)
    assert c.max_position_embeddings == 2048 and c.tie_word_embeddings
    assert c.bos_token_id == 1 and c.eos_token_ids == [2]
    assert ckpt.generation.eos_token_ids == [2, 7]
    assert ckpt.chat_template == "{{ x }}" and ckpt.tokenizer is None
    got = dict(ckpt.weights())
    assert set(got) == set(hf)
    for name, w in hf.items():
        assert got[name].dtype == torch.float32
        assert torch.equal(got[name], torch.from_numpy(w)), name


def test_untied_output(gguf_writer):
    hf, tensors, meta = tiny_llama(tied=False)
    ckpt = load_gguf(gguf_writer(tensors, meta))
    assert not ckpt.config.tie_word_embeddings
    got = dict(ckpt.weights())
    assert torch.equal(got["lm_head.weight"], torch.from_numpy(hf["lm_head.weight"]))


def test_llama3_rope_freqs_become_rope_scaling(gguf_writer):
    from ninfer.engine.layers.rotary import rope_inv_freq

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    base = 500000.0
    freqs = (rope_inv_freq(HEAD_DIM, base, None) / rope_inv_freq(HEAD_DIM, base, scaling)).numpy()
    _, tensors, meta = tiny_llama(rope_freqs=freqs)
    ckpt = load_gguf(gguf_writer(tensors, meta))
    assert ckpt.config.rope_scaling == scaling
    assert "rope_freqs" not in " ".join(name for name, _ in ckpt.weights())


def test_other_architecture_is_rejected(gguf_writer):
    _, tensors, meta = tiny_llama()
    meta = {k.replace("llama.", "qwen2."): v for k, v in meta.items()}
    with pytest.raises(UnsupportedModelError, match=r"'qwen2'.*llama"):
        load_gguf(gguf_writer(tensors, meta, arch="qwen2"))


def test_unknown_tensor_is_rejected(gguf_writer):
    _, tensors, meta = tiny_llama()
    tensors.append(("blk.0.ffn_gate_inp.weight", np.zeros((4, HIDDEN), np.float32), None))
    with pytest.raises(UnsupportedModelError, match="ffn_gate_inp"):
        load_gguf(gguf_writer(tensors, meta))


def test_unsupported_tokenizer_model(gguf_writer):
    _, tensors, meta = tiny_llama()
    meta.update({"tokenizer.ggml.model": "t5", "tokenizer.ggml.tokens": [f"t{i}" for i in range(VOCAB)]})
    with pytest.raises(UnsupportedModelError, match="'t5'"):
        load_gguf(gguf_writer(tensors, meta))


# ---- SentencePiece-style ("llama") vocabulary ----------------------------------------------------

PIECES = ["▁the", "▁a", "▁in", "he", "in", "er", "▁t", "th", "an", "▁an", "▁and", "ing", "▁of", "▁to",
          "ll", "▁he", "▁hello", "hello", "▁w", "or", "ld", "▁world", "▁wor", "el", "lo", "hel", "ell", "▁", "▁h"]
CHARS = list("abcdefghijklmnopqrstuvwxyz,.!?'")
SPM_TOKENS = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + PIECES + CHARS + ["<|user|>"]
SPM_TEXTS = ["hello world", "the cat and the hat", " hello  world", "héllo 中 world!",
             "<s>hello<|user|> the</s>", "\nhello\n\n", "it's a test."]


@pytest.fixture(scope="module")
def spm_file(tmp_path_factory, gguf_file):
    types = [2, 3, 3] + [6] * 256 + [1] * (len(PIECES) + len(CHARS)) + [4]
    scores = [0.0] * 259 + [-float(i) for i in range(len(PIECES))] + [-100.0 - i for i in range(len(CHARS))] + [0.0]
    hidden = 8
    meta = {"llama.block_count": 1, "llama.embedding_length": hidden, "llama.feed_forward_length": 8,
            "llama.attention.head_count": 2, "llama.vocab_size": len(SPM_TOKENS),
            "tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": SPM_TOKENS,
            "tokenizer.ggml.token_type": types, "tokenizer.ggml.scores": scores,
            "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
            "tokenizer.ggml.unknown_token_id": 0, "tokenizer.ggml.add_space_prefix": True}
    path = tmp_path_factory.mktemp("spm") / "spm.gguf"
    return gguf_file(path, [("token_embd.weight", np.zeros((len(SPM_TOKENS), hidden), np.float32), None)], meta)


def test_sentencepiece_tokenizer_matches_transformers(spm_file):
    transformers = pytest.importorskip("transformers")
    ours = load_gguf(spm_file).tokenizer
    theirs = transformers.AutoTokenizer.from_pretrained(str(spm_file.parent), gguf_file=spm_file.name)
    assert (ours.bos_token, ours.eos_token) == ("<s>", "</s>")
    for text in SPM_TEXTS:
        ids = ours.encode(text)
        assert ids == theirs.encode(text, add_special_tokens=False), text
        assert ours.decode(ids) == theirs.decode(ids)
    assert ours.encode("<|user|>") == [SPM_TOKENS.index("<|user|>")]
    assert ours.encode("é") == [SPM_TOKENS.index("▁"), 3 + 0xC3, 3 + 0xA9]  # byte fallback
