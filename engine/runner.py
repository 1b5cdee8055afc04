"""The Runner: turns a step's plan into one model forward and the sampled tokens.

It owns the physical side of a step (input tensors, the forward, logits, sampling). The engine
decides what runs; the runner decides how. A GPU runner with CUDA graphs plugs in here.
"""
from __future__ import annotations

import torch

from .models.base import CausalLM, ForwardBatch
from .request import Request
from .sampler import sample


class ModelRunner:
    def __init__(self, model: CausalLM, device: torch.device) -> None:
        self.model = model
        self.device = device

    def execute(self, plan: list[tuple[Request, int]]) -> tuple[list[Request], list[int]]:
        """Run ``n`` new tokens for each ``(request, n)``; advance ``num_computed``; return the
        requests that reached their next token and the tokens sampled for them."""
        ids, positions = [], []
        for req, n in plan:
            ids.extend(req.all_ids[req.num_computed : req.num_computed + n])
            positions.extend(range(req.num_computed, req.num_computed + n))
        batch = ForwardBatch(
            positions=torch.tensor(positions, dtype=torch.long, device=self.device),
            seq_lens=[n for _, n in plan],
            caches=[req.cache for req, _ in plan],
        )
        with torch.inference_mode():
            hidden = self.model(torch.tensor(ids, dtype=torch.long, device=self.device), batch)
            rows, ready, end = [], [], 0
            for req, n in plan:
                end += n
                req.num_computed += n
                if req.num_computed == req.num_tokens:  # everything known is computed: sample
                    rows.append(end - 1)
                    ready.append(req)
            if not ready:
                return [], []
            logits = self.model.compute_logits(hidden[rows])
            return ready, sample(logits, ready)
