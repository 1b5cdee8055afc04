"""Chat templates: a checkpoint's Jinja template, or one of ours, rendered in a sandbox.

The environment offers what Hugging Face chat templates expect: ``trim_blocks``/``lstrip_blocks``,
loop controls, a ``tojson`` that keeps non-ASCII text, ``raise_exception`` and ``strftime_now``.
"""
from __future__ import annotations

import json
from datetime import datetime
from importlib import resources
from typing import Any, NoReturn

import jinja2
import jinja2.meta
from jinja2.sandbox import ImmutableSandboxedEnvironment


class TemplateError(ValueError):
    """The template could not be rendered for these messages (a client error, usually)."""


class ChatTemplate:
    def __init__(self, source: str, bos_token: str = "", eos_token: str = "") -> None:
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self._template = env.from_string(source)
            names = jinja2.meta.find_undeclared_variables(env.parse(source))
        except jinja2.TemplateSyntaxError as e:
            raise TemplateError(f"chat template syntax error (line {e.lineno}): {e.message}") from e
        # whether the template puts tool definitions in the prompt at all (SmolLM2's does not)
        self.renders_tools = "tools" in names
        self._answers_back: dict[str, bool] = {}  # renders_answer_back, by template variables

    def render(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        """The prompt text; ``kwargs`` reach the template as variables (``enable_thinking``, ...)."""
        return self._render(messages, add_generation_prompt, tools, kwargs)

    def _render(self, messages: list[dict[str, Any]], add_generation_prompt: bool,
                tools: list[dict[str, Any]] | None, kwargs: dict[str, Any]) -> str:
        context = {"bos_token": self.bos_token, "eos_token": self.eos_token, **kwargs}
        context.update(
            messages=[_parse_tool_arguments(m) for m in messages],
            tools=tools or None,
            add_generation_prompt=add_generation_prompt,
        )
        try:
            return self._template.render(**context)
        except TemplateError:
            raise
        except jinja2.TemplateError as e:
            raise TemplateError(f"chat template error: {e}") from e
        except (TypeError, ValueError, LookupError, AttributeError) as e:
            raise TemplateError(f"chat template error: {type(e).__name__}: {e}") from e


    def renders_answer_back(self, **kwargs: Any) -> bool:
        """Whether the next turn renders an answer as the model wrote it after the generation
        prompt (``kwargs``: the template variables), so that a prefix checkpoint where the answer
        ends is one the next turn can go on from. Not where the template rewrites answers: drops
        an earlier turn's reasoning (Qwen3.5's, with thinking on) or the empty reasoning block the
        generation prompt opened with thinking off. Found once per set of variables, on a probe
        conversation."""
        key = json.dumps(kwargs, sort_keys=True, default=str)
        if key not in self._answers_back:
            self._answers_back[key] = self._probe_answer_back(kwargs)
        return self._answers_back[key]

    def _probe_answer_back(self, kwargs: dict[str, Any]) -> bool:
        first = [{"role": "user", "content": "What is two and two?"}]
        answer = {"role": "assistant", "content": "Four."}
        try:
            opened = self._render(first, True, None, kwargs)
            written = "Four."
            if opened.rstrip().endswith("<think>"):  # the model reasons first, then closes the block
                answer["reasoning_content"] = "Two and two make four."
                written = "Two and two make four.\n</think>\n\nFour."
            again = self._render([*first, answer, {"role": "user", "content": "And three?"}], True, None, kwargs)
        except TemplateError:
            return False
        return again.startswith(opened + written)


def builtin_template(name: str) -> str:
    """The source of one of our templates, ``templates/<name>.jinja`` in this package."""
    if not name or not name.replace("_", "").replace("-", "").isalnum():
        raise ValueError(f"invalid template name {name!r}")
    file = resources.files(__package__).joinpath("templates", f"{name}.jinja")
    if not file.is_file():
        raise ValueError(f"no built-in chat template named {name!r}")
    return file.read_text(encoding="utf-8")


def _parse_tool_arguments(message: dict[str, Any]) -> dict[str, Any]:
    """OpenAI clients send tool-call arguments as a JSON string; templates iterate a mapping."""
    calls = message.get("tool_calls") if isinstance(message, dict) else None
    if not calls or not isinstance(calls, list):
        return message
    parsed = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict) and isinstance(function.get("arguments"), str):
            try:
                arguments = json.loads(function["arguments"] or "{}")
            except json.JSONDecodeError as e:
                raise TemplateError(f"tool call arguments are not valid JSON: {e}") from e
            if not isinstance(arguments, dict):
                raise TemplateError("tool call arguments must be a JSON object")
            call = {**call, "function": {**function, "arguments": arguments}}
        parsed.append(call)
    return {**message, "tool_calls": parsed}


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _raise_exception(message: str) -> NoReturn:
    raise TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)
