"""Token selection from logits, per request: penalties, then greedy or temperature / top-k /
top-p / min-p sampling.

Each request samples with its own ``torch.Generator`` so that its output depends on its own seed
only, never on what else is in the batch.
"""
from __future__ import annotations

import torch

from .request import Request
from .sampling_params import SamplingParams


def make_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    if params.greedy:
        return None
    gen = torch.Generator(device=device)
    if params.seed is not None:
        gen.manual_seed(params.seed)
    else:
        gen.seed()
    return gen


def apply_penalties(logits: torch.Tensor, params: SamplingParams, prompt_ids: list[int],
                    output_ids: list[int]) -> torch.Tensor:
    """Repetition penalty over prompt + output (divide positive / multiply negative logits);
    presence and frequency penalties over the output only, as OpenAI defines them."""
    if params.repetition_penalty != 1.0 and (prompt_ids or output_ids):
        seen = torch.tensor(sorted(set(prompt_ids) | set(output_ids)), device=logits.device)
        vals = logits[seen]
        logits[seen] = torch.where(vals > 0, vals / params.repetition_penalty, vals * params.repetition_penalty)
    if (params.presence_penalty or params.frequency_penalty) and output_ids:
        ids = torch.tensor(output_ids, device=logits.device)
        counts = torch.zeros_like(logits).index_add_(0, ids, torch.ones_like(ids, dtype=logits.dtype))
        logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def filtered_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Probabilities ``[V]`` (fp32) after temperature, top-k, top-p and min-p.

    Whatever the values (a temperature or penalty so small that the logits overflow, a top_p that
    rounds to 0 in fp32), the most likely token keeps a probability: a NaN or empty distribution
    would fail the whole engine step."""
    logits = torch.nan_to_num(logits.float(), nan=float("-inf"))
    top = logits.max()
    logits = torch.where(logits == top, 0.0, (logits - top) / params.temperature)  # the best at 0, none +inf
    if 0 < params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.min_p > 0.0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        drop = before >= params.top_p * sorted_probs.sum()
        drop[0] = False  # the nucleus holds at least the most likely token
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return probs / probs.sum()


def sample_one(logits: torch.Tensor, req: Request) -> torch.Tensor:
    """The token for one row, as a one-element tensor left on the device (read later, together)."""
    params = req.params
    logits = apply_penalties(logits.float().clone(), params, req.prompt_ids, req.output_ids)
    if params.greedy:
        return torch.argmax(logits).reshape(1)
    probs = filtered_probs(logits, params)
    return torch.multinomial(probs, 1, generator=req.generator)


def _plain_greedy(params: SamplingParams) -> bool:
    return params.greedy and not uses_history(params)


def uses_history(params: SamplingParams) -> bool:
    """Whether the token depends on the request's earlier tokens (penalties), so it cannot be
    sampled before the previous token has been read back."""
    return params.repetition_penalty != 1.0 or bool(params.presence_penalty) or bool(params.frequency_penalty)


def sample_tokens(logits: torch.Tensor, reqs: list[Request], greedy: torch.Tensor | None = None) -> torch.Tensor:
    """One token per row of ``logits`` ``[B, V]``, row ``i`` for ``reqs[i]``, as a ``[B]`` tensor
    left on the device: every row is decided there (plain greedy rows in one argmax, ``greedy``
    where the caller has it already; returned as is when every row is plain greedy)."""
    if greedy is None:
        greedy = torch.argmax(logits, dim=-1)
    if all(_plain_greedy(r.params) for r in reqs):
        return greedy
    return torch.cat([greedy[i : i + 1] if _plain_greedy(r.params) else sample_one(logits[i], r)
                      for i, r in enumerate(reqs)])


def sample(logits: torch.Tensor, reqs: list[Request]) -> list[int]:
    """``sample_tokens`` read back with one copy."""
    return sample_tokens(logits, reqs).tolist()
