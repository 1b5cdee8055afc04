"""A Gated DeltaNet layer's prompt rows over their state slots on the GPU, with as few launches
and as little Python per layer as the math allows.

- ``prompt_conv``: the depthwise conv + SiLU from and into the rows' conv-state slots, q and k
  l2-normalised, in two Triton launches (``gdn_prompt_triton``); ``prompt_conv_reference`` is its
  torch reference, row by row.
- ``prompt_delta_rule``: fla-core's chunked gated delta rule, its five kernels launched from a
  thin call with their tuned choices fixed (``gdn_chunk_fla``: no autograd Function, dispatch,
  guards or per-launch autotuner keys), the decay ``g`` computed and summed inside its first
  kernel from the raw ``a``, and the recurrent states gathered from and scattered to the slots.
"""
from __future__ import annotations

import torch

from .gdn_ops import causal_conv1d
from .triton_switch import on_triton


def prompt_conv_reference(groups: tuple[torch.Tensor, ...], weight: torch.Tensor, conv_pool: torch.Tensor,
                          slots: torch.Tensor, cu_seqlens: torch.Tensor, num_k_heads: int, head_dim: int,
                          eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`prompt_conv` row by row through ``gdn_ops.causal_conv1d`` (reads ``slots`` and
    ``cu_seqlens`` on the host)."""
    from .gated_delta_net import l2norm

    x = groups[0] if len(groups) == 1 else torch.cat(groups, dim=-1)
    key_dim = num_k_heads * head_dim
    outs = []
    bounds = cu_seqlens.tolist()
    for r, slot in enumerate(slots.tolist()):
        out, conv_pool[slot] = causal_conv1d(x[bounds[r]:bounds[r + 1]], weight, conv_pool[slot])
        outs.append(out)
    y = torch.cat(outs) if outs else x.new_empty(0, x.shape[1])
    t = y.shape[0]
    q = l2norm(y[:, :key_dim].reshape(t, num_k_heads, head_dim).float(), eps).to(x.dtype)
    k = l2norm(y[:, key_dim: 2 * key_dim].reshape(t, num_k_heads, head_dim).float(), eps).to(x.dtype)
    v = y[:, 2 * key_dim:].reshape(t, -1, head_dim).contiguous()
    return q, k, v


def prompt_conv(groups: tuple[torch.Tensor, ...], weight: torch.Tensor, conv_pool: torch.Tensor,
                slots: torch.Tensor, cu_seqlens: torch.Tensor, chunks: torch.Tensor | None, num_k_heads: int,
                head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The prompt rows' conv from their slots' conv states, which it advances past the rows:
    ``groups`` the conv input ``[T, C]`` or its q, k, v channel groups; ``conv_pool``
    ``[slots, W-1, C]``; ``slots`` ``[N]`` and ``cu_seqlens`` ``[N + 1]`` int64; ``chunks`` the
    (row, chunk) table of ``models.base.chunk_pairs`` on the device (Triton). Returns q, k ``[T, Hk, D]`` l2-normalised and
    v ``[T, Hv, D]``, contiguous."""
    if on_triton(groups[0]):
        from .gdn_prompt_triton import prompt_conv_triton

        return prompt_conv_triton(groups, weight, conv_pool, slots, cu_seqlens, chunks, num_k_heads, head_dim)
    return prompt_conv_reference(groups, weight, conv_pool, slots, cu_seqlens, num_k_heads, head_dim)


def prompt_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                      A_log: torch.Tensor, dt_bias: torch.Tensor, rec_pool: torch.Tensor, slots: torch.Tensor,
                      cu_seqlens: torch.Tensor, chunks: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """fla-core's chunked forward over the flat run (CUDA): q, k (l2-normalised), v as
    :func:`prompt_conv` gives them, ``a`` / ``b`` ``[T, Hv]`` the raw gate projections
    (``g = -exp(A_log) * softplus(a + dt_bias)`` inside fla's first kernel, ``beta = sigmoid(b)``),
    each row's state read from its slot of ``rec_pool`` ``[slots, Hv, K, V]`` and its final state
    written back; ``offsets`` each row's first chunk in ``chunks`` (``PromptRows.chunk_offsets``).
    Its kernels launch from ``gdn_chunk_fla``'s thin call. Returns
    ``[T, Hv, V]`` in v's dtype."""
    from .gdn_chunk_fla import chunk_delta_rule

    beta = torch.sigmoid(b.float())
    state = rec_pool.index_select(0, slots)
    o, final = chunk_delta_rule(
        q[None], k[None], v[None], a.contiguous()[None], beta[None], A_log, dt_bias,
        state if state.dtype == torch.float32 else state.float(), cu_seqlens, chunks,
        offsets, k.shape[-1] ** -0.5)
    rec_pool.index_copy_(0, slots, final.to(rec_pool.dtype))
    return o[0].to(v.dtype)
