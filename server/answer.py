"""The generation routes' common ending: admit the request, then answer it as an SSE stream or
as one JSON body. The client going away cancels the request in both cases."""
from __future__ import annotations

from typing import Any, AsyncIterator, Awaitable, Callable, Sequence

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ..engine.outputs import RequestOutput
from ..engine.sampling_params import SamplingParams
from .cancellation import cancel_on_disconnect
from .choices import start_choices
from .generation import Keep
from .state import ServerState
from .streaming import sse_response

Outputs = AsyncIterator[RequestOutput]
OMITTED_TOOLS_HEADER = "x-ninfer-omitted-tools"


def name_omitted_tools(response: Response, omitted: Sequence[str]) -> Response:
    """Name the tools left out of the prompt (hosted tool types the server cannot run, or every
    function where the chat template has no place for tools), so a client can see what it lacks."""
    if omitted:
        response.headers[OMITTED_TOOLS_HEADER] = ",".join(omitted)
    return response


async def answer(request: Request, state: ServerState, prompt_ids: list[int], params: SamplingParams,
                 request_id: str, stream: bool | None,
                 frames: Callable[[RequestOutput, Outputs], AsyncIterator[str]],
                 whole: Callable[[Outputs], Awaitable[Any]],
                 keepalive: Callable[[], str] | None = None,
                 omitted_tools: Sequence[str] = (),
                 keep: Keep = Keep()) -> StreamingResponse | JSONResponse:
    """``frames(admitted, outputs)`` gives the SSE frames of a streamed answer, ``whole(outputs)``
    the JSON body of a complete one; ``keepalive()`` the API's idle frame (default: a comment);
    ``omitted_tools`` are named in a header; ``keep``: where prefix checkpoints are kept."""
    return await answer_choices(request, state, prompt_ids, params, request_id, 1, stream,
                                lambda admitted, outputs: frames(admitted[0], outputs[0]),
                                lambda outputs: whole(outputs[0]), keepalive, omitted_tools, keep)


async def answer_choices(request: Request, state: ServerState, prompt_ids: list[int], params: SamplingParams,
                         request_id: str, n: int, stream: bool | None,
                         frames: Callable[[list[RequestOutput], list[Outputs]], AsyncIterator[str]],
                         whole: Callable[[list[Outputs]], Awaitable[Any]],
                         keepalive: Callable[[], str] | None = None,
                         omitted_tools: Sequence[str] = (),
                         keep: Keep = Keep()) -> StreamingResponse | JSONResponse:
    """``answer`` for ``n`` choices of one prompt (``choices.py``): ``frames`` and ``whole`` get
    one admission output and one iterator per choice."""
    admitted, outputs = await cancel_on_disconnect(
        request, start_choices(state, prompt_ids, params, request_id, n, keep))
    if stream:
        return name_omitted_tools(sse_response(frames(admitted, outputs), state.keepalive_s, keepalive),
                                  omitted_tools)
    return name_omitted_tools(JSONResponse(await cancel_on_disconnect(request, whole(outputs))), omitted_tools)
