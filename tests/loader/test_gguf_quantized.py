"""GGUF Q4_0 / Q4_1 / Q8_0 matrices kept quantized: the blocks read as gguf dequantizes them, and a
llama written in each format gives, kept quantized, the logits of its dequantized load."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

from ninfer.engine.engine_config import EngineConfig
from ninfer.engine.layers.embedding import Embedding
from ninfer.engine.layers.linear import Fp16CpuMethod, Int4CpuMethod, Linear, fp16_cpu_gemm_available
from ninfer.engine.loader import load_model
from ninfer.engine.loader.gguf_loader import kept_quantized, load_gguf, open_gguf
from ninfer.engine.loader.gguf_quant import group_quantized
from support.llama_gguf import LlamaDims, llama_layers, llama_meta, logits

KEPT = [Q.Q4_0, Q.Q4_1, Q.Q8_0]
HIDDEN, HEADS, KV_HEADS, FFN, LAYERS, VOCAB = 128, 8, 4, 192, 2, 128
DIMS = LlamaDims(HIDDEN, HEADS, KV_HEADS, FFN, LAYERS, VOCAB)


@pytest.mark.parametrize("qtype", KEPT)
def test_blocks_read_as_gguf_dequantizes_them(gguf_writer, qtype):
    w = np.random.default_rng(1).standard_normal((48, 96)).astype(np.float32)
    w[3, :32] += 5.0  # a block with a large offset
    path = gguf_writer([("blk.0.ffn_up.weight", quantize(w, qtype), qtype)])
    tensor = open_gguf(path).tensors[0]
    g = group_quantized(tensor)
    assert tuple(g.shape) == (48, 96) and g.group == 32 and g.kind == qtype.name
    assert torch.equal(g.dequantize(), torch.from_numpy(dequantize(tensor.data, qtype)))
    assert (g.dequantize() - torch.from_numpy(w)).abs().max() < 0.5  # it is the weight, quantized


def random_q4_k(rows: int, cols: int) -> np.ndarray:
    """Q4_K blocks of random scales, minimums and nibbles (gguf has no Q4_K quantizer), with
    finite fp16 ``d`` and ``dmin``."""
    rng = np.random.default_rng(2)
    blocks = rng.integers(0, 256, (rows * cols // 256, 144), dtype=np.uint8)
    blocks[:, 0:2] = rng.uniform(0.001, 0.02, (len(blocks), 1)).astype(np.float16).view(np.uint8)
    blocks[:, 2:4] = rng.uniform(0.001, 0.02, (len(blocks), 1)).astype(np.float16).view(np.uint8)
    return blocks.reshape(rows, cols // 256 * 144)


def test_q4_k_blocks_read_as_gguf_dequantizes_them(gguf_writer):
    path = gguf_writer([("blk.0.ffn_up.weight", random_q4_k(32, 512), Q.Q4_K)])
    tensor = open_gguf(path).tensors[0]
    g = group_quantized(tensor)
    assert tuple(g.shape) == (32, 512) and g.group == 32 and g.bits == 4 and g.kind == "Q4_K"
    assert torch.equal(g.dequantize(), torch.from_numpy(dequantize(tensor.data, Q.Q4_K)))


def test_rows_the_cpu_kernel_cannot_take_are_dequantized(gguf_writer):
    w = np.ones((24, 64), np.float32)
    path = gguf_writer([("blk.0.ffn_up.weight", quantize(w, Q.Q8_0), Q.Q8_0)])
    assert kept_quantized(open_gguf(path).tensors[0]) is None


def write_llama(writer, qtype: Q, tied: bool):
    rng = np.random.default_rng(0)
    tensors = [("token_embd.weight", quantize(rng.standard_normal((VOCAB, HIDDEN)).astype(np.float32), qtype), qtype),
               ("output_norm.weight", np.ones(HIDDEN, np.float32), None)]
    if not tied:
        out = rng.standard_normal((VOCAB, HIDDEN)).astype(np.float32)
        tensors.append(("output.weight", quantize(out, qtype), qtype))
    tensors += llama_layers(rng, DIMS, lambda name, short, layer, w: (name, quantize(w, qtype), qtype))
    return writer(tensors, llama_meta(DIMS))


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("qtype", KEPT)
def test_llama_kept_quantized_gives_the_dequantized_logits(gguf_writer, qtype, tied):
    ckpt = load_gguf(write_llama(gguf_writer, qtype, tied))
    kept = load_model(ckpt, "cpu", torch.float32)
    dense = load_model(ckpt, "cpu", torch.float32, weights="dense")
    projections = [m for m in kept.modules() if isinstance(m, Linear)]
    assert len(projections) == 7 * LAYERS and all(m.quantized for m in projections)
    # the head is held in fp16 and the table stays quantized, tied or not; without fbgemm a head
    # and a table tied to it are held dense (layers/embedding.py)
    fp16 = fp16_cpu_gemm_available()
    assert isinstance(kept.model.embed_tokens, Embedding)
    assert (kept.model.embed_tokens.table is not None) == (fp16 or not tied)
    assert isinstance(kept.lm_head.method, Fp16CpuMethod) == fp16
    assert not any(m.quantized for m in dense.modules() if isinstance(m, Linear))
    for layer in kept.model.layers:  # q/k/v and gate/up each one int4 product
        assert isinstance(layer.self_attn._fused, Int4CpuMethod) and isinstance(layer.mlp._fused, Int4CpuMethod)
    ids = [5, 17, 99, 3, 64, 127, 0, 42]
    got, want = logits(kept, ids), logits(dense, ids)
    assert got.shape == (len(ids), VOCAB)
    # bf16 activations in the products: close, and the same ranking at the top
    assert (got - want).abs().max() <= 0.02 * want.abs().max()
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_dense_setting_is_checked():
    with pytest.raises(ValueError, match="weights must be one of auto, dense"):
        load_model(None, "cpu", torch.float32, weights="int3")


def test_weights_flag_reaches_the_engine_config():
    from ninfer.server.bootstrap import engine_config
    from ninfer.server.cli import build_parser

    args = build_parser().parse_args(["--weights", "dense"])
    assert engine_config(args, 256, "cpu", torch.float32).weights == "dense"
    assert build_parser().parse_args([]).weights == "auto"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--weights", "int3"])
    with pytest.raises(ValueError, match="weights must be one of auto, dense"):
        EngineConfig(weights="int3")
