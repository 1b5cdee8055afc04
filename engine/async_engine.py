"""The asyncio face of the engine for the HTTP gateway: submission, admission limits, cancellation."""
from __future__ import annotations

import asyncio
import uuid
from typing import AsyncIterator

from .engine_config import EngineConfig
from .loop import EngineFailedError, EngineLoop
from .outputs import RequestOutput
from .request import Request
from .sampling_params import SamplingParams


class EngineError(RuntimeError):
    """The engine rejected or failed a request; ``str`` is safe to show to the client.

    ``code``: ``server_overloaded`` (too many outstanding requests), ``request_queue_timeout``
    (not admitted in time), ``engine_failed`` (the engine has stopped), or ``invalid_request``."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code


class AsyncEngine:
    def __init__(self, loop: EngineLoop, config: EngineConfig, eos_ids: frozenset[int]) -> None:
        self.loop = loop
        self.config = config
        self.eos_ids = eos_ids
        self.outstanding = 0  # submitted and not yet finished; touched only on the event loop
        # sees each request's lifecycle on the event loop: begin(request) -> watch; watch.output(out)
        # for every output; watch.close() when the caller leaves (server/observability/monitor.py)
        self.observer = None

    @property
    def healthy(self) -> bool:
        return self.loop.failed is None

    @property
    def capacity(self) -> int:
        return self.config.max_concurrency + self.config.max_pending

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Outputs of one request; leaving the iteration early cancels the request."""
        if self.outstanding >= self.capacity:
            raise EngineError(f"server is at capacity ({self.capacity} outstanding requests); retry later",
                              "server_overloaded")
        request_id = request_id or uuid.uuid4().hex
        aio = asyncio.get_running_loop()
        outputs: asyncio.Queue[RequestOutput] = asyncio.Queue()
        request = Request(
            request_id=request_id,
            prompt_ids=list(prompt_ids),
            params=params,
            max_total_tokens=self.config.max_context,
            eos_ids=self.eos_ids,
        )

        def sink(out: RequestOutput) -> None:
            try:
                aio.call_soon_threadsafe(outputs.put_nowait, out)
            except RuntimeError:  # the caller's event loop has closed: nobody is listening
                pass

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
