"""Token selection for a whole step at once: penalties, then greedy or temperature / top-k /
top-p / min-p sampling, in batched tensor operations (no loop over rows but the noise draw);
each request's logit bias added on its row; log-probabilities for the rows that ask for them.

A row is sampled as ``argmax(p / E)`` with ``E ~ Exp(1)`` i.i.d. per candidate (the exponential
race, exact for any distribution ``p``), its noise drawn from its own ``torch.Generator``: its
token depends on its own seed and logits only, never on what else is in the step. Rows with a
``top_k`` work on their ``top_k`` best ids only; the others on the full vocabulary. Penalties read each request's output counts and prompt ids from device
tensors that the sampler keeps up to date (``_History``). Log-probabilities are computed after
the draw, only for rows whose request asks (``Sampler.logprobs``): a step without such a row does
no more than before. Nothing here waits for the device.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .outputs import TokenLogprob
from .request import Request
from .sampling_params import SamplingParams
from .step import index_on


def make_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    if params.greedy:
        return None
    gen = torch.Generator(device=device)
    if params.seed is not None:
        gen.manual_seed(params.seed)
    else:
        gen.seed()
    return gen


def uses_history(params: SamplingParams) -> bool:
    """Whether the token depends on the request's earlier tokens (penalties), so it cannot be
    sampled before the previous token has been read back."""
    return params.repetition_penalty != 1.0 or bool(params.presence_penalty) or bool(params.frequency_penalty)


def _plain_greedy(params: SamplingParams) -> bool:
    """A row whose token is the argmax of its raw logits (a captured graph's argmax serves it)."""
    return params.greedy and not uses_history(params) and not params.logit_bias


# what a log-probability of -inf reads as in an answer (JSON has no infinity), as OpenAI writes it
LOGPROB_FLOOR = -9999.0


@dataclass
class StepLogprobs:
    """The log-probabilities of a step's rows that ask for them, still on the device: ``rows``
    (their places in the step), each one's own number of alternatives (``counts``), and ``table``
    ``[len(rows), 1 + 2K]`` fp32 (``K``: the most any of them asks): the chosen token's
    log-probability, the ``K`` best ones in descending order, then those ``K`` ids (exact in fp32
    below 2^24)."""

    rows: list[int]
    counts: list[int]
    table: torch.Tensor

    def unpack(self, values: list[list[float]], tokens: list[int]) -> list[TokenLogprob | None]:
        """Per row of the step (``tokens``: the tokens it sampled), its ``TokenLogprob`` or None;
        ``values``: ``table`` read back. Alternatives of probability 0 are left out."""
        out: list[TokenLogprob | None] = [None] * len(tokens)
        width = (self.table.shape[-1] - 1) // 2
        for row, k, v in zip(self.rows, self.counts, values):
            top = tuple((int(v[1 + width + j]), v[1 + j]) for j in range(min(k, width)) if v[1 + j] != -math.inf)
            out[row] = TokenLogprob(tokens[row], max(v[0], LOGPROB_FLOOR), top)
        return out


def constrained(req: Request) -> bool:
    """Whether the request's grammar holds its next token."""
    return req.grammar is not None and req.grammar.constrains


def _on(device: torch.device, values: list, dtype: torch.dtype) -> torch.Tensor:
    """A small host list on ``device`` without waiting for the device (a pinned staging copy)."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


@dataclass
class _Params:
    """The filter values of some rows, one column each, on the device."""

    temperature: torch.Tensor  # [n, 1]
    top_k: torch.Tensor  # [n, 1] long, 0 = off
    top_p: torch.Tensor  # [n, 1]
    min_p: torch.Tensor  # [n, 1]

    @classmethod
    def of(cls, params: list[SamplingParams], device: torch.device) -> _Params:
        table = _on(device, [[p.temperature, p.top_k, p.top_p, p.min_p] for p in params], torch.float64)
        return cls(table[:, 0:1].float(), table[:, 1:2].long(), table[:, 2:3].float(), table[:, 3:4].float())


def _filtered(logits: torch.Tensor, params: _Params, ranked: bool) -> torch.Tensor:
    """Probabilities ``[n, C]`` (fp32) after temperature, top-k, top-p and min-p, per row.

    ``ranked``: each row holds a row's ``top_k`` best logits (and maybe more, for others in the
    group), in descending order (``torch.topk``): top-k is a mask on positions and top-p needs no
    sort. Otherwise the rows have no top-k and cover the whole vocabulary. Whatever the values (a
    temperature or penalty so small that the logits overflow, a top_p that rounds to 0 in fp32),
    the most likely token keeps a probability: a NaN or empty distribution would fail the step."""
    x = torch.nan_to_num(logits.float(), nan=float("-inf"))
    top = x.amax(dim=-1, keepdim=True)
    x = torch.where(x == top, 0.0, (x - top) / params.temperature)  # the best at 0, none +inf
    if ranked:
        x = x.masked_fill(torch.arange(x.shape[-1], device=x.device) >= params.top_k, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    probs = probs.masked_fill(probs < params.min_p * probs.amax(dim=-1, keepdim=True), 0.0)
    ordered, order = (probs, None) if ranked else torch.sort(probs, dim=-1, descending=True)
    before = torch.cumsum(ordered, dim=-1) - ordered
    drop = (before >= params.top_p * ordered.sum(dim=-1, keepdim=True)) & (params.top_p < 1.0)
    drop[:, 0] = False  # the nucleus holds at least the most likely token
    ordered = ordered.masked_fill(drop, 0.0)
    probs = ordered if order is None else torch.zeros_like(probs).scatter_(-1, order, ordered)
    return probs / probs.sum(dim=-1, keepdim=True)


def _ranked(params: SamplingParams, vocab: int) -> bool:
    return 0 < params.top_k < vocab


def _candidates(x: torch.Tensor, params: list[SamplingParams], ranked: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The probabilities rows sample from and, for ranked rows (all with a top_k), the ids they
    stand for (``None``: position = id)."""
    table = _Params.of(params, x.device)
    if not ranked:
        return _filtered(x, table, ranked=False), None
    values, ids = torch.topk(x, max(p.top_k for p in params), dim=-1)
    return _filtered(values, table, ranked=True), ids


def distribution(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The filtered distribution ``[n, V]`` each row samples from (penalties already applied)."""
    x = torch.nan_to_num(logits.float(), nan=float("-inf"))
    probs = torch.zeros_like(x)
    for ranked in (True, False):
        rows = [i for i, p in enumerate(params) if _ranked(p, x.shape[-1]) == ranked]
        if rows:
            at = index_on(rows, x.device)
            p, ids = _candidates(x[at], [params[i] for i in rows], ranked)
            probs[at] = p if ids is None else torch.zeros_like(x[at]).scatter_(-1, ids, p)
    return probs


class _History:
    """Per request that uses penalties, on the device: how often each id occurs in its output
    (``counts``) and which ids its prompt holds (``prompt``). Rows of two pooled tensors, brought
    up to date with the output ids appended since the last step in one scatter for all rows."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.counts: torch.Tensor | None = None  # [rows, V] int32
        self.prompt: torch.Tensor | None = None  # [rows, V] bool
        self._row: dict[str, list[int]] = {}  # request id -> [row, output ids counted]
        self._free: list[int] = []

    def release(self, req: Request) -> None:
        entry = self._row.pop(req.request_id, None)
        if entry is not None:
            self._free.append(entry[0])

    def rows(self, reqs: list[Request], vocab: int) -> torch.Tensor:
        """The pool rows of ``reqs`` (taken for those new to it), counting their new output ids."""
        new = [r for r in reqs if r.request_id not in self._row]
        if new:
            self._take(new, vocab)
        rows, cols = [], []
        for r in reqs:
            entry = self._row[r.request_id]
            fresh = r.output_ids[entry[1]:]
            rows += [entry[0]] * len(fresh)
            cols += fresh
            entry[1] = len(r.output_ids)
        if rows:
            at = _on(self.device, [rows, cols], torch.long)
            self.counts.index_put_((at[0], at[1]), torch.ones(len(rows), dtype=torch.int32, device=self.device),
                                   accumulate=True)
        return _on(self.device, [self._row[r.request_id][0] for r in reqs], torch.long)

    def _take(self, new: list[Request], vocab: int) -> None:
        need = len(new) - len(self._free)
        if need > 0:
            have = 0 if self.counts is None else self.counts.shape[0]
            size = max(have * 2, have + need, 4)
            counts = torch.zeros(size, vocab, dtype=torch.int32, device=self.device)
            prompt = torch.zeros(size, vocab, dtype=torch.bool, device=self.device)
            if self.counts is not None:
                counts[:have] = self.counts
                prompt[:have] = self.prompt
            self.counts, self.prompt = counts, prompt
            self._free += range(size - 1, have - 1, -1)
        rows, cols = [], []
        taken = []
        for r in new:
            row = self._free.pop()
            taken.append(row)
            self._row[r.request_id] = [row, 0]
            ids = [t for t in set(r.prompt_ids) if t < vocab]
            rows += [row] * len(ids)
            cols += ids
        at = _on(self.device, taken, torch.long)
        self.counts[at] = 0
        self.prompt[at] = False
        if rows:
            where = _on(self.device, [rows, cols], torch.long)
            self.prompt[where[0], where[1]] = True

    def penalize(self, logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        """``logits`` ``[n, V]`` of ``reqs`` with their penalties: the repetition penalty over prompt
        and output ids (positive logits divided, negative multiplied); presence and frequency
        penalties over the output only, as OpenAI defines them."""
        rows = self.rows(reqs, logits.shape[-1])
        values = _on(self.device, [[r.params.repetition_penalty, r.params.presence_penalty,
                                    r.params.frequency_penalty] for r in reqs], torch.float64).float()
        rep, presence, frequency = values[:, 0:1], values[:, 1:2], values[:, 2:3]
        counts = self.counts[rows].to(logits.dtype)
        seen = (counts > 0) | self.prompt[rows]
        logits = torch.where(seen & (rep != 1.0), torch.where(logits > 0, logits / rep, logits * rep), logits)
        return logits - frequency * counts - presence * (counts > 0).to(logits.dtype)


def _exponential_(row: torch.Tensor, generator: torch.Generator | None) -> None:
    """``row`` filled with Exp(1) draws: one kernel on CUDA; on the CPU as ``-log(U)``, three
    times faster there than its ``exponential_``."""
    if row.device.type == "cuda":
        row.exponential_(generator=generator)
    else:
        row.uniform_(generator=generator).log_().neg_()


class Sampler:
    """One token per row of a step's logits, decided on the device. ``max_rows``: the most rows a
    step has (the engine's concurrency), what the grammar masks' buffers are sized for."""

    def __init__(self, device: torch.device, max_rows: int = 8) -> None:
        self.device = device
        self.history = _History(device)
        self._masks = None  # GrammarMasks, made for the first step with a row under a grammar
        self._max_rows = max_rows
        self._indices: dict[tuple[int, ...], torch.Tensor] = {}

    def release(self, req: Request) -> None:
        """Forget a finished request's token history."""
        self.history.release(req)

    def _index(self, rows: list[int]) -> torch.Tensor:
        """``rows`` as a device index tensor, kept for the next step with the same rows."""
        key = tuple(rows)
        at = self._indices.get(key)
        if at is None:
            if len(self._indices) >= 256:
                self._indices.clear()
            at = self._indices[key] = _on(self.device, rows, torch.long)
        return at

    def penalized(self, logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        """fp32 logits ``[n, V]`` with each request's penalties (rows without any unchanged)."""
        return self._penalize_(logits.float().clone(), reqs)

    def _penalize_(self, logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        """``penalized`` in place on fp32 ``logits``."""
        rows = [i for i, r in enumerate(reqs) if uses_history(r.params)]
        if rows:
            at = _on(self.device, rows, torch.long)
            logits[at] = self.history.penalize(logits[at], [reqs[i] for i in rows])
        return logits

    def sample(self, logits: torch.Tensor, reqs: list[Request], greedy: torch.Tensor | None = None) -> torch.Tensor:
        """One token per row of ``logits`` ``[B, V]``, row ``i`` for ``reqs[i]``, as a ``[B]`` tensor
        left on the device. Plain greedy rows take one argmax over the step (``greedy``, where
        the caller has it already; returned as is when every row is plain greedy and free); rows
        under a grammar choose among the ids it allows now (the masks filled on the host now:
        the matchers must have taken every token before this step's). A plain greedy row under
        a grammar is the argmax of its masked logits, in their own dtype (in place when the whole
        step is such rows and none asks for log-probabilities); the others go through the fp32
        chain (penalties, bias, filters) with the mask applied after the penalties and bias."""
        held = [constrained(r) and not r.is_finished for r in reqs]  # a finished row's token is dropped
        rows = [i for i, r in enumerate(reqs) if not _plain_greedy(r.params)]
        mask = None
        if any(held):
            if self._masks is None:
                from .grammar import GrammarMasks

                self._masks = GrammarMasks(self.device, self._max_rows)
            mask = self._masks.fill([r.grammar if h else None for r, h in zip(reqs, held)], logits.shape[-1])
            fast = [i for i, h in enumerate(held) if h and _plain_greedy(reqs[i].params)]
            if fast:
                greedy = self._held_argmax(logits, reqs, fast, mask, greedy)
        if greedy is None:
            greedy = torch.argmax(logits, dim=-1)
        if not rows:
            return greedy
        whole = len(rows) == len(reqs)
        at = self._index(rows)
        reqs_at = [reqs[i] for i in rows]
        x = self._bias_(self._penalize_(logits[at].float(), reqs_at), reqs_at).nan_to_num_(nan=float("-inf"))  # a copy
        if mask is not None and any(held[i] for i in rows):
            from .grammar import apply_bitmask

            apply_bitmask(x, mask if whole else mask[at])
        reqs = reqs_at
        chosen = torch.argmax(x, dim=-1)  # right for the greedy rows with penalties
        for ranked in (True, False):
            group = [i for i, r in enumerate(reqs) if not r.params.greedy and _ranked(r.params, x.shape[-1]) == ranked]
            if group:
                where = self._index(group)
                chosen[where] = self._draw(x[where], [reqs[i] for i in group], ranked)
        tokens = greedy.clone()
        tokens[at] = chosen.to(tokens.dtype)
        return tokens

    def _held_argmax(self, logits: torch.Tensor, reqs: list[Request], fast: list[int], mask: torch.Tensor,
                     greedy: torch.Tensor | None) -> torch.Tensor:
        """The step's greedy tokens with the rows ``fast`` (plain greedy, under a grammar) taken as
        the argmax of their masked logits (NaN as -inf, as the fp32 chain reads it)."""
        from .grammar import apply_bitmask

        if len(fast) == len(reqs) and all(r.params.logprobs is None for r in reqs):
            # nothing reads these logits after the draw (the graph's output, rewritten by its next replay)
            apply_bitmask(logits.nan_to_num_(nan=float("-inf")), mask)
            return torch.argmax(logits, dim=-1)
        at = self._index(fast)
        x = logits[at].nan_to_num_(nan=float("-inf"))  # a copy, in the logits' dtype
        apply_bitmask(x, mask[at])
        tokens = (torch.argmax(logits, dim=-1) if greedy is None else greedy).clone()
        tokens[at] = torch.argmax(x, dim=-1).to(tokens.dtype)
        return tokens

    def _bias_(self, x: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        """Each request's ``logit_bias`` added in place to its row of ``x`` (fp32), in one scatter."""
        rows, cols, values = [], [], []
        for i, r in enumerate(reqs):
            for token, bias in r.params.logit_bias.items():
                if token < x.shape[-1]:
                    rows.append(i)
                    cols.append(token)
                    values.append(bias)
        if rows:
            at = _on(self.device, [rows, cols], torch.long)
            x.index_put_((at[0], at[1]), _on(self.device, values, torch.float32), accumulate=True)
        return x

    def logprobs(self, logits: torch.Tensor, reqs: list[Request], tokens: torch.Tensor) -> StepLogprobs | None:
        """The log-probabilities of the rows whose request asks for them (None when none does),
        left on the device: ``log_softmax`` of the raw logits, or, for requests that ask for them
        after sampling, the log of the distribution the token was drawn from (penalties, bias,
        temperature and filters applied; a greedy row's is all on its token). ``tokens``: what
        ``sample`` chose for every row."""
        rows = [i for i, r in enumerate(reqs) if r.params.logprobs is not None]
        if not rows:
            return None
        asking = [reqs[i] for i in rows]
        at = _on(self.device, rows, torch.long)
        x = logits[at].float().nan_to_num_(nan=float("-inf"))  # a copy
        lp = torch.log_softmax(x, dim=-1)
        after = [i for i, r in enumerate(asking) if r.params.logprobs_after_sampling]
        if after:
            where = _on(self.device, after, torch.long)
            chain = self._bias_(self._penalize_(x[where], [asking[i] for i in after]), [asking[i] for i in after])
            lp[where] = distribution(chain, [asking[i].params for i in after]).log()
        counts = [r.params.logprobs for r in asking]
        parts = [lp.gather(-1, tokens[at].view(-1, 1).long())]
        if max(counts):
            values, ids = torch.topk(lp, min(max(counts), lp.shape[-1]), dim=-1)
            parts += [values, ids.float()]
        return StepLogprobs(rows, counts, torch.cat(parts, dim=-1))

    def draw_size(self, params: SamplingParams, vocab: int) -> int:
        """Noise values one draw of a sampled row takes from its generator (``_draw``)."""
        return params.top_k if _ranked(params, vocab) else vocab

    def replay(self, req: Request, state: torch.Tensor, draws: int, vocab: int) -> None:
        """Set ``req``'s generator back to ``state`` and take ``draws`` draws from it: after a
        verify row of ``1 + k`` sampled positions of which ``draws`` gave committed tokens, its
        stream stands where one-token steps would have left it (``spec.py``)."""
        gen = req.generator
        gen.set_state(state)
        size = self.draw_size(req.params, vocab)
        scratch = torch.empty(size, device=self.device)
        for _ in range(draws):
            _exponential_(scratch, gen)

    def _draw(self, x: torch.Tensor, reqs: list[Request], ranked: bool) -> torch.Tensor:
        """``argmax(p / E)``, ``E ~ Exp(1)`` i.i.d., drawn from each request's own generator: one
        per id over the vocabulary, or for a ranked row one per rank of its own ``top_k`` (the
        ranks are a function of its logits alone, so the draw does not depend on the batch)."""
        probs, ids = _candidates(x, [r.params for r in reqs], ranked)
        noise = torch.ones_like(probs)
        for i, r in enumerate(reqs):
            row = noise[i] if ids is None else noise[i, : r.params.top_k]
            _exponential_(row, r.generator)
        noise.clamp_(min=torch.finfo(noise.dtype).tiny)
        pick = torch.argmax(probs / noise, dim=-1, keepdim=True)
        return pick.squeeze(-1) if ids is None else ids.gather(-1, pick).squeeze(-1)
