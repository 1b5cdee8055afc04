"""Tool calls held to their schemas: the grammar of calls ``tool_parser`` reads back.

A forced choice (``tool_choice`` ``required`` or a named function; Anthropic ``any`` / ``tool``)
makes the answer one call, or several separated by a newline when parallel calls are allowed, and
nothing else (but up to two newlines before, as a model writes after closing its reasoning). Strict
functions under ``auto`` leave the answer free until it opens a ``<tool_call>``; from there it must
be a whole call to a callable function.

A call is written the way the chat template writes one and ``tool_parser`` reads it::

    <tool_call>
    <function=NAME>
    <parameter=KEY>
    VALUE
    </parameter>
    </function>
    </tool_call>

Parameters come in the schema's property order, the required ones always and the others optionally.
A value is held to its property schema in the form ``convert_parameter`` turns back into that
value: a parameter that declares a string type is raw text (narrowed to the string alternatives of
its schema), anything else is JSON. No value may contain ``<parameter=`` or ``</parameter>``, which
would end or nest the parameter for the parser; a string with a length bound (which xgrammar does
not apply beside such exclusions) is held to it by a pattern that leaves out ``<`` and the UTF-16
surrogates (which xgrammar reads as characters, though their bytes decode to three replacement
characters each), and in JSON quotes, backslashes and control characters. A function that is
callable but not strict takes any parameter text. JSON values have at most one blank between their
tokens (a weak model given room for whitespace may write only that). The grammar is an xgrammar
structural tag (``GrammarSpec`` kind ``structural_tag``).
"""
from __future__ import annotations

import json
from typing import Any, Mapping, Sequence

from ..grammar import GrammarError, GrammarSpec
from .tool_parser import CALL_CLOSE, CALL_OPEN, FUNCTION_CLOSE, FUNCTION_OPEN, PARAM_CLOSE, PARAM_OPEN, \
    ToolSpec, declared_types

CALL_SEPARATOR = "\n"
_EXCLUDED = [PARAM_OPEN, PARAM_CLOSE]  # what would end a value early, or open a nested one


def tool_call_grammar(tools: Sequence[ToolSpec], *, forced: bool, parallel: bool,
                      strict: Sequence[str] = (), params: Mapping[str, str] | None = None,
                      param: str = "tool_choice") -> GrammarSpec:
    """The grammar of an answer that calls ``tools`` (the callable ones, in order). ``forced``:
    the answer is the call(s) only; else free text in which any call is held. ``parallel``:
    more than one call. ``strict``: the names whose arguments are held to their schemas (every
    tool when ``forced``); ``params``: the request field of each tool's parameters, for errors."""
    if not tools:
        raise GrammarError(param, f"{param} needs at least one callable function")
    held = {t.name for t in tools} if forced else set(strict)
    tags = [_call_tag(t, t.name in held, (params or {}).get(t.name, "tools")) for t in tools]
    if forced:  # after up to two newlines (those a model writes after closing its reasoning)
        calls = {"type": "tags_with_separator", "tags": tags, "separator": CALL_SEPARATOR,
                 "at_least_one": True, "stop_after_first": not parallel}
        fmt: dict[str, Any] = {"type": "sequence", "elements": [{"type": "regex", "pattern": r"\n{0,2}"}, calls]}
    else:
        fmt = {"type": "triggered_tags", "triggers": [CALL_OPEN], "tags": tags, "stop_after_first": not parallel}
    return GrammarSpec("structural_tag", json.dumps({"type": "structural_tag", "format": fmt}), param)


def _call_tag(tool: ToolSpec, held: bool, param: str) -> dict[str, Any]:
    begin = f"{CALL_OPEN}\n{FUNCTION_OPEN}{tool.name}>\n"
    end = f"{FUNCTION_CLOSE}\n{CALL_CLOSE}"
    if not held:
        return {"type": "tag", "begin": begin, "content": {"type": "any_text", "excludes": [CALL_CLOSE]},
                "end": "\n" + end}
    body = _parameters(tool.parameters, param)
    if not body:
        return {"type": "tag", "begin": begin, "content": {"type": "const_string", "value": ""}, "end": end}
    return {"type": "tag", "begin": begin, "content": {"type": "sequence", "elements": body}, "end": end}


def _parameters(schema: Mapping[str, Any] | None, param: str) -> list[dict[str, Any]]:
    """One element per property, in the schema's order; optional ones may be left out."""
    if schema is None:
        return []
    for key in ("anyOf", "oneOf", "allOf", "$ref", "not", "if"):
        if key in schema:
            raise GrammarError(param, f"{param} cannot be held to a tool call: "
                               f"its top level uses '{key}'; declare an object with 'properties'")
    if schema.get("type", "object") != "object":
        raise GrammarError(param, f"{param} must be an object schema")
    props, required = schema.get("properties") or {}, schema.get("required") or []
    if not isinstance(props, Mapping) or not isinstance(required, list):
        raise GrammarError(param, f"{param}: 'properties' must be an object and "
                           "'required' a list")
    required = [k for k in required if isinstance(k, str)]
    extra = schema.get("additionalProperties")
    names = list(props) + [k for k in required if k not in props]
    defs = {k: schema[k] for k in ("$defs", "definitions") if k in schema}  # for '#/$defs/...' inside values
    out = []
    for key in names:
        if any(c in key for c in "<>\n"):
            raise GrammarError(param, f"property {key!r} cannot be written as a parameter")
        sub = props.get(key, extra if isinstance(extra, Mapping) else {})
        if not isinstance(sub, Mapping):
            sub = {} if sub is not False else {"not": {}}
        tag = {"type": "tag", "begin": f"{PARAM_OPEN}{key}>\n", "content": _value(sub, defs),
               "end": f"\n{PARAM_CLOSE}\n"}
        out.append(tag if key in required else {"type": "optional", "content": tag})
    return out


def _value(schema: Mapping[str, Any], defs: Mapping[str, Any]) -> dict[str, Any]:
    """A value held to ``schema`` in the form the parser converts back (module docstring)."""
    types = declared_types(schema)
    if types is not None and "string" in types:
        text = _bounded({**_string_part(schema), **defs}, r"[^<\ud800-\udfff]")
        return {"type": "json_schema", "json_schema": text,
                "style": "qwen_xml", "excludes": _EXCLUDED}
    return {"type": "json_schema", "json_schema": _bounded({**schema, **defs}, r'[^<"\\\x00-\x1f\ud800-\udfff]'),
            "style": "json", "excludes": _EXCLUDED, "max_whitespace_cnt": 1}


def _bounded(node: Any, char: str) -> Any:
    """``node`` with every string schema's ``minLength`` / ``maxLength`` (and no pattern, format,
    enum or const of its own) turned into the pattern ``char{min,max}``."""
    if isinstance(node, list):
        return [_bounded(n, char) for n in node]
    if not isinstance(node, Mapping):
        return node
    out = {k: _bounded(v, char) for k, v in node.items()}
    lengths = [k for k in ("minLength", "maxLength") if isinstance(node.get(k), int)]
    if node.get("type") == "string" and lengths and not {"pattern", "format", "enum", "const"} & node.keys():
        low, high = node.get("minLength", 0), node.get("maxLength", "")
        for k in lengths:
            del out[k]
        out["pattern"] = f"{char}{{{low},{high}}}"
    return out


def _string_part(schema: Mapping[str, Any]) -> dict[str, Any]:
    """The string alternatives of a schema that admits a string (the parser keeps such a value as
    text whatever it looks like)."""
    if isinstance(schema.get("type"), (str, list)):
        return {**schema, "type": "string"}
    for key in ("anyOf", "oneOf"):
        alternatives = schema.get(key)
        if isinstance(alternatives, list):
            strings = [a for a in alternatives if "string" in (declared_types(a) or ())]
            rest = {k: v for k, v in schema.items() if k != key}
            if len(strings) == 1:
                return {**rest, **_string_part(strings[0])}
            return {**rest, "anyOf": [_string_part(a) for a in strings]}
    return {**schema, "type": "string"}
