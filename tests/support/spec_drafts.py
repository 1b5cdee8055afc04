"""Drafters for speculative-decoding tests: drafts taken from a known answer (the model's own
greedy tokens from a run without drafts), whole (an oracle) or with one token spoiled at a
position that moves from round to round, so every accepted length is seen."""
from __future__ import annotations

from ninfer.engine.engine import LLMEngine
from ninfer.engine.engine_config import EngineConfig
from ninfer.engine.request import Request
from ninfer.engine.sampling_params import SamplingParams
from ninfer.engine.spec import Drafter


class AnswerDrafter(Drafter):
    """Proposes what follows each request's output in ``answers`` (request id -> the tokens it
    gives without drafts); with ``spoil``, round ``r`` of a request changes its draft's token
    ``r % (k + 1)`` (none when that is ``k``), so rounds accept 0 .. k drafts in turn."""

    def __init__(self, answers: dict[str, list[int]], draft_tokens: int, spoil: bool = False) -> None:
        super().__init__(draft_tokens, 1, 1)
        self.answers, self.spoil = answers, spoil
        self.rounds: dict[str, int] = {}

    def propose(self, req: Request) -> list[int]:
        if not self.eligible(req):
            return []
        # spoiled rounds take full drafts (``room``): adapting to their misses would leave the
        # longer accepted lengths untried
        k, n = (self.room(req) if self.spoil else self.limit(req)), len(req.output_ids)
        draft = list(self.answers[req.request_id][n : n + k])
        if self.spoil and draft:
            r = self.rounds.get(req.request_id, 0)
            self.rounds[req.request_id] = r + 1
            at = r % (len(draft) + 1)
            if at < len(draft):
                draft[at] = (draft[at] + 1) % 50
        return draft


class CutDrafter(AnswerDrafter):
    """The answers' drafts cut to a length that moves from round to round (none at all too), so
    rows of every width up to the full one, and rows without a draft, share the steps."""

    def propose(self, req: Request) -> list[int]:
        draft = super().propose(req)
        r = self.rounds.get(req.request_id, 0)
        self.rounds[req.request_id] = r + 1
        return draft[: (r + len(req.request_id)) % (self.draft_tokens + 1)]


def use_drafter(engine: LLMEngine, drafter: Drafter) -> None:
    """Make ``engine`` (built with a ``spec`` setting) draft with ``drafter``."""
    engine.drafter = engine.scheduler.drafter = drafter
    engine.counters.spec_enabled = True


def two_turns(parts, spec: str, first_tokens: int, second_tokens: int, **settings):
    """A conversation of two greedy turns on a fresh engine with ``spec`` (the second is the first's
    prompt, its answer and a new turn, so it goes on from the answer's checkpoint): the engine,
    both answers and the tokens the second found cached."""
    from support.overlap import prompt

    model, tok = parts
    engine = LLMEngine(model, tok, EngineConfig(max_context=256, max_concurrency=2, prefill_chunk=32,
                                                kv_capacity=2048, page_size=8, spec=spec, **settings))
    answers, ids = [], prompt(tok, 3)
    for name, n in (("t1", first_tokens), ("t2", second_tokens)):
        turn = Request(name, ids, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True), max_total_tokens=256)
        engine.add_request(turn)
        while engine.has_work:
            engine.step()
        answers.append(turn.output_ids)
        ids = turn.all_ids + prompt(tok, 1)
    return engine, answers[0], answers[1], turn.cached_tokens
