"""Dequantisation of every GGML type the loader is expected to meet, and the q/k row order.

Types ``gguf.quants`` can quantise (BF16, Q8_0, Q4_0, Q4_1) go through it; Q4_K and Q6_K, which it
only decodes, are packed here by a small encoder written from the ggml block layout and checked
both against the original values and against a scalar reference decoder of the same bytes.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader
from gguf.quants import quantize

from ninfer.engine.loader.gguf_loader import tensor_to_torch, unpermute_rotary

QK_K = 256


def read_back(path) -> dict[str, torch.Tensor]:
    return {t.name: tensor_to_torch(t) for t in GGUFReader(path).tensors}


def rand(rows: int, cols: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)


# ---- float types: exact --------------------------------------------------------------------------


def test_float_types_exact_and_hf_shape(gguf_writer):
    x = rand(6, 40)
    bf16 = torch.from_numpy(x).to(torch.bfloat16).float()
    path = gguf_writer([
        ("f32", x, None),
        ("f16", x.astype(np.float16), None),
        ("bf16", quantize(x, Q.BF16), Q.BF16),
        ("vec", x[0].copy(), None),
    ])
    got = read_back(path)
    assert got["f32"].dtype == torch.float32 and tuple(got["f32"].shape) == (6, 40)
    assert torch.equal(got["f32"], torch.from_numpy(x))
    assert torch.equal(got["f16"], torch.from_numpy(x.astype(np.float16).astype(np.float32)))
    assert torch.equal(got["bf16"], bf16)
    assert tuple(got["vec"].shape) == (40,)


# ---- block types gguf can quantise ----------------------------------------------------------------


@pytest.mark.parametrize(
    "qtype, block, tolerance",
    [
        # worst-case rounding error as a fraction of the block's max |x| (Q4_1: of its range)
        (Q.Q8_0, 32, 0.5 / 127 + 1e-3),
        (Q.Q4_0, 32, 1 / 8 + 1e-3),  # the max's sign sets the scale: +max clips to 7/8
        (Q.Q4_1, 32, 0.5 / 15 + 2e-3),
    ],
)
def test_simple_block_types(gguf_writer, qtype, block, tolerance):
    x = rand(12, 128, seed=1)
    path = gguf_writer([("w", quantize(x, qtype), qtype)])
    got = read_back(path)["w"].numpy()
    assert got.shape == (12, 128)
    blocks = x.reshape(-1, block)
    scale = np.abs(blocks).max(axis=1) if qtype != Q.Q4_1 else blocks.max(axis=1) - blocks.min(axis=1)
    err = np.abs(got.reshape(-1, block) - blocks)
    assert (err <= tolerance * scale[:, None]).all()
    assert err.max() > 0  # really quantised


def _ref_q8_0(raw: np.ndarray) -> np.ndarray:
    d = raw[:2].view(np.float16).astype(np.float32)[0]
    return d * raw[2:34].view(np.int8).astype(np.float32)


def _ref_q4_1(raw: np.ndarray) -> np.ndarray:
    d, m = raw[:4].view(np.float16).astype(np.float32)
    qs = raw[4:20]
    return np.array([d * (qs[i % 16] >> (4 * (i // 16)) & 15) + m for i in range(32)], dtype=np.float32)


@pytest.mark.parametrize("name, ref", [("token_embd.weight", _ref_q8_0), ("blk.0.ffn_down.weight", _ref_q4_1)])
def test_smollm2_tensors_match_scalar_reference(smollm2_reader, name, ref):
    """The shipped model's own Q8_0 / Q4_1 tensors, decoded block by block by hand."""
    tensor = next(t for t in smollm2_reader.tensors if t.name == name)
    got = tensor_to_torch(tensor).numpy()
    block_bytes = 34 if ref is _ref_q8_0 else 20
    for row in (0, 5, got.shape[0] - 1):
        raw = tensor.data[row].reshape(-1, block_bytes)
        expected = np.concatenate([ref(b) for b in raw])
        np.testing.assert_array_equal(got[row], expected)


# ---- K-quants: encoder and scalar decoder from the ggml block layout ------------------------------


def _encode_q4_k(x: np.ndarray) -> np.ndarray:
    """block_q4_K: f16 d, f16 dmin, 12 bytes of 6-bit scales/mins, 128 bytes of nibbles."""
    out = []
    for blk in x.reshape(-1, QK_K).astype(np.float64):
        sub = blk.reshape(8, 32)
        lo = np.minimum(sub.min(axis=1), 0.0)
        step = (sub.max(axis=1) - lo) / 15
        d = np.float16(step.max() / 63)
        dmin = np.float16(-lo.min() / 63)
        sc = np.clip(np.round(step / float(d)), 1, 63).astype(np.uint8)
        m = np.clip(np.round(-lo / float(dmin)), 0, 63).astype(np.uint8) if dmin else np.zeros(8, np.uint8)
        q = np.clip(np.round((sub + float(dmin) * m[:, None]) / (float(d) * sc[:, None])), 0, 15).astype(np.uint8)
        scales = np.zeros(12, np.uint8)
        for j in range(4):
            scales[j] = sc[j] | ((sc[j + 4] >> 4) << 6)
            scales[j + 4] = m[j] | ((m[j + 4] >> 4) << 6)
            scales[j + 8] = (sc[j + 4] & 15) | ((m[j + 4] & 15) << 4)
        qs = np.concatenate([q[2 * k] | (q[2 * k + 1] << 4) for k in range(4)]).astype(np.uint8)
        out.append(np.concatenate([np.array([d, dmin], np.float16).view(np.uint8), scales, qs]))
    return np.stack(out).reshape(x.shape[0], -1)


def _decode_q4_k(raw: np.ndarray) -> np.ndarray:
    d, dmin = raw[:4].view(np.float16).astype(np.float32)
    s, qs = raw[4:16].astype(np.int64), raw[16:144]
    y = np.zeros(QK_K, np.float32)
    for j in range(8):
        if j < 4:
            sc, m = s[j] & 63, s[j + 4] & 63
        else:
            sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4)
            m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4)
        for i in range(32):
            q = (qs[32 * (j // 2) + i] >> (4 * (j % 2))) & 15
            y[32 * j + i] = d * np.float32(sc) * np.float32(q) - dmin * np.float32(m)
    return y


def _encode_q6_k(x: np.ndarray) -> np.ndarray:
    """block_q6_K: 128 bytes low nibbles, 64 bytes high 2-bit pairs, 16 int8 scales, f16 d."""
    out = []
    for blk in x.reshape(-1, QK_K).astype(np.float64):
        sub = blk.reshape(16, 16)
        step = np.abs(sub).max(axis=1) / 31
        d = np.float16(step.max() / 127)
        sc = np.clip(np.round(step / float(d)), 1, 127).astype(np.int8)
        q = np.clip(np.round(sub / (float(d) * sc[:, None].astype(np.float64))), -32, 31).astype(np.int64) + 32
        q = q.reshape(-1)
        ql, qh = np.zeros(128, np.uint8), np.zeros(64, np.uint8)
        for half in range(2):
            v = q[128 * half: 128 * half + 128]
            for i in range(32):
                ql[64 * half + i] = (v[i] & 15) | ((v[i + 64] & 15) << 4)
                ql[64 * half + i + 32] = (v[i + 32] & 15) | ((v[i + 96] & 15) << 4)
                qh[32 * half + i] = (v[i] >> 4) | ((v[i + 32] >> 4) << 2) | ((v[i + 64] >> 4) << 4) | ((v[i + 96] >> 4) << 6)
        out.append(np.concatenate([ql, qh, sc.view(np.uint8), np.array([d], np.float16).view(np.uint8)]))
    return np.stack(out).reshape(x.shape[0], -1)


def _decode_q6_k(raw: np.ndarray) -> np.ndarray:
    ql, qh = raw[:128].astype(np.int64), raw[128:192].astype(np.int64)
    sc = raw[192:208].view(np.int8).astype(np.float32)
    d = raw[208:210].view(np.float16).astype(np.float32)[0]
    y = np.zeros(QK_K, np.float32)
    for half in range(2):
        for i in range(32):
            lo, hi, h = ql[64 * half + i], ql[64 * half + i + 32], qh[32 * half + i]
            s = sc[8 * half + i // 16:]
            base = 128 * half
            y[base + i] = d * s[0] * np.float32(((lo & 15) | ((h & 3) << 4)) - 32)
            y[base + i + 32] = d * s[2] * np.float32(((hi & 15) | (((h >> 2) & 3) << 4)) - 32)
            y[base + i + 64] = d * s[4] * np.float32(((lo >> 4) | (((h >> 4) & 3) << 4)) - 32)
            y[base + i + 96] = d * s[6] * np.float32(((hi >> 4) | (((h >> 6) & 3) << 4)) - 32)
    return y


@pytest.mark.parametrize(
    "qtype, encode, decode, block_bytes",
    [(Q.Q4_K, _encode_q4_k, _decode_q4_k, 144), (Q.Q6_K, _encode_q6_k, _decode_q6_k, 210)],
)
def test_k_quants(gguf_writer, qtype, encode, decode, block_bytes):
    x = rand(4, 512, seed=2)
    packed = encode(x)
    assert packed.shape == (4, 2 * block_bytes)
    got = read_back(gguf_writer([("w", packed, qtype)]))["w"].numpy()
    assert got.shape == (4, 512)
    reference = np.concatenate([decode(b) for b in packed.reshape(-1, block_bytes)]).reshape(4, 512)
    np.testing.assert_allclose(got, reference, rtol=1e-6, atol=1e-6)
    # close to the original: within about one quantisation step of each 256-value block
    span = (x.reshape(-1, QK_K).max(axis=1) - x.reshape(-1, QK_K).min(axis=1))[:, None]
    err = np.abs(got.reshape(-1, QK_K) - x.reshape(-1, QK_K))
    assert (err <= span / (15 if qtype == Q.Q4_K else 63)).all()


# ---- q/k rotary row order ---------------------------------------------------------------------------


def llama_cpp_permute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """What llama.cpp's converter does to q_proj/k_proj rows: rotate-half -> interleaved pairs."""
    head_dim = w.shape[0] // n_heads
    return w.reshape(n_heads, 2, head_dim // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.mark.parametrize("n_heads, head_dim", [(9, 64), (3, 64), (4, 8)])
def test_unpermute_inverts_llama_cpp_permute(n_heads, head_dim):
    w = torch.randn(n_heads * head_dim, 24)
    back = unpermute_rotary(llama_cpp_permute(w, n_heads), n_heads)
    assert torch.equal(back, w)
    bias = torch.randn(n_heads * head_dim)
    assert torch.equal(unpermute_rotary(llama_cpp_permute(bias, n_heads), n_heads), bias)


def test_unpermute_row_mapping():
    """Head of 8: GGUF rows (pairs) 0,1,2,...,7 hold HF rows 0,4,1,5,2,6,3,7."""
    gguf_rows = torch.tensor([0, 4, 1, 5, 2, 6, 3, 7], dtype=torch.float32)
    assert unpermute_rotary(gguf_rows, 1).tolist() == list(range(8))
