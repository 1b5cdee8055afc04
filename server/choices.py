"""Several choices of one request (``n``): one engine request per choice, the first computing the
prompt and the others going on from its state (``Request.forks`` / ``fork_of``), each drawing with
its own seed: choice ``i`` with ``seed + i`` (modulo 2^64), so choice 0 is what the request alone
with that seed gives, and choice ``i`` what it gives with ``seed + i``; without a seed each draws
at random."""
from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any, AsyncIterator, Awaitable, Sequence, TypeVar

from ..engine.outputs import RequestOutput
from ..engine.sampling_params import SamplingParams
from .generation import Keep, start
from .state import ServerState

Outputs = AsyncIterator[RequestOutput]
T = TypeVar("T")


def choice_seed(seed: int | None, index: int) -> int | None:
    return None if seed is None else (seed + index) & ((1 << 64) - 1)


def choice_id(request_id: str, index: int) -> str:
    """The engine request id of choice ``index`` (the request's own for the first)."""
    return request_id if index == 0 else f"{request_id}-{index}"


async def all_of(work: Sequence[Awaitable[Any]]) -> list[Any]:
    """Every result, in order; when one fails (or this is cancelled) the others are cancelled, so
    no choice's engine request outlives the answer."""
    tasks = [asyncio.ensure_future(w) for w in work]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def start_choices(state: ServerState, prompt_ids: list[int], params: SamplingParams, request_id: str,
                        n: int, keep: Keep = Keep(), media: Any = None) -> tuple[list[RequestOutput], list[Outputs]]:
    """Submit ``n`` choices (in order: the first is submitted first) and wait for each one's
    admission; the admission outputs and the iterators of the rest. If one is refused, those
    already admitted are cancelled."""
    if n == 1:
        admitted, outputs = await start(state, prompt_ids, params, request_id, keep, media=media)
        return [admitted], [outputs]
    started = [start(state, prompt_ids, replace(params, seed=choice_seed(params.seed, i)), choice_id(request_id, i),
                     keep, forks=n - 1 if i == 0 else 0, fork_of=None if i == 0 else request_id, media=media)
               for i in range(n)]
    tasks = [asyncio.ensure_future(s) for s in started]
    try:
        results = await asyncio.gather(*tasks, return_exceptions=True)
    except asyncio.CancelledError:  # the client went away: the admitted ones are cancelled too
        for t in tasks:
            if t.done() and not t.cancelled() and t.exception() is None:
                await t.result()[1].aclose()
        raise
    failed = [r for r in results if isinstance(r, BaseException)]
    if failed:
        for r in results:
            if not isinstance(r, BaseException):
                await r[1].aclose()  # cancels its engine request
        raise failed[0]
    return [a for a, _ in results], [o for _, o in results]


async def merged(outputs: Sequence[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """``(index, item)`` from every iterator (a request's outputs, a batch job's frames), each item
    as soon as it arrives; leaving early (or an error from one) closes them all, which cancels
    their engine requests."""
    if len(outputs) == 1:
        async for out in outputs[0]:
            yield 0, out
        return
    pending = {asyncio.ensure_future(anext(it)): i for i, it in enumerate(outputs)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=lambda t: pending[t]):
                i = pending.pop(task)
                try:
                    out = task.result()
                except StopAsyncIteration:
                    continue
                yield i, out
                pending[asyncio.ensure_future(anext(outputs[i]))] = i
    finally:
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for it in outputs:
            await it.aclose()


def combined(finals: Sequence[RequestOutput]) -> RequestOutput:
    """The usage of all choices as one final output: the prompt once (the first choice's, which
    computed it), the output tokens of every choice."""
    return replace(finals[0], completion_tokens=sum(f.completion_tokens for f in finals),
                   reasoning_tokens=sum(f.reasoning_tokens for f in finals))
