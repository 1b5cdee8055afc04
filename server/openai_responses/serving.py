"""Responses Core: preparation (stored history, Items, tools), the engine call, the Response
object, its SSE lifecycle, and storage for continuation."""
from __future__ import annotations

import logging
import time
from typing import Any, AsyncIterator

from ...engine.frontend.assistant_output import AssistantOutputParser
from ...engine.outputs import RequestOutput
from ..errors import APIError, invalid
from ..media import expand, images_of
from ..generation import Sampling, check_prompt, prepare, render_prompt, template_options, tools_left_out
from ..logprobs import TokenText, new_logprobs, openai_entries
from ..openai_common import callable_tools, check_model, new_id
from ..state import ServerState
from ..streaming import sse_event
from ..structured import request_grammar
from .items import normalize_input, to_messages
from .output import OutputBuilder
from .protocol import InputTokensRequest, ResponsesRequest
from .store import ResponseStore, StoredResponse
from .tools import allowed_names, check_forced_hosted, named_function, response_tools

log = logging.getLogger("ninfer.server")


# ---------------------------------------------------------------------------- preparation
class PreparedResponse:
    """A Create or input-token request resolved against the store: Items, tools, prompt."""

    def __init__(self, req: ResponsesRequest | InputTokensRequest, state: ServerState) -> None:
        if req.model is not None:
            check_model(state, req.model)
        if isinstance(req, ResponsesRequest):
            req.reject_unsupported()
        else:
            req.reject_common()
        self.parent: StoredResponse | None = None
        if req.previous_response_id is not None:
            self.parent = state.responses.get(req.previous_response_id)
            if self.parent is None:
                raise APIError(404, f"previous response '{req.previous_response_id}' is not stored (never stored, "
                               "deleted, evicted, or store: false)", "previous_response_id",
                               "previous_response_not_found")
        self.context = list(self.parent.context) if self.parent else []
        self.input_items = normalize_input(req.input, [i["id"] for i in self.context], state.reasoning_seal.open)
        history = self.context + self.input_items
        if not any(i["type"] == "message" and i["role"] == "user" for i in history):
            raise invalid("input", "the conversation needs a user message")
        declared = response_tools(req.tools, state.strict_tools)
        check_forced_hosted(req.tool_choice)
        self.use = callable_tools(declared.functions, req.tool_choice, req.parallel_tool_calls,
                                  lambda choice: allowed_names(choice, declared.functions, state.strict_tools),
                                  named_function)
        self.tools = self.use.tools
        self.omitted_tools = declared.omitted  # hosted tool types left out of the prompt
        if self.omitted_tools:
            log.warning("responses: hosted tools left out of the prompt: %s", ", ".join(self.omitted_tools))
        kwargs = req.chat_template_kwargs or {}
        preserve = req.preserve_thinking
        if preserve is None and kwargs.get("preserve_thinking") is None and self.parent is not None:
            preserve = self.parent.preserve_thinking
        self.options = template_options(state, kwargs, {"preserve_thinking": preserve,
                                                        "reasoning_effort": req.effort})
        self.preserve_thinking = self.options.get("preserve_thinking")
        self.messages = to_messages(history, req.instructions, len(self.context))
        self.req = req


def count_input_tokens(req: InputTokensRequest, state: ServerState) -> tuple[dict[str, Any], list[str]]:
    """The input-token count object, and the tools left out of the prompt (``ResponseRun.omitted_tools``)."""
    p = PreparedResponse(req, state)
    _, ids = render_prompt(state, p.messages, [t.template for t in p.tools], p.options, "input",
                           fit=True)
    ids, _, _ = expand(state, ids, images_of(state, p.messages), None)  # the images' tokens counted
    check_prompt(state, ids, "input")
    left_out = p.omitted_tools + tools_left_out(state, [t.spec for t in p.tools])
    return {"object": "response.input_tokens", "input_tokens": len(ids)}, left_out


class ResponseRun:
    """One Create: the prepared prompt, then the Response object as the output arrives."""

    def __init__(self, req: ResponsesRequest, state: ServerState) -> None:
        self.p = PreparedResponse(req, state)
        self.req = req
        self.state = state
        sampling = Sampling(temperature=req.temperature, top_p=req.top_p, max_tokens=req.max_output_tokens,
                            logprobs=req.top,
                            grammar=self.p.use.grammar(request_grammar(None, req.text.format if req.text else None,
                                                                       "text.format")))
        self.prepared = prepare(state, self.p.messages, tools=[t.template for t in self.p.tools],
                                tool_specs=[t.spec for t in self.p.tools], options=self.p.options,
                                sampling=sampling, thinking_budget=req.thinking_budget, budget_param="thinking_budget",
                                prompt_param="input")
        self.id = new_id("resp_")
        self.created = time.time()
        self.store: ResponseStore = state.responses
        # reasoning Items carry their text sealed when the client keeps the state itself
        self.seal = state.reasoning_seal.seal if req.include_encrypted_reasoning else None
        self.seq = 0  # the stream's next sequence number
        text = TokenText(state.tokenizer)
        self.entries = None if req.top is None else (lambda lps: openai_entries(text, lps, req.top))
        # hosted tool types the server cannot run, and functions the chat template cannot show
        self.omitted_tools = self.p.omitted_tools + tools_left_out(state, self.prepared.tools)

    def event(self, kind: str, body: dict[str, Any]) -> str:
        """One stream event with the next sequence number."""
        frame = sse_event(kind, {"type": kind, "sequence_number": self.seq, **body})
        self.seq += 1
        return frame

    def still_working(self) -> str:
        """The idle event of a stream that has sent nothing for a while (a long prompt prefilling)."""
        return self.event("response.in_progress", {"response": self.obj("in_progress", [])})

    def parser(self) -> AssistantOutputParser:
        return AssistantOutputParser(self.prepared.starts_in_reasoning, self.prepared.tools)

    def obj(self, status: str, output: list[dict[str, Any]], final: RequestOutput | None = None,
            error: dict[str, Any] | None = None) -> dict[str, Any]:
        req, params = self.req, self.prepared.params
        body = {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "completed_at": time.time() if status == "completed" else None,
            "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "max_tool_calls": req.max_tool_calls, "model": self.state.model_id, "output": output,
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "reasoning": {"effort": req.effort, "summary": None}, "store": req.store is not False,
            "temperature": params.temperature, "top_p": params.top_p,
            "text": {"format": {"type": "text"}, "verbosity": "medium"},
            "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
            "tools": req.tools or [], "top_logprobs": req.top_logprobs or 0, "truncation": "disabled",
            "safety_identifier": req.safety_identifier,
            "prompt_cache_key": req.prompt_cache_key, "metadata": req.metadata or {},
            "service_tier": "default", "background": False,
        }
        # optional in OpenAI's Response schema: omitted rather than null until there is a value
        if final is not None:
            body["usage"] = _usage(final)
        if req.user is not None:
            body["user"] = req.user
        return body

    def finish(self, builder: OutputBuilder, final: RequestOutput) -> dict[str, Any]:
        """The terminal Response; stored when asked (before it is shown, so a refusal is visible)."""
        status = "incomplete" if final.finish_reason == "length" else "completed"
        builder.close("incomplete" if status == "incomplete" else "completed")
        response = self.obj(status, builder.items, final)
        if self.req.store is not False:
            context = self.p.context + self.p.input_items + [dict(i) for i in builder.items]
            self.store.put(self.id, response, self.p.input_items, context, self.p.preserve_thinking)
        return response


def _usage(final: RequestOutput) -> dict[str, Any]:
    return {
        "input_tokens": final.prompt_tokens,
        # no prompt is written to a cache that a later request could read (no prefix cache yet)
        "input_tokens_details": {"cached_tokens": final.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": final.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": final.reasoning_tokens},
        "total_tokens": final.prompt_tokens + final.completion_tokens,
    }


async def complete(run: ResponseRun, outputs: AsyncIterator[RequestOutput]) -> dict[str, Any]:
    parser, builder = run.parser(), OutputBuilder({t.name: t for t in run.p.tools}, seal=run.seal,
                                                   logprobs=run.entries)
    final: RequestOutput | None = None
    async for out in outputs:
        builder.tokens(new_logprobs(out))
        builder.push(parser.push(out.text))
        final = out
    builder.push(parser.finish())
    assert final is not None and final.finished
    return run.finish(builder, final)


async def stream(run: ResponseRun, outputs: AsyncIterator[RequestOutput]) -> AsyncIterator[str]:
    frames: list[str] = []

    def emit(kind: str, body: dict[str, Any]) -> None:
        frames.append(run.event(kind, body))

    parser, builder = run.parser(), OutputBuilder({t.name: t for t in run.p.tools}, emit, run.seal, run.entries)
    emit("response.created", {"response": run.obj("in_progress", [])})
    emit("response.in_progress", {"response": run.obj("in_progress", [])})
    try:
        async for out in outputs:
            builder.tokens(new_logprobs(out))
            builder.push(parser.push(out.text))
            if out.finished:
                builder.push(parser.finish())
                response = run.finish(builder, out)
                emit(f"response.{response['status']}", {"response": response})
            while frames:
                yield frames.pop(0)
    except APIError as exc:
        builder.close("incomplete")
        error = {"code": exc.code or "server_error", "message": exc.message}
        emit("response.failed", {"response": run.obj("failed", builder.items, error=error)})
    while frames:
        yield frames.pop(0)


# ---------------------------------------------------------------------------- stored objects
def stored(state: ServerState, response_id: str) -> StoredResponse:
    entry = state.responses.get(response_id)
    if entry is None:
        raise APIError(404, f"no stored response '{response_id}'", "response_id", "response_not_found")
    return entry


def input_items_page(entry: StoredResponse, after: str | None, limit: int, order: str) -> dict[str, Any]:
    items = list(entry.input_items)
    if order == "desc":
        items.reverse()
    if after is not None:
        ids = [i["id"] for i in items]
        if after not in ids:
            raise invalid("after", f"no input Item '{after}' in this response")
        items = items[ids.index(after) + 1:]
    page = items[:limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit}
