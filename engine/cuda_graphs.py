"""Decode steps captured in CUDA graphs, one graph per batch-size bucket.

All inputs of a captured step live in static device buffers (token ids, positions, block tables,
context lengths, KV write rows, state slots); a step copies the real rows in, pads the rest of
the bucket with a reserved padding page and slot, replays the graph, and reads the logits.
Nothing in a replay syncs with the host; the caller reads the sampled tokens once.
"""
from __future__ import annotations

import logging

import torch

from .cache.manager import CacheManager
from .decode_meta import decode_rows
from .models.base import CausalLM, DecodeMeta, ForwardBatch
from .request import Request

log = logging.getLogger("ninfer.engine")

BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64)


class CudaGraphDecoder:
    def __init__(self, model: CausalLM, caches: CacheManager, max_batch: int, max_context: int,
                 device: torch.device) -> None:
        self.model = model
        self.caches = caches
        self.device = device
        self.buckets = [b for b in BUCKETS if b < max_batch] + [max_batch]
        self.max_pages = -(-max_context // caches.page_size) + 1
        self.pad_page, self.pad_slot = caches.reserve_padding()
        n = max_batch
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.block_tables = torch.zeros(n, self.max_pages, dtype=torch.int32, device=device)
        self.context_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.write_index = torch.zeros(n, dtype=torch.long, device=device)
        self.slot_ids = torch.zeros(n, dtype=torch.long, device=device)
        self._reset_padding(0)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = torch.cuda.graph_pool_handle()

    def _reset_padding(self, start: int) -> None:
        page = max(self.pad_page, 0)
        self.block_tables[start:] = page
        self.context_lens[start:] = 1
        self.write_index[start:] = page * self.caches.page_size
        self.slot_ids[start:] = max(self.pad_slot, 0)
        self.input_ids[start:] = 0
        self.positions[start:] = 0

    def _batch(self, b: int) -> ForwardBatch:
        meta = DecodeMeta(
            kv=self.caches.kv, states=self.caches.states, attn_ordinal=self.caches.attn_ordinal,
            gdn_ordinal=self.caches.gdn_ordinal, block_tables=self.block_tables[:b],
            context_lens=self.context_lens[:b], write_index=self.write_index[:b], slot_ids=self.slot_ids[:b],
        )
        return ForwardBatch(positions=self.positions[:b], seq_lens=[1] * b, caches=[], decode=meta)

    @torch.inference_mode()
    def capture(self) -> None:
        for b in reversed(self.buckets):  # largest first, so smaller graphs reuse its memory
            batch = self._batch(b)
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm-up: compiles / autotunes kernels outside the capture
                    self.model.compute_logits(self.model(self.input_ids[:b], batch))
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                logits = self.model.compute_logits(self.model(self.input_ids[:b], batch))
            self.graphs[b] = (graph, logits)
        torch.cuda.synchronize(self.device)
        log.info("captured decode CUDA graphs for batch sizes %s", self.buckets)

    def bucket(self, n: int) -> int | None:
        return next((b for b in self.buckets if b >= n), None)

    def fits(self, reqs: list[Request]) -> bool:
        """Whether a captured graph can run this decode batch."""
        return self.bucket(len(reqs)) is not None and all(len(r.cache.pages) <= self.max_pages for r in reqs)

    def run(self, reqs: list[Request]) -> torch.Tensor:
        """Logits ``[len(reqs), V]`` for one decode token of each request (caches not advanced)."""
        n = len(reqs)
        b = self.bucket(n)
        tables, lens, writes, slots = decode_rows(reqs, self.caches.page_size, self.max_pages, max(self.pad_page, 0))
        ids = [r.all_ids[r.num_computed] for r in reqs]
        pos = [r.num_computed for r in reqs]
        host = torch.tensor([ids, pos, lens, writes, slots], dtype=torch.long)
        self.input_ids[:n].copy_(host[0], non_blocking=True)
        self.positions[:n].copy_(host[1], non_blocking=True)
        self.context_lens[:n].copy_(host[2], non_blocking=True)
        self.write_index[:n].copy_(host[3], non_blocking=True)
        self.slot_ids[:n].copy_(host[4], non_blocking=True)
        self.block_tables[:n].copy_(torch.tensor(tables, dtype=torch.int32), non_blocking=True)
        if n < b:
            self._reset_padding(n)
        graph, logits = self.graphs[b]
        graph.replay()
        return logits[:n]
