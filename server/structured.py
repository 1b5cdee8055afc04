"""Structured outputs: a request's output format read into one ``GrammarSpec`` (engine/grammar.py).

Every API family names it its own way: Chat and legacy Completions ``response_format``
(``json_object``, ``json_schema``), Responses ``text.format``, llama.cpp's ``grammar`` (GBNF) and
``json_schema``, and the extension fields local servers take (``structured_outputs`` and the older
``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar``). A request gives at
most one; each is checked here, so a schema or grammar that cannot be built is a 400 naming its
field before anything runs.
"""
from __future__ import annotations

from typing import Any

from ..engine.grammar import GrammarError, GrammarSpec
from .errors import invalid, unsupported

BACKENDS = (None, "auto", "xgrammar")  # guided_decoding_backend values taken (the one engine there is)


def _checked(spec: GrammarSpec | None) -> GrammarSpec | None:
    if spec is not None:
        try:
            spec.check()
        except GrammarError as exc:
            raise invalid(exc.param, str(exc)) from None
    return spec


def _build(make, *args) -> GrammarSpec:
    try:
        return make(*args)
    except GrammarError as exc:
        raise invalid(exc.param, str(exc)) from None


def response_format(fmt: dict[str, Any] | None, param: str = "response_format") -> GrammarSpec | None:
    """Chat / Completions ``response_format`` (and Responses ``text.format``, flat: the schema
    beside ``type``). ``json_object`` with a ``schema`` is llama.cpp's form of a schema."""
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise invalid(param, f"{param} must be an object")
    kind = fmt.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        if fmt.get("schema") is not None:
            return _build(GrammarSpec.json_schema, fmt["schema"], f"{param}.schema")
        return GrammarSpec("json", "", param)
    if kind == "json_schema":
        holder, at = (fmt["json_schema"], f"{param}.json_schema") if "json_schema" in fmt else (fmt, param)
        if not isinstance(holder, dict) or holder.get("schema") is None:
            raise invalid(f"{at}.schema", f"{at}.schema is required for type 'json_schema'")
        return _build(GrammarSpec.json_schema, holder["schema"], f"{at}.schema")
    raise invalid(f"{param}.type", f"unknown {param}.type; one of 'text', 'json_object', 'json_schema'")


def extension_fields(req: Any) -> list[GrammarSpec]:
    """The constraint fields beyond ``response_format`` a request model declares and sets."""
    specs = []
    backend = getattr(req, "guided_decoding_backend", None)
    if backend not in BACKENDS:
        raise unsupported("guided_decoding_backend", "constrained decoding runs on xgrammar here; 'auto' or 'xgrammar'")
    so = getattr(req, "structured_outputs", None)
    if so is not None:
        if not isinstance(so, dict) or not so:
            raise invalid("structured_outputs", "structured_outputs must be an object with one of 'json', "
                          "'regex', 'choice', 'grammar', 'json_object'")
        known = {"json", "regex", "choice", "grammar", "json_object", "disable_any_whitespace",
                 "disable_additional_properties", "whitespace_pattern"}
        for key in so:
            if key not in known:
                raise unsupported(f"structured_outputs.{key}", "not available")
        given = [k for k in ("json", "regex", "choice", "grammar", "json_object") if so.get(k) not in (None, False)]
        if len(given) != 1:
            raise invalid("structured_outputs", "structured_outputs takes exactly one of 'json', 'regex', "
                          "'choice', 'grammar', 'json_object'")
        key = given[0]
        specs.append(_spec(key, so[key], f"structured_outputs.{key}"))
    for name, key in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                      ("guided_grammar", "grammar"), ("json_schema", "json"), ("grammar", "grammar")):
        value = getattr(req, name, None)
        if value is not None and not (name == "grammar" and value == ""):
            specs.append(_spec(key, value, name))
    return specs


def _spec(key: str, value: Any, param: str) -> GrammarSpec:
    if key == "json":
        return _build(GrammarSpec.json_schema, value, param)
    if key == "json_object":
        return GrammarSpec("json", "", param)
    if key == "choice":
        return _build(GrammarSpec.choice, value, param)
    if not isinstance(value, str) or not value:
        raise invalid(param, f"{param} must be a non-empty string")
    return GrammarSpec("regex" if key == "regex" else "ebnf", value, param)


def request_grammar(req: Any, fmt: dict[str, Any] | None = None, fmt_param: str = "response_format") -> GrammarSpec | None:
    """The one grammar a request asks for (``fmt``: its ``response_format``-like field), checked;
    None where it asks for none."""
    specs = [s for s in [response_format(fmt, fmt_param)] if s is not None] + extension_fields(req)
    if len(specs) > 1:
        names = ", ".join(s.param for s in specs)
        raise invalid(specs[1].param, f"one output constraint per request; this one gives {names}")
    return _checked(specs[0]) if specs else None
