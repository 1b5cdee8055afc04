"""The generation routes' common ending: admit the request, then answer it as an SSE stream or
as one JSON body. The client going away cancels the request in both cases."""
from __future__ import annotations

from typing import Any, AsyncIterator, Awaitable, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from ..engine.outputs import RequestOutput
from ..engine.sampling_params import SamplingParams
from .cancellation import cancel_on_disconnect
from .generation import start
from .state import ServerState
from .streaming import sse_response

Outputs = AsyncIterator[RequestOutput]


async def answer(request: Request, state: ServerState, prompt_ids: list[int], params: SamplingParams,
                 request_id: str, stream: bool | None,
                 frames: Callable[[RequestOutput, Outputs], AsyncIterator[str]],
                 whole: Callable[[Outputs], Awaitable[Any]]) -> StreamingResponse | JSONResponse:
    """``frames(admitted, outputs)`` gives the SSE frames of a streamed answer, ``whole(outputs)``
    the JSON body of a complete one."""
    admitted, outputs = await cancel_on_disconnect(request, start(state, prompt_ids, params, request_id))
    if stream:
        return sse_response(frames(admitted, outputs), state.keepalive_s)
    return JSONResponse(await cancel_on_disconnect(request, whole(outputs)))
