"""The Runner: turns a step's plan into one model forward and the sampled tokens.

It owns the physical side of a step (input tensors, the forward, logits, sampling). The engine
decides what runs; the runner decides how. Decode-only steps on CUDA run as one batched forward
over the pools (``DecodeMeta``), replayed from a CUDA graph when one was captured for the batch
size; everything else runs eagerly with per-sequence attention and recurrence.
"""
from __future__ import annotations

import torch

from .cache.manager import CacheManager
from .decode_meta import build_decode_meta
from .models.base import CausalLM, ForwardBatch
from .request import Request
from .sampler import sample


class ModelRunner:
    def __init__(self, model: CausalLM, device: torch.device, caches: CacheManager | None = None,
                 batched_decode: bool | None = None) -> None:
        self.model = model
        self.device = device
        self.caches = caches
        self.batched_decode = (device.type == "cuda") if batched_decode is None else batched_decode
        self.graphs = None  # CudaGraphDecoder, when captured

    def enable_cuda_graphs(self, max_batch: int, max_context: int) -> None:
        from .cuda_graphs import CudaGraphDecoder

        self.graphs = CudaGraphDecoder(self.model, self.caches, max_batch, max_context, self.device)
        self.graphs.capture()

    def execute(self, plan: list[tuple[Request, int]]) -> tuple[list[Request], list[int]]:
        """Run ``n`` new tokens for each ``(request, n)``; advance ``num_computed``; return the
        requests that reached their next token and the tokens sampled for them."""
        with torch.inference_mode():
            if self.batched_decode and self.caches is not None and all(n == 1 for _, n in plan) and \
                    all(r.decode_ready for r, _ in plan):
                logits = self._decode(plan)
                ready = [r for r, _ in plan]
                for r in ready:
                    r.num_computed += 1
            else:
                ready, logits = self._eager(plan)
            if not ready:
                return [], []
            return ready, sample(logits, ready)

    def _decode(self, plan: list[tuple[Request, int]]) -> torch.Tensor:
        reqs = [r for r, _ in plan]
        if self.graphs is not None and self.graphs.fits(reqs):
            logits = self.graphs.run(reqs)
        else:
            meta = build_decode_meta(reqs, self.caches, self.device)
            positions = torch.tensor([r.num_computed for r in reqs], dtype=torch.long, device=self.device)
            ids = torch.tensor([r.all_ids[r.num_computed] for r in reqs], dtype=torch.long, device=self.device)
            batch = ForwardBatch(positions=positions, seq_lens=[1] * len(reqs), caches=[], decode=meta)
            logits = self.model.compute_logits(self.model(ids, batch))
        for r in reqs:
            r.cache.num_tokens += 1
        return logits

    def _eager(self, plan: list[tuple[Request, int]]) -> tuple[list[Request], torch.Tensor | None]:
        ids, positions = [], []
        for req, n in plan:
            ids.extend(req.all_ids[req.num_computed : req.num_computed + n])
            positions.extend(range(req.num_computed, req.num_computed + n))
        batch = ForwardBatch(
            positions=torch.tensor(positions, dtype=torch.long, device=self.device),
            seq_lens=[n for _, n in plan],
            caches=[req.cache for req, _ in plan],
        )
        hidden = self.model(torch.tensor(ids, dtype=torch.long, device=self.device), batch)
        rows, ready, end = [], [], 0
        for req, n in plan:
            end += n
            req.num_computed += n
            if req.num_computed == req.num_tokens:  # everything known is computed: sample
                rows.append(end - 1)
                ready.append(req)
        return ready, (self.model.compute_logits(hidden[rows]) if rows else None)
