"""The kernels a step runs in its token mixers, chosen once for the device the model is built on.

An attention backend and a linear-attention (Gated DeltaNet) backend each take a whole step over
the shared pools (``models.base.StepMeta``): its decode rows, the rows that verify drafts and
its prompt rows, each kind through its own kernels, and a sequence on the models' reference path
(its own ``SequenceCache``). ``build_model`` installs the backends of its device
(``Backends.for_device``, ``use_backends``); the layers call them and never ask where their
tensors live or which rows a step holds.

| backend | attention | Gated DeltaNet |
|---|---|---|
| ``torch`` (CPU) | q/k norm, RoPE and the K/V write in torch; decode rows through torch's SDPA per KV head's query group (``paged_decode_attention_sdpa``); prompt rows and a sequence through the fp32 reference | the conv and recurrence in torch: decode rows all at once (``GatedDeltaNet._decode``), verify rows position by position (``gdn_verify_reference``), prompt rows and a sequence row by row (recurrent form under ``RECURRENT_MAX_TOKENS`` tokens, chunked above) |
| ``triton`` (CUDA) | q/k norm + RoPE + K/V write in one launch where the pages are not quantized; the split-K decode kernel; the varlen prompt kernel; a sequence through torch's fused SDPA | the fused decode step; the verify kernel; prompt rows through the Triton conv and fla-core's chunked rule (``gdn_prompt``; fla-core's varlen conv and rule where key and value heads differ in size); a sequence through fla-core |
| ``interpreter`` (CPU, ``TRITON_INTERPRET=1``) | as ``triton``, but decode rows and a sequence as ``torch`` | the fused decode step and the verify kernel; prompt rows and a sequence as ``torch`` (fla-core needs CUDA) |

Quantized KV pages take the torch K/V write on every backend (the keys' rotation, 4-bit key
ranges), then the backend's attention kernels, which read them dequantized.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .gdn_ops import (causal_conv1d, causal_conv1d_fla, chunk_gated_delta_rule, prefill_gated_delta_rule,
                      recurrent_gated_delta_rule)
from .triton_switch import INTERPRET

RECURRENT_MAX_TOKENS = 8  # the torch path's runs shorter than this take the token loop, longer the chunked form


# ------------------------------------------------------------------------------------ attention
class TorchAttention:
    """Attention in torch: the reference every other backend is tested against."""

    name = "torch"
    fused_write = False  # q/k norm + RoPE + K/V write in one Triton launch (unquantized pages)

    def step(self, layer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, meta,
             memo: dict | None, out: torch.Tensor | None = None) -> torch.Tensor:
        """The step's new K/V written into its pages, then its decode rows and its prompt rows
        attending over them: ``[N, H, D]`` with the output gate applied (into ``out`` where given)."""
        ordinal = meta.attn_ordinal[layer.layer_idx]
        k_pages, v_pages, k_scale, v_scale = meta.kv.layer(ordinal)
        if self.fused_write and k_scale is None and positions.dim() == 1:  # three-axis positions: the torch write
            gate = layer._gate(q)
            q = layer._qkv_fused(q, k, v, positions, meta.write_index, k_pages, v_pages)
        else:
            q, gate = layer._write_kv(q, k, v, positions, meta, memo, ordinal, (k_pages, v_pages, k_scale, v_scale))
        d, prompt = meta.num_decode, meta.prompt
        parts = []
        if d:
            parts.append(self.decode(q[:d], k_pages, v_pages, meta.block_tables[:d], meta.context_lens[:d],
                                     layer.scale, None if gate is None else gate[:d], k_scale, v_scale))
        if prompt is not None:
            parts.append(self.prefill(q[d:], k_pages, v_pages, meta.block_tables[d:], prompt.cu_seqlens,
                                      meta.context_lens[d:], prompt.max_seqlen, layer.scale,
                                      None if gate is None else gate[d:], k_scale, v_scale))
        if out is None:
            return parts[0] if len(parts) == 1 else torch.cat(parts)
        if len(parts) == 1:
            return out.copy_(parts[0])
        return torch.cat(parts, out=out)

    def decode(self, q, k_pages, v_pages, block_tables, context_lens, scale, gate, k_scale, v_scale):
        from .paged_attention import paged_decode_attention_sdpa

        out = paged_decode_attention_sdpa(q, k_pages, v_pages, block_tables, context_lens, scale, k_scale, v_scale)
        return out if gate is None else out * torch.sigmoid(gate)

    def prefill(self, q, k_pages, v_pages, block_tables, cu_seqlens, ctx_lens, max_seqlen, scale, gate, k_scale,
                v_scale):
        from .prefill_attention import prefill_attention_ref

        return prefill_attention_ref(q, k_pages, v_pages, block_tables, cu_seqlens, ctx_lens, scale, gate,
                                     k_scale, v_scale)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """One sequence's newest ``T`` queries over its ``S`` cached keys (the reference path)."""
        from .attention import causal_attention

        return causal_attention(q, k, v, scale)


class TritonAttention(TorchAttention):
    name = "triton"
    fused_write = True

    def decode(self, q, k_pages, v_pages, block_tables, context_lens, scale, gate, k_scale, v_scale):
        from .paged_attention import _check
        from .paged_attention_triton import paged_decode_attention_triton

        _check(q, k_pages, v_pages, block_tables, context_lens)
        return paged_decode_attention_triton(q, k_pages, v_pages, block_tables, context_lens, scale, gate,
                                             k_scale=k_scale, v_scale=v_scale)

    def prefill(self, q, k_pages, v_pages, block_tables, cu_seqlens, ctx_lens, max_seqlen, scale, gate, k_scale,
                v_scale):
        from .prefill_attention_triton import prefill_attention_triton

        return prefill_attention_triton(q, k_pages, v_pages, block_tables, cu_seqlens, ctx_lens, max_seqlen, scale,
                                        gate, k_scale=k_scale, v_scale=v_scale)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """torch's fused SDPA (flash / memory-efficient kernels, bottom-right causal mask)."""
        import torch.nn.functional as F
        from torch.nn.attention.bias import causal_lower_right

        t, s = q.shape[0], k.shape[0]
        qh, kh, vh = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
        mask = causal_lower_right(t, s) if t > 1 else None
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale,
                                             enable_gqa=q.shape[1] != k.shape[1])
        return out[0].transpose(0, 1)


class InterpretedAttention(TritonAttention):
    """The Triton kernels that Triton's CPU interpreter runs; decode rows and a sequence in torch."""

    name = "interpreter"
    decode = TorchAttention.decode
    attend = TorchAttention.attend


# ------------------------------------------------------------------------- Gated DeltaNet
class TorchLinearAttention:
    """The Gated DeltaNet conv and recurrence in torch: the reference of the other backends."""

    name = "torch"
    rows_in_graph = False  # its ``graph_rows`` is the reference: no bucket captures it unless a test asks

    def step(self, layer, groups: tuple[torch.Tensor, ...], z: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
             meta, out: torch.Tensor | None = None) -> torch.Tensor:
        """A step over the state slots from the input projections (the conv input whole or as its
        q / k / v groups, z, a, b): its decode rows (every row, in a step without prompt rows),
        then its prompt rows, each from its slot's states, which it advances. ``[N, value_dim]``,
        ``out_proj``'s input (written into ``out``, contiguous, where given: the prompt rows'
        output norm writes there directly)."""
        n = z.shape[0]
        d = n if meta.prompt is None else meta.num_decode
        parts = []
        if d:
            qkv = groups[0][:d] if len(groups) == 1 else torch.cat([x[:d] for x in groups], dim=-1)
            parts.append(self._decode_rows(layer, qkv, z[:d], a[:d], b[:d], meta))
            if out is not None:
                out[:d].copy_(parts.pop())
        if d < n:
            t = n - d
            heads = (t, layer.num_v_heads, layer.head_v_dim)
            o = self.prompt(layer, tuple(x[d:] for x in groups), a[d:], b[d:], meta)
            y = layer.norm(o.to(z.dtype), z[d:].view(heads), out=None if out is None else out[d:].view(heads))
            parts.append(y.reshape(t, layer.value_dim))
        if out is not None:
            return out
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def graph_rows(self, layer, groups: tuple[torch.Tensor, ...], z: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                   meta, rows, out: torch.Tensor) -> torch.Tensor:
        """The torch reference of ``TritonLinearAttention.graph_rows`` (a CPU captures no such bucket
        unless a test asks, ``rows_in_graph``): every shape fixed by the bucket and no device value
        read on the host. Each token finds its prompt row from ``rows.cu_seqlens``; its conv window
        comes from the tokens before it in the row and the row's conv state; the recurrence walks
        the bucket's tokens one at a time, each updating its row's state where it lies inside a
        row; the final states go to the rows' slots (rows of no tokens: the padding slot). Then the
        decode rows run from their slots, the ones past the real rows on ``rows.pad_slot``, their
        outputs kept only for the real ones."""
        from .gated_delta_net import l2norm
        from .gdn_ops import recurrent_step_batched

        gi = meta.gdn_ordinal[layer.layer_idx]
        conv_pool, rec_pool = meta.states.conv[gi], meta.states.recurrent[gi]
        x = groups[0] if len(groups) == 1 else torch.cat(groups, dim=-1)
        t, c = x.shape
        weight = layer.conv1d.weight.reshape(c, -1)  # [C, W]
        w = weight.shape[1]
        cu, slots = rows.cu_seqlens, rows.prompt_slots
        p = slots.shape[0]
        at = torch.arange(t, device=x.device)
        row = torch.searchsorted(cu[1:], at, right=True).clamp(max=p - 1)  # each token's row
        start, inside = cu[row], (at >= cu[0]) & (at < cu[-1])
        old = conv_pool.index_select(0, slots)  # [P, W-1, C]: the W-1 inputs before each row

        def inputs(pos: torch.Tensor, first: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
            """The conv input at flat positions ``pos`` of rows ``r`` starting at ``first``."""
            mine = x.index_select(0, pos.clamp(0, t - 1)).to(conv_pool.dtype)
            before = old[r, (w - 1 + pos - first).clamp(0, w - 2)]
            return torch.where((pos >= first)[:, None], mine, before)

        window = torch.stack([inputs(at - (w - 1) + j, start, row) for j in range(w)], dim=1)  # [T, W, C]
        mixed = F.silu(torch.einsum("twc,cw->tc", window.float(), weight.float())).to(x.dtype)
        q, k, v = mixed.split([layer.key_dim, layer.key_dim, layer.value_dim], dim=-1)
        q = l2norm(q.reshape(t, layer.num_k_heads, layer.head_k_dim))
        k = l2norm(k.reshape(t, layer.num_k_heads, layer.head_k_dim))
        v = v.reshape(t, layer.num_v_heads, layer.head_v_dim)
        g, beta = layer._gates(a, b)
        state = rec_pool.index_select(0, slots).float()
        o = []
        for i in range(t):
            r = row[i: i + 1]
            before = state.index_select(0, r)
            o_i, after = recurrent_step_batched(q[i: i + 1], k[i: i + 1], v[i: i + 1], g[i: i + 1], beta[i: i + 1],
                                                before)
            state.index_copy_(0, r, torch.where(inside[i], after, before))
            o.append(o_i)
        rec_pool.index_copy_(0, slots, state.to(rec_pool.dtype))
        ends, firsts, each = cu[1:], cu[:-1], torch.arange(p, device=x.device)
        conv_pool.index_copy_(0, slots, torch.stack(
            [inputs(ends - (w - 1) + j, firsts, each) for j in range(w - 1)], dim=1))
        heads = (t, layer.num_v_heads, layer.head_v_dim)
        layer.norm(torch.cat(o).to(z.dtype), z.view(heads), out=out.view(heads))
        n = rows.decode_slots.shape[0]
        real = rows.decode_slots >= 0
        safe = torch.where(real, rows.decode_slots, rows.pad_slot)
        decoded = self.decode(layer, x[:n], z[:n], a[:n], b[:n], safe, meta)
        out[:n].copy_(torch.where(real[:, None], decoded, out[:n]))
        return out

    def _decode_rows(self, layer, qkv, z, a, b, meta) -> torch.Tensor:
        """One token for each row: plain decode rows (distinct slots), then the rows that verify
        drafts (``meta.verify``), which share their request's slot and leave it as it is; the
        states after each of their positions are kept for ``VerifyRows.commit``."""
        n = qkv.shape[0]
        verify = meta.verify
        if verify is None:
            return self.decode(layer, qkv, z, a, b, meta.slot_ids[:n], meta)
        d, t = verify.first, n - verify.first
        gi = meta.gdn_ordinal[layer.layer_idx]
        conv, recurrent = verify.buffers(meta.states)
        o = self.verify(qkv[d:], a[d:], b[d:], meta.states.conv[gi], layer.conv1d.weight, layer.A_log, layer.dt_bias,
                        meta.states.recurrent[gi], verify.slots, verify.cu_seqlens, conv[gi], recurrent[gi],
                        layer.num_k_heads)
        out = layer.norm(o, z[d:].view(t, layer.num_v_heads, layer.head_v_dim)).reshape(t, layer.value_dim)
        if not d:
            return out
        return torch.cat([self.decode(layer, qkv[:d], z[:d], a[:d], b[:d], meta.slot_ids[:d], meta), out])

    def decode(self, layer, qkv, z, a, b, slots, meta) -> torch.Tensor:
        """Rows of distinct ``slots``: conv, recurrence and output norm -> ``[n, value_dim]``."""
        n = qkv.shape[0]
        g, beta = layer._gates(a, b)
        out = layer._decode(qkv, g, beta, slots, meta)
        return layer.norm(out, z.view(n, layer.num_v_heads, layer.head_v_dim)).reshape(n, layer.value_dim)

    def verify(self, *args) -> torch.Tensor:
        from .gdn_verify import gdn_verify_reference

        return gdn_verify_reference(*args)

    def prompt(self, layer, groups, a, b, meta) -> torch.Tensor:
        """The prompt rows, row by row from and into their slots -> ``[t, Hv, V]``."""
        g, beta = layer._gates(a, b)
        gi = meta.gdn_ordinal[layer.layer_idx]
        conv_pool, rec_pool = meta.states.conv[gi], meta.states.recurrent[gi]
        bounds, outs = meta.prompt.cu_seqlens_host.tolist(), []
        for r, slot in enumerate(meta.prompt.slots_host):
            s, e = bounds[r], bounds[r + 1]
            o, conv_pool[slot], rec_pool[slot] = self.tokens(
                layer, tuple(x[s:e] for x in groups), g[s:e], beta[s:e], conv_pool[slot], rec_pool[slot])
            outs.append(o)
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def tokens(self, layer, groups, g, beta, conv_state, state):
        """Conv + recurrence for one sequence's new tokens from its conv state ``[W-1, C]`` and
        recurrent state (None: zeros) -> ``(out [T, Hv, V], conv state, recurrent state)``."""
        from .gated_delta_net import l2norm

        t = groups[0].shape[0]
        mixed, conv_state = layer._conv_groups(groups, conv_state, causal_conv1d)
        q, k, v = layer._conv_split(mixed, t)
        rule = recurrent_gated_delta_rule if t < RECURRENT_MAX_TOKENS else chunk_gated_delta_rule
        o, state = rule(l2norm(q), l2norm(k), v, g, beta, state)
        return o, conv_state, state


class TritonLinearAttention(TorchLinearAttention):
    name = "triton"
    rows_in_graph = True  # ``graph_rows``: a step's core that a CUDA graph can hold

    def graph_rows(self, layer, groups: tuple[torch.Tensor, ...], z: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                   meta, rows, out: torch.Tensor) -> torch.Tensor:
        """A step of prompt rows after its decode rows over every token of a captured bucket,
        reading the rows from device tensors alone (``cuda_graph_mixed.GraphRows``: the prompt
        rows' bounds in the flat run, their slots and chunk table, rows of no tokens on the
        padding slot past them; the decode rows' slots, -1 past the real ones), so a CUDA graph
        replays it for any such step: the Triton conv and fla-core's chunked rule over the prompt
        rows (tokens outside them are read by no program and written by none), the output norm
        over every token into ``out`` ``[T, value_dim]``, then the fused decode step over the first
        ``rows.decode_slots`` tokens, which writes the real decode rows' outputs over those and
        skips the rest."""
        from .gdn_decode_triton import gdn_decode_step_triton
        from .gdn_prompt import prompt_delta_rule
        from .gdn_prompt_triton import prompt_conv_triton

        gi = meta.gdn_ordinal[layer.layer_idx]
        conv_pool, rec_pool = meta.states.conv[gi], meta.states.recurrent[gi]
        t = z.shape[0]
        q, k, v = prompt_conv_triton(groups, layer.conv1d.weight, conv_pool, rows.prompt_slots, rows.cu_seqlens,
                                     rows.chunks, layer.num_k_heads, layer.head_k_dim)
        o = prompt_delta_rule(q, k, v, a, b, layer.A_log, layer.dt_bias, rec_pool, rows.prompt_slots, rows.cu_seqlens,
                              rows.chunks, rows.chunk_offsets)
        heads = (t, layer.num_v_heads, layer.head_v_dim)
        layer.norm(o.to(z.dtype), z.view(heads), out=out.view(heads))
        n = rows.decode_slots.shape[0]
        qkv = groups[0][:n] if len(groups) == 1 else torch.cat([x[:n] for x in groups], dim=-1)
        gdn_decode_step_triton(qkv, z[:n], a[:n], b[:n], conv_pool, layer.conv1d.weight, layer.A_log, layer.dt_bias,
                               rec_pool, rows.decode_slots, meta.states.step_counts, layer.norm.weight, layer.norm.eps,
                               layer.num_k_heads, out=out[:n])
        return out

    def decode(self, layer, qkv, z, a, b, slots, meta) -> torch.Tensor:
        return layer._decode_fused(qkv, z, a, b, slots, meta)

    def verify(self, *args) -> torch.Tensor:
        from .gdn_verify_triton import gdn_verify_triton

        return gdn_verify_triton(*args)

    def prompt(self, layer, groups, a, b, meta) -> torch.Tensor:
        """Every prompt row in one call per kernel (CUDA): a few rows of a few tokens (the launch
        settings ``gdn_recurrent_prompt_tokens``, ``gdn_recurrent_step_tokens``) through the verify kernel's recurrent form, each
        row's final states then copied into its slot; longer ones through the Triton conv and
        fla-core's chunked rule, or fla-core's varlen conv and rule where key and value heads
        differ in size."""
        from .. import launch

        gi, d = meta.gdn_ordinal[layer.layer_idx], meta.num_decode
        conv_pool, rec_pool, slots = meta.states.conv[gi], meta.states.recurrent[gi], meta.slot_ids[d:]
        settings, longest = launch.current(), meta.prompt.max_seqlen
        if longest <= settings.gdn_recurrent_prompt_tokens and \
                longest * len(meta.prompt.slots_host) <= settings.gdn_recurrent_step_tokens:
            return self.short_rows(layer, groups, a, b, conv_pool, rec_pool, slots, meta.prompt)
        if layer.head_k_dim == layer.head_v_dim:
            return layer._mix_prompt_rows(groups, a, b, conv_pool, rec_pool, slots, meta.prompt)
        g, beta = layer._gates(a, b)
        return layer._mix_varlen(groups, g, beta, conv_pool, rec_pool, slots, meta.prompt)

    @staticmethod
    def short_rows(layer, groups, a, b, conv_pool, rec_pool, slots, prompt) -> torch.Tensor:
        """Prompt rows of a few tokens in one launch, each walked token by token from its slot's
        states (``gdn_verify_triton`` keeping only the states after a row's last token), which
        then replace the slot's -> ``[t, Hv, V]`` before the output norm."""
        from .gdn_verify_triton import gdn_verify_triton

        qkv = groups[0] if len(groups) == 1 else torch.cat(groups, dim=-1)
        rows = slots.shape[0]
        conv = conv_pool.new_empty((rows, *conv_pool.shape[1:]))
        state = rec_pool.new_empty((rows, *rec_pool.shape[1:]))
        o = gdn_verify_triton(qkv, a, b, conv_pool, layer.conv1d.weight, layer.A_log, layer.dt_bias, rec_pool, slots,
                              prompt.cu_seqlens_long, conv, state, layer.num_k_heads, last_only=True)
        conv_pool.index_copy_(0, slots, conv)
        rec_pool.index_copy_(0, slots, state)
        return o

    def tokens(self, layer, groups, g, beta, conv_state, state):
        """fla-core's Triton conv and chunked rule, l2 norms of q and k inside it."""
        t = groups[0].shape[0]
        mixed, conv_state = layer._conv_groups(groups, conv_state, causal_conv1d_fla)
        q, k, v = layer._conv_split(mixed, t)
        o, state = prefill_gated_delta_rule(q, k, v, g, beta, state, l2norm_qk=True)
        return o, conv_state, state


class InterpretedLinearAttention(TritonLinearAttention):
    """The decode and verify kernels under Triton's CPU interpreter; prompt rows and a sequence
    in torch (fla-core's kernels need CUDA)."""

    name = "interpreter"
    rows_in_graph = False
    prompt = TorchLinearAttention.prompt
    tokens = TorchLinearAttention.tokens


# ------------------------------------------------------------------------------ choosing
@dataclass(frozen=True)
class Backends:
    attention: TorchAttention
    linear_attention: TorchLinearAttention

    @classmethod
    def for_device(cls, device: torch.device | str) -> "Backends":
        if torch.device(device).type == "cuda":
            return cls(TritonAttention(), TritonLinearAttention())
        if INTERPRET:
            return cls(InterpretedAttention(), InterpretedLinearAttention())
        return cls(TorchAttention(), TorchLinearAttention())

    @classmethod
    def named(cls, name: str) -> "Backends":
        kinds = {"torch": (TorchAttention, TorchLinearAttention), "triton": (TritonAttention, TritonLinearAttention),
                 "interpreter": (InterpretedAttention, InterpretedLinearAttention)}
        attention, linear = kinds[name]
        return cls(attention(), linear())


def use_backends(model: torch.nn.Module, backends: Backends) -> None:
    """Every token mixer of ``model`` calls ``backends``' kernels."""
    from .attention import Attention
    from .gated_delta_net import GatedDeltaNet

    for module in model.modules():
        if isinstance(module, Attention):
            module.backend = backends.attention
        elif isinstance(module, GatedDeltaNet):
            module.backend = backends.linear_attention


DEFAULT = Backends.for_device("cpu")  # a layer built on its own, until a model's device installs its own
