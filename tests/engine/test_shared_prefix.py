"""Requests sent together that share a long prompt prefix (an orchestrator's subagents with one
system prompt) compute it once: on the embedded model, where a prompt's compute is real, the two
take at most 65% of the time they take without the prefix cache. The time is this thread's CPU
time (the engine steps on it; torch runs on one thread in the tests, conftest's ``_few_threads``):
what other programs on a shared machine do moves the wall clock, not that."""
from __future__ import annotations

import time

import pytest

from ninfer.engine.engine import LLMEngine
from ninfer.engine.engine_config import EngineConfig
from ninfer.engine.request import Request
from ninfer.engine.sampling_params import SamplingParams
from support.embedded import embedded_parts


@pytest.fixture(scope="module")
def parts():
    return embedded_parts()


def finish(eng: LLMEngine, prompts: dict[str, list[int]]) -> tuple[float, dict[str, tuple[list[int], int]]]:
    start = time.thread_time()
    for name, ids in prompts.items():
        eng.add_request(Request(name, ids, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
                                max_total_tokens=2048))
    out = {name: ([], 0) for name in prompts}
    while eng.has_work:
        for o in eng.step():
            ids, cached = out[o.request_id]
            out[o.request_id] = (ids + list(o.token_ids or []), o.cached_tokens if o.admitted else cached)
    return time.thread_time() - start, out


def test_two_requests_sharing_a_long_system_prompt_finish_sooner(parts):
    model, tok = parts
    system = tok.encode("You are a careful assistant that reads the repository before it answers. " * 60)
    prompts = {"a": system + tok.encode("Summarize the design."), "b": system + tok.encode("List the tests.")}
    times, outs = {False: float("inf"), True: float("inf")}, {}
    for cached in (False, True, True, False):  # each twice, the least counts: a busy moment falls on one
        eng = LLMEngine(model, tok, EngineConfig(max_context=2048, max_concurrency=2, prefill_chunk=1024,
                                                 max_batched_tokens=2048, prefix_cache=cached))
        finish(eng, {"warm": tok.encode("Hello there, how are you?")})  # the first steps are slower
        spent, outs[cached] = finish(eng, prompts)
        times[cached] = min(times[cached], spent)
    shared = outs[True]["b"][1]
    assert shared >= len(system) - 2 and outs[False]["b"][1] == 0
    assert outs[True] == {**outs[False], "b": (outs[False]["b"][0], shared)}  # the same tokens
    assert times[True] <= 0.65 * times[False], times
