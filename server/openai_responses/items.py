"""Responses Items: the input normalised to canonical Items, and Items as template messages.

Canonical Items keep the client's order and ids (generated when missing). Converting a history
to chat-template messages groups contiguous assistant-owned Items (reasoning -> message ->
function_call) into one assistant turn and puts tool results in their calls' declaration order.
"""
from __future__ import annotations

import json
from typing import Any, Callable, Iterable

from ..errors import APIError, invalid, unsupported
from ..media import image_part
from ..openai_common import new_id

ASSISTANT_PHASE = {"reasoning": 0, "message": 1, "function_call": 2}
Unseal = Callable[[str, str], str]  # (encrypted_content, param) -> reasoning text
ID_PREFIX = {"message": "msg_", "reasoning": "rs_", "function_call": "fc_", "function_call_output": "fco_"}


def engine_name(name: str, namespace: str | None) -> str:
    """The one name the model sees for a function: ``namespace.name`` inside a namespace."""
    return f"{namespace}.{name}" if namespace else name


def _text_part(part: Any, at: str, role: str) -> dict[str, Any]:
    if not isinstance(part, dict):
        raise invalid(at, "a content part must be an object")
    kind = part.get("type")
    if kind in ("input_text", "output_text") or (kind == "text" and role != "assistant"):
        if not isinstance(part.get("text"), str):
            raise invalid(f"{at}.text", f"a {kind} part needs string 'text'")
        if kind == "output_text" and role != "assistant":
            raise invalid(f"{at}.type", "output_text parts belong to assistant messages")
        return {**part, "type": "input_text" if kind == "text" else kind}
    if kind == "refusal" and role == "assistant":
        if not isinstance(part.get("refusal"), str):
            raise invalid(f"{at}.refusal", "a refusal part needs string 'refusal'")
        return dict(part)
    if kind == "input_image" and role != "assistant":
        detail = part.get("detail")
        if detail not in (None, "auto"):
            raise unsupported(f"{at}.detail", "only 'auto' image detail")
        if part.get("file_id") is not None:
            raise unsupported(f"{at}.file_id", "uploaded files; send the image as a data URI in 'image_url'")
        if not isinstance(part.get("image_url"), str):
            raise invalid(f"{at}.image_url", "an input_image part needs 'image_url' (a data URI)")
        return {"type": "input_image", "image_url": part["image_url"], "detail": detail or "auto"}
    if kind in ("input_image", "input_video"):
        raise unsupported(at, f"'{kind}' input is not supported here")
    if kind in ("input_file", "input_audio"):
        raise unsupported(at, f"'{kind}' input is not supported")
    raise unsupported(f"{at}.type", f"content part type {kind!r} is not supported")


def _message(item: dict[str, Any], at: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in ("user", "assistant", "system", "developer"):
        raise invalid(f"{at}.role", "role must be user, assistant, system or developer")
    content = item.get("content")
    if isinstance(content, str):
        parts = [{"type": "output_text", "text": content, "annotations": []} if role == "assistant"
                 else {"type": "input_text", "text": content}]
    elif isinstance(content, list):
        parts = [_text_part(p, f"{at}.content[{j}]", role) for j, p in enumerate(content)]
    else:
        raise invalid(f"{at}.content", "content must be a string or an array of parts")
    out = {"id": item.get("id") or new_id("msg_"), "type": "message", "role": role, "content": parts,
           "status": item.get("status") or "completed"}
    return out


def _reasoning_texts(content: Any, at: str) -> list[str]:
    texts = [p for p in content or [] if isinstance(p, dict) and p.get("type") == "reasoning_text"]
    if not texts or len(texts) != len(content or []) or any(not isinstance(p.get("text"), str) for p in texts):
        raise unsupported(f"{at}.content", "a reasoning Item needs its raw reasoning_text content or the "
                          "encrypted_content this server issued; a summary cannot replace them")
    return [p["text"] for p in texts]


def _reasoning(item: dict[str, Any], at: str, unseal: Unseal | None) -> dict[str, Any]:
    content, sealed = item.get("content"), item.get("encrypted_content")
    out = {"id": item.get("id") or new_id("rs_"), "type": "reasoning", "summary": item.get("summary") or []}
    if sealed is not None:
        if not isinstance(sealed, str) or unseal is None:
            raise invalid(f"{at}.encrypted_content", "encrypted_content must be the string this server issued")
        text = unseal(sealed, f"{at}.encrypted_content")
        if content and "".join(_reasoning_texts(content, at)) != text:
            raise invalid(f"{at}.content", "the reasoning content differs from the text sealed in encrypted_content")
        out["encrypted_content"] = sealed
        texts = [text]
    else:
        texts = _reasoning_texts(content, at)
    out["content"] = [{"type": "reasoning_text", "text": t} for t in texts]
    return out


def _function_call(item: dict[str, Any], at: str) -> dict[str, Any]:
    for key in ("call_id", "name", "arguments"):
        if not isinstance(item.get(key), str) or (key != "arguments" and not item[key]):
            raise invalid(f"{at}.{key}", f"a function_call needs string '{key}'")
    if item.get("status") not in (None, "completed"):
        raise unsupported(f"{at}.status", "only completed function calls")
    try:
        args = json.loads(item["arguments"] or "{}")
    except ValueError:
        args = None
    if not isinstance(args, dict):
        raise invalid(f"{at}.arguments", "arguments must be a JSON object text")
    out = {"id": item.get("id") or new_id("fc_"), "type": "function_call", "call_id": item["call_id"],
           "name": item["name"], "arguments": item["arguments"], "status": "completed"}
    if item.get("namespace"):
        out["namespace"] = item["namespace"]
    return out


def _function_output(item: dict[str, Any], at: str) -> dict[str, Any]:
    if not isinstance(item.get("call_id"), str) or not item["call_id"]:
        raise invalid(f"{at}.call_id", "a function_call_output needs string 'call_id'")
    if item.get("status") not in (None, "completed"):
        raise unsupported(f"{at}.status", "only completed function results")
    output = item.get("output")
    if isinstance(output, list):
        if not output:
            raise invalid(f"{at}.output", "output parts must not be empty")
        output = [_text_part(p, f"{at}.output[{j}]", "tool") for j, p in enumerate(output)]
    elif not isinstance(output, str):
        raise invalid(f"{at}.output", "output must be a string or an array of input_text / input_image parts")
    out = {"id": item.get("id") or new_id("fco_"), "type": "function_call_output", "call_id": item["call_id"],
           "output": output, "status": "completed"}
    for key in ("name", "namespace"):
        if item.get(key) is not None:
            out[key] = item[key]
    return out


def normalize_input(value: str | list[dict[str, Any]] | None, taken_ids: Iterable[str] = (),
                    unseal: Unseal | None = None) -> list[dict[str, Any]]:
    """Canonical Items of a request's ``input``; ids must be unique (also against ``taken_ids``).
    ``unseal(blob, param)`` opens a reasoning Item's ``encrypted_content`` (a 400 naming ``param``
    when the blob was not issued here)."""
    if value is None:
        return []
    if isinstance(value, str):
        return [{"id": new_id("msg_"), "type": "message", "role": "user", "status": "completed",
                 "content": [{"type": "input_text", "text": value}]}]
    items, seen = [], set(taken_ids)
    for i, item in enumerate(value):
        at = f"input[{i}]"
        kind = item.get("type") or ("message" if "role" in item else None)
        if kind == "message":
            out = _message(item, at)
        elif kind == "reasoning":
            out = _reasoning(item, at, unseal)
        elif kind == "function_call":
            out = _function_call(item, at)
        elif kind == "function_call_output":
            out = _function_output(item, at)
        else:
            raise unsupported(f"{at}.type", f"input Item type {kind!r} is not supported")
        if out["id"] in seen:
            raise invalid(f"{at}.id", f"duplicate Item id {out['id']!r}", "duplicate_item_id")
        seen.add(out["id"])
        items.append(out)
    return items


def _part_text(part: dict[str, Any]) -> str:
    return part.get("refusal", "") if part.get("type") == "refusal" else part.get("text", "")


def _content(parts: str | list[dict[str, Any]], at: str, key: str = "content") -> str | list[dict[str, Any]]:
    """A message's (or a function result's) template content: its text, or with images a list of
    text and image parts (``server/media.py``; ``at``: where the Item was sent, ``key``: its parts)."""
    if isinstance(parts, str):
        return parts
    if not any(p.get("type") == "input_image" for p in parts):
        return "".join(_part_text(p) for p in parts)
    return [image_part(p["image_url"], f"{at}.{key}[{j}]") if p.get("type") == "input_image"
            else {"type": "text", "text": _part_text(p)} for j, p in enumerate(parts)]


def to_messages(items: list[dict[str, Any]], instructions: str | None = None, first_input: int = 0) -> list[dict[str, Any]]:
    """Template messages for a canonical Item history (``instructions`` first, as a developer turn);
    ``first_input``: the index of the request's first ``input`` Item in ``items`` (those before it
    come from a previous response)."""
    messages: list[dict[str, Any]] = [{"role": "developer", "content": instructions}] if instructions else []
    turn: dict[str, Any] | None = None  # the assistant turn being gathered
    calls: dict[str, tuple[int, dict[str, Any]]] = {}  # call_id -> (order, call) of the last turn
    results: list[dict[str, Any]] = []

    def close_turn() -> None:
        nonlocal turn, calls
        if turn is None:
            return
        msg = {"role": "assistant", "content": "".join(turn["content"])}
        if turn["reasoning"]:
            msg["reasoning_content"] = "\n".join(turn["reasoning"])
        if turn["calls"]:
            msg["tool_calls"] = [{"type": "function", "function": {
                "name": engine_name(c["name"], c.get("namespace")), "arguments": c["arguments"]}}
                for c in turn["calls"]]
        messages.append(msg)
        calls = {c["call_id"]: (k, c) for k, c in enumerate(turn["calls"])}
        turn = None

    def close_results() -> None:
        nonlocal results, calls
        if not results:
            return
        ordered = []
        for r in results:
            found = calls.get(r["call_id"])
            if found is None:
                raise APIError(400, f"function_call_output for unknown call_id {r['call_id']!r}: results must "
                               "follow the assistant turn that made the call", "input", "invalid_tool_history")
            if any(o[1]["call_id"] == r["call_id"] for o in ordered):
                raise APIError(400, f"two results for call_id {r['call_id']!r}", "input", "invalid_tool_history")
            call = found[1]
            for key in ("name", "namespace"):
                if r.get(key) is not None and r[key] != call.get(key):
                    raise APIError(400, f"result {key} {r[key]!r} does not match call {r['call_id']!r}",
                                   "input", "invalid_tool_history")
            ordered.append((found[0], r))
        ordered.sort(key=lambda o: o[0])
        if [o[0] for o in ordered] != list(range(len(ordered))):
            raise APIError(400, "tool results must answer the turn's calls in a prefix of their order; a "
                           "missing earlier result cannot be represented", "input", "invalid_tool_history")
        for _, r in ordered:
            messages.append({"role": "tool", "content": _content(r["output"], sent[id(r)], "output"),
                             "tool_call_id": r["call_id"]})
        results, calls = [], {}

    sent: dict[int, str] = {}  # id(Item) -> where it was sent

    for n, item in enumerate(items):
        kind = item["type"]
        sent[id(item)] = f"input[{n - first_input}]" if n >= first_input else "previous_response_id"
        if kind in ASSISTANT_PHASE and (kind != "message" or item["role"] == "assistant"):
            close_results()
            phase = ASSISTANT_PHASE[kind]
            if turn is None:
                turn = {"phase": phase, "reasoning": [], "content": [], "calls": []}
            elif phase < turn["phase"]:
                raise APIError(400, f"a {kind} Item cannot follow the assistant's later output in the same turn "
                               "(the order is reasoning, message, function_call)", "input",
                               "invalid_assistant_history")
            turn["phase"] = phase
            if kind == "reasoning":
                turn["reasoning"].append("".join(p["text"] for p in item["content"]))
            elif kind == "message":
                turn["content"].append("".join(_part_text(p) for p in item["content"]))
            else:
                turn["calls"].append(item)
        elif kind == "function_call_output":
            close_turn()
            results.append(item)
        else:
            close_turn()
            close_results()
            messages.append({"role": item["role"], "content": _content(item["content"], sent[id(item)])})
    close_turn()
    close_results()
    return messages
