"""Sparse mixture-of-experts block (Qwen3.5-MoE / Qwen3-Next), with HF parameter names.

Router ``gate`` ``[E, H]``: fp32 softmax, top-k, renormalised when ``norm_topk_prob``. Experts are
stored fused: ``experts.gate_up_proj`` ``[E, 2I, H]`` (gate rows first) and ``experts.down_proj``
``[E, H, I]``. An optional shared expert is added as ``sigmoid(shared_expert_gate(x)) *
shared_expert(x)``. Tokens are grouped per expert (sorted by expert id) and only the experts that
received tokens run (the CPU path). With Triton (CUDA) the block runs as a router GEMM, a
routing kernel and the experts as grouped GEMVs for few tokens (``moe_triton.py``, decode) or a
grouped GEMM over assignments sorted by expert on the device (``moe_gemm_triton.py``, prefill),
the shared expert folded in as one more assignment when its intermediate size equals the
experts'. In a decode step the decoder layer calls ``forward_residual``, where the residual add,
the post-attention RMSNorm, the router GEMV and the routing are one launch
(``moe_triton.norm_route_triton``), so norm and block cost three launches with the shared
expert folded.

With ``--weights int4`` / ``int8`` the experts' two matrices are held quantized
(``QuantizedExperts``: an int4 product per expert on the CPU; packed for ``moe_quant_triton``'s
grouped GEMVs and grouped GEMM elsewhere, which read 4-bit experts as a quarter of the bytes),
the shared expert then running as its own quantized projections.

Checkpoints saved by transformers name experts one by one (``experts.N.gate_proj.weight``, ...);
:func:`fuse_expert_weights` turns such a stream into the fused names.
"""
from __future__ import annotations

import re
from typing import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from .fused_linear import fuse_linears
from .linear import GroupQuantized, Int4CpuMethod, TritonGroupMethod, check_shape, cpu_method_fits
from .mlp import GatedMLP
from .triton_switch import on_triton

DECODE_MAX_ASSIGNMENTS = 512  # up to this many (token, expert) pairs use the grouped GEMVs, more the GEMM
# Prompt chunks this long run the experts as a loop of cuBLAS GEMMs over tokens grouped by expert
# (one host read of the per-expert counts, so never inside a CUDA-graph capture): on an H200 at
# the 35B-A3B shape that loop prefilled 16K tokens at 14,800 tok/s against the grouped Triton
# GEMM's 6,400-6,800, while at 512 tokens the grouped GEMM is 10x faster (bench/RESULTS.md).
LOOP_MIN_TOKENS = 4096
# Arrival counters a block keeps for the fused norm + router + routing launch: one per token group
# (the launch settings' ``moe_norm_route_tiles``), so it covers up to this many groups; more tokens go unfused.
ROUTE_COUNTERS = 64


class QuantizedExperts(nn.Module):
    """One experts matrix ``[E, N, K]`` held in 4 or 8 bits (``linear.GroupQuantized`` over its
    ``E * N`` rows, groups along ``K``). On the CPU each expert is an ``Int4CpuMethod`` (torch's
    int4 matmul); elsewhere the matrix is packed for the Triton kernels (``moe_quant_triton``):
    ``packed`` ``[E, N, K / 2]`` uint8 (4-bit, ``quant_gemv_triton.pack_int4``) or int8 ``[E, N,
    K]``, ``scale`` and ``offset`` (None: symmetric) fp16 ``[E, N, K / G]``."""

    def __init__(self, w: GroupQuantized, experts: int, device: torch.device, packed: bool | None = None) -> None:
        """``packed``: held for the Triton kernels (default: off the CPU)."""
        super().__init__()
        rows, self.in_features = (int(d) for d in w.shape)
        self.experts, self.out_features = experts, rows // experts
        self.group, self.bits = w.group, w.bits
        n = self.out_features
        self.per_expert: nn.ModuleList | None = None
        if not (device.type != "cpu" if packed is None else packed):
            self.per_expert = nn.ModuleList(Int4CpuMethod.from_groups(w.select_rows(torch.arange(e * n, (e + 1) * n)))
                                     for e in range(experts))
            self.packed = self.scale = self.offset = None
            return
        from .quant_gemv_triton import pack_int4

        held = pack_int4(w.q) if w.bits == 4 else w.q.to(torch.int8).contiguous()
        self.register_buffer("packed", held.to(device).view(experts, n, -1), persistent=False)
        self.register_buffer("scale", w.scale.to(device, torch.float16).view(experts, n, -1), persistent=False)
        self.register_buffer("offset", None if w.offset is None else
                             w.offset.to(device, torch.float16).view(experts, n, -1), persistent=False)

    @staticmethod
    def fits(w: GroupQuantized, experts: int, device: torch.device) -> bool:
        """Whether ``w`` (``[E * N, K]``) is held this way on ``device``: on the CPU where the int4
        matmul takes one expert's rows; elsewhere in groups of a power of two of at least 16 columns."""
        if torch.device(device).type == "cpu":
            n = w.shape[0] // experts
            return cpu_method_fits(GroupQuantized(w.q[:n], w.scale[:n], None if w.offset is None else w.offset[:n],
                                                  w.group, w.bits, w.kind))
        return w.group >= 16 and not w.group & (w.group - 1)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """The packed matrix as ``[E, N, K]`` in ``dtype`` (held for the kernels only)."""
        if self.packed is None:
            raise ValueError("the per-expert CPU form keeps no packed matrix to dequantize")
        e, n, _ = self.packed.shape
        if self.bits == 4:
            q = torch.stack([self.packed & 15, self.packed >> 4], dim=-1).view(e, n, self.in_features).float()
        else:
            q = self.packed.float()
        w = q.view(e, n, -1, self.group) * self.scale.float()[..., None]
        if self.offset is not None:
            w = w + self.offset.float()[..., None]
        return w.view(e, n, self.in_features).to(dtype)

    def apply(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """``x @ W[e].T`` for rows ``x`` ``[M, K]``."""
        if self.per_expert is not None:
            return self.per_expert[e](x)
        return TritonGroupMethod(self.packed[e], self.scale[e], None if self.offset is None else self.offset[e],
                                 self.group)(x)


class FusedExperts(nn.Module):
    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        # the matrices held quantized (take_quantized), in place of the dense parameters
        self.gate_up_held: QuantizedExperts | None = None
        self.down_held: QuantizedExperts | None = None

    QUANTIZED = ("gate_up_proj", "down_proj")  # the tensors take_quantized holds

    @property
    def quantized(self) -> bool:
        """Whether a matrix is held quantized."""
        return self.gate_up_held is not None or self.down_held is not None

    @property
    def kernels_take(self) -> bool:
        """Whether the Triton kernels take these experts: both dense, or both held packed
        (``QuantizedExperts.packed``); otherwise they run the torch loop (``forward``)."""
        held = (self.gate_up_held, self.down_held)
        return all(h is None for h in held) or all(h is not None and h.packed is not None for h in held)

    def shapes(self) -> dict[str, tuple[int, int, int]]:
        """``[E, N, K]`` of each matrix, held or not."""
        e, i = self.num_experts, self.intermediate_size
        h = self.gate_up_held.in_features if self.gate_up_held is not None else self.gate_up_proj.shape[2]
        return {"gate_up_proj": (e, 2 * i, h), "down_proj": (e, h, i)}

    def take_quantized(self, name: str, w: GroupQuantized, device: torch.device | None = None,
                       packed: bool | None = None) -> None:
        """Hold ``w`` (checkpoint tensor ``name``: this module's ``gate_up_proj`` or ``down_proj``,
        its ``E * N`` rows) quantized on ``device`` in place of the dense parameter (``packed``:
        as ``QuantizedExperts`` takes it)."""
        attr = name.rpartition(".")[2]
        e, n, k = self.shapes()[attr]
        check_shape(name, w, torch.Size((e * n, k)))
        param = getattr(self, attr)
        setattr(self, attr.removesuffix("_proj") + "_held",
                QuantizedExperts(w, e, torch.device(device if device is not None else param.device), packed))
        delattr(self, attr)
        self.register_parameter(attr, None)

    def settle(self, dtype: torch.dtype) -> bool:
        """After loading: where one matrix is held packed and the other is dense (a GGUF file
        whose experts' halves come in formats of which only one is held), the held one dense
        again in ``dtype``, so the kernels, which take both held or neither, run them (the torch
        loop reads counts on the host, which a CUDA graph cannot). Whether it changed anything."""
        held = [(attr, getattr(self, attr.removesuffix("_proj") + "_held")) for attr in self.QUANTIZED]
        if self.kernels_take or any(h is not None and h.packed is None for _, h in held):
            return False  # (the CPU's per-expert form runs the torch loop either way)
        for attr, h in held:
            if h is not None:
                dense = h.dequantize(dtype)
                setattr(self, attr.removesuffix("_proj") + "_held", None)
                self.register_parameter(attr, nn.Parameter(dense, requires_grad=False))
        return True

    def _matmul(self, attr: str, e: int, x: torch.Tensor) -> torch.Tensor:
        held = getattr(self, attr.removesuffix("_proj") + "_held")
        return held.apply(e, x) if held is not None else F.linear(x, getattr(self, attr)[e])

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """``x`` ``[N, H]``, ``expert_ids``/``weights`` ``[N, k]`` -> weighted sum of expert outputs."""
        n, top_k = expert_ids.shape
        flat_ids = expert_ids.reshape(-1)
        order = torch.argsort(flat_ids, stable=True)  # assignments grouped by expert
        counts = torch.bincount(flat_ids, minlength=self.num_experts).tolist()
        token_of = order // top_k
        weight_of = weights.reshape(-1)[order]
        out = torch.zeros_like(x)
        start = 0
        for e, count in enumerate(counts):
            if count == 0:
                continue
            rows = token_of[start : start + count]
            gate, up = self._matmul("gate_up_proj", e, x[rows]).split(self.intermediate_size, dim=-1)
            y = self._matmul("down_proj", e, F.silu(gate) * up)
            out.index_add_(0, rows, y * weight_of[start : start + count, None].to(y.dtype))
            start += count
        return out


class SparseMoeBlock(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        intermediate_size: int,
        shared_intermediate_size: int = 0,
        norm_topk_prob: bool = True,
    ) -> None:
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok {top_k} must be in 1..num_experts ({num_experts})")
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        self.experts = FusedExperts(num_experts, hidden_size, intermediate_size)
        if shared_intermediate_size > 0:
            self.shared_expert = GatedMLP(hidden_size, shared_intermediate_size)
            self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False)
        else:
            self.shared_expert = self.shared_expert_gate = None
        self._router: torch.Tensor | None = None  # router rows (+ shared gate row), fuse_projections
        self._shared_folded = False
        # arrival counters of the fused norm + router + routing launch (int32 zeros, on the weights'
        # device): made by fuse_projections, or on first use, never during a CUDA-graph capture
        self._route_count: torch.Tensor | None = None

    def fuse_projections(self) -> bool:
        """Append the shared expert's gate row to the router, so one GEMV gives both, when the
        shared expert can ride along the experts' kernels (same intermediate size, no bias).
        Also makes the fused decode launch's counter (``forward_residual``)."""
        self._counter(self.gate.weight.device)
        shared = self.shared_expert
        if self._shared_folded:
            return True
        if shared is None or shared.down_proj.bias is not None or self.experts.quantized or \
                any(getattr(p, "method", None) is not None for p in (shared.gate_proj, shared.up_proj, shared.down_proj)) or \
                shared.down_proj.weight.shape[1] != self.experts.intermediate_size:
            return False  # (a shared expert held quantized, ``linear.py``, runs on its own)
        shared.fuse_projections()
        self._router = fuse_linears([self.gate, self.shared_expert_gate])
        self._shared_folded = self._router is not None and shared._fused is not None
        return self._shared_folded

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k expert ids ``[N, k]`` and their weights ``[N, k]`` (in ``x``'s dtype)."""
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return ids, weights.to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if on_triton(x) and self.experts.kernels_take and not (
                x.shape[0] >= LOOP_MIN_TOKENS and x.is_cuda and not self.experts.quantized
                and not torch.cuda.is_current_stream_capturing()):
            return self._forward_kernels(x)
        ids, weights = self.route(x)
        out = self.experts(x, ids, weights)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out

    def forward_residual(self, x: torch.Tensor, residual: torch.Tensor,
                         norm: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        """``(self(norm(residual + x)), residual + x)``, ``norm`` the layer's
        ``post_attention_layernorm`` (an ``RMSNorm``). For few tokens with Triton (decode) the
        residual add, the norm, the router GEMV and the routing run as one launch
        (``moe_triton.norm_route_triton``); otherwise ``norm(x, residual)`` then ``forward``."""
        n = x.shape[0] if x.dim() == 2 else 0
        if 0 < n and n * (self.top_k + int(self._shared_folded)) <= DECODE_MAX_ASSIGNMENTS and on_triton(x) \
                and self.experts.kernels_take:
            from .moe_triton import norm_route_tiles, norm_route_triton

            tiles, count = norm_route_tiles(n), self._counter(x.device)
            if tiles is not None and count is not None and -(-n // tiles["TOKENS"]) <= count.numel():
                folded = self._shared_folded
                hidden, residual, ids, weights = norm_route_triton(
                    x, residual, norm.weight, norm.eps, norm.zero_centered,
                    self._router if folded else self.gate.weight, count, self.top_k, self.experts.num_experts,
                    self.norm_topk_prob, folded)
                return self._experts_kernels(hidden, ids, weights), residual
        hidden, residual = norm(x, residual)
        return self(hidden), residual

    def _counter(self, device: torch.device) -> torch.Tensor | None:
        """The fused launch's arrival counters on ``device``; None when they would have to be
        allocated inside a CUDA-graph capture (the caller then takes the unfused kernels)."""
        count = self._route_count
        if count is None or count.device != device:
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                return None
            count = self._route_count = torch.zeros(ROUTE_COUNTERS, dtype=torch.int32, device=device)
        return count

    def _forward_kernels(self, x: torch.Tensor) -> torch.Tensor:
        """Router GEMM and routing kernel, then the experts (``_experts_kernels``)."""
        from .moe_triton import route_triton

        folded = self._shared_folded
        logits = F.linear(x, self._router if folded else self.gate.weight)
        ids, weights = route_triton(logits, self.top_k, self.experts.num_experts, self.norm_topk_prob, folded)
        return self._experts_kernels(x, ids, weights)

    def _experts_kernels(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The routed experts as grouped GEMVs (few tokens: decode) or as a grouped GEMM over
        assignments sorted by expert (prefill); the shared expert rides along when folded."""
        from .moe_gemm_triton import moe_grouped_gemm
        from .moe_triton import moe_down_triton, moe_gate_up_triton

        experts = self.experts
        if experts.quantized:  # both held packed (kernels_take)
            from .moe_quant_triton import moe_down_quant, moe_gate_up_quant, moe_grouped_gemm_quant

            if ids.numel() <= DECODE_MAX_ASSIGNMENTS:
                out = moe_down_quant(moe_gate_up_quant(x, experts.gate_up_held, ids), experts.down_held, ids, weights)
            else:
                out = moe_grouped_gemm_quant(x, experts.gate_up_held, experts.down_held, ids, weights)
            if self.shared_expert is not None:
                out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
            return out
        folded = self._shared_folded
        shared = self.shared_expert if folded else None
        shared_gate_up = None if shared is None else shared._fused
        shared_down = None if shared is None else shared.down_proj.weight
        if ids.numel() <= DECODE_MAX_ASSIGNMENTS:
            h = moe_gate_up_triton(x, experts.gate_up_proj, shared_gate_up, ids)
            out = moe_down_triton(h, experts.down_proj, shared_down, ids, weights)
        else:
            out = moe_grouped_gemm(x, experts.gate_up_proj, experts.down_proj, ids, weights, shared_gate_up,
                                   shared_down)
        if self.shared_expert is not None and not folded:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


_PER_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def fuse_expert_weights(
    weights: Iterable[tuple[str, torch.Tensor]], num_experts: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """Pass tensors through, stacking per-expert ``<p>.experts.N.{gate,up,down}_proj.weight`` into
    ``<p>.experts.gate_up_proj`` ``[E, 2I, H]`` and ``<p>.experts.down_proj`` ``[E, H, I]``.

    A group is emitted as soon as all its experts have arrived, so at most one layer's experts are
    held at a time when the checkpoint is ordered. Incomplete groups raise ``ValueError``.
    """
    pending: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    for name, tensor in weights:
        match = _PER_EXPERT.match(name)
        if match is None:
            yield name, tensor
            continue
        prefix, index, kind = match.group(1), int(match.group(2)), match.group(3)
        if index >= num_experts:
            raise ValueError(f"unexpected weight {name}: expert {index} >= num_experts {num_experts}")
        parts = pending.setdefault(prefix, {"gate_proj": {}, "up_proj": {}, "down_proj": {}})
        parts[kind][index] = tensor
        if all(len(p) == num_experts for p in parts.values()):
            del pending[prefix]
            yield from _stack(prefix, parts, num_experts)
    for prefix, parts in pending.items():
        missing = [
            f"{prefix}.{e}.{kind}.weight" for kind, p in parts.items() for e in range(num_experts) if e not in p
        ]
        raise ValueError(f"missing expert weights: {', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}")


def _stack(prefix: str, parts: dict[str, dict[int, torch.Tensor]], n: int) -> Iterator[tuple[str, torch.Tensor]]:
    gate = torch.stack([parts["gate_proj"][e] for e in range(n)])
    up = torch.stack([parts["up_proj"][e] for e in range(n)])
    yield f"{prefix}.gate_up_proj", torch.cat([gate, up], dim=1)
    yield f"{prefix}.down_proj", torch.stack([parts["down_proj"][e] for e in range(n)])
