"""fla-core's chunked gated delta rule forward, its five kernels launched from one thin call.

fla-core's ``chunk_gated_delta_rule_fwd`` reaches its kernels through a backend-dispatch wrapper
and a ``torch.compiler.disable`` frame per operation, ``triton.heuristics`` and an autotuner that
builds its key from every argument on every launch: about 0.3 ms of host time a kernel, five a
Gated DeltaNet layer, in a step whose kernels take less. Here each kernel is launched as its
``triton.jit`` function with what those layers decide (the heuristics' flags, the autotuned tile
and warps) fixed after its first launch through them (:class:`FixedLaunch`), and the buffers and
grids are the ones fla-core's wrappers make for a flat run of rows (``cu_seqlens``) with the
decay computed inside the first kernel. fla-core stays the kernel library; the math and the
results are its own (``tests/interp``: equal to its forward; ``tests/gpu``: on CUDA).
"""
from __future__ import annotations

import functools

import torch
import triton
from triton.runtime.autotuner import Autotuner, Heuristics

CHUNK = 64  # fla-core's chunk (models.base.GDN_CHUNK: the step's (row, chunk) table is built for it)
_RCP_LN2 = 1.4426950408889634  # fla-core keeps the decay's cumulative sums in base 2


class FixedLaunch:
    """A Triton kernel under ``triton.heuristics`` and an autotuner, launched as its jit function
    with their decisions fixed: the first launch at each ``site`` (a key of what the decisions
    depend on: head counts and sizes, dtypes) goes through the decorators, which tune and choose;
    later ones pass those choices (constexpr flags, tile sizes, warps and stages) directly."""

    def __init__(self, kernel) -> None:
        self.kernel = kernel
        self.tuner: Autotuner | None = None
        self.heuristics: list[dict] = []
        fn = kernel
        while isinstance(fn, (Autotuner, Heuristics)):
            if isinstance(fn, Autotuner):
                self.tuner = fn
            else:
                self.heuristics.append(fn.values)
            fn = fn.fn
        self.jit = fn
        self.fixed: dict[tuple, dict] = {}

    def __call__(self, site: tuple, grid, **args) -> None:
        fixed = self.fixed.get(site)
        if fixed is not None:
            self.jit[grid](**args, **fixed)
            return
        self.kernel[grid](**args)
        fixed = dict(self.tuner.best_config.all_kwargs()) if self.tuner is not None else {}
        seen = dict(args)
        for values in self.heuristics:  # outermost first, as the decorators run them
            for name, rule in values.items():
                seen[name] = fixed[name] = rule(seen)
        self.fixed[site] = fixed


class ChunkKernels:
    """fla-core's forward kernels of the chunked gated delta rule (with the decay's gate inside
    the first), each a :class:`FixedLaunch`."""

    def __init__(self) -> None:
        from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_fwd_kernel_h_blockdim64
        from fla.ops.common.chunk_o import chunk_fwd_kernel_o
        from fla.ops.gated_delta_rule.chunk_fwd import chunk_gated_delta_rule_fwd_kkt_solve_kernel
        from fla.ops.gated_delta_rule.gate import gdn_gate_chunk_cumsum_scalar_kernel
        from fla.ops.gated_delta_rule.wy_fast import recompute_w_u_fwd_kernel

        self.gate = FixedLaunch(gdn_gate_chunk_cumsum_scalar_kernel)
        self.solve = FixedLaunch(chunk_gated_delta_rule_fwd_kkt_solve_kernel)
        self.w_u = FixedLaunch(recompute_w_u_fwd_kernel)
        self.states = FixedLaunch(chunk_gated_delta_rule_fwd_kernel_h_blockdim64)
        self.out = FixedLaunch(chunk_fwd_kernel_o)


@functools.cache
def chunk_kernels() -> ChunkKernels:
    """The process's :class:`ChunkKernels` (made at the first call: fla-core imports then)."""
    return ChunkKernels()


def chunk_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, beta: torch.Tensor,
                     A_log: torch.Tensor, dt_bias: torch.Tensor, state: torch.Tensor, cu_seqlens: torch.Tensor,
                     chunks: torch.Tensor, offsets: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked forward over a flat run of ``N`` rows: ``q``, ``k`` ``[1, T, H, K]``
    (l2-normalised), ``v`` ``[1, T, HV, V]``, ``a`` ``[1, T, HV]`` the raw decay projection
    (``g = -exp(A_log) * softplus(a + dt_bias)`` inside the first kernel), ``beta`` ``[1, T, HV]``
    fp32, ``state`` ``[N, HV, K, V]`` fp32 each row's state before it, ``cu_seqlens`` ``[N + 1]``
    int64, ``chunks`` the ``[NT, 2]`` (row, chunk) table, ``offsets`` each row's first chunk in it (``models.base.chunk_offsets``).
    Returns ``(o [1, T, HV, V] in v's dtype, final states [N, HV, K, V] fp32)``: fla-core's
    ``chunk_gated_delta_rule_fwd`` with ``use_gate_in_kernel``."""
    run = chunk_kernels()
    _, t, h, dk = k.shape
    hv, dv = v.shape[2], v.shape[3]
    n, nt = cu_seqlens.shape[0] - 1, chunks.shape[0]
    site = (h, hv, dk, dv, k.dtype, v.dtype)
    g = torch.empty(1, t, hv, dtype=torch.float32, device=k.device)
    run.gate(site, (nt, hv), g=a, A_log=A_log, dt_bias=dt_bias, o=g, scale=_RCP_LN2, cu_seqlens=cu_seqlens,
             chunk_indices=chunks, T=t, H=hv, BT=CHUNK, REVERSE=False)
    A = torch.zeros(1, t, hv, CHUNK, dtype=k.dtype, device=k.device)
    run.solve(site, (nt, hv), k=k, g=g, beta=beta, A=A, cu_seqlens=cu_seqlens, chunk_indices=chunks, T=t, H=h, HV=hv,
              K=dk, BT=CHUNK, BC=16)
    w = k.new_empty(1, t, hv, dk)
    u = torch.empty_like(v)
    run.w_u(site, (nt, hv), k=k, v=v, beta=beta, w=w, u=u, A=A, g=g, cu_seqlens=cu_seqlens, chunk_indices=chunks,
            T=t, H=h, HV=hv, K=dk, V=dv, BT=CHUNK, BK=64, BV=64)
    h_all = k.new_empty(1, nt, hv, dk, dv)
    final = k.new_zeros(n, hv, dk, dv, dtype=torch.float32)
    v_new = torch.empty_like(u)
    run.states(site, lambda meta: (triton.cdiv(dv, meta["BV"]) * n * hv,), k=k, v=u, w=w, v_new=v_new, g=g, gk=None,
               h=h_all, h0=state, ht=final, cu_seqlens=cu_seqlens, chunk_offsets=offsets, T=t, H=h, HV=hv, K=dk,
               V=dv, BT=CHUNK, STATE_V_FIRST=False)
    o = torch.empty_like(v)
    run.out(site, lambda meta: (triton.cdiv(dv, meta["BV"]) * nt, hv), q=q, k=k, v=v_new, h=h_all, g=g,
            g_gamma=None, o=o, cu_seqlens=cu_seqlens, chunk_indices=chunks, scale=scale, T=t, H=h, HV=hv, K=dk,
            V=dv, BT=CHUNK, STATE_V_FIRST=False)
    return o, final
