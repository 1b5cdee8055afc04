"""Speculative decoding: n-gram (prompt lookup) drafts, or the checkpoint's MTP head's
(``MTPDrafter``), verified in the step that runs them, for every model (a hybrid model's Gated
DeltaNet layers keep each verified position's state: ``models/base.VerifyRows``).

Before a step, the scheduler asks ``Drafter.propose`` for each decoding request that may
speculate (``speculates``): up to ``draft_tokens`` tokens that followed the latest earlier place
where the sequence's last ``ngram_max`` .. ``ngram_min`` tokens (prompt and output) occur, the
longest such n-gram first (or the MTP head's draft, made after the step before). A request with a
draft runs as a row of ``1 + k`` tokens (its last sampled token and the ``k`` drafts) in the
step's one forward, laid out as one decode row per position over the same pages
(``step.build_step``: each position computed exactly as a one-token step computes it), and the
logits of every one of those positions are sampled. ``accepted`` then keeps the longest prefix of
drafts equal to the model's own tokens, and the model's token after it: each round commits
``accepted + 1`` tokens, exactly those that one-token steps would have produced. The KV of the
rejected positions is discarded by setting ``num_computed`` back (the engine's ``_verify``);
their pages stay with the request and are written again.

Sampled requests speculate too, by rejection sampling: a draft here is a fixed token (q one-hot),
so accepting it with probability min(1, p/q) = p(d) and else drawing from (p - q)+ renormalised
(p without d) is exactly drawing each position's token from its own p (after temperature,
top-k / top-p / min-p and ``logit_bias``) and keeping the draft while the draw equals it; the
first draw that differs is the replacement. Each position draws with the noise its request's
generator gives a one-token step there (``Sampler._draw``: a row's draws in order), and after the
round the generator is set back to the draws committed (``Sampler.replay``): a seeded request's
output does not depend on the drafts. Requests with penalties (they read the token history) and
grammars (the next mask needs the token before it) decode one token per step.
"""
from __future__ import annotations

from .request import Request
from .sampler import uses_history


def speculates(req: Request) -> bool:
    """Whether ``req``'s tokens may be drafted and verified: each one is drawn from its own
    position's logits (after ``logit_bias``, temperature and filters), whatever came before them."""
    return not uses_history(req.params) and req.grammar is None and req.pooled is None


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

    def room(self, req: Request) -> int:
        """The most drafts ``req`` can take: none that could run past its context or its
        ``max_tokens`` (a round commits the drafts kept and one more)."""
        k = min(self.draft_tokens, req.max_total_tokens - req.num_tokens - 1)
        if req.params.max_tokens is not None:
            k = min(k, req.params.max_tokens - len(req.output_ids) - 1)
        return k

    def limit(self, req: Request) -> int:
        """How many drafts ``req`` takes now: ``room``, and no more than its recent rounds kept
        (``adapt``), so a text the drafts miss costs rows of two positions, not of
        ``draft_tokens + 1``."""
        k = self.room(req)
        return k if req.spec_len is None else min(k, req.spec_len)

    def adapt(self, req: Request, drafted: int, kept: int) -> None:
        """After a round of ``drafted`` drafts of which ``kept`` held: two more next time where
        all held (up to ``draft_tokens``), one fewer (at least one) where one missed."""
        n = self.draft_tokens if req.spec_len is None else req.spec_len
        req.spec_len = min(self.draft_tokens, n + 2) if kept == drafted else max(1, n - 1)

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


class MTPDrafter(Drafter):
    """Drafts from the checkpoint's MTP head (``--spec mtp``, ``models/mtp.py``). After every step
    (``after_step``) the head runs over the positions each speculating request has just had
    computed and kept (its K/V there, in the pool's extra attention layer, is then that of the
    committed tokens; the positions of rejected drafts are written over), and, for a request
    ready to decode, drafts ``k`` tokens: the first from its last position's output, each next
    one from one more head step on its own output and the token it drafted (greedy). The draft
    waits in ``Request.mtp_draft`` for the scheduler (``propose``)."""

    def __init__(self, draft_tokens: int, model, caches, device, vocab: int | None) -> None:
        super().__init__(draft_tokens, 1, 1)
        self.model, self.caches, self.device, self.vocab = model, caches, device, vocab

    def propose(self, req: Request) -> list[int]:
        if not self.eligible(req):
            return []
        return req.mtp_draft[: self.limit(req)]

    def after_step(self, rows: list[tuple[Request, int, int, int]], hidden) -> None:
        """``rows``: a step's ``(request, first position, tokens, first flat row)``; ``hidden``:
        the main model's final hidden states of its flat run."""
        import torch

        from .request import Status
        from .runner import sampled_logits
        from .step import build_rows, index_on

        runs = []  # (request, first position, positions, first flat row)
        for req, start, n, at in rows:
            req.mtp_draft = []
            if req.is_finished or not speculates(req) or req.cache is None:
                continue
            end = min(start + n, req.num_computed, req.num_tokens - 1)  # kept, and the next token known
            if end > start:
                runs.append((req, start, end - start, at))
        if not runs:
            return
        runs.sort(key=lambda r: r[2] != 1)  # (stable) rows of one position first
        tokens = [t for req, start, n, _ in runs for t in req.all_ids[start + 1 : start + n + 1]]
        index = index_on([at + i for _, _, n, at in runs for i in range(n)], hidden.device)
        with torch.inference_mode():
            ids, batch, last = build_rows([(r, s, n) for r, s, n, _ in runs], tokens, self.caches, self.device)
            out = self.model.mtp_forward(ids, hidden.index_select(0, index), batch)[last]
            wanted = []
            for i, (req, start, n, _) in enumerate(runs):
                k = self.limit(req) if req.status is Status.DECODE and start + n == req.num_computed \
                    and req.num_tokens == req.num_computed + 1 and self.eligible(req) else 0
                while k > 1 and not self.caches.reserve(req.cache, req.num_computed + k - 1):
                    k -= 1  # the head's further steps write K/V at the positions after it
                if k > 0:
                    wanted.append((i, req, k))
            if not wanted:
                return
            keep = index_on([i for i, _, _ in wanted], out.device)
            out = out.index_select(0, keep)
            # the chain stays on the device: each head step takes the tokens the one before drafted
            # there, and the host reads the whole table once, at the end
            depth = max(k for _, _, k in wanted)
            table = torch.empty((len(wanted), depth), dtype=torch.long, device=out.device)
            table[:, 0] = sampled_logits(self.model, out, self.vocab).argmax(dim=-1)
            for j in range(1, depth):
                active = [w for w, (_, _, k) in enumerate(wanted) if k > j]
                rows_j = [(wanted[w][1], wanted[w][1].num_computed + j - 1, 1) for w in active]
                sel = index_on(active, out.device)
                ids, batch, _ = build_rows(rows_j, table[:, j - 1].index_select(0, sel), self.caches, self.device)
                out_j = self.model.mtp_forward(ids, out.index_select(0, sel), batch)
                table[sel, j] = sampled_logits(self.model, out_j, self.vocab).argmax(dim=-1)
                out = out.clone()
                out[sel] = out_j
            drafts = table.tolist()
        for (_, req, k), draft in zip(wanted, drafts):
            req.mtp_draft = draft[:k]
