"""Responses tools: function tools and namespaces for the prompt, hosted tools left out.

Hosted tools are ones OpenAI's platform runs on the model's behalf (web search, file search, code
interpreter, image generation, computer use, remote MCP, the local shell). This server cannot
run them, and clients such as Codex declare some on every request; so unless ``--strict-tools``
is given they are left out of the prompt, the route reports their types in the
``x-ninfer-omitted-tools`` header and the server logs one warning line per request. A
``tool_choice`` that forces one is refused either way.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..errors import invalid, unsupported
from ..openai_common import FunctionTool, function_tool, unique_names
from .items import engine_name

# the hosted tool types of OpenAI's Responses API (openai.types.responses.Tool, ToolChoiceTypes)
HOSTED_TOOL_TYPES = frozenset([
    "web_search", "web_search_2025_08_26", "web_search_preview", "web_search_preview_2025_03_11",
    "file_search", "code_interpreter", "image_generation", "computer", "computer_use", "computer_use_preview",
    "mcp", "local_shell",
])


@dataclass
class ResponseTools:
    functions: list[FunctionTool]  # every declared function, namespaced ones as "namespace.name"
    omitted: list[str] = field(default_factory=list)  # hosted tool types left out, first-seen order


def _namespace(tool: dict[str, Any], at: str) -> list[FunctionTool]:
    ns = tool.get("name")
    if not isinstance(ns, str) or not ns or any(c in ns for c in "<>\n"):
        raise invalid(f"{at}.name", "a namespace needs a non-empty 'name'")
    members = tool.get("tools")
    if not isinstance(members, list) or not members:
        raise invalid(f"{at}.tools", "a namespace needs a non-empty 'tools' array")
    desc = tool.get("description")
    out = []
    for j, fn in enumerate(members):
        sub = f"{at}.tools[{j}]"
        if not isinstance(fn, dict) or fn.get("type", "function") != "function":
            raise unsupported(f"{sub}.type", "namespaces hold function tools only")
        name = fn.get("name") if isinstance(fn.get("name"), str) else ""
        out.append(function_tool(fn, sub, name=engine_name(name, ns) if name else None, namespace=ns,
                                 extra_description=f"[{ns}] {desc}" if desc else f"[{ns}]"))
    return out


def response_tools(tools: list[dict[str, Any]] | None, strict: bool) -> ResponseTools:
    """The declared tools; hosted ones are refused when ``strict``, else recorded as omitted."""
    out = ResponseTools([])
    for i, tool in enumerate(tools or []):
        kind = tool.get("type")
        if kind == "function":
            out.functions.append(function_tool(tool, f"tools[{i}]"))
        elif kind == "namespace":
            out.functions.extend(_namespace(tool, f"tools[{i}]"))
        elif kind in HOSTED_TOOL_TYPES and not strict:
            if kind not in out.omitted:
                out.omitted.append(kind)
        elif kind in HOSTED_TOOL_TYPES:
            raise unsupported(f"tools[{i}].type", f"hosted tool '{kind}' cannot be run by this server "
                              "(--strict-tools refuses hosted tools instead of leaving them out)")
        else:
            raise unsupported(f"tools[{i}].type", f"'{kind}' tools (custom, shell and apply_patch tools are not "
                              "available; declare function tools)")
    unique_names(out.functions, "tools")
    return out


def check_forced_hosted(choice: Any) -> None:
    """A ``tool_choice`` that forces a hosted tool: a 400, as the tool cannot run here."""
    if isinstance(choice, dict) and choice.get("type") in HOSTED_TOOL_TYPES:
        raise unsupported("tool_choice", f"hosted tool '{choice['type']}' cannot be run by this server")


def named_function(choice: dict) -> str:
    """The engine name in a Responses ``{"type": "function", "name", "namespace"?}`` choice."""
    name = choice.get("name")
    if not isinstance(name, str) or not name:
        raise invalid("tool_choice.name", "a named tool choice needs a function 'name'")
    namespace = choice.get("namespace")
    return engine_name(name, namespace if isinstance(namespace, str) else None)


def allowed_names(choice: dict, tools: list[FunctionTool], strict: bool) -> tuple[list[str], bool]:
    """Names in a Responses ``{"type": "allowed_tools", "mode", "tools"}`` choice, and whether
    its mode requires a call; hosted tools in it are left out as the declared ones are (refused
    when ``strict``)."""
    mode = choice.get("mode", "auto")
    if mode not in ("auto", "required"):
        raise invalid("tool_choice.mode", "mode must be 'auto' or 'required'")
    names = []
    for j, ref in enumerate(choice.get("tools") or []):
        if isinstance(ref, dict) and ref.get("type") in HOSTED_TOOL_TYPES and not strict:
            continue
        if not isinstance(ref, dict) or ref.get("type") != "function" or not isinstance(ref.get("name"), str):
            raise unsupported(f"tool_choice.tools[{j}]", "only function tools can be allowed")
        name = engine_name(ref["name"], ref.get("namespace"))
        if name not in {t.name for t in tools}:
            raise invalid(f"tool_choice.tools[{j}]", f"no declared function {name!r}")
        names.append(name)
    return names, mode == "required"
