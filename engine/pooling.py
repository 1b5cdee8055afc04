"""Embedding requests: a prompt-only request whose output is the model's final hidden states
(after the last norm) pooled over its prompt, instead of a sampled token.

The runner hands every prompt chunk's hidden rows to the request's ``Pooled`` as they are
computed (``runner.ModelRunner``); a chunk computed again (a paused request rebuilt by replay)
adds nothing twice. The engine publishes the result when the prompt is done (``RequestOutput.
embedding``). An embedding request never goes on from a prefix checkpoint: the tokens it would
skip are tokens it must see.
"""
from __future__ import annotations

import torch

POOLING = ("none", "mean", "last")  # every token's state | their mean | the last token's


class Pooled:
    """What one embedding request has gathered so far, kept in fp32 on the model's device."""

    def __init__(self, mode: str) -> None:
        if mode not in POOLING:
            raise ValueError(f"pooling must be one of {', '.join(POOLING)}, got {mode!r}")
        self.mode = mode
        self.seen = 0  # prompt positions gathered (the next row expected is at this position)
        self._rows: list[torch.Tensor] = []  # "none": every row; "last": the newest row
        self._sum: torch.Tensor | None = None  # "mean"

    def add(self, rows: torch.Tensor, first: int) -> None:
        """``rows``: hidden states of positions ``first ..``; those already gathered are skipped."""
        skip = self.seen - first
        if skip >= rows.shape[0]:
            return
        rows = rows[max(skip, 0):].float()
        self.seen += rows.shape[0]
        if self.mode == "mean":
            total = rows.sum(dim=0)
            self._sum = total if self._sum is None else self._sum + total
        elif self.mode == "last":
            self._rows = [rows[-1:].clone()]
        else:
            self._rows.append(rows.clone())

    def result(self) -> list[list[float]]:
        """One vector for ``mean`` and ``last``, one per prompt token for ``none``."""
        if self.mode == "mean":
            return [] if self._sum is None else [(self._sum / self.seen).tolist()]
        return torch.cat(self._rows).tolist() if self._rows else []
