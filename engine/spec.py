"""Speculative decoding with n-gram (prompt lookup) drafts, for models whose cache rolls back by
truncation (attention only; ``EngineConfig.check_for_model`` refuses hybrid models).

Before a step, the scheduler asks ``Drafter.propose`` for each decoding request that may
speculate (``speculates``): up to ``draft_tokens`` tokens that followed the latest earlier place
where the sequence's last ``ngram_max`` .. ``ngram_min`` tokens (prompt and output) occur, the
longest such n-gram first. A request with a draft runs as a row of ``1 + k`` tokens (its last
sampled token and the ``k`` drafts) in the step's one forward, laid out as one decode row per
position over the same pages (``step.build_step``: each position computed exactly as a one-token
step computes it), and the logits of every one of those positions are sampled. ``accepted`` then keeps the longest prefix
of drafts equal to the model's own greedy tokens, and the model's token after it: each round
commits ``accepted + 1`` tokens, exactly those that one-token steps would have produced. The KV
of the rejected positions is discarded by setting ``num_computed`` back (the engine's
``_verify``); their pages stay with the request and are written again.

Greedy requests speculate (temperature 0 or ``top_k`` 1, with ``logit_bias`` and logprobs,
under a thinking budget); sampled requests, penalties (they read the token history) and grammars
(the next mask needs the token before it) decode one token per step.
"""
from __future__ import annotations

from .request import Request
from .sampler import uses_history


def speculates(req: Request) -> bool:
    """Whether ``req``'s tokens may be drafted and verified: its tokens are its logits' argmax
    (after ``logit_bias``), whatever came before them."""
    params = req.params
    return params.greedy and not uses_history(params) and req.grammar is None and req.pooled is None


class NgramIndex:
    """Where each n-gram of a sequence last ended (``n`` in ``[lo, hi]``), kept up to date as the
    sequence grows: ``last[key]`` is the position of the token that followed ``key``'s latest
    occurrence."""

    def __init__(self, lo: int, hi: int) -> None:
        self.lo, self.hi = lo, hi
        self.last: dict[tuple[int, ...], int] = {}
        self.indexed = 0  # positions whose preceding n-grams are in ``last``

    def update(self, ids: list[int]) -> None:
        """Index the n-grams that end before each position in ``[indexed, len(ids) - 1]`` (the
        final position has no follower yet)."""
        last, lo, hi = self.last, self.lo, self.hi
        for i in range(max(self.indexed, 1), len(ids)):
            for n in range(lo, min(hi, i) + 1):
                last[tuple(ids[i - n : i])] = i
        self.indexed = max(self.indexed, len(ids))

    def propose(self, ids: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens to follow ``ids`` (indexed up to its end): what followed the latest
        earlier occurrence of its longest matching suffix. A copy that reaches the end of ``ids``
        goes on with the same period (a repeating tail keeps repeating)."""
        end = len(ids)
        for n in range(min(self.hi, end - 1), self.lo - 1, -1):
            at = self.last.get(tuple(ids[end - n :]))
            if at is not None:
                period = end - at
                return [ids[at + t] if at + t < end else ids[at + t - period * (1 + (at + t - end) // period)]
                        for t in range(k)]
        return []


class Drafter:
    """N-gram drafts for the requests that speculate (``speculates``)."""

    def __init__(self, draft_tokens: int, ngram_min: int, ngram_max: int) -> None:
        self.draft_tokens = draft_tokens
        self.ngram_min, self.ngram_max = ngram_min, ngram_max

    def limit(self, req: Request) -> int:
        """How many drafts ``req`` may take now: none that could run past its context or its
        ``max_tokens`` (a round commits the drafts kept and one more)."""
        k = min(self.draft_tokens, req.max_total_tokens - req.num_tokens - 1)
        if req.params.max_tokens is not None:
            k = min(k, req.params.max_tokens - len(req.output_ids) - 1)
        return k

    def eligible(self, req: Request) -> bool:
        """Whether ``req`` may take a draft now."""
        return self.limit(req) > 0 and speculates(req)

    def propose(self, req: Request) -> list[int]:
        """A draft for ``req`` (a decoding request with one uncomputed token), or none."""
        if not self.eligible(req):
            return []
        k = self.limit(req)
        if req.ngram is None:
            req.ngram = NgramIndex(self.ngram_min, self.ngram_max)
        ids = req.all_ids
        req.ngram.update(ids)
        return req.ngram.propose(ids, k)


def accepted(targets: list[int], draft: list[int]) -> int:
    """How many drafts the model's own tokens confirm: the longest prefix of ``draft`` equal to
    ``targets`` (the model's token at each verified position, one more than ``draft``)."""
    j = 0
    while j < len(draft) and targets[j] == draft[j]:
        j += 1
    return j
