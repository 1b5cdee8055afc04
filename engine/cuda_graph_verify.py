"""Verify steps of speculative decoding captured in CUDA graphs, one graph per batch-size bucket.

A step in which every request verifies a draft (at most ``width - 1`` tokens after its last one) or
decodes its next token is run as ``width`` decode rows per request (``step.build_step`` lays out
a verify row the same way), the rows past a request's own positions only filling its width: the
same shape each time for a given number of requests, so it is captured as decode steps are
(``cuda_graphs.py``). All inputs live
in one static device buffer: per row its token id, position, KV write row, state slot and KV write slot (int64)
and its context length (int32); per request its state slot and row bounds (int64, for the Gated
DeltaNet verify kernel, ``layers/gdn_verify.py``) and its block table (int32), which the graph
widens to a table per row. A step writes the real requests in, pads the rest of the bucket with
the reserved padding page and slot, sends it in one copy and replays; the graph ends with the
logits of every row, of which the sampler draws from the requests' own as from an eager verify
step's. The states after each position land in the runner's verify buffers (shared with the
eager verify steps), and ``VerifyRows.commit`` takes them from there as after an eager step (at
once, for a request without a draft: its one position is kept).
"""
from __future__ import annotations

import logging

import torch

from .cache.kv_pool import pool_row
from .cache.manager import CacheManager
from .cuda_graphs import WIDE_ROWS, uncollected
from .models.base import CausalLM, ForwardBatch, StepMeta, VerifyRows
from .request import Request
from .runner import sampled_logits

log = logging.getLogger("ninfer.engine")


def _aligned16(offset: int) -> int:
    return -(-offset // 16) * 16


class _Layout:
    """Where each input sits in the buffer of ``n`` requests of ``width`` rows (bytes): the int64
    rows (token ids, positions, KV write rows, row slots, KV write slots), the requests' slots and row bounds, then
    the int32 context lengths and the requests' block tables (last, so a bucket sends its own)."""

    def __init__(self, n: int, width: int, max_pages: int) -> None:
        self.n, self.width, self.max_pages = n, width, max_pages
        self.rows = rows = n * width
        up = _aligned16  # each part starts 16-byte aligned: Triton specializes a kernel on it
        self.slots = up(WIDE_ROWS * rows * 8)
        self.cu = up(self.slots + n * 8)
        self.lens = up(self.cu + (n + 1) * 8)
        self.tables = up(self.lens + rows * 4)

    def end(self, b: int) -> int:
        """Bytes a step of bucket ``b`` sends: everything up to its requests' block tables."""
        return self.tables + b * self.max_pages * 4

    def views(self, buf: torch.Tensor):
        """``(wide [WIDE_ROWS, rows], slots [n], cu_seqlens [n + 1], lens [rows], tables [n, max_pages])``."""
        return (buf[: WIDE_ROWS * self.rows * 8].view(torch.long).view(WIDE_ROWS, self.rows),
                buf[self.slots : self.slots + self.n * 8].view(torch.long),
                buf[self.cu : self.cu + (self.n + 1) * 8].view(torch.long),
                buf[self.lens : self.lens + self.rows * 4].view(torch.int32),
                buf[self.tables : self.end(self.n)].view(torch.int32).view(self.n, self.max_pages))


class _Stage:
    """Pinned host bytes laid out as the device buffer, written per step and sent in one copy;
    a block table row is rewritten only when its request or page count changed."""

    def __init__(self, layout: _Layout, pad: tuple[int, int, int, int]) -> None:
        self.layout, self.pad = layout, pad
        self.bytes = torch.zeros(layout.end(layout.n), dtype=torch.uint8, pin_memory=torch.cuda.is_available())
        self.wide, self.slots, self.cu, self.lens, self.tables = layout.views(self.bytes)
        self.cu.copy_(torch.arange(layout.n + 1, dtype=torch.long) * layout.width)
        self.keys: list[tuple[object, int] | None] = [None] * layout.n
        self._pad(0, layout.n)
        self.used = 0  # requests written by the last fill (the rest hold padding)

    def _pad(self, start: int, stop: int) -> None:
        """Requests ``[start, stop)`` as padding: the reserved page and slot, no KV write slot,
        context length 1."""
        page, write, slot, kv_slot = self.pad
        w = self.layout.width
        self.wide[:, start * w : stop * w] = torch.tensor([0, 0, write, slot, kv_slot]).unsqueeze(1)
        self.slots[start:stop] = slot
        self.lens[start * w : stop * w] = 1
        self.tables[start:stop] = page
        self.keys[start:stop] = [None] * (stop - start)

    def fill(self, plan: list[tuple[Request, int]], page_size: int) -> None:
        """Each ``(request, n)`` in its ``width`` rows: its ``n`` positions from its last token,
        then rows that only fill the width (on the padding page, context length 1)."""
        w, n = self.layout.width, len(plan)
        if n < self.used:
            self._pad(n, self.used)
        pad_write, pad_kv = self.pad[1], self.pad[3]
        ids, pos, writes, row_slots, kv_slots, lens, slots = [], [], [], [], [], [], []
        for i, (req, k) in enumerate(plan):
            cache, start = req.cache, req.num_computed
            slot = cache.slot if cache.slot is not None else self.pad[2]
            slots.append(slot)
            for p in range(start, start + k):
                ids.append(req.token_at(p) if p < req.num_tokens else req.draft[p - req.num_tokens])
                pos.append(p)
                writes.append(pool_row(cache.pages, p, page_size))
                lens.append(p + 1)
            kv_slots += [cache.kv_slot if cache.kv_slot is not None else pad_kv] * k + [pad_kv] * (w - k)
            ids += [0] * (w - k)
            pos += [start] * (w - k)
            writes += [pad_write] * (w - k)
            lens += [1] * (w - k)
            row_slots += [slot] * w
            key = self.keys[i]
            if key is None or key[0] is not cache or key[1] != len(cache.pages):
                row = cache.pages + [self.pad[0]] * (self.layout.max_pages - len(cache.pages))
                self.tables[i] = torch.tensor(row, dtype=torch.int32)
                self.keys[i] = (cache, len(cache.pages))
        self.wide[:, : n * w] = torch.tensor([ids, pos, writes, row_slots, kv_slots], dtype=torch.long)
        self.slots[:n] = torch.tensor(slots, dtype=torch.long)
        self.lens[: n * w] = torch.tensor(lens, dtype=torch.int32)
        self.used = n


class CudaGraphVerifier:
    """Captured verify steps of ``width`` rows per request, one graph per bucket of ``buckets``."""

    def __init__(self, model: CausalLM, caches: CacheManager, buckets: list[int], width: int, max_context: int,
                 device: torch.device, vocab: int | None, buffers: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        self.model, self.caches, self.device, self.vocab = model, caches, device, vocab
        self.width = width
        self.buckets = list(buckets)
        self.max_pages = -(-max_context // caches.page_size) + 1
        self.layout = _Layout(self.buckets[-1], width, self.max_pages)
        self.buffers = buffers  # the runner's verify buffers (None: no recurrent layers)
        page, slot = caches.reserve_padding()
        page = max(page, 0)
        pad = (page, page * caches.page_size, max(slot, 0), caches.no_write_slot)
        self._stages = [_Stage(self.layout, pad) for _ in range(2)]  # used in turn, as the decoder's
        self._turn = 0
        self.inputs = torch.zeros(self.layout.end(self.layout.n), dtype=torch.uint8, device=device)
        wide, self.slots, self.cu, self.lens, self.tables = self.layout.views(self.inputs)
        self.input_ids, self.positions, self.write_index, self.row_slots, self.kv_slots = wide.unbind(0)
        self.inputs.copy_(self._stages[0].bytes)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.replays = 0  # steps run from a graph (the benchmark reports them)

    def _forward(self, b: int) -> torch.Tensor:
        """The logits of a verify step of bucket ``b`` from the static inputs."""
        rows, p = b * self.width, self.max_pages
        tables = self.tables[:b, None, :].expand(b, self.width, p).reshape(rows, p)  # one per row
        verify = None
        if self.buffers is not None:
            verify = VerifyRows(first=0, slots=self.slots[:b], cu_seqlens=self.cu[: b + 1], positions=rows,
                                requests={}, conv=self.buffers[0], recurrent=self.buffers[1])
        meta = StepMeta(kv=self.caches.kv, states=self.caches.states, attn_ordinal=self.caches.attn_ordinal,
                        gdn_ordinal=self.caches.gdn_ordinal, block_tables=tables, context_lens=self.lens[:rows],
                        write_index=self.write_index[:rows], slot_ids=self.row_slots[:rows], num_decode=rows,
                        verify=verify, kv_slots=self.kv_slots[:rows])
        batch = ForwardBatch(positions=self.positions[:rows], seq_lens=[1] * rows, caches=[], step=meta)
        return sampled_logits(self.model, self.model(self.input_ids[:rows], batch), self.vocab)

    @torch.inference_mode()
    def capture(self, pool=None) -> None:
        """Capture every bucket's step, in ``pool`` (the decode graphs': no two graphs run at
        once, and each step's logits are sampled before the next replay) or a new one."""
        pool = torch.cuda.graph_pool_handle() if pool is None else pool
        stream = torch.cuda.Stream(self.device)  # one for every warm-up: a stream's freed blocks serve it alone
        for b in reversed(self.buckets):  # largest first, so smaller graphs reuse its memory
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm-up: compiles / autotunes kernels outside the capture
                    self._forward(b)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with uncollected(), torch.cuda.graph(graph, pool=pool):
                logits = self._forward(b)
            self.graphs[b] = (graph, logits)
        torch.cuda.synchronize(self.device)
        log.info("captured verify CUDA graphs of %d rows per request for batch sizes %s", self.width, self.buckets)

    def bucket(self, n: int) -> int | None:
        return next((b for b in self.buckets if b >= n), None)

    def fits(self, plan: list[tuple[Request, int]]) -> bool:
        """Whether a captured graph runs this step: every row starts at its request's last token
        and runs at most ``width`` positions (a draft of ``n - 1`` tokens, or none), none has
        images, each one's pages fit the tables."""
        return bool(plan) and self.bucket(len(plan)) is not None and all(
            1 <= n <= self.width and r.decode_ready and len(r.draft) >= n - 1 and r.media is None
            and r.pooled is None and r.num_computed + n <= r.cache.capacity
            and len(r.cache.pages) <= self.max_pages for r, n in plan)

    def run(self, plan: list[tuple[Request, int]]) -> tuple[torch.Tensor, VerifyRows | None]:
        """Logits of every position the rows of ``plan`` run (``sum(n)`` rows, the requests in
        order; caches not advanced), and the step's ``VerifyRows`` (None without recurrent
        layers): request ``i``'s states after its position ``j`` are at buffer row ``i * width + j``."""
        n, w = len(plan), self.width
        b = self.bucket(n)
        self._turn ^= 1
        stage = self._stages[self._turn]
        stage.fill(plan, self.caches.page_size)
        end = self.layout.end(b)
        self.inputs[:end].copy_(stage.bytes[:end], non_blocking=True)
        graph, logits = self.graphs[b]
        graph.replay()
        self.replays += 1
        if all(k == w for _, k in plan):
            logits = logits[: n * w]
        else:  # the rows that only fill a request's width are not sampled
            rows = [i * w + j for i, (_, k) in enumerate(plan) for j in range(k)]
            logits = logits.index_select(0, torch.tensor(rows, dtype=torch.long).to(self.device, non_blocking=True))
        verify = None
        if self.buffers is not None:
            verify = VerifyRows(first=0, slots=self.slots[:n], cu_seqlens=self.cu[: n + 1], positions=n * w,
                                requests={id(r): (i * w, k) for i, (r, k) in enumerate(plan)},
                                conv=self.buffers[0], recurrent=self.buffers[1])
        return logits, verify
