"""Full causal attention (GQA) over a per-sequence KV cache, with the options Qwen models add.

Options: per-head ``q_norm``/``k_norm`` (Qwen3: plain RMSNorm, Qwen3.5: zero-centred) and an output
gate (Qwen3.5: ``q_proj`` emits ``[q | gate]`` per head, output ``o_proj(attn * sigmoid(gate))``).
Projections, norms and RoPE run on the whole flat token run. In an engine step (``batch.step``)
the attention reads K/V in place from the shared pages, every row in one call per kernel of the
layer's backend (``backends.py``: its K/V write, decode rows and prompt rows); on the reference
path it runs per sequence against that sequence's cache. The pages may hold one byte
per element with a scale per (token, KV head) row (``--kv-dtype fp8`` / ``int8``: keys and
queries rotated) or two per byte (``4bit``: keys with a range per page and channel, values with a
scale per group of 32; ``cache/kv_quant.py``): K/V written quantized, read dequantized inside the
attention.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from ..cache.kv_quant import is_packed, quantize, raw_bytes, rotation, write_keys4
from . import backends
from .fused_linear import NormFusedInput, fuse_linears, split_linear
from .linear import Linear
from .norm import RMSNorm
from .rotary import RotaryEmbedding

if TYPE_CHECKING:
    from ..models.base import ForwardBatch

QK_NORM_KINDS = (None, "plain", "zero_centered")

# Upper bound on the fp32 score matrix per query chunk, so long prompts do not need O(T*S) memory.
_MAX_SCORE_ELEMENTS = 1 << 26


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Reference attention for one sequence: ``q`` ``[T, H, D]`` (the newest T tokens),
    ``k``/``v`` ``[S, Hkv, D]`` (all cached tokens, S >= T, the last T are the new ones).

    Query ``i`` sits at cache position ``S - T + i`` and sees keys ``0 ..= S - T + i``. Query head
    ``h`` reads KV head ``h // (H / Hkv)``. Scores, softmax and the weighted sum run in fp32; the
    result ``[T, H, D]`` is in ``q``'s dtype.
    """
    t, h, d = q.shape
    s, hkv, _ = k.shape
    if s < t or h % hkv:
        raise ValueError(f"bad attention shapes q={tuple(q.shape)} k={tuple(k.shape)}")
    group = h // hkv
    k32 = k.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [H, S, D]
    v32 = v.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [H, S, D]
    q32 = q.float().transpose(0, 1)  # [H, T, D]
    key_pos = torch.arange(s, device=q.device)
    out = torch.empty(h, t, d, dtype=torch.float32, device=q.device)
    chunk = max(1, _MAX_SCORE_ELEMENTS // max(h * s, 1))
    for start in range(0, t, chunk):  # chunks of queries only bound memory; usually one pass
        end = min(t, start + chunk)
        query_pos = torch.arange(s - t + start, s - t + end, device=q.device)
        scores = torch.matmul(q32[:, start:end], k32.transpose(1, 2)) * scale  # [H, t', S]
        future = key_pos[None, :] > query_pos[:, None]  # [t', S]
        scores = scores.masked_fill(future, float("-inf"))
        out[:, start:end] = torch.matmul(torch.softmax(scores, dim=-1), v32)
    return out.transpose(0, 1).to(q.dtype)


class Attention(NormFusedInput, nn.Module):
    def __init__(
        self,
        layer_idx: int,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        rotary: RotaryEmbedding,
        qk_norm: str | None = None,
        gated: bool = False,
        bias: bool = False,
        eps: float = 1e-6,
    ) -> None:
        super().__init__()
        if qk_norm not in QK_NORM_KINDS:
            raise ValueError(f"qk_norm must be one of {QK_NORM_KINDS}, got {qk_norm!r}")
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
        self.layer_idx = layer_idx
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.gated = gated
        self.scale = head_dim**-0.5
        self.rotary = rotary
        q_out = num_heads * head_dim * (2 if gated else 1)
        self.q_proj = Linear(hidden_size, q_out, bias=bias)
        self.k_proj = Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.v_proj = Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.o_proj = Linear(num_heads * head_dim, hidden_size, bias=bias)
        self._sizes = [q_out, num_kv_heads * head_dim, num_kv_heads * head_dim]
        self._fused: torch.Tensor | nn.Module | None = None  # concatenated q/k/v (fuse_projections)
        self.backend: backends.TorchAttention = backends.DEFAULT.attention  # the model's device's (use_backends)
        if qk_norm is not None:
            zero_centered = qk_norm == "zero_centered"
            self.q_norm = RMSNorm(head_dim, eps, zero_centered)
            self.k_norm = RMSNorm(head_dim, eps, zero_centered)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """``hidden`` ``[N, hidden]`` for the flat run -> ``[N, hidden]``; appends K/V to each cache."""
        if self._fused is not None:
            q, k, v = split_linear(hidden, self._fused, self._sizes)
        else:
            q, k, v = self.q_proj(hidden), self.k_proj(hidden), self.v_proj(hidden)
        return self._from_projections(q, k, v, batch)

    def _from_projections(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """From the projections ``[N, *]`` to the output projection's result ``[N, hidden]``."""
        n = q.shape[0]
        positions = batch.positions if batch.mrope is None else batch.mrope
        if batch.step is not None:
            out = self.backend.step(self, q, k, v, positions, batch.step, batch.memo)
            return self._o_proj(out.reshape(n, self.num_heads * self.head_dim))
        q, k, v, gate = self._prepare(q, k, v, positions, batch.memo)
        parts = []
        for (start, end), cache in zip(batch.slices, batch.caches):
            keys, values = cache.append_kv(self.layer_idx, k[start:end], v[start:end])
            parts.append(self.backend.attend(q[start:end], keys, values, self.scale))
        out = parts[0] if len(parts) == 1 else torch.cat(parts)
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return self._o_proj(out.reshape(n, self.num_heads * self.head_dim))

    def _prepare(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                 memo: dict | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The torch path's q ``[N, H, D]`` and k ``[N, Hkv, D]`` normed and rotated, v
        ``[N, Hkv, D]``, and the output gate ``[N, H, D]`` (gated attention) or None."""
        n = q.shape[0]
        gate = None
        if self.gated:  # rows per head: [q(head_dim) | gate(head_dim)]
            q, gate = q.view(n, self.num_heads, 2 * self.head_dim).split(self.head_dim, dim=-1)
        q = q.reshape(n, self.num_heads, self.head_dim)
        k = k.view(n, self.num_kv_heads, self.head_dim)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k, memo)
        return q, k, v, gate

    def _write_kv(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, meta,
                  memo: dict | None, ordinal: int, pools: tuple) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The step's new K/V written into their pages in torch (q/k normed and rotated; quantized
        pages: the keys' rotation or 4-bit ranges, bytes and scales): the query ``[N, H, D]`` as
        the attention reads it and the output gate (or None). ``pools``: the layer's pages and
        scales (``meta.kv.layer(ordinal)``)."""
        k_pages, v_pages, k_scale, v_scale = pools
        q, k, v, gate = self._prepare(q, k, v, positions, memo)
        hkv, hd = self.num_kv_heads, self.head_dim
        keys4 = k_scale is not None and is_packed(k_pages.dtype)
        if keys4:  # 4-bit keys: requantized with a range per page and channel, unrotated
            write_keys4(k_pages, k_scale, meta.write_index, k, meta.kv.exact_keys(ordinal, meta.kv_slots))
        elif k_scale is not None:  # one-byte pages: rotated keys (``kv_quant.rotation``), bytes and scales
            h = rotation(hd, q.device, torch.float32)
            if h is not None:  # in fp32: the keys go on to their bytes, the queries back to their dtype
                q, k = torch.matmul(q.float(), h).to(q.dtype), torch.matmul(k.float(), h)
            k, ks = quantize(k, k_pages.dtype)
            k_scale.flatten(0, 1).index_copy_(0, meta.write_index, ks)  # a scale per row
        if v_scale is not None:
            v, vs = quantize(v, v_pages.dtype)
            v_scale.flatten(0, 1).index_copy_(0, meta.write_index, vs)  # a scale per row (per group: 4-bit)
        for pages, x in ((k_pages, k), (v_pages, v))[keys4:]:  # e4m3 as its bytes: no fp8 index_copy_ on the CPU
            rows = raw_bytes(pages).view(-1, hkv, pages.shape[-1])
            rows.index_copy_(0, meta.write_index, raw_bytes(x.to(pages.dtype)))
        return q, gate

    def _o_proj(self, out: torch.Tensor) -> torch.Tensor:
        return self.o_proj(out)

    def fuse_projections(self) -> bool:
        self._fused = fuse_linears([self.q_proj, self.k_proj, self.v_proj])
        return self._fused is not None

    def _gate(self, q: torch.Tensor) -> torch.Tensor | None:
        """The output gate ``[N, H, D]`` interleaved in the raw query rows (gated attention), a view."""
        d = self.head_dim
        return q.view(q.shape[0], self.num_heads, 2 * d)[:, :, d:] if self.gated else None

    def _qkv_fused(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                   write_index: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor) -> torch.Tensor:
        """q/k norm + RoPE + K/V write into the pages, one Triton launch; the rotated query."""
        from .attention_triton import decode_qkv_triton

        norm = self.q_norm
        return decode_qkv_triton(
            q, k, v, positions, self.rotary.inv_freq_on(q.device),
            None if norm is None else norm.weight, None if norm is None else self.k_norm.weight,
            norm is not None and norm.zero_centered, 0.0 if norm is None else norm.eps,
            write_index, k_pages, v_pages, self.num_heads, 2 * self.head_dim if self.gated else self.head_dim)
