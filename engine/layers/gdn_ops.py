"""Pure-torch kernels of the Gated DeltaNet layer: causal conv1d and the gated delta rule.

These are the CPU path and the reference the tests hold faster kernels to. A GPU path may swap in
fused kernels behind the same signatures. All tensors describe ONE sequence, token-major, without
a batch dimension:

    q, k   [T, Hk, K]   keys/queries (l2-normalised by the caller); Hk divides Hv
    v      [T, Hv, V]
    g      [T, Hv]      log decay per token (<= 0): the state is multiplied by exp(g) at each step
    beta   [T, Hv]      write strength in (0, 1)
    state  [Hv, K, V]   fp32 recurrent state, or None for zeros

Value head j reads key head ``j // (Hv // Hk)``. Per token the recurrence is

    S = S * exp(g);  d = beta * (v - S^T k);  S = S + k d^T;  o = S^T (q * scale)

and both kernels return ``(out [T, Hv, V] in v's dtype, final state [Hv, K, V] fp32)``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor | None,
    activation: str | None = "silu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv over time, continuing from ``conv_state``.

    x: ``[T, C]`` new rows; weight: ``[C, W]`` (or ``[C, 1, W]``); conv_state: ``[W-1, C]``, the raw
    input rows of the previous W-1 tokens (None: zeros, i.e. the sequence starts here).
    Returns ``(out [T, C], new_state [W-1, C])``; out has ``activation`` applied (``"silu"`` or None),
    the new state holds the raw input of the last W-1 tokens.
    """
    if weight.dim() == 3:
        weight = weight.squeeze(1)
    channels, width = weight.shape
    if x.dim() != 2 or x.shape[1] != channels:
        raise ValueError(f"causal_conv1d: x {tuple(x.shape)} does not match weight {tuple(weight.shape)}")
    if conv_state is None:
        conv_state = x.new_zeros(width - 1, channels)
    elif conv_state.shape != (width - 1, channels):
        raise ValueError(f"causal_conv1d: conv_state {tuple(conv_state.shape)}, expected {(width - 1, channels)}")
    full = torch.cat([conv_state.to(x.dtype), x], dim=0)  # [W-1+T, C]
    out = F.conv1d(full.t().unsqueeze(0).to(weight.dtype), weight.unsqueeze(1), groups=channels)
    out = out.squeeze(0).t().to(x.dtype)  # [T, C]
    if activation == "silu":
        out = F.silu(out)
    elif activation is not None:
        raise ValueError(f"causal_conv1d: unsupported activation {activation!r}")
    return out, full[full.shape[0] - (width - 1):].clone()


def _prepare(q, k, v, g, beta, state, scale):
    """Check shapes, expand key heads to value heads, move everything to fp32."""
    t, hk, dk = k.shape
    hv, dv = v.shape[1:]
    if q.shape != k.shape or v.shape[0] != t or g.shape != (t, hv) or beta.shape != (t, hv):
        raise ValueError(
            f"gated delta rule: inconsistent shapes q{tuple(q.shape)} k{tuple(k.shape)} v{tuple(v.shape)} "
            f"g{tuple(g.shape)} beta{tuple(beta.shape)}"
        )
    if hv % hk:
        raise ValueError(f"gated delta rule: {hv} value heads are not a multiple of {hk} key heads")
    if hv != hk:
        q = q.repeat_interleave(hv // hk, dim=1)
        k = k.repeat_interleave(hv // hk, dim=1)
    if scale is None:
        scale = dk**-0.5
    if state is None:
        state = torch.zeros(hv, dk, dv, dtype=torch.float32, device=v.device)
    elif state.shape != (hv, dk, dv):
        raise ValueError(f"gated delta rule: state {tuple(state.shape)}, expected {(hv, dk, dv)}")
    f32 = [x.float() for x in (q, k, v, g, beta)]
    f32[0] = f32[0] * scale
    return (*f32, state.float())


def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor | None = None,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence token by token: exact, used for decode and as the oracle.

    Shapes as in the module docstring; ``scale`` multiplies q (default ``K ** -0.5``).
    """
    out_dtype = v.dtype
    q, k, v, g, beta, s = _prepare(q, k, v, g, beta, state, scale)
    out = torch.empty_like(v)
    for t in range(q.shape[0]):
        s = s * g[t].exp()[:, None, None]
        predicted = torch.einsum("hkv,hk->hv", s, k[t])
        delta = beta[t][:, None] * (v[t] - predicted)
        s = s + k[t][:, :, None] * delta[:, None, :]
        out[t] = torch.einsum("hkv,hk->hv", s, q[t])
    return out.to(out_dtype), s


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor | None = None,
    scale: float | None = None,
    chunk: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same recurrence in chunks of ``chunk`` tokens (WY / UT form), for prefill.

    Inside a chunk, with G_t the cumulative log decay since the chunk start and S0 the state at the
    chunk start, the written deltas solve the unit lower-triangular system

        (I + A) D = beta*V - (beta*exp(G)*K) S0,   A[t, j] = beta_t exp(G_t - G_j) k_t.k_j  (j < t)

    and then  O = (Q*exp(G)) S0 + tril(Q K^T * exp(G_t - G_j)) D,
              S_end = exp(G_last) S0 + (K*exp(G_last - G))^T D.
    Everything except the S0 terms is computed for all chunks at once; one short loop over chunks
    carries the state. Padding tokens use g = 0 and beta = 0, so they change nothing.
    """
    out_dtype = v.dtype
    q, k, v, g, beta, s = _prepare(q, k, v, g, beta, state, scale)
    t = q.shape[0]
    pad = (-t) % chunk
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, 0, 0, pad)) for x in (g, beta))
    n = (t + pad) // chunk
    # [H, n, C, D] and [H, n, C]
    q, k, v = (x.reshape(n, chunk, *x.shape[1:]).permute(2, 0, 1, 3) for x in (q, k, v))
    g, beta = (x.reshape(n, chunk, -1).permute(2, 0, 1) for x in (g, beta))

    cum = g.cumsum(dim=-1)  # G_t
    strictly_upper = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    # decay[t, j] = exp(G_t - G_j) for j <= t, 0 above the diagonal (masked before exp: no overflow)
    decay = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(strictly_upper, float("-inf")).exp()
    k_beta = k * beta.unsqueeze(-1)
    a = ((k_beta @ k.transpose(-1, -2)) * decay).tril(-1)  # strictly lower: A
    system = a + torch.eye(chunk, dtype=a.dtype, device=a.device)  # I + A, unit lower triangular
    u = torch.linalg.solve_triangular(system, v * beta.unsqueeze(-1), upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, k_beta * cum.exp().unsqueeze(-1), upper=False, unitriangular=True)
    attn = (q @ k.transpose(-1, -2)) * decay  # includes the diagonal
    q_decayed = q * cum.exp().unsqueeze(-1)
    k_to_end = k * (cum[..., -1:] - cum).exp().unsqueeze(-1)
    chunk_decay = cum[..., -1].exp()  # [H, n]

    out = torch.empty_like(v)
    for i in range(n):
        d = u[:, i] - w[:, i] @ s  # [H, C, V]
        out[:, i] = q_decayed[:, i] @ s + attn[:, i] @ d
        s = s * chunk_decay[:, i, None, None] + k_to_end[:, i].transpose(-1, -2) @ d
    out = out.permute(1, 2, 0, 3).reshape(n * chunk, out.shape[0], -1)[:t]
    return out.to(out_dtype), s


def recurrent_step_batched(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                           beta: torch.Tensor, state: torch.Tensor, scale: float | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """One token for each of ``B`` sequences: q, k ``[B, Hk, K]`` (l2-normalised), v ``[B, Hv, V]``,
    g and beta ``[B, Hv]``, state ``[B, Hv, K, V]`` fp32. Returns ``(out [B, Hv, V], new_state)``.

    On CUDA this runs fla-core's fused recurrent Triton kernel; elsewhere the same math in torch."""
    b, hk, dk = k.shape
    hv = v.shape[1]
    scale = dk**-0.5 if scale is None else scale
    if q.is_cuda:
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule

        o, new_state = fused_recurrent_gated_delta_rule(
            q[:, None].to(v.dtype), k[:, None].to(v.dtype), v[:, None], g=g[:, None].float(),
            beta=beta[:, None].float(), scale=scale, initial_state=state.float().contiguous(), output_final_state=True)
        return o[:, 0], new_state
    qf = q.float().repeat_interleave(hv // hk, dim=1) * scale
    kf = k.float().repeat_interleave(hv // hk, dim=1)
    s = state.float() * torch.exp(g.float())[..., None, None]
    delta = beta.float()[..., None] * (v.float() - torch.einsum("bhk,bhkv->bhv", kf, s))
    s = s + torch.einsum("bhk,bhv->bhkv", kf, delta)
    return torch.einsum("bhk,bhkv->bhv", qf, s).to(v.dtype), s


def prefill_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                             beta: torch.Tensor, state: torch.Tensor | None,
                             l2norm_qk: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's ``T`` new tokens (shapes as :func:`recurrent_gated_delta_rule`): fla-core's
    chunked Triton kernel on CUDA. ``l2norm_qk``: q and k come raw and are l2-normalised inside
    the kernel (eps 1e-6, as :func:`gated_delta_net.l2norm`)."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk

    hv, dk, dv = v.shape[1], k.shape[2], v.shape[2]
    if state is None:
        state = torch.zeros(hv, dk, dv, dtype=torch.float32, device=v.device)
    o, final = fla_chunk(q[None].to(v.dtype), k[None].to(v.dtype), v[None], g=g[None].float(),
                         beta=beta[None].float(), scale=dk**-0.5, initial_state=state[None].float().contiguous(),
                         output_final_state=True, use_qk_l2norm_in_kernel=l2norm_qk)
    return o[0], final[0]


def causal_conv1d_fla(x: torch.Tensor, weight: torch.Tensor,
                      conv_state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`causal_conv1d` with SiLU through fla-core's Triton kernel (CUDA): ``x`` ``[T, C]``
    (rows may be strided), ``conv_state`` ``[W-1, C]`` -> ``(out [T, C], new_state [W-1, C])``.

    fla keeps a width-``W`` state ``[N, C, W]``, oldest input first; its first column is never
    read by a width-``W`` conv, so ours maps to its last ``W - 1`` columns."""
    from fla.modules.causal_conv1d import causal_conv1d as fla_conv

    weight = weight.reshape(weight.shape[0], -1)
    channels, width = weight.shape
    init = None
    if conv_state is not None:
        init = torch.cat([conv_state.new_zeros(1, channels), conv_state.to(x.dtype)]).t()[None].contiguous()
    out, final = fla_conv(x[None], weight, initial_state=init, output_final_state=True, activation="silu",
                          backend="triton")
    return out[0], final[0, :, 1:].t().contiguous()


def varlen_conv1d_fla(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor, cu_seqlens: torch.Tensor,
                      cu_seqlens_host: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`causal_conv1d_fla` over the flat run of ``N`` sequences (fla-core's varlen Triton
    conv, CUDA): ``x`` ``[T, C]`` (rows may be strided), ``conv_state`` ``[N, W-1, C]`` each
    sequence's raw input of the tokens before its run, ``cu_seqlens`` ``[N + 1]`` int64 (also on
    the host, so the kernel's chunk table needs no sync). Returns ``(out [T, C], new_state
    [N, W-1, C])``; a run shorter than ``W - 1`` keeps the older rows of its state."""
    from fla.modules.causal_conv1d import causal_conv1d as fla_conv

    weight = weight.reshape(weight.shape[0], -1)
    n, channels = conv_state.shape[0], weight.shape[0]
    init = torch.cat([conv_state.new_zeros(n, 1, channels), conv_state.to(x.dtype)], dim=1).transpose(1, 2)
    out, final = fla_conv(x[None], weight, initial_state=init.contiguous(), output_final_state=True,
                          activation="silu", backend="triton", cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_host)
    return out[0], final[:, :, 1:].transpose(1, 2)


def varlen_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                            state: torch.Tensor, cu_seqlens: torch.Tensor, cu_seqlens_host: torch.Tensor
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`prefill_gated_delta_rule` (raw q and k, l2-normalised in the kernel) over the flat
    run of ``N`` sequences: fla-core's chunked kernel with ``cu_seqlens``, ``state`` ``[N, Hv, K, V]``
    fp32 each sequence's state before its run. Returns ``(out [T, Hv, V], final states [N, Hv, K, V])``."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk

    dk = k.shape[2]
    o, final = fla_chunk(q[None].to(v.dtype), k[None].to(v.dtype), v[None], g=g[None].float(), beta=beta[None].float(),
                         scale=dk**-0.5, initial_state=state.float().contiguous(), output_final_state=True,
                         use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_host)
    return o[0], final
