"""The asyncio face of the engine for the HTTP gateway."""
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
    """The engine rejected or failed a request; ``str`` is safe to show to the client."""


class AsyncEngine:
    def __init__(self, loop: EngineLoop, config: EngineConfig, eos_ids: frozenset[int]) -> None:
        self.loop = loop
        self.config = config
        self.eos_ids = eos_ids

    @property
    def healthy(self) -> bool:
        return self.loop.failed is None

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Outputs of one request; leaving the iteration early cancels the request."""
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
            raise EngineError(str(exc)) from exc
        finished = False
        try:
            while True:
                out = await outputs.get()
                if out.finished and out.finish_reason == "error":
                    finished = True
                    raise EngineError(out.error or "engine error")
                yield out
                if out.finished:
                    finished = True
                    return
        finally:
            if not finished:
                self.loop.abort(request_id)
