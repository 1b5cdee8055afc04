"""What a request's reader gets from the engine thread: every output in order, outputs that pile
up while the reader is busy read as one (the same text and tokens, the latest counts), the
admission, progress reports and an error never merged, and one event-loop wake-up for all the outputs a step
publishes, whatever the number of requests."""
from __future__ import annotations

import asyncio
import random
import threading


from ninfer.engine.async_engine import AsyncEngine, EngineError
from ninfer.engine.engine_config import EngineConfig
from ninfer.engine.outputs import RequestOutput, TokenLogprob
from ninfer.engine.sampling_params import SamplingParams


class HandLoop:
    """The engine thread's face with the steps done by hand: the test publishes outputs."""

    failed = None

    def __init__(self) -> None:
        self.sinks: dict[str, object] = {}
        self.aborted: list[str] = []

    def submit(self, request, sink) -> None:
        self.sinks[request.request_id] = sink

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


def engine() -> tuple[AsyncEngine, HandLoop]:
    loop = HandLoop()
    return AsyncEngine(loop, EngineConfig(max_concurrency=64, max_context=4096), frozenset()), loop


def tokens(request_id: str, i: int, finished: bool = False) -> RequestOutput:
    return RequestOutput(request_id, text=f"<{i}>", token_ids=[i], completion_tokens=i + 1, prompt_tokens=3,
                         finished=finished, finish_reason="length" if finished else None)


async def published_then_read(outputs: list[RequestOutput]) -> list[RequestOutput]:
    """Every output published (from another thread) before the reader looks, then read."""
    async_engine, loop = engine()
    gen = async_engine.generate([1, 2, 3], SamplingParams(max_tokens=8), "r")
    first = asyncio.ensure_future(anext(gen))
    while "r" not in loop.sinks:
        await asyncio.sleep(0)
    producer = threading.Thread(target=lambda: [loop.sinks["r"](o) for o in outputs])
    producer.start()
    producer.join()
    got = [await first]
    try:
        async for out in gen:
            got.append(out)
    except EngineError as exc:
        got.append(exc)
    return got


def test_outputs_that_piled_up_are_read_as_one_with_the_same_text_and_tokens():
    outs = [RequestOutput("r", admitted=True, prompt_tokens=3)]
    outs += [RequestOutput("r", prompt_tokens=3, prompt_processed=n) for n in (1, 2)]
    outs += [tokens("r", i) for i in range(40)] + [tokens("r", 40, finished=True)]
    got = asyncio.run(published_then_read(outs))
    assert [g.admitted for g in got] == [True, False, False, False]
    assert [g.prompt_processed for g in got[1:3]] == [1, 2]  # each progress report on its own
    assert got[3].text == "".join(f"<{i}>" for i in range(41)) and got[3].token_ids == list(range(41))
    assert got[3].finished and got[3].finish_reason == "length" and got[3].completion_tokens == 41


def test_piled_up_log_probabilities_stay_one_per_token_in_order():
    outs = [RequestOutput("r", admitted=True, prompt_tokens=3)]
    for i in range(30):
        out = tokens("r", i, finished=i == 29)
        out.logprobs = [TokenLogprob(i, -0.5 * i, ((i, -0.5 * i), (i + 1, -9.0)))]
        outs.append(out)
    got = asyncio.run(published_then_read(outs))
    assert len(got) == 2 and got[1].token_ids == list(range(30))
    assert [lp.token for lp in got[1].logprobs] == list(range(30))
    assert [lp.logprob for lp in got[1].logprobs] == [-0.5 * i for i in range(30)]


def test_an_error_is_never_merged_into_the_text_before_it():
    outs = [RequestOutput("r", admitted=True), tokens("r", 0), tokens("r", 1),
            RequestOutput("r", finished=True, finish_reason="error", error="boom", error_code="internal_error")]
    got = asyncio.run(published_then_read(outs))
    assert got[1].text == "<0><1>" and not got[1].finished
    assert isinstance(got[2], EngineError) and got[2].code == "internal_error"


def test_a_slow_reader_loses_nothing_and_keeps_the_order():
    async def main():
        async_engine, loop = engine()
        gen = async_engine.generate([1], SamplingParams(max_tokens=500), "r")
        first = asyncio.ensure_future(anext(gen))
        while "r" not in loop.sinks:
            await asyncio.sleep(0)
        rng = random.Random(0)

        def produce():
            loop.sinks["r"](RequestOutput("r", admitted=True))
            for i in range(500):
                loop.sinks["r"](tokens("r", i, finished=i == 499))
                if rng.random() < 0.05:
                    threading.Event().wait(0.001)

        producer = threading.Thread(target=produce)
        producer.start()
        assert (await first).admitted
        reads = []
        async for out in gen:
            reads.append(out)
            await asyncio.sleep(rng.random() * 0.002)
        producer.join()
        return reads

    reads = asyncio.run(main())
    assert [t for r in reads for t in r.token_ids] == list(range(500))
    assert "".join(r.text for r in reads) == "".join(f"<{i}>" for i in range(500))
    assert reads[-1].finished and sum(r.finished for r in reads) == 1
    assert len(reads) < 500  # a reader that sleeps between reads finds several outputs waiting


def test_one_wake_up_of_the_event_loop_for_a_steps_outputs_of_many_requests():
    async def main():
        async_engine, loop = engine()
        aio = asyncio.get_running_loop()
        wakes = []
        real = aio.call_soon_threadsafe
        aio.call_soon_threadsafe = lambda *a, **k: (wakes.append(a[0]), real(*a, **k))[1]
        gens = [async_engine.generate([1], SamplingParams(max_tokens=4), f"r{i}") for i in range(64)]
        firsts = [asyncio.ensure_future(anext(g)) for g in gens]
        while len(loop.sinks) < 64:
            await asyncio.sleep(0)
        step = threading.Thread(target=lambda: [loop.sinks[f"r{i}"](RequestOutput(f"r{i}", admitted=True))
                                                for i in range(64)])
        step.start()
        step.join()
        assert all(out.admitted for out in await asyncio.gather(*firsts))
        for g in gens:
            await g.aclose()
        return len(wakes), loop.aborted

    wakes, aborted = asyncio.run(main())
    assert wakes == 1
    assert sorted(aborted) == sorted(f"r{i}" for i in range(64))  # readers that left cancel their requests
