"""A tiny llama's layers written as llama.cpp's GGUF converter lays them out (q and k rows
permuted to its rotary order), each matrix in the type a test gives it; its metadata; and the
logits a loaded model gives for a prompt."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from ninfer.engine.models.base import ForwardBatch

# llama.cpp's short names of a layer's matrices -> their Hugging Face names under model.layers.N
HF_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
            "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
            "ffn_down": "mlp.down_proj"}


@dataclass(frozen=True)
class LlamaDims:
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    layers: int
    vocab: int

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


def llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama_layers(rng: np.random.Generator, dims: LlamaDims,
                 place: Callable[[str, str, int, np.ndarray], tuple]) -> list[tuple]:
    """Every layer's tensors: random matrices (scaled by their width) given to
    ``place(gguf name, short name, layer, float32 matrix)``, which returns the tensor entry
    ``(name, data, type)``; norms of ones."""
    d = dims
    shapes = {"attn_q": (d.hidden, d.hidden), "attn_k": (d.kv_heads * d.head_dim, d.hidden),
              "attn_v": (d.kv_heads * d.head_dim, d.hidden), "attn_output": (d.hidden, d.hidden),
              "ffn_gate": (d.ffn, d.hidden), "ffn_up": (d.ffn, d.hidden), "ffn_down": (d.hidden, d.ffn)}
    tensors = []
    for i in range(d.layers):
        for short, shape in shapes.items():
            w = (rng.standard_normal(shape) / np.sqrt(shape[1])).astype(np.float32)
            if short == "attn_q":
                w = llama_cpp_permute(w, d.heads)
            elif short == "attn_k":
                w = llama_cpp_permute(w, d.kv_heads)
            tensors.append(place(f"blk.{i}.{short}.weight", short, i, w))
        tensors += [(f"blk.{i}.attn_norm.weight", np.ones(d.hidden, np.float32), None),
                    (f"blk.{i}.ffn_norm.weight", np.ones(d.hidden, np.float32), None)]
    return tensors


def llama_meta(dims: LlamaDims) -> dict:
    d = dims
    return {"llama.block_count": d.layers, "llama.context_length": 512, "llama.embedding_length": d.hidden,
            "llama.feed_forward_length": d.ffn, "llama.attention.head_count": d.heads,
            "llama.attention.head_count_kv": d.kv_heads, "llama.rope.freq_base": 10000.0,
            "llama.attention.layer_norm_rms_epsilon": 1e-5, "llama.vocab_size": d.vocab}


def logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model.compute_logits(model(torch.tensor(ids), ForwardBatch.single(len(ids), model.new_cache())))
