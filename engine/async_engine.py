"""The asyncio face of the engine for the HTTP gateway: submission, admission limits, cancellation."""
from __future__ import annotations

import asyncio
import uuid
import weakref
from collections import deque
from typing import Any, AsyncIterator

from .engine_config import EngineConfig
from .loop import EngineFailedError, EngineLoop
from .outputs import RequestOutput, merge
from .request import Request
from .sampling_params import SamplingParams


class EngineError(RuntimeError):
    """The engine rejected or failed a request; ``str`` is safe to show to the client.

    ``code``: ``server_overloaded`` (too many outstanding requests), ``request_queue_timeout``
    (not admitted in time), ``engine_failed`` (the engine has stopped), or ``invalid_request``."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code


def _mergeable(out: RequestOutput) -> bool:
    """Text and tokens may be read as one; the admission, progress (one report per prompt
    chunk: few, and each one a client may show) and an error never."""
    return not (out.admitted or out.prompt_processed is not None or out.finish_reason == "error")


class _Stream:
    """One request's outputs on the event loop. A reader that is behind gets what has piled up
    as one output (``merge``), so a stream's frames, JSON and socket writes stay one per read,
    not one per token, while the engine runs ahead of the HTTP side."""

    def __init__(self, aio: asyncio.AbstractEventLoop) -> None:
        self._aio = aio
        self._pending: deque[RequestOutput] = deque()
        self._waiter: asyncio.Future | None = None

    def put(self, out: RequestOutput) -> None:
        self._pending.append(out)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def get(self) -> RequestOutput:
        while not self._pending:
            self._waiter = self._aio.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        out = self._pending.popleft()
        while _mergeable(out) and self._pending and _mergeable(self._pending[0]):
            out = merge(out, self._pending.popleft())
        return out


class _Mailbox:
    """Outputs from the engine thread to one event loop: the thread appends, and one wake-up of
    the loop (``call_soon_threadsafe``) delivers everything posted before it ran, so a step's
    outputs for many requests cost the loop one wake-up, not one each."""

    def __init__(self, aio: asyncio.AbstractEventLoop) -> None:
        self._aio = aio
        self._items: deque[tuple[_Stream, RequestOutput]] = deque()
        self._scheduled = False

    def post(self, stream: _Stream, out: RequestOutput) -> None:  # the engine thread
        self._items.append((stream, out))
        if not self._scheduled:
            self._scheduled = True
            try:
                self._aio.call_soon_threadsafe(self._deliver)
            except RuntimeError:  # the loop has closed: nobody is listening
                pass

    def _deliver(self) -> None:  # the event loop
        self._scheduled = False  # before draining: what is posted from now on schedules its own
        while self._items:
            stream, out = self._items.popleft()
            stream.put(out)


class AsyncEngine:
    def __init__(self, loop: EngineLoop, config: EngineConfig, eos_ids: frozenset[int]) -> None:
        self.loop = loop
        self.config = config
        self.eos_ids = eos_ids
        self.outstanding = 0  # submitted and not yet finished; touched only on the event loop
        # sees each request's lifecycle on the event loop: begin(request) -> watch; watch.output(out)
        # for every output; watch.close() when the caller leaves (server/observability/monitor.py)
        self.observer = None
        self._mailboxes: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    @property
    def healthy(self) -> bool:
        return self.loop.failed is None

    @property
    def capacity(self) -> int:
        return self.config.max_concurrency + self.config.max_pending

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None,
        checkpoints: list[int] | None = None, checkpoint_answer: bool = True,
        forks: int = 0, fork_of: str | None = None, media: Any = None,
    ) -> AsyncIterator[RequestOutput]:
        """Outputs of one request; leaving the iteration early cancels the request. Outputs that
        pile up while the caller is busy come as one (``_Stream``). ``checkpoints``,
        ``checkpoint_answer``: where prefix checkpoints are kept; ``forks``, ``fork_of``: several
        choices of one prompt (``Request``); ``media``: the prompt's images (``vision/media.py``)."""
        if self.outstanding >= self.capacity:
            raise EngineError(f"server is at capacity ({self.capacity} outstanding requests); retry later",
                              "server_overloaded")
        request_id = request_id or uuid.uuid4().hex
        aio = asyncio.get_running_loop()
        mailbox = self._mailboxes.get(aio)
        if mailbox is None:
            mailbox = self._mailboxes[aio] = _Mailbox(aio)
        outputs = _Stream(aio)
        request = Request(
            request_id=request_id,
            prompt_ids=list(prompt_ids),
            params=params,
            max_total_tokens=self.config.max_context,
            eos_ids=self.eos_ids,
            checkpoints=checkpoints,
            checkpoint_answer=checkpoint_answer,
            forks=forks,
            fork_of=fork_of,
            media=media,
        )

        def sink(out: RequestOutput) -> None:
            mailbox.post(outputs, out)

        try:
            self.loop.submit(request, sink)
        except EngineFailedError as exc:
            raise EngineError(str(exc), "engine_failed") from exc
        self.outstanding += 1
        watch = self.observer.begin(request) if self.observer is not None else None
        finished = False
        try:
            while True:
                out = await outputs.get()
                if watch is not None:
                    watch.output(out)
                if out.finished and out.finish_reason == "error":
                    finished = True
                    code = out.error_code or ("engine_failed" if not self.healthy else "invalid_request")
                    raise EngineError(out.error or "engine error", code)
                yield out
                if out.finished:
                    finished = True
                    return
        finally:
            self.outstanding -= 1
            if watch is not None:
                watch.close()
            if not finished:
                self.loop.abort(request_id)
