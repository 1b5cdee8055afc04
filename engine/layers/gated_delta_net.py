"""Gated DeltaNet token mixer (``linear_attn``) of Qwen3.5 and Qwen3-Next, with HF parameter names.

Projections, the gated output norm and ``out_proj`` run on the whole flat token run; the causal
conv and the recurrence continue from each sequence's state: the raw (pre-conv) qkv rows of the
last ``kernel - 1`` tokens ``[W-1, conv_dim]`` and the fp32 state ``[Hv, K, V]``. In an engine
step (``batch.step``) the states live in the pool's slots and the layer's backend
(``backends.py``) runs the step's decode, verify and prompt rows, one call per kernel on CUDA
(decode rows through the fused step kernel, prompt rows through fla-core's chunked kernels); on
the reference path they live in each sequence's ``SequenceCache`` (``backend.tokens``).

Qwen3.5 stores four projections (``in_proj_qkv`` = [Q all heads | K | V], ``in_proj_z``,
``in_proj_b``, ``in_proj_a``). Qwen3-Next (:class:`Qwen3NextGatedDeltaNet`) fuses them as
``in_proj_qkvz`` / ``in_proj_ba`` laid out per key head: ``[q, k, v_group, z_group]`` and
``[b_group, a_group]``, a group being the ``Hv / Hk`` value heads that share one key head.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from . import backends, fused_linear
from .fused_linear import NormFusedInput, fuse_linears, split_linear
from .linear import Linear
from .triton_switch import on_triton
from .gdn_ops import recurrent_step_batched, varlen_conv1d_fla, varlen_gated_delta_rule
from .gdn_prompt import prompt_delta_rule

if TYPE_CHECKING:
    from ..models.base import ForwardBatch

def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x * rsqrt(sum(x^2) + eps)`` over the last dim, in fp32."""
    x = x.float()
    return x * torch.rsqrt(x.pow(2).sum(dim=-1, keepdim=True) + eps)


class GatedRMSNorm(nn.Module):
    """Output norm of the GDN layer: ``rmsnorm(x) * weight * silu(z)`` in fp32 (plain weight)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, z: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """``[..., H, D]``; written into ``out`` (contiguous, ``x``'s size) where given."""
        if on_triton(x):
            from .norm_triton import gated_rms_norm_triton

            return gated_rms_norm_triton(x, z.to(x.dtype), self.weight, self.eps, out)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        y = (x32 * self.weight.float() * F.silu(z.float())).to(x.dtype)
        return y if out is None else out.view(y.shape).copy_(y)


class GatedDeltaNet(NormFusedInput, nn.Module):
    """Qwen3.5 layout: separate ``in_proj_qkv`` / ``in_proj_z`` / ``in_proj_b`` / ``in_proj_a``."""

    def __init__(
        self,
        layer_idx: int,
        hidden_size: int,
        num_k_heads: int,
        num_v_heads: int,
        head_k_dim: int,
        head_v_dim: int,
        conv_kernel: int = 4,
        eps: float = 1e-6,
    ) -> None:
        super().__init__()
        if num_k_heads <= 0 or num_v_heads % num_k_heads:
            raise ValueError(f"linear value heads ({num_v_heads}) must be a multiple of key heads ({num_k_heads})")
        self.layer_idx = layer_idx
        self.num_k_heads = num_k_heads
        self.num_v_heads = num_v_heads
        self.head_k_dim = head_k_dim
        self.head_v_dim = head_v_dim
        self.key_dim = num_k_heads * head_k_dim
        self.value_dim = num_v_heads * head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        # the fused input projection's parts: qkv, z, b, a
        self._sizes = [self.conv_dim, self.value_dim, num_v_heads, num_v_heads]
        self._make_projections(hidden_size)
        self._fused: torch.Tensor | nn.Module | None = None  # concatenated input projections (fuse_projections)
        self.conv1d = _DepthwiseConv(self.conv_dim, conv_kernel)
        self.A_log = nn.Parameter(torch.zeros(num_v_heads))
        self.dt_bias = nn.Parameter(torch.ones(num_v_heads))
        self.norm = GatedRMSNorm(head_v_dim, eps)
        self.out_proj = Linear(self.value_dim, hidden_size, bias=False)
        self.backend: backends.TorchLinearAttention = backends.DEFAULT.linear_attention  # use_backends

    def _make_projections(self, hidden_size: int) -> None:
        self.in_proj_qkv = Linear(hidden_size, self.conv_dim, bias=False)
        self.in_proj_z = Linear(hidden_size, self.value_dim, bias=False)
        self.in_proj_b = Linear(hidden_size, self.num_v_heads, bias=False)
        self.in_proj_a = Linear(hidden_size, self.num_v_heads, bias=False)

    def project(self, hidden: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``[N, hidden]`` -> qkv ``[N, conv_dim]`` (flat [Q | K | V]), z ``[N, value_dim]``,
        b and a ``[N, Hv]``."""
        if self._fused is not None:
            return split_linear(hidden, self._fused, self._sizes)
        return self.in_proj_qkv(hidden), self.in_proj_z(hidden), self.in_proj_b(hidden), self.in_proj_a(hidden)

    def fuse_projections(self) -> bool:
        self._fused = fuse_linears([self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a])
        return self._fused is not None

    def project_parts(self, hidden: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], torch.Tensor, torch.Tensor,
                                                           torch.Tensor]:
        """Prefill's ``project``: the conv input as one ``[N, conv_dim]`` tensor, or, for a run
        longer than ``fused_linear.SPLIT_ROWS``, as its q, k and v channel groups, each from its
        own GEMM (contiguous, so fla's chunked kernel needs no copies); then z, b, a."""
        if self._fused is not None and hidden.shape[0] > fused_linear.SPLIT_ROWS:
            q, k, v, z, b, a = split_linear(hidden, self._fused, [self.key_dim, self.key_dim, self.value_dim,
                                                                  self.value_dim, self.num_v_heads, self.num_v_heads])
            return (q, k, v), z, b, a
        qkv, z, b, a = self.project(hidden)
        return (qkv,), z, b, a

    def forward(self, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """``hidden`` ``[N, hidden]`` for the flat run -> ``[N, hidden]``; updates each row's states."""
        if batch.step is not None and batch.step.prompt is None:
            return self._from_projections(*self.project(hidden), batch)
        groups, z, b, a = self.project_parts(hidden)
        if batch.step is not None:
            return self.out_proj(self.backend.step(self, groups, z, a, b, batch.step))
        n = hidden.shape[0]
        g, beta = self._gates(a, b)
        parts = []
        for (s, e), cache in zip(batch.slices, batch.caches):
            if e > s:
                i = self.layer_idx
                o, cache.conv_states[i], cache.recurrent_states[i] = self.backend.tokens(
                    self, tuple(x[s:e] for x in groups), g[s:e], beta[s:e], cache.conv_states[i],
                    cache.recurrent_states[i])
                parts.append(o.to(hidden.dtype))
        out = parts[0] if len(parts) == 1 else torch.cat(parts) if parts else \
            hidden.new_empty(n, self.num_v_heads, self.head_v_dim)
        out = self.norm(out, z.view(n, self.num_v_heads, self.head_v_dim))
        return self.out_proj(out.reshape(n, self.value_dim))

    def _from_projections(self, qkv: torch.Tensor, z: torch.Tensor, b: torch.Tensor, a: torch.Tensor,
                          batch: ForwardBatch) -> torch.Tensor:
        """A step of decode rows only (one token per row) from the input projections -> ``[N, hidden]``."""
        return self.out_proj(self.backend.step(self, (qkv,), z, a, b, batch.step))

    def _gates(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per token and value head: the decay ``g`` (log space) and the write strength ``beta``."""
        g = -torch.exp(self.A_log.float()) * F.softplus(a.float() + self.dt_bias.float())
        return g, torch.sigmoid(b.float())

    def _conv_groups(self, groups: tuple[torch.Tensor, ...], state: torch.Tensor | None, conv
                     ) -> tuple[list[torch.Tensor], torch.Tensor]:
        """The depthwise conv over the qkv rows whole or per q / k / v group, each group with its
        channels of the weight and of ``state`` (channels last: ``[W-1, C]``, or ``[N, W-1, C]``
        for ``N`` rows): the outputs, and the new state joined on its channels."""
        weight = self.conv1d.weight
        mixed, states, lo = [], [], 0
        for x in groups:
            hi = lo + x.shape[1]
            out, new = conv(x, weight[lo:hi], None if state is None else state[..., lo:hi])
            mixed.append(out)
            states.append(new)
            lo = hi
        return mixed, states[0] if len(states) == 1 else torch.cat(states, dim=-1)

    def _conv_split(self, mixed: list[torch.Tensor], t: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The conv's output (whole, or per q / k / v group) as q, k ``[t, Hk, K]`` and v ``[t, Hv, V]``."""
        if len(mixed) == 1:
            mixed = mixed[0].split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        return (mixed[0].reshape(t, self.num_k_heads, self.head_k_dim),
                mixed[1].reshape(t, self.num_k_heads, self.head_k_dim),
                mixed[2].reshape(t, self.num_v_heads, self.head_v_dim))

    def _mix_prompt_rows(self, groups: tuple[torch.Tensor, ...], a: torch.Tensor, b: torch.Tensor,
                         conv_pool: torch.Tensor, rec_pool: torch.Tensor, slots: torch.Tensor, prompt
                         ) -> torch.Tensor:
        """Every prompt row at once (CUDA, key and value heads of one size): the conv from and into
        the slots in two launches, q and k normalised there (``gdn_prompt_triton``), then fla-core's
        chunked forward called directly, its decay computed in its first kernel (``gdn_prompt``)."""
        from .gdn_prompt_triton import prompt_conv_triton

        q, k, v = prompt_conv_triton(groups, self.conv1d.weight, conv_pool, slots, prompt.cu_seqlens_long, prompt.chunks,
                              self.num_k_heads, self.head_k_dim)
        return prompt_delta_rule(q, k, v, a, b, self.A_log, self.dt_bias, rec_pool, slots, prompt.cu_seqlens_long,
                                 prompt.chunks, prompt.chunk_offsets)

    def _mix_varlen(self, groups: tuple[torch.Tensor, ...], g: torch.Tensor, beta: torch.Tensor,
                    conv_pool: torch.Tensor, rec_pool: torch.Tensor, slots: torch.Tensor, prompt
                    ) -> torch.Tensor:
        """Every prompt row at once (CUDA): fla-core's varlen conv and chunked delta rule over the
        flat run, initial states gathered from the rows' slots, final states scattered back."""
        t = groups[0].shape[0]
        mixed, final = self._conv_groups(
            groups, conv_pool.index_select(0, slots),
            lambda x, w, s: varlen_conv1d_fla(x, w, s, prompt.cu_seqlens_long, prompt.cu_seqlens_host))
        conv_pool.index_copy_(0, slots, final)
        q, k, v = self._conv_split(mixed, t)
        o, final = varlen_gated_delta_rule(q, k, v, g, beta, rec_pool.index_select(0, slots),
                                           prompt.cu_seqlens_long, prompt.cu_seqlens_host)
        rec_pool.index_copy_(0, slots, final.to(rec_pool.dtype))
        return o

    def _decode_fused(self, qkv: torch.Tensor, z: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                      slots: torch.Tensor, meta) -> torch.Tensor:
        """The decode step up to ``out_proj``'s input (conv, recurrence, gated output norm) as one
        Triton kernel working in place on the slots (CUDA)."""
        from .gdn_decode_triton import gdn_decode_step_triton

        gi = meta.gdn_ordinal[self.layer_idx]
        return gdn_decode_step_triton(qkv, z, a, b, meta.states.conv[gi], self.conv1d.weight, self.A_log,
                                      self.dt_bias, meta.states.recurrent[gi], slots,
                                      meta.states.step_counts, self.norm.weight, self.norm.eps, self.num_k_heads)

    def _decode(self, qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, slots: torch.Tensor,
                meta) -> torch.Tensor:
        """One token per sequence, all sequences at once, states read from and written back to
        their slots in the pool (no host sync, so it can be captured in a CUDA graph). With the
        output norm, the torch reference of ``_decode_fused``."""
        b = qkv.shape[0]
        gi = meta.gdn_ordinal[self.layer_idx]
        conv_pool, rec_pool = meta.states.conv[gi], meta.states.recurrent[gi]
        window = torch.cat([conv_pool.index_select(0, slots), qkv[:, None, :].to(conv_pool.dtype)], dim=1)
        weight = self.conv1d.weight.reshape(self.conv_dim, -1)  # [C, W]
        mixed = F.silu(torch.einsum("bwc,cw->bc", window.float(), weight.float())).to(qkv.dtype)
        conv_pool.index_copy_(0, slots, window[:, 1:])
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = l2norm(q.reshape(b, self.num_k_heads, self.head_k_dim))
        k = l2norm(k.reshape(b, self.num_k_heads, self.head_k_dim))
        v = v.reshape(b, self.num_v_heads, self.head_v_dim)
        o, state = recurrent_step_batched(q, k, v, g, beta, rec_pool.index_select(0, slots))
        rec_pool.index_copy_(0, slots, state.to(rec_pool.dtype))
        return o


class Qwen3NextGatedDeltaNet(GatedDeltaNet):
    """Qwen3-Next layout: fused ``in_proj_qkvz`` and ``in_proj_ba``, rows grouped per key head."""

    def _make_projections(self, hidden_size: int) -> None:
        self.in_proj_qkvz = Linear(hidden_size, 2 * self.key_dim + 2 * self.value_dim, bias=False)
        self.in_proj_ba = Linear(hidden_size, 2 * self.num_v_heads, bias=False)

    def fuse_projections(self) -> bool:
        """Kept apart: ``project`` regroups the per-key-head rows, so one GEMM would save nothing."""
        return False

    def project(self, hidden: torch.Tensor) -> tuple[torch.Tensor, ...]:
        n, hk = hidden.shape[0], self.num_k_heads
        group = self.num_v_heads // hk
        group_v = group * self.head_v_dim
        qkvz = self.in_proj_qkvz(hidden).view(n, hk, 2 * self.head_k_dim + 2 * group_v)
        q, k, v, z = qkvz.split([self.head_k_dim, self.head_k_dim, group_v, group_v], dim=-1)
        ba = self.in_proj_ba(hidden).view(n, hk, 2 * group)
        b, a = ba.split([group, group], dim=-1)
        qkv = torch.cat([q.reshape(n, -1), k.reshape(n, -1), v.reshape(n, -1)], dim=-1)
        return qkv, z.reshape(n, -1), b.reshape(n, -1), a.reshape(n, -1)


class _DepthwiseConv(nn.Module):
    """Holds ``conv1d.weight`` ``[C, 1, W]`` (HF name, no bias); the conv runs in ``causal_conv1d``."""

    def __init__(self, channels: int, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, width))
