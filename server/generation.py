"""From a normalised conversation to an engine request, and the engine call: shared by every API.

An API family translates its request into template messages, tool definitions, template options
and sampling values; ``prepare`` renders and tokenizes the prompt, checks it against the context,
resolves reasoning (does the output start inside ``<think>``? which budget?) and builds the
``SamplingParams``. ``start`` submits it and waits for admission, so that overload and queue
timeouts are ordinary HTTP errors; the outputs that follow are the caller's to translate.
Routes run the preparation on ``state.workers`` (``workers.py``), off the event loop.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Mapping, Sequence

from ..engine.grammar import GrammarSpec
from ..engine.async_engine import EngineError
from ..engine.frontend.chat_template import TemplateError
from ..engine.frontend.control_guard import guard_for
from ..engine.frontend.tokenizer import GIL_SLICE, gil_slices
from ..engine.frontend.reasoning import THINK_CLOSE, prompt_opens_reasoning
from ..engine.frontend.tool_parser import ToolSpec
from ..engine.outputs import RequestOutput
from ..engine.sampling_params import SamplingParamError, SamplingParams, ThinkingControl
from .errors import APIError, engine_error, invalid, unsupported
from .media import expand, images_of
from .state import ServerState

# Qwen's early-close guidance, committed when a thinking budget runs out; ends with the close marker.
THINKING_CLOSE_TEXT = ("\n\nConsidering the limited time by the user, I have to give the solution based on "
                       "the thinking directly now.\n" + THINK_CLOSE + "\n\n")
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
STANDARD_OPTIONS = ("enable_thinking", "preserve_thinking", "reasoning_effort")
# what chat_template_kwargs may not set: the conversation, the generation mode, special tokens
RESERVED_KWARGS = frozenset(["messages", "tools", "documents", "add_generation_prompt", "continue_final_message",
                             "bos_token", "eos_token", "pad_token", "unk_token"])


@dataclass
class Sampling:
    """Sampling values as a request gives them; None takes the server default."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    max_tokens: int | None = None
    stop: Sequence[str] = ()
    logprobs: int | None = None  # None: none; k: the chosen token's and the k best, per token
    logit_bias: Mapping[int, float] = field(default_factory=dict)  # checked ids (``server/logprobs.py``)
    grammar: GrammarSpec | None = None  # the output's format, checked (``server/structured.py``)


@dataclass(frozen=True)
class Keep:
    """Where the engine keeps prefix checkpoints for one request: at the prompt positions ``at``
    (None: where the prompt ends) and, with ``answer``, where the answer ends."""
    at: tuple[int, ...] | None = None
    answer: bool = True


def keep_for(state: ServerState, marks: tuple[int, ...], options: Mapping[str, Any]) -> Keep:
    """Checkpoints of a chat prompt: at ``marks`` (``rendered_prompt``'s; none: the engine's
    default), and where the answer ends when the template renders answers back as written."""
    return Keep(marks or None, state.template.renders_answer_back(**options))


@dataclass
class Prepared:
    prompt_text: str
    prompt_ids: list[int]
    params: SamplingParams
    starts_in_reasoning: bool  # the prompt ends inside an open <think>
    tools: list[ToolSpec] = field(default_factory=list)  # functions the output may call
    keep: Keep = Keep()  # where prefix checkpoints are kept
    media: Any = None  # the prompt's images (MediaPrompt, ``server/media.py``), or None


def template_options(state: ServerState, kwargs: Mapping[str, Any] | None, typed: Mapping[str, Any],
                     kwargs_param: str = "chat_template_kwargs") -> dict[str, Any]:
    """The template variables of a request: ``kwargs`` merged with the typed fields ``typed``
    (``enable_thinking``, ``preserve_thinking``, ``reasoning_effort``; None = unspecified), which
    must agree where both are given, then the server's defaults. ``reasoning_effort: "none"``
    turns thinking off; any other effort leaves it to the template."""
    if kwargs is not None and not isinstance(kwargs, Mapping):
        raise invalid(kwargs_param, f"'{kwargs_param}' must be a JSON object")
    out = dict(kwargs or {})
    for key in out:
        if key in RESERVED_KWARGS:
            raise unsupported(f"{kwargs_param}.{key}", "messages, tools, the generation mode and special "
                              "tokens cannot be set through template kwargs")
    for name in STANDARD_OPTIONS:
        given, typed_value = out.pop(name, None), typed.get(name)
        if given is not None and typed_value is not None and given != typed_value:
            raise APIError(400, f"'{name}' is given twice with different values ({typed_value!r} and "
                           f"{kwargs_param}.{name}={given!r})", name, "conflicting_template_option")
        value = typed_value if typed_value is not None else given
        if value is None:
            continue
        if name == "reasoning_effort" and value not in REASONING_EFFORTS:
            raise invalid(name, f"'reasoning_effort' must be one of {', '.join(REASONING_EFFORTS)}")
        if name != "reasoning_effort" and not isinstance(value, bool):
            raise invalid(name, f"'{name}' must be a boolean")
        out[name] = value
    effort = out.get("reasoning_effort")
    if effort is not None:
        wants = effort != "none"
        if out.get("enable_thinking", wants) != wants:
            raise APIError(400, f"reasoning_effort={effort!r} conflicts with enable_thinking="
                           f"{out['enable_thinking']!r}", "reasoning_effort", "conflicting_template_option")
        if not wants:
            out["enable_thinking"] = False
        elif state.thinking.enable_thinking is False:
            out["enable_thinking"] = True  # an explicit effort overrides --no-thinking
    if "enable_thinking" not in out and state.thinking.enable_thinking is not None:
        out["enable_thinking"] = state.thinking.enable_thinking
    if "preserve_thinking" not in out and state.thinking.preserve_thinking is not None:
        out["preserve_thinking"] = state.thinking.preserve_thinking
    return out


def lower_roles(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Developer turns become system turns: chat templates know only system, user, assistant, tool."""
    return [{**m, "role": "system"} if m.get("role") == "developer" else m for m in messages]


def _is_text_part(part: Any) -> bool:
    return isinstance(part, str) or (isinstance(part, Mapping) and part.get("type") == "text"
                                     and isinstance(part.get("text"), str))


def lower_content(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Text-only content reaches the template as one string (parts joined without separators, as
    templates that iterate parts write them): many templates concatenate ``message['content']``.
    Content with other parts (images) stays a list for templates that know them."""
    out = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list) and all(_is_text_part(p) for p in content):
            m = {**m, "content": "".join(p if isinstance(p, str) else p["text"] for p in content)}
        out.append(m)
    return out


def render_prompt(state: ServerState, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                  options: Mapping[str, Any], param: str = "messages", fit: bool = False) -> tuple[str, list[int]]:
    """The prompt text and ids of template messages from any API family, lowered here first.
    ``fit``: the prompt goes to the engine as it is, so one that cannot fit the context is refused
    before it is tokenized (``check_context_floor``)."""
    text, ids, _ = _prompt(state, messages, tools, options, param, fit, with_turn_end=False)
    return text, ids


def rendered_prompt(state: ServerState, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                    options: Mapping[str, Any], param: str = "messages",
                    fit: bool = False) -> tuple[str, list[int], tuple[int, ...]]:
    """``render_prompt``, and where the engine keeps prefix checkpoints in the ids, for a prompt
    that goes to the engine: where a long system part ends (``system_end``) and where the
    conversation's turn ends (``turn_end``); empty where neither is found (the engine keeps one
    where the prompt ends)."""
    return _prompt(state, messages, tools, options, param, fit, with_turn_end=True)


def _prompt(state: ServerState, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
            options: Mapping[str, Any], param: str, fit: bool,
            with_turn_end: bool) -> tuple[str, list[int], tuple[int, ...] | None]:
    guard = guard_for(state.tokenizer)
    guarded, literals = guard.protect(lower_content(lower_roles(messages)))
    # a stand-in for what follows a long system part first (only to find where it ends)
    stand_in = system_stand_in(state, guarded, tools, options) if with_turn_end else None
    try:  # without the generation prompt (only to find the turn's end; a counted prompt needs none)
        base = state.template.render(guarded, add_generation_prompt=False, tools=tools or None,
                                     **options) if with_turn_end else None
        text = state.template.render(guarded, add_generation_prompt=True, tools=tools or None, **options)
    except TemplateError as exc:
        raise APIError(400, f"the conversation cannot be rendered: {exc}", param, "invalid_prompt") from exc
    if fit:  # the text outside the guard's markers alone is a floor for the prompt's tokens
        check_context_floor(state, state.tokenizer.min_tokens(literals.pattern.sub("", text) if literals else text),
                            param)
    guarded_text = text
    text, ids = guard.encode(text, literals)
    if base is None:
        return text, ids, None
    turn = turn_end(state, text, ids, base, literals)
    start = None if stand_in is None else system_end(stand_in, guarded_text, ids, guard, literals)
    marks = {m for m in (start, turn) if m is not None}
    if start is not None and turn is None:
        marks.add(len(ids))  # the prompt's end, where the engine puts one when none is named
    return text, ids, tuple(sorted(marks))


# the shortest system part (characters of system prompts and tool definitions) that gets a
# checkpoint of its own, which other conversations that start with it go on from
SYSTEM_CHECKPOINT_CHARS = 2048


def system_stand_in(state: ServerState, guarded: list[dict[str, Any]], tools, options: Mapping[str, Any]) -> str | None:
    """The prompt rendered with its system messages (and the tool definitions the template
    renders with them) and a stand-in user turn after them, ``\ue002``: where it parts from the
    real rendering, the system part ends. None where there is no such part, it is short (at most
    ``SYSTEM_CHECKPOINT_CHARS`` of content and tool definitions) or the template refuses it."""
    head = 0
    while head < len(guarded) and guarded[head].get("role") in ("system", "developer"):
        head += 1
    if head == len(guarded) or not (head or tools):
        return None
    size = sum(len(str(m.get("content") or "")) for m in guarded[:head]) + len(json.dumps(tools or []))
    if size < SYSTEM_CHECKPOINT_CHARS:
        return None
    try:
        return state.template.render([*guarded[:head], {"role": "user", "content": "\ue002"}],
                                     add_generation_prompt=False, tools=tools or None, **options)
    except TemplateError:
        return None


def system_end(stand_in: str, text: str, ids: list[int], guard, literals) -> int | None:
    """Where the system part ends in ``ids`` (``system_stand_in``; ``text``: the real rendering,
    guard markers in it): there a checkpoint serves every conversation that starts with it, an
    agent's new sessions and subagents. None where no token boundary matches there."""
    cut = stand_in.find("\ue002")
    if cut <= 0 or not text.startswith(stand_in[:cut]):
        return None
    _, part = guard.encode(stand_in[:cut], literals)
    for n in (len(part), len(part) - 1):  # the part's last token may merge with what follows it
        if 0 < n < len(ids) and ids[:n] == part[:n]:
            return n
    return None


def turn_end(state: ServerState, text: str, ids: list[int], base: str, literals) -> int | None:
    """Where the conversation so far ends in ``ids`` (``base``: the prompt rendered without the
    generation prompt, guard markers in it): before the generation prompt, the stable boundary of
    a returning conversation (the next turn renders this turn's answer after it, and the template
    may rewrite what the generation prompt opened, such as a reasoning block). None where the
    generation prompt's own tokens do not end ``ids``."""
    if literals:
        base = literals.pattern.sub(lambda m: literals[int(m.group(1))], base)
    if not text.startswith(base):
        return None
    if len(base) == len(text):  # the template adds no generation prompt
        return len(ids)
    tail = state.tokenizer.encode(text[len(base):])
    if tail and len(tail) < len(ids) and ids[-len(tail):] == tail:
        return len(ids) - len(tail)
    return None


def tools_left_out(state: ServerState, specs: Sequence[ToolSpec]) -> list[str]:
    """The names of the request's tools that its prompt cannot show: all of them where the chat
    template has no place for tool definitions (SmolLM2's). The answer names them in the
    ``x-ninfer-omitted-tools`` header, so an agent can see that the model was not told of them."""
    return [s.name for s in specs] if specs and not state.template.renders_tools else []


def check_token_ids(state: ServerState, ids: Sequence[int], param: str, offset: int = 0) -> None:
    """Every id is one the tokenizer decodes and the model embeds (the engine's ``token_limit``;
    a checkpoint may declare more rows than its tokenizer has ids): a 400 naming ``param[i]``
    for the first that is not."""
    limit = state.engine.loop.token_limit
    if ids and (min(ids) < 0 or max(ids) >= limit):
        i, t = next((i, t) for i, t in enumerate(ids) if not 0 <= t < limit)
        raise invalid(f"{param}[{offset + i}]", f"token id {t} is out of range [0, {limit})")


def check_context_floor(state: ServerState, least_tokens: int, param: str = "messages") -> None:
    """``check_context`` before the tokenizer runs, for a prompt known to have at least
    ``least_tokens`` tokens (``Tokenizer.min_tokens``): what cannot fit is refused at once, and
    what passes is tokenized and checked exactly."""
    if least_tokens >= state.max_context:
        raise APIError(400, f"the prompt has at least {least_tokens} tokens; this server's context is "
                       f"{state.max_context} tokens (--max-context)", param, "context_length_exceeded")


def check_context(state: ServerState, prompt_tokens: int, param: str = "messages") -> None:
    if prompt_tokens >= state.max_context:
        raise APIError(400, f"the prompt has {prompt_tokens} tokens; this server's context is "
                       f"{state.max_context} tokens (--max-context)", param, "context_length_exceeded")


def check_prompt(state: ServerState, ids: list[int], param: str = "messages") -> None:
    """``check_context`` for a prompt's ids. Those of a prompt that does not fit (millions, for a
    long one) are let go of a slice at a time first (``gil_slices``): freed at once, they would
    hold the GIL (and stall the event loop and the engine) for as long as it takes."""
    count = len(ids)
    if count >= state.max_context:
        for _ in gil_slices(count):
            del ids[-GIL_SLICE:]
    check_context(state, count, param)


def thinking_control(state: ServerState, prompt_text: str, prompt_tokens: int, max_tokens: int | None,
                     budget: int | None, budget_param: str = "thinking_budget") -> tuple[bool, ThinkingControl | None]:
    """(output starts inside reasoning, its engine control). A budget applies only to output that
    starts in reasoning; the request's ``budget`` overrides ``--default-thinking-budget``;
    ``--reasoning-loop`` comes with every control."""
    if not prompt_opens_reasoning(prompt_text):
        return False, None
    end_id = state.tokenizer.token_to_id(THINK_CLOSE)
    if end_id is None:  # the close tag is not one token: no accounting
        return True, None
    budget = state.thinking.budget if budget is None else budget
    loop = state.thinking.loop
    close_ids = tuple(state.tokenizer.encode(THINKING_CLOSE_TEXT)) if budget is not None or loop else ()
    if budget is None:
        return True, ThinkingControl(end_id, close_ids=close_ids, loop=loop)
    capacity = state.max_context - prompt_tokens
    if max_tokens is not None:
        capacity = min(capacity, max_tokens)
    if budget < capacity < budget + len(close_ids) + 1:
        raise APIError(400, f"the output limit ({capacity} tokens) reaches past the thinking budget ({budget}) "
                       f"but cannot hold the {len(close_ids)}-token close and one answer token",
                       budget_param, "thinking_budget_capacity_insufficient")
    return True, ThinkingControl(end_id, budget, close_ids, loop)


def sampling_params(state: ServerState, s: Sampling, thinking: ThinkingControl | None = None) -> SamplingParams:
    d = state.sampling
    try:
        return SamplingParams(
            temperature=d.temperature if s.temperature is None else s.temperature,
            top_p=d.top_p if s.top_p is None else s.top_p,
            top_k=d.top_k if s.top_k is None else s.top_k,
            min_p=d.min_p if s.min_p is None else s.min_p,
            presence_penalty=s.presence_penalty or 0.0,
            frequency_penalty=s.frequency_penalty or 0.0,
            repetition_penalty=d.repetition_penalty,
            seed=None if s.seed is None else s.seed & ((1 << 64) - 1),
            max_tokens=state.default_max_tokens if s.max_tokens is None else s.max_tokens,
            stop=list(s.stop),
            thinking=thinking,
            logprobs=s.logprobs,
            logit_bias=dict(s.logit_bias),
            grammar=s.grammar,
        )
    except SamplingParamError as exc:
        raise invalid(exc.param, str(exc)) from exc


def prepare(state: ServerState, messages: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None = None,
            tool_specs: Sequence[ToolSpec] = (), options: Mapping[str, Any] | None = None,
            sampling: Sampling | None = None, thinking_budget: int | None = None,
            budget_param: str = "thinking_budget", prompt_param: str = "messages") -> Prepared:
    """Render, tokenize and check one chat request; ``tools`` are rendered in the prompt,
    ``tool_specs`` are what the output parser may turn into calls."""
    sampling = sampling or Sampling()
    images = images_of(state, messages)  # decoded and preprocessed here, on a worker thread
    text, ids, marks = rendered_prompt(state, messages, tools, options or {}, prompt_param, fit=True)
    ids, media, marks = expand(state, ids, images, marks)
    check_prompt(state, ids, prompt_param)
    max_tokens = state.default_max_tokens if sampling.max_tokens is None else sampling.max_tokens
    starts, control = thinking_control(state, text, len(ids), max_tokens, thinking_budget, budget_param)
    params = sampling_params(state, sampling, control)
    return Prepared(text, ids, params, starts, list(tool_specs), keep_for(state, marks, options or {}), media)


async def run(state: ServerState, prompt_ids: list[int], params: SamplingParams,
              request_id: str, keep: Keep = Keep(), forks: int = 0,
              fork_of: str | None = None, media: Any = None) -> AsyncIterator[RequestOutput]:
    """The engine's outputs for one request, engine errors as HTTP errors; ``forks``,
    ``fork_of``: one choice of several (``choices.py``); ``media``: the prompt's images."""
    at = None if keep.at is None else list(keep.at)
    held = state.media.hold(media) if media is not None and state.media is not None else 0
    try:
        async for out in state.engine.generate(prompt_ids, params, request_id, at, keep.answer, forks, fork_of,
                                               media):
            yield out
    except EngineError as exc:
        raise engine_error(exc) from exc
    finally:
        if held:
            state.media.release(held)


async def start(state: ServerState, prompt_ids: list[int], params: SamplingParams, request_id: str,
                keep: Keep = Keep(), forks: int = 0, fork_of: str | None = None,
                media: Any = None) -> tuple[RequestOutput, AsyncIterator[RequestOutput]]:
    """Submit and wait for admission; return the admission output and the iterator of the rest.
    ``keep``: where the engine keeps prefix checkpoints."""
    outputs = run(state, prompt_ids, params, request_id, keep, forks, fork_of, media)
    first = await anext(outputs)
    if not first.admitted:
        raise RuntimeError("engine published output before admission")
    return first, outputs

