"""Steps replayed from CUDA graphs in pieces, one set of pieces per token-count bucket: those with
prompt rows, and (``--spec mtp``, where no other graph runs) those of decode and verify rows.

What a step computes token by token (the embedding, every projection, norm, MLP and MoE, the
final norm) depends only on how many tokens it holds; what its token mixers compute over their
rows (attention's K/V write and its decode and prompt kernels, the Gated DeltaNet's conv and
recurrence from the state slots: the backends' ``step``) depends on the rows. So a step of at
most the largest bucket's tokens runs as the graphs captured for the smallest bucket that holds
it (of its kind: with prompt rows, or without, whose token-wise work differs a little): the
pieces between the token mixers' cores replayed, each core called eagerly between them on the
step's real tokens with the step's own description, its result copied into the static tensor
the next piece reads. The pieces are captured once, at
engine build, with the cores cut out (``_Capture``: a layer's backend stands in for the real one
while the forward runs, ends the piece, and hands back the static output); the padding tokens
past the step's own run through the pieces (finite values, whatever the last step left) and
never reach a core, the KV pages or the state slots.

A bucket's pieces take one launch each from the host instead of one per kernel: at the 9B
shape a layer's projections, norms, residual adds and MLP, about a dozen launches, become one
replay, and only the cores pay Python's cost per kernel.

Memory: the cores' static inputs and outputs are one set per kind of core (attention, Gated
DeltaNet), sized for the largest bucket, that every core of every bucket uses the head of: a
piece ends by copying its core's inputs there (storage for storage, the core seeing views with
the originals' strides), and a core's output is read by the piece after it alone. The last piece
copies the final hidden states into one shared output too, so a bucket keeps nothing of its own
in the graphs' pool (``graph_buckets.kept_per_token``: at the 9B shape the shared set is 68 KB a
token of the largest bucket, 136 MB at 2,048, however many buckets there are; before, each
bucket kept its final hidden states, 8 KB a token of every bucket of every kind, and every
layer's core inputs before that, 0.77 MB a token). So the buckets can be close together (a step
pads at most a fifth of its tokens above 32) for the cost of their capture time alone. The engine
captures the pieces before it sizes the KV cache, so the cache is planned around what they take,
and gives them at most ``PIECES_SHARE`` of the memory free then: a probe forward of the smallest
bucket measures the bytes a bucket keeps per token, and the buckets above what the share holds
are not captured (their steps stay eager).

Steps that stay eager: images (embeddings placed in the run, three-axis positions), embedding
requests (their final hidden states outlive the step), tensor parallelism, and more tokens than
the largest bucket (long prompt chunks are GPU-bound). Steps of decode rows only and of decode
and verify rows have whole graphs of their own (``cuda_graphs.py``, ``cuda_graph_verify.py``),
except with the MTP head, whose drafts take every step's final hidden states (a view of the
bucket's static output, read before the next step runs): there those steps take the pieces.
"""
from __future__ import annotations

import contextlib
import gc
import logging
import time
from dataclasses import dataclass
from typing import Callable

import torch

from . import launch
from .cuda_graphs import uncollected
from .graph_buckets import (BUCKETS, PIECES_SHARE, activation_per_token, buckets_within, kept_bytes, piece_tokens,
                            rows_buckets_within)
from .memory import free_memory_bytes
from .models.base import GDN_CHUNK, CausalLM, ForwardBatch, PromptRows, StepMeta

log = logging.getLogger("ninfer.engine")



class _Core:
    """One token mixer's call: its layer, its token-major inputs (static tensors the piece
    before it leaves) and the static output the piece after it reads."""

    def __init__(self, layer, inputs: tuple, out: torch.Tensor, attention: bool) -> None:
        self.layer, self.inputs, self.out, self.attention = layer, inputs, out, attention

    def run(self, n: int, batch: ForwardBatch) -> None:
        """The real backend's step over the first ``n`` tokens, with the step's description."""
        layer, meta = self.layer, batch.step
        if self.attention:
            q, k, v = (x[:n] for x in self.inputs)
            layer.backend.step(layer, q, k, v, batch.positions, meta, batch.memo, out=self.out[:n])
        else:
            groups, z, a, b = self.inputs
            layer.backend.step(layer, tuple(g[:n] for g in groups), z[:n], a[:n], b[:n], meta, out=self.out[:n])


class _Capture:
    """Stands in for the layers' backends while a bucket's forward runs: at each token mixer's
    step it copies the mixer's inputs into the shared static ones, ends the piece being captured
    (``cut``), records the core and returns its static output; without a capture (the warm-up
    run) it only hands the outputs back.

    The static inputs and outputs are shared by every core of a kind (attention, Gated DeltaNet)
    and by every bucket: a core's inputs are read by that core alone, before the next piece
    runs, and its output by the piece after it alone, before the next core runs. The inputs are
    copied storage for storage (one copy of the fused projection's output, not one per view),
    and the core gets views of the copies with the strides and offsets of the originals, so its
    kernels see the layout they would eagerly."""

    def __init__(self, shared: dict, cut: Callable[[], None] | None, rows: "_RowsView | None" = None) -> None:
        # (kind of core, what) -> a shared static tensor: ("out") the output, (j) the j-th
        # storage under the core's inputs, as bytes; sized for the largest bucket (the probe,
        # which runs before they exist, makes its own)
        self.shared, self.cut, self.cores = shared, cut, []
        # a bucket of kind ONE or FEW: the rows its Gated DeltaNet cores read (they run inside the
        # piece, through the layers' own backends, ``real``)
        self.rows, self.real = rows, {}

    def _buffer(self, key: tuple, shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
        """The head (``shape[0]`` tokens) of the shared tensor ``key`` (of that shape per token and
        dtype), made here by the probe."""
        key = (*key, tuple(shape[1:]), dtype)
        if key not in self.shared:
            if self.cut is not None:  # inside a capture: a tensor the probe did not see
                raise RuntimeError(f"a token mixer's static tensor {key} that the probe did not make")
            self.shared[key] = torch.zeros(shape, dtype=dtype, device=device)
        if self.shared[key].shape[0] < shape[0]:
            raise RuntimeError(f"a token mixer's static tensor {key} holds {self.shared[key].shape[0]} tokens, "
                               f"the bucket has {shape[0]}")
        return self.shared[key][: shape[0]]

    def _inputs(self, attention: bool, inputs, t: int):
        """``inputs`` (tensors, nested tuples of them) as views of the shared static storages,
        each original storage copied in first (storages not made of whole tokens stay as they are)."""
        copies: dict[int, torch.Tensor | None] = {}

        def static(x: torch.Tensor) -> torch.Tensor:
            st = x.untyped_storage()
            ptr, nbytes = st.data_ptr(), st.nbytes()
            if ptr not in copies:
                if nbytes % t or nbytes % x.element_size():
                    copies[ptr] = None
                else:
                    whole = x.as_strided((nbytes // x.element_size(),), (1,), 0).view(torch.uint8)
                    buf = self._buffer((attention, len(copies), nbytes // t), (t, nbytes // t), torch.uint8, x.device)
                    buf.view(-1).copy_(whole)
                    copies[ptr] = buf
            buf = copies[ptr]
            if buf is None:
                return x
            return buf.view(-1).view(x.dtype).as_strided(x.shape, x.stride(), x.storage_offset())

        def walk(xs):
            return tuple(walk(x) if isinstance(x, (tuple, list)) else static(x) for x in xs)

        return walk(inputs)

    def attention(self, layer, q, k, v, positions, meta, memo) -> torch.Tensor:
        t = q.shape[0]
        out = self._buffer((True, "out"), (t, layer.num_heads, layer.head_dim), q.dtype, q.device)
        self._record(_Core(layer, self._inputs(True, (q, k, v), t), out, attention=True))
        return out

    def linear_attention(self, layer, groups, z, a, b, meta) -> torch.Tensor:
        t = z.shape[0]
        if self.rows is not None:  # inside the piece: no cut, nothing copied
            out = torch.empty((t, layer.value_dim), dtype=z.dtype, device=z.device)
            return self.real[id(layer)].graph_rows(layer, tuple(groups), z, a, b, meta, self.rows, out)
        out = self._buffer((False, "out"), (t, layer.value_dim), z.dtype, z.device)
        groups, z, a, b = self._inputs(False, (tuple(groups), z, a, b), t)
        self._record(_Core(layer, (groups, z, a, b), out, attention=False))
        return out

    def output(self, hidden: torch.Tensor) -> torch.Tensor:
        """The forward's final hidden states copied into the shared static output, which every
        bucket of every kind writes the head of (a step's are read before the next step runs)."""
        out = self._buffer(("final",), tuple(hidden.shape), hidden.dtype, hidden.device)
        out.copy_(hidden)
        return out

    def _record(self, core: _Core) -> None:
        self.cores.append(core)
        if self.cut is not None:
            self.cut()


class _Stand:
    """A layer's backend while a forward is captured: its ``step`` is the capture's."""

    def __init__(self, step) -> None:
        self.step = step


def _mixers(model: torch.nn.Module):
    from .layers.attention import Attention
    from .layers.gated_delta_net import GatedDeltaNet

    for module in model.modules():
        if isinstance(module, (Attention, GatedDeltaNet)):
            yield module, isinstance(module, Attention)


class _Bucket:
    def __init__(self, pieces: list, cores: list[_Core], hidden: torch.Tensor) -> None:
        self.pieces, self.cores, self.hidden = pieces, cores, hidden

    def kept(self, shared: dict | None = None) -> list[torch.Tensor]:
        """The tensors of the graphs' pool this bucket keeps of its own: any core input or final
        output not on a ``shared`` storage (the cores' static inputs and outputs and the final
        hidden states are shared: nothing, as captured)."""
        ptrs = {x.untyped_storage().data_ptr() for x in (shared or {}).values()}
        return [x for x in [*(y for core in self.cores for y in _flat(core.inputs)), self.hidden]
                if x.untyped_storage().data_ptr() not in ptrs]


def _flat(xs) -> list[torch.Tensor]:
    return [y for x in xs for y in (_flat(x) if isinstance(x, (tuple, list)) else [x])]


def storage_bytes(tensors: list[torch.Tensor]) -> int:
    """The bytes of the distinct storages under ``tensors`` (views of one storage count once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


PROMPT, ROWS = "prompt", "rows"  # the kinds of step: with prompt rows, or of decode and verify rows only
ONE, FEW = "one", "few"  # a prompt row, or a few, after decode rows: the Gated DeltaNet cores inside the pieces


@dataclass
class _RowsView:
    """What a bucket of kind ONE or FEW reads its rows from (views of ``GraphRows``' tensors)."""

    decode_slots: torch.Tensor  # [D] int64: the decode rows' slots, -1 past the real ones
    cu_seqlens: torch.Tensor  # [P + 1] int64: the prompt rows' bounds in the flat run
    prompt_slots: torch.Tensor  # [P] int64
    chunks: torch.Tensor  # [C, 2] int64: the (row, chunk) table
    chunk_offsets: torch.Tensor  # [P + 1] int64: each row's first chunk in it
    pad_slot: torch.Tensor  # [1] int64: the padding slot (the torch reference's rows past the real ones)


class GraphRows:
    """The device tensors the buckets of kind ONE (``max_rows`` 1) or FEW read a step's rows
    from, written before each replay from the step's description (no device value read on the
    host): the decode rows' slots (-1 past them: the fused decode kernel skips those tokens), the
    prompt rows' bounds, slots and (row, chunk) table. Past a step's own prompt rows come rows of
    no tokens on the padding slot; past its chunks, chunks beyond row 0's end: fla-core's kernels
    and the Triton conv bound every access by the row's length, so those programs load and store
    nothing. With one row the table is the same for every step, ``(0, c)`` for each chunk."""

    def __init__(self, max_tokens: int, max_decode: int, max_rows: int, pad_slot: int, device: torch.device) -> None:
        self.max_decode, self.max_rows, self.pad_slot = max_decode, max_rows, pad_slot
        self.decode_slots = torch.full((max_decode,), -1, dtype=torch.long, device=device)
        self.cu_seqlens = torch.zeros(max_rows + 1, dtype=torch.long, device=device)
        self.prompt_slots = torch.full((max_rows,), pad_slot, dtype=torch.long, device=device)
        n = self._chunks(max_tokens)
        beyond = -(-max_tokens // GDN_CHUNK)  # a chunk past the end of any row of the bucket
        table = [(0, c) for c in range(n)] if max_rows == 1 else [(0, beyond)] * n
        self.spare = torch.tensor(table, dtype=torch.long, device=device)
        self.chunks = self.spare.clone()
        self.chunk_offsets = torch.zeros(max_rows + 1, dtype=torch.long, device=device)
        self.pad = torch.full((1,), pad_slot, dtype=torch.long, device=device)

    def _chunks(self, t: int) -> int:
        """Chunks of at most ``max_rows`` rows in ``t`` tokens."""
        return -(-t // GDN_CHUNK) + (self.max_rows > 1) * self.max_rows

    def decode_rows(self, t: int) -> int:
        """The decode rows a bucket of ``t`` tokens runs its decode kernel over."""
        return min(t, self.max_decode)

    def view(self, t: int) -> _RowsView:
        return _RowsView(self.decode_slots[: self.decode_rows(t)], self.cu_seqlens, self.prompt_slots,
                         self.chunks[: self._chunks(t)], self.chunk_offsets, self.pad)

    def load(self, meta: StepMeta) -> None:
        """This step's rows (``meta``: decode rows, then at most ``max_rows`` prompt rows) on the device."""
        d, prompt = meta.num_decode, meta.prompt
        rows = len(prompt.slots_host)
        self.decode_slots.fill_(-1)
        self.decode_slots[:d].copy_(meta.slot_ids[:d])
        torch.add(prompt.cu_seqlens_long, d, out=self.cu_seqlens[: rows + 1])
        self.prompt_slots[:rows].copy_(meta.slot_ids[d: d + rows])
        if self.max_rows == 1:
            return
        self.cu_seqlens[rows + 1:].fill_(d + int(prompt.cu_seqlens_host[-1]))
        self.prompt_slots[rows:].fill_(self.pad_slot)
        nt = prompt.chunks.shape[0]
        self.chunks[:nt].copy_(prompt.chunks)
        self.chunks[nt:].copy_(self.spare[nt:])
        self.chunk_offsets[: rows + 1].copy_(prompt.chunk_offsets)
        self.chunk_offsets[rows + 1:].fill_(nt)


class MixedGraphs:
    """The pieces of every bucket up to ``max_tokens`` for each of ``kinds``, and a step's run
    through them.

    ``graph`` makes a graph (``torch.cuda.CUDAGraph``; tests on a CPU give a recording of the
    pieces' operations that replays them over the same tensors), ``pool`` the memory pool the
    captures share (the decode graphs', when there are some)."""

    def __init__(self, model: CausalLM, device: torch.device, max_tokens: int,
                 graph: Callable[[], object] | None = None, pool=None, kinds: tuple[str, ...] = (PROMPT,),
                 budget: int | None = None) -> None:
        """``budget``: the most bytes the buckets may keep (None: no limit); the buckets above what
        it holds are left out (``buckets_within``, from a probe forward of the smallest)."""
        self.model, self.device, self.kinds = model, device, kinds
        self.buckets = [b for b in BUCKETS if b <= max_tokens]
        self.graph = graph or torch.cuda.CUDAGraph
        self.pool = pool if pool is not None or device.type != "cuda" else torch.cuda.graph_pool_handle()
        self.captured: dict[tuple[str, int], _Bucket] = {}
        self.rows: dict[str, GraphRows] = {}  # the rows of kinds ONE and FEW's buckets (``capture_rows``)
        self._rows_meta: tuple = ()  # their state pools and ordinals
        self.shared: dict = {}  # the cores' static inputs and outputs, shared by every bucket (_Capture)
        top = self.buckets[-1] if self.buckets else 0
        self.capture_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.input_ids = torch.zeros(top, dtype=torch.long, device=device)
        self.positions = torch.zeros(top, dtype=torch.long, device=device)
        if self.buckets:
            self.buckets = self._fitted(budget)

    @torch.inference_mode()
    def _fitted(self, budget: int | None) -> list[int]:
        """The buckets ``budget`` holds, and the shared static inputs and outputs made for the
        largest of them: a forward of the smallest bucket (no capture) shows what a bucket keeps
        per token."""
        t = self.buckets[0]
        probe = _Capture({}, None)
        hidden = probe.output(self._forward(self.kinds[0], t, probe))
        per_token = storage_bytes(_Bucket([], probe.cores, hidden).kept(probe.shared)) / t
        shared = storage_bytes(list(probe.shared.values())) / t
        self.per_token, self.shared_per_token = per_token, shared
        # within the budget, the largest bucket's activations too: the graphs' pool keeps what
        # its capture took at most (the plan counts them so: ``app/footprint.piece_bytes``)
        self.elt = hidden.element_size()
        self.work_per_token = activation_per_token(self.model.config, self.elt)
        shared += self.work_per_token
        kept = buckets_within(self.buckets, per_token, shared, len(self.kinds), budget)
        if len(kept) < len(self.buckets):
            log.info("CUDA graphs in pieces up to %s tokens (%d MiB of the %d MiB they may take; %d tokens would "
                     "take %d MiB)", kept[-1] if kept else 0, kept_bytes(kept, per_token, shared, len(self.kinds)) / 2**20,
                     budget / 2**20, self.buckets[-1],
                     kept_bytes(self.buckets, per_token, shared, len(self.kinds)) / 2**20)
        if kept:
            self.shared = {key: torch.zeros((kept[-1], *x.shape[1:]), dtype=x.dtype, device=x.device)
                           for key, x in probe.shared.items()}
        return kept

    def held_bytes(self) -> int:
        """The bytes the captured buckets keep: their own tensors and the shared inputs and outputs."""
        shared = list(self.shared.values())
        return storage_bytes([x for b in self.captured.values() for x in b.kept(self.shared)] + shared)

    def _batch(self, kind: str, t: int) -> ForwardBatch:
        """The batch a bucket's forward is captured with: a step of the kind whose description
        no piece reads (the cores, which read it, are cut out)."""
        none = torch.zeros(0, dtype=torch.long, device=self.device)
        prompt = PromptRows(cu_seqlens=none, cu_seqlens_long=none, cu_seqlens_host=none.cpu(), max_seqlen=t,
                            slots_host=[], chunks=none, chunk_offsets=none) if kind != ROWS else None
        states, ordinal = self._rows_meta if kind in self.rows else (None, {})  # (ONE, FEW: their cores read the pools)
        meta = StepMeta(kv=None, states=states, attn_ordinal={}, gdn_ordinal=ordinal, block_tables=none,
                        context_lens=none, write_index=none,
                        slot_ids=torch.zeros(t, dtype=torch.long, device=self.device),
                        num_decode=t if kind == ROWS else 0, prompt=prompt)
        return ForwardBatch(positions=self.positions[:t], seq_lens=[t], caches=[], step=meta)

    def _forward(self, kind: str, t: int, capture: _Capture) -> torch.Tensor:
        mixers = list(_mixers(self.model))
        saved = [(m, m.backend) for m, _ in mixers]
        capture.real = {id(m): backend for m, backend in saved}
        try:
            for m, attention in mixers:
                m.backend = _Stand(capture.attention if attention else capture.linear_attention)
            return self.model(self.input_ids[:t], self._batch(kind, t))
        finally:
            for m, backend in saved:
                m.backend = backend

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket of every kind, largest first (the smaller ones reuse its memory).
        A bucket that cannot be captured ends the capture of its kind: the steps it would have
        taken stay eager."""
        gc.collect()  # (what holds graphs of an engine before this one freed now, not mid-capture)
        start = time.perf_counter()
        for kind in self.kinds:
            for t in reversed(self.buckets):
                try:
                    self.captured[kind, t] = self._capture(kind, t)
                except Exception as exc:  # a piece that reads a device value on the host, or the like
                    log.warning("steps of kind %r stay eager: the %d-token bucket could not be captured (%s)",
                                kind, t, exc)
                    for key in [key for key in self.captured if key[0] == kind]:
                        del self.captured[key]
                    break
        if self.captured:
            log.info("captured CUDA graphs in pieces for steps of %s tokens in %.1f s",
                     ", ".join(f"{kind}: {sorted(t for k, t in self.captured if k == kind)}" for kind in self.kinds),
                     time.perf_counter() - start)

    @torch.inference_mode()
    def capture_rows(self, caches, max_decode: int, max_tokens: int, max_rows: int, budget: int | None = None) -> None:
        """Capture the buckets of kinds ONE and FEW (up to ``max_rows`` prompt rows) up to
        ``max_tokens`` (at most the largest bucket of kind PROMPT): steps of prompt rows after at
        most ``max_decode`` decode rows, whose Gated DeltaNet cores run inside the pieces over
        ``caches``' state pools (made by now: these are captured after the caches, beside the
        decode graphs), reading their rows from ``GraphRows``. Needs Gated DeltaNet layers whose
        backend can (``rows_in_graph``), key and value heads of one size; a bucket that cannot
        be captured leaves its kind out. ``budget``: the most bytes they may take of the memory the
        caches left (``graph_buckets.rows_buckets_within``; None: no limit)."""
        from .layers.gated_delta_net import GatedDeltaNet

        gdn = [m for m in self.model.modules() if isinstance(m, GatedDeltaNet)]
        tops = [t for k, t in self.captured if k == PROMPT and t <= max_tokens]
        tops = rows_buckets_within(tops, self.model.config, max_rows, self.elt, budget)
        if not (gdn and tops and caches.states is not None) or \
                not all(m.backend.rows_in_graph and m.head_k_dim == m.head_v_dim for m in gdn):
            return
        _, pad_slot = caches.reserve_padding()
        gc.collect()
        start = time.perf_counter()
        self._rows_meta = (caches.states, caches.gdn_ordinal)
        for kind, rows in ((ONE, 1), (FEW, max_rows))[: 1 + (max_rows > 1)]:
            self.rows[kind] = GraphRows(max(tops), max_decode, rows, pad_slot, self.device)
            for t in sorted(tops, reverse=True):
                try:
                    self.captured[kind, t] = self._capture(kind, t)
                except Exception as exc:
                    log.warning("steps of %s prompt rows keep their Gated DeltaNet cores eager: the %d-token bucket "
                                "could not be captured (%s)", "one" if kind == ONE else "a few", t, exc)
                    for key in [key for key in self.captured if key[0] == kind]:
                        del self.captured[key]
                    del self.rows[kind]
                    break
        if self.rows:
            log.info("captured CUDA graphs in pieces with the Gated DeltaNet cores inside for steps of %s in %.1f s",
                     ", ".join(f"{'one prompt row' if k == ONE else f'up to {r.max_rows} prompt rows'}: "
                               f"{sorted(t for kk, t in self.captured if kk == k)} tokens"
                               for k, r in self.rows.items()), time.perf_counter() - start)

    def _capture(self, kind: str, t: int) -> _Bucket:
        shared = self.shared
        rows = self.rows[kind].view(t) if kind in self.rows else None
        if rows is not None:  # warm-up and capture over one row of the bucket's tokens on the padding slot: fla-core's
            # autotuner, on its first launch, times work of the bucket's size
            rows.cu_seqlens.copy_(torch.tensor([0] + [t] * (rows.cu_seqlens.shape[0] - 1)))
            rows.chunks[:, 0].zero_()
            rows.chunks[:, 1].copy_(torch.arange(rows.chunks.shape[0]))
            rows.chunk_offsets.copy_(torch.tensor([0] + [rows.chunks.shape[0]] * (rows.chunk_offsets.shape[0] - 1)))
        cuda = self.device.type == "cuda"
        # one side stream for every bucket: the allocator hands a stream's freed blocks only to
        # that stream's allocations, so a stream per bucket grew the graphs' pool by each bucket's
        # intermediates (the 9B's to 1,046 MiB) where the smaller buckets reuse the largest's
        stream = self.capture_stream
        if cuda:
            stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream) if cuda else contextlib.nullcontext():
            for _ in range(2):  # warm-up: the pieces' kernels compiled and tuned outside the capture
                warm = _Capture(shared, None, rows)
                warm.output(self._forward(kind, t, warm))
            pieces = [self.graph()]

            def cut() -> None:
                pieces[-1].capture_end()
                pieces.append(self.graph())
                pieces[-1].capture_begin(pool=self.pool)

            capture = _Capture(shared, cut, rows)
            with uncollected():
                pieces[0].capture_begin(pool=self.pool)
                try:
                    hidden = capture.output(self._forward(kind, t, capture))
                finally:
                    pieces[-1].capture_end()
        if cuda:
            torch.cuda.current_stream(self.device).wait_stream(stream)
            torch.cuda.synchronize(self.device)
        return _Bucket(pieces, capture.cores, hidden)

    def bucket(self, kind: str, n: int) -> int | None:
        return next((t for t in self.buckets if t >= n and (kind, t) in self.captured), None)

    @staticmethod
    def kind(batch: ForwardBatch) -> str:
        return ROWS if batch.step.prompt is None else PROMPT

    def _key(self, batch: ForwardBatch, n: int) -> tuple[str, int] | None:
        """The bucket a step of ``n`` tokens runs through: of kind ONE (FEW) where it is one prompt
        row (a few) after no more decode rows than that bucket holds, verifying no draft; else of
        its kind."""
        meta = batch.step
        if self.rows and meta.prompt is not None and meta.verify is None:
            p = len(meta.prompt.slots_host)
            kind = ONE if p == 1 else FEW
            rows = self.rows.get(kind)
            if rows is not None and p <= rows.max_rows:
                t = self.bucket(kind, n)
                if t is not None and meta.num_decode <= rows.decode_rows(t):
                    return kind, t
        kind = self.kind(batch)
        t = self.bucket(kind, n)
        return None if t is None else (kind, t)

    def fits(self, batch: ForwardBatch, n: int) -> bool:
        """Whether a step of ``n`` tokens described by ``batch`` runs through the pieces."""
        return (batch.step is not None and batch.mrope is None and batch.embeds is None
                and self._key(batch, n) is not None)

    def run(self, input_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """The step's final hidden states ``[n, hidden]``: a view of the bucket's static output,
        valid until the next step."""
        n = input_ids.shape[0]
        key = self._key(batch, n)
        b = self.captured[key]
        if key[0] in self.rows:
            self.rows[key[0]].load(batch.step)
        self.input_ids[:n].copy_(input_ids)
        for piece, core in zip(b.pieces, b.cores):
            piece.replay()
            core.run(n, batch)
        b.pieces[-1].replay()
        return b.hidden[:n]


def capture_pieces(model: CausalLM, device: torch.device, config, every_step: bool = False) -> MixedGraphs | None:
    """The pieces an engine of ``config`` runs its steps with prompt rows through (``every_step``:
    its decode and verify rows too, for the MTP head), up to the launch setting
    ``mixed_graph_tokens`` or the bucket that holds a whole step, within ``PIECES_SHARE`` of the
    memory free now; captured, with what their warm-up left cached given back. None where no
    bucket is wanted."""
    tokens = piece_tokens(launch.current().mixed_graph_tokens, config.step_tokens)
    if not tokens:
        return None
    budget = int(PIECES_SHARE * free_memory_bytes(device, config.gpu_memory_gib))
    pieces = MixedGraphs(model, device, tokens, kinds=(PROMPT, ROWS) if every_step else (PROMPT,), budget=budget)
    pieces.capture()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return pieces
