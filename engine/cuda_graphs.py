"""Decode steps captured in CUDA graphs, one graph per batch-size bucket.

All inputs of a captured step live in one static device buffer (token ids, positions, KV write
rows, state slots, KV write slots, context lengths, block tables); a step copies the real rows in with one copy,
pads the rest of the bucket with a reserved padding page and slot, replays the graph, and reads
the logits. The graph ends with the greedy tokens (the logits' argmax) written over its own input
ids, so a greedy decode step that follows with the same rows needs no token copy at all
(``run(..., follow=True)``). With the launch setting ``advance_in_graph`` (the default) the
graph also leaves the next positions, context lengths and KV write rows in place
(``decode_advance``), and such a step sends nothing when its staged inputs equal the host's picture of the device buffer
(``_Picture``): every step but those where a sequence takes a new page. Nothing in a replay
syncs with the host; the caller reads the sampled tokens once.
"""
from __future__ import annotations

import contextlib
import gc
import logging

import torch

from . import launch
from .cache.kv_pool import pool_row
from .cache.manager import CacheManager
from .decode_advance import advance_reference, advance_triton
from .models.base import CausalLM, ForwardBatch, StepMeta
from .request import Request
from .runner import sampled_logits

log = logging.getLogger("ninfer.engine")


@contextlib.contextmanager
def uncollected():
    """The garbage collector off while a capture runs: an unreachable object that holds a CUDA
    graph (an engine made before this one, in a process that makes several) destroys its graph
    when the collector frees it, and a graph destroyed while a stream captures invalidates that
    capture (the bucket's steps then stay eager). Collect before capturing (``torch.cuda.graph``
    does) so that nothing is left for the collector to free once it runs again."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64)
WIDE_ROWS = 5  # int64 inputs per row: token id, position, KV write row, state slot, KV write slot


def _layout(n: int, max_pages: int) -> tuple[int, int]:
    """Bytes of the int64 rows (token ids, positions, KV write rows, state slots, KV write slots)
    and of the whole input buffer (then the int32 context lengths and block tables) for ``n`` rows."""
    wide = WIDE_ROWS * n * 8
    return wide, wide + (n + n * max_pages) * 4


def _views(buf: torch.Tensor, n: int, max_pages: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The ``[WIDE_ROWS, n]`` int64 rows, the int32 lengths + tables, and the tables ``[n, max_pages]``
    of an input buffer (bytes)."""
    wide, _ = _layout(n, max_pages)
    narrow = buf[wide:].view(torch.int32)
    return buf[:wide].view(torch.long).view(WIDE_ROWS, n), narrow, narrow[n:].view(n, max_pages)


class _Stage:
    """Pinned host copies of the static inputs, written row by row and sent in one copy.

    ``wide`` holds five int64 rows (token ids, positions, KV write rows, state slots, KV write
    slots), ``narrow``
    the int32 context lengths followed by the block tables; both are views of ``bytes``, laid out
    as the device buffer is, so a step's inputs go over in one copy."""

    def __init__(self, n: int, max_pages: int, pad: tuple[int, int, int, int]) -> None:
        self.n, self.max_pages, self.pad = n, max_pages, pad
        pin = torch.cuda.is_available()  # pinned, so the copies are truly asynchronous
        self.bytes = torch.zeros(_layout(n, max_pages)[1], dtype=torch.uint8, pin_memory=pin)
        self.wide, self.narrow, self.tables = _views(self.bytes, n, max_pages)
        self.keys: list[tuple[object, int] | None] = [None] * n  # (cache, pages) each table row holds
        self.rows = n
        self.clear(0)

    def clear(self, start: int) -> None:
        """Padding rows from ``start`` on: the reserved page and slot, no KV write slot, context length 1."""
        if start >= self.rows:
            return
        page, write, slot, kv_slot = self.pad
        self.wide[:, start:] = torch.tensor([0, 0, write, slot, kv_slot]).unsqueeze(1)
        self.narrow[start:self.n] = 1
        self.tables[start:] = page
        self.keys[start:] = [None] * (self.n - start)
        self.rows = start

    def _write_table(self, i: int, start: int, cache) -> None:
        """Block-table row ``i`` from entry ``start`` on: the cache's pages from there, then padding
        where the row is written whole."""
        pages = cache.pages
        self.tables[i, start:len(pages)] = torch.tensor(pages[start:], dtype=torch.int32)
        if start == 0:
            self.tables[i, len(pages):] = self.pad[0]
        self.keys[i] = (cache, len(pages))

    def fill(self, reqs: list[Request], page_size: int) -> None:
        n = len(reqs)
        self.clear(n)
        ids, pos, writes, slots, kv_slots, lens = [], [], [], [], [], []
        for i, req in enumerate(reqs):
            cache, p = req.cache, req.num_computed
            ids.append(req.token_at(req.num_computed) if req.num_computed < req.num_tokens else 0)
            pos.append(req.num_computed)
            writes.append(pool_row(cache.pages, p, page_size))
            slots.append(cache.slot if cache.slot is not None else 0)
            kv_slots.append(cache.kv_slot if cache.kv_slot is not None else self.pad[3])
            lens.append(p + 1)
            key, held = self.keys[i], len(cache.pages)
            if key is None or key[0] is not cache or key[1] > held:  # another sequence (or fewer pages)
                self._write_table(i, 0, cache)
            elif key[1] < held:  # the same sequence grew: only its new pages (a row is max_context long)
                self._write_table(i, key[1], cache)
        self.wide[:, :n] = torch.tensor([ids, pos, writes, slots, kv_slots], dtype=torch.long)
        self.narrow[:n] = torch.tensor(lens, dtype=torch.int32)
        self.rows = max(self.rows, n)


class _Picture:
    """What the device's input buffer holds, as far as the host knows: the bytes last sent, then
    advanced as each replay advances them (``advance_reference``, the device kernel's twin). The
    token ids row is never compared: after a replay it holds the argmax, unknown to the host."""

    def __init__(self, n: int, max_pages: int, page_size: int) -> None:
        self.page_size = page_size
        self.bytes = torch.zeros(_layout(n, max_pages)[1], dtype=torch.uint8)
        self.wide, self.narrow, self.tables = _views(self.bytes, n, max_pages)

    def holds(self, stage: _Stage, start: int, end: int) -> bool:
        """Whether bytes ``[start, end)`` of the stage are what the device holds already."""
        return torch.equal(self.bytes[start:end], stage.bytes[start:end])

    def sent(self, stage: _Stage, start: int, end: int) -> None:
        self.bytes[start:end] = stage.bytes[start:end]

    def replayed(self, b: int) -> None:
        """A replay of bucket ``b``'s graph advanced rows ``[0, b)``."""
        advance_reference(self.wide[1, :b], self.narrow[:b], self.wide[2, :b], self.tables[:b], self.page_size)


class CudaGraphDecoder:
    def __init__(self, model: CausalLM, caches: CacheManager, max_batch: int, max_context: int,
                 device: torch.device, vocab: int | None = None) -> None:
        self.model = model
        self.vocab = vocab  # the logits' first columns the step samples from (runner.sampled_logits)
        self.caches = caches
        self.device = device
        self.buckets = [b for b in BUCKETS if b < max_batch] + [max_batch]
        self.max_pages = -(-max_context // caches.page_size) + 1
        self.pad_page, self.pad_slot = caches.reserve_padding()
        n = self.max_batch = max_batch
        self.inputs = torch.zeros(_layout(n, self.max_pages)[1], dtype=torch.uint8, device=device)
        self.wide, self.narrow, self.block_tables = _views(self.inputs, n, self.max_pages)
        self.input_ids, self.positions, self.write_index, self.slot_ids, self.kv_slots = self.wide.unbind(0)
        self.context_lens = self.narrow[:n]
        page = max(self.pad_page, 0)
        pad = (page, page * caches.page_size, max(self.pad_slot, 0), caches.no_write_slot)
        # two stages used in turn: a stage is rewritten only after the step that read it has run
        self._stages = [_Stage(n, self.max_pages, pad) for _ in range(2)]
        self._turn = 0
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = torch.cuda.graph_pool_handle()
        # the argmax inside the captured step (else the sampler takes it after), and the step's
        # positions, lengths and KV write rows advanced inside it, so a greedy step that follows
        # may need no input copy: launch settings, both fixed at capture
        settings = launch.current()
        self.greedy_in_graph = settings.greedy_in_graph
        self.advance = settings.advance_in_graph and self.greedy_in_graph
        self._picture = _Picture(n, self.max_pages, caches.page_size) if self.advance else None
        self._send(self._stages[0], n)

    def _send(self, stage: _Stage, b: int, ids: bool = True) -> bool:
        """One copy of the stage up to bucket ``b``'s block tables; without the token ids row
        when the device already holds them, and none at all when it holds the rest too (as the
        picture says). Returns whether a copy went."""
        wide, _ = _layout(self.max_batch, self.max_pages)
        start, end = 0 if ids else 8 * self.max_batch, wide + (self.max_batch + b * self.max_pages) * 4
        if self._picture is not None:
            if not ids and self._picture.holds(stage, start, end):
                return False
            self._picture.sent(stage, start, end)
        self.inputs[start:end].copy_(stage.bytes[start:end], non_blocking=True)
        return True

    def _batch(self, b: int) -> ForwardBatch:
        meta = StepMeta(
            kv=self.caches.kv, states=self.caches.states, attn_ordinal=self.caches.attn_ordinal,
            gdn_ordinal=self.caches.gdn_ordinal, block_tables=self.block_tables[:b],
            context_lens=self.context_lens[:b], write_index=self.write_index[:b], slot_ids=self.slot_ids[:b],
            kv_slots=self.kv_slots[:b],
        )
        return ForwardBatch(positions=self.positions[:b], seq_lens=[1] * b, caches=[], step=meta)

    @torch.inference_mode()
    def capture(self) -> None:
        stream = torch.cuda.Stream(self.device)  # one for every warm-up: a stream's freed blocks serve it alone
        for b in reversed(self.buckets):  # largest first, so smaller graphs reuse its memory
            batch = self._batch(b)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm-up: compiles / autotunes kernels outside the capture
                    sampled_logits(self.model, self.model(self.input_ids[:b], batch), self.vocab)
                if self.advance:  # compiled on the very buffers (same alignment), then put back
                    saved = self.inputs.clone()
                    self._advance(b)
                    self.inputs.copy_(saved)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with uncollected(), torch.cuda.graph(graph, pool=self.pool):
                logits = sampled_logits(self.model, self.model(self.input_ids[:b], batch), self.vocab)
                if self.greedy_in_graph:  # the embedding has read the ids: the greedy tokens take their place
                    torch.argmax(logits, dim=-1, out=self.input_ids[:b])
                if self.advance:
                    self._advance(b)
            self.graphs[b] = (graph, logits)
        torch.cuda.synchronize(self.device)
        log.info("captured decode CUDA graphs for batch sizes %s", self.buckets)

    def _advance(self, b: int) -> None:
        advance_triton(self.positions[:b], self.context_lens[:b], self.write_index[:b], self.block_tables[:b],
                       self.caches.page_size)

    def replay(self, b: int) -> None:
        """Bucket ``b``'s graph once more on the inputs it holds (timing), the picture kept true."""
        self.graphs[b][0].replay()
        if self._picture is not None:
            self._picture.replayed(b)

    def bucket(self, n: int) -> int | None:
        return next((b for b in self.buckets if b >= n), None)

    def fits(self, reqs: list[Request]) -> bool:
        """Whether a captured graph can run this decode batch."""
        # a request with images: its positions are offset from its indices (``vision/media.py``),
        # which the graph's in-place position advance does not know
        return self.bucket(len(reqs)) is not None and all(len(r.cache.pages) <= self.max_pages and r.media is None
                                                          for r in reqs)

    def run(self, reqs: list[Request], ids: torch.Tensor | None = None,
            follow: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits ``[len(reqs), vocab]`` for one decode token of each request (caches not advanced),
        and their argmax (a view of the input ids, valid until the next step) or None when the
        graph does not take it. The input tokens are the requests' next uncomputed ones, or
        ``ids`` (on the device); ``follow``: they are the greedy tokens of the replay just before,
        whose first rows were these same requests in this order, and are already in place."""
        n = len(reqs)
        b = self.bucket(n)
        self._turn ^= 1
        stage = self._stages[self._turn]
        stage.fill(reqs, self.caches.page_size)
        follow = follow and self.greedy_in_graph
        self._send(stage, b, ids=not follow)
        if ids is not None and not follow:
            self.input_ids[:n].copy_(ids)
        self.replay(b)
        return self.graphs[b][1][:n], (self.input_ids[:n] if self.greedy_in_graph else None)
