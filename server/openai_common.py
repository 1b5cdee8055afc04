"""What the OpenAI API families share: model check, ids, usage and timings, function tools."""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from ..engine.frontend.tool_grammar import tool_call_grammar
from ..engine.frontend.tool_parser import ToolSpec
from ..engine.grammar import GrammarError, GrammarSpec
from ..engine.outputs import RequestOutput
from .errors import APIError, invalid, unsupported
from .state import ServerState


def normalize_stops(value: str | list[str] | None) -> list[str]:
    """``stop`` as a list of at most four non-empty strings (pydantic validator body)."""
    stops = [] if value is None else [value] if isinstance(value, str) else list(value)
    if len(stops) > 4:
        raise ValueError("at most 4 stop sequences are allowed")
    if any(not s for s in stops):
        raise ValueError("stop sequences must not be empty")
    return stops


def reject_unsupported_sampling(req: Any) -> None:
    """The refusals Chat Completions and legacy Completions share: a repetition penalty and
    ``stream_options`` without streaming. Fields a request model does not declare read as unset."""
    if req.repetition_penalty is not None and req.repetition_penalty != 1:
        raise unsupported("repetition_penalty", "only the neutral value 1")
    if req.stream_options is not None and not req.stream:
        raise invalid("stream_options", "'stream_options' requires 'stream': true")


def check_choices(state: ServerState, n: int | None, param: str = "n") -> int:
    """How many choices a request asks for: each is a lane of its own, so at most
    ``--max-concurrency``."""
    n = n or 1
    lanes = state.engine.config.max_concurrency
    if n > lanes:
        raise invalid(param, f"at most {lanes} choices per request on this server (--max-concurrency), got {n}")
    return n


@dataclass
class ToolUse:
    """What ``tool_choice`` makes of the declared functions: ``tools``, the callable ones in
    declaration order (rendered in the prompt and parsed from the output); ``forced``: the
    answer must be call(s) to them; ``parallel``: more than one call may come."""

    tools: list["FunctionTool"]
    forced: bool = False
    parallel: bool = True

    def grammar(self, output: GrammarSpec | None = None) -> GrammarSpec | None:
        """The output's grammar: the calls held to their schemas where the choice forces a call
        or a callable function is strict, else ``output`` (the request's own format). Both at
        once is a 400 naming the format's field."""
        strict = [t.name for t in self.tools if t.strict]
        if not self.tools or not (self.forced or strict):
            return output
        if output is not None:
            why = "a forced tool call" if self.forced else "strict function tools"
            raise invalid(output.param, f"{output.param} and {why} cannot both constrain one answer; "
                          "one output constraint per request")
        try:
            spec = tool_call_grammar([t.spec for t in self.tools], forced=self.forced, parallel=self.parallel,
                                     strict=strict, params={t.name: t.schema_param for t in self.tools},
                                     param="tool_choice" if self.forced else "tools")
            spec.check()
        except GrammarError as exc:
            raise invalid(exc.param, str(exc)) from None
        return spec


def callable_tools(tools: Sequence["FunctionTool"], choice: Any, parallel: bool | None,
                   allowed_names: Callable[[dict], tuple[list[str], bool]],
                   named: Callable[[dict], str]) -> ToolUse:
    """What ``tool_choice`` lets the model call. ``allowed_names`` reads an ``allowed_tools``
    choice in its API family's shape and returns the names it allows and whether its mode is
    ``required``; ``named`` reads the function name of a choice that names one."""
    forced = False
    if choice is None or choice == "auto":
        allowed = list(tools)
    elif choice == "none":
        allowed = []
    elif choice == "required":
        allowed, forced = list(tools), True
    elif isinstance(choice, dict) and choice.get("type") == "allowed_tools":
        names, forced = allowed_names(choice)
        allowed = [t for t in tools if t.name in names]
    elif isinstance(choice, dict) and choice.get("type") == "function":
        name = named(choice)
        allowed, forced = [t for t in tools if t.name == name], True
        if not allowed:
            raise invalid("tool_choice", f"tool_choice names {name!r}, which is not a declared function")
    elif isinstance(choice, dict):
        raise unsupported("tool_choice", f"a {choice.get('type')!r} tool choice; 'auto', 'none', 'required', "
                          "'allowed_tools' or a named function")
    else:
        raise invalid("tool_choice", f"unknown tool_choice {choice!r}")
    if forced and not allowed:
        raise invalid("tool_choice", "a tool call is required but no function is declared")
    if allowed and parallel is False and not (forced or any(t.strict for t in allowed)):
        raise unsupported("parallel_tool_calls", "false is enforced only where calls are held to a grammar "
                          "(a forced tool_choice or strict functions)")
    return ToolUse(allowed, forced, parallel is not False)


def check_model(state: ServerState, model: str | None, status: int = 400) -> str:
    """The name to echo for a request's ``model``: the name itself when it is one of the public
    names, else the served model's id, as llama-server answers whatever name a client sends
    (``gpt-3.5-turbo`` from an OpenAI client). With ``--strict-model-names`` (servers behind one
    router) a name that is not public is refused, ``model_not_found``."""
    if model is not None and model in state.public_names:
        return model
    if model is not None and state.strict_model_names:
        served = ", ".join(repr(n) for n in state.public_names)
        raise APIError(status, f"model {model!r} does not exist; this server serves {served}", "model",
                       "model_not_found")
    return state.model_id


def known_model(state: ServerState, model: str) -> str:
    """A public name, else ``model_not_found`` (404): retrieving a model by name lists only what
    ``/v1/models`` lists, whatever ``--strict-model-names`` says."""
    if model not in state.public_names:
        served = ", ".join(repr(n) for n in state.public_names)
        raise APIError(404, f"model {model!r} does not exist; this server serves {served}", "model",
                       "model_not_found")
    return model


def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex}"


def chat_usage(final: RequestOutput) -> dict[str, Any]:
    return {
        "prompt_tokens": final.prompt_tokens,
        "completion_tokens": final.completion_tokens,
        "total_tokens": final.prompt_tokens + final.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": final.cached_tokens},
        "completion_tokens_details": {"reasoning_tokens": final.reasoning_tokens},
    }


def _rates(cache_n: int, prompt_n: int, prompt_s: float, predicted_n: int, predicted_s: float) -> dict[str, Any]:
    intervals = max(predicted_n - 1, 0)  # the first token belongs to prompt latency
    prompt_ms, predicted_ms = max(prompt_s, 0.0) * 1000.0, max(predicted_s, 0.0) * 1000.0
    return {
        "cache_n": cache_n,
        "prompt_n": prompt_n,
        "prompt_ms": prompt_ms,
        "prompt_per_token_ms": prompt_ms / prompt_n if prompt_n else 0.0,
        "prompt_per_second": prompt_n / (prompt_ms / 1000.0) if prompt_n and prompt_ms > 0 else 0.0,
        "predicted_n": predicted_n,
        "predicted_ms": predicted_ms,
        "predicted_per_token_ms": predicted_ms / intervals if intervals else 0.0,
        "predicted_per_second": intervals / (predicted_ms / 1000.0) if intervals and predicted_ms > 0 else 0.0,
    }


def timings(final: RequestOutput) -> dict[str, Any]:
    """llama.cpp-compatible terminal timings from the engine's own clock; ``draft_n`` /
    ``draft_n_accepted`` where tokens were drafted for the request (``--spec``), as llama.cpp
    adds them."""
    out = _rates(final.cached_tokens, final.prompt_tokens - final.cached_tokens, final.prefill_time or 0.0,
                 final.completion_tokens, final.decode_time or 0.0)
    if final.draft_tokens:
        out.update(draft_n=final.draft_tokens, draft_n_accepted=final.draft_accepted)
    return out


class TimingClock:
    """Cumulative timings while a request streams (``timings_per_token``), on the gateway's clock."""

    def __init__(self, admitted: RequestOutput) -> None:
        self.t0 = time.monotonic()
        self.cached = admitted.cached_tokens
        self.prompt = admitted.prompt_tokens
        self.t_first: float | None = None
        self.predicted = 0

    def observe(self, out: RequestOutput) -> None:
        if out.completion_tokens and self.t_first is None:
            self.t_first = time.monotonic()
        self.predicted = max(self.predicted, out.completion_tokens)

    def snapshot(self) -> dict[str, Any]:
        now = time.monotonic()
        first = self.t_first if self.t_first is not None else now
        return _rates(self.cached, self.prompt - self.cached, first - self.t0, self.predicted,
                      now - first if self.t_first is not None else 0.0)


# ---------------------------------------------------------------------------- function tools
@dataclass
class FunctionTool:
    """A declared function: how the template shows it, and what the output parser may call."""

    name: str  # the engine identity (for Responses namespaces: "namespace.name")
    template: dict[str, Any]  # {"type": "function", "function": {...}} as the template renders it
    parameters: Mapping[str, Any] | None
    namespace: str | None = None
    public_name: str | None = None  # the name in the API when it differs from ``name``
    strict: bool = False  # its calls' arguments are held to ``parameters``
    schema_param: str = "tools"  # the request field of ``parameters``, for errors

    @property
    def spec(self) -> ToolSpec:
        return ToolSpec(self.name, self.parameters)


def function_tool(fn: Any, param: str, *, name: str | None = None, namespace: str | None = None,
                  extra_description: str | None = None) -> FunctionTool:
    """Validate one function definition (``fn``: name, description, parameters, strict)."""
    if not isinstance(fn, Mapping):
        raise invalid(param, f"'{param}' must be an object")
    public = fn.get("name")
    if not isinstance(public, str) or not public:
        raise invalid(f"{param}.name", "a function needs a non-empty string 'name'")
    if any(c in public for c in "<>\n"):
        raise invalid(f"{param}.name", f"function name {public!r} cannot be written in the model's call format")
    strict = fn.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise invalid(f"{param}.strict", "'strict' must be a boolean")
    description = fn.get("description")
    if description is not None and not isinstance(description, str):
        raise invalid(f"{param}.description", "'description' must be a string")
    parameters = fn.get("parameters")
    if parameters is not None and not isinstance(parameters, Mapping):
        raise invalid(f"{param}.parameters", "'parameters' must be a JSON schema object")
    if fn.get("defer_loading"):
        raise unsupported(f"{param}.defer_loading", "every declared function is shown to the model")
    if fn.get("output_schema") is not None:
        raise unsupported(f"{param}.output_schema", "output schemas cannot be enforced")
    callers = fn.get("allowed_callers")
    if callers is not None and "direct" not in callers:
        raise unsupported(f"{param}.allowed_callers", "the model calls functions directly")
    engine_name = name or public
    # what the template shows, in the received member order
    shown = {k: v for k, v in fn.items() if k in ("name", "description", "parameters") and v is not None}
    shown["name"] = engine_name
    if extra_description:
        shown["description"] = f"{extra_description}\n{description}" if description else extra_description
    return FunctionTool(engine_name, {"type": "function", "function": shown}, parameters, namespace,
                        public if engine_name != public else None, strict is True, f"{param}.parameters")


def unique_names(tools: Sequence[FunctionTool], param: str) -> None:
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        if tool.name in seen:
            raise invalid(f"{param}[{i}]", f"function '{tool.name}' is declared twice")
        seen.add(tool.name)
