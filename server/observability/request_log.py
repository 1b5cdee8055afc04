"""``--request-log-jsonl FILE``: one JSON object per line for every server and request event.

Events: ``server_start``; per generation request either ``request_rejected`` alone (it failed
before reaching the engine), or ``request_start`` followed by exactly one of ``request_done`` /
``request_error`` (engine error or cancellation); ``throughput`` at each stats interval.

Records hold counts, settings and timings, never prompt or output text, tool arguments, any other
value a request carried, or an API key. An error is logged as its type, code and the field it
names (``logged_error``), never its message, which may quote the request. The file is opened in
append mode and flushed after every event.
"""
from __future__ import annotations

import functools
import json
import re
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Mapping, Sequence

SCHEMA = "ninfer_request_log"
SCHEMA_VERSION = 1
REDACTED = "<redacted>"
SECRET_FLAGS = ("--api-key",)


class RequestLog:
    def __init__(self, path: str | Path, model_path: str | None = None) -> None:
        file = Path(path)
        if model_path is not None and file.resolve() == Path(model_path).resolve():
            raise ValueError(f"--request-log-jsonl {path}: this is the model file")
        if not file.parent.is_dir():
            raise ValueError(f"--request-log-jsonl {path}: directory {file.parent} does not exist")
        try:
            self._file = open(file, "a", encoding="utf-8")
        except OSError as exc:
            raise ValueError(f"--request-log-jsonl {path}: {exc.strerror or exc}") from exc
        self.path = file
        self.instance_id = uuid.uuid4().hex
        self._lock = threading.Lock()

    def write(self, event: str, **fields: Any) -> None:
        record = {
            "event": event,
            "schema": SCHEMA,
            "schema_version": SCHEMA_VERSION,
            "timestamp_unix_ms": int(time.time() * 1000),
            "server_instance_id": self.instance_id,
            **fields,
        }
        line = json.dumps(record, ensure_ascii=False, separators=(",", ":"), default=str)
        with self._lock:
            if self._file.closed:
                return
            self._file.write(line + "\n")
            self._file.flush()

    def close(self) -> None:
        with self._lock:
            self._file.close()


def redact_argv(argv: list[str], secrets: Sequence[str | None] = ()) -> list[str]:
    """``argv`` with the value of every secret flag (``--api-key K`` or ``--api-key=K``) replaced,
    and any argument holding one of ``secrets`` (the key given under an abbreviated flag)."""
    out, hide_next = [], False
    secrets = [s for s in secrets if s]
    for arg in argv:
        if any(s in arg for s in secrets) and not arg.startswith(tuple(f + "=" for f in SECRET_FLAGS)):
            out.append(REDACTED)
            hide_next = False
        elif hide_next:
            out.append(REDACTED)
            hide_next = False
        elif arg in SECRET_FLAGS:
            out.append(arg)
            hide_next = True
        elif arg.startswith(tuple(f + "=" for f in SECRET_FLAGS)):
            out.append(arg.split("=", 1)[0] + "=" + REDACTED)
        else:
            out.append(arg)
    return out


_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")
_PARAM_PART = re.compile(r"\[\d+\]|[^.\[\]]+")
UNNAMED = "*"  # a param segment the server's own code does not name: a request's key, not a field


@functools.lru_cache(maxsize=1)
def _server_words() -> frozenset[str]:
    """Every identifier written in the gateway's source: the field names an error's ``param`` may
    hold. A segment outside it came from the request (an unknown field, a map key) and is hidden."""
    words: set[str] = set()
    for file in Path(__file__).resolve().parents[1].rglob("*.py"):
        try:
            words.update(_IDENTIFIER.findall(file.read_text(encoding="utf-8")))
        except OSError:
            continue
    return frozenset(words)


def logged_param(param: str) -> str:
    """``param`` as the log may hold it: indices and the server's field names kept, any other
    segment (``unknown_parameter``'s own name, a metadata key) replaced by ``*``."""
    words = _server_words()
    parts = _PARAM_PART.findall(param)
    shown = [p if p.startswith("[") or (_IDENTIFIER.fullmatch(p) and p in words) else UNNAMED for p in parts]
    return "".join(p if p.startswith("[") or i == 0 else "." + p for i, p in enumerate(shown)) or UNNAMED


def logged_error(err: Mapping[str, Any]) -> dict[str, Any]:
    """The part of an error envelope the log keeps: ``type`` and ``code`` (the server's
    identifiers) and ``param`` (field names only). Never ``message``: it quotes request values."""
    out: dict[str, Any] = {}
    for key in ("type", "code"):
        value = err.get(key)
        if value is not None:
            out[key] = value if isinstance(value, str) and _IDENTIFIER.fullmatch(value) else "other"
    param = err.get("param")
    if param is not None:
        out["param"] = logged_param(param) if isinstance(param, str) else UNNAMED
    return out


_ENUMS = {
    "thinking": {"enabled", "disabled", "adaptive"},
    "effort": {"minimal", "low", "medium", "high", "xhigh", "max", "none"},
    "tool_choice": {"auto", "none", "required", "any", "tool", "function", "allowed_tools", "custom"},
}


def _enum(kind: str, value: Any) -> str | None:
    if value is None:
        return None
    return value if isinstance(value, str) and value in _ENUMS[kind] else "other"


def request_shape(body: Any) -> dict[str, Any]:
    """Counts and flags of a request body, never its text: what a measurement needs to group by."""
    if not isinstance(body, dict):
        return {}
    shape: dict[str, Any] = {}
    if "stream" in body:
        shape["stream"] = bool(body["stream"])
    for key in ("messages", "input", "tools", "stop", "stop_sequences"):
        value = body.get(key)
        if isinstance(value, list):
            shape[f"n_{key}"] = len(value)
    if "system" in body:
        shape["has_system"] = True
    prompt = body.get("prompt")
    if prompt is not None:
        shape["prompt_kind"] = "text" if isinstance(prompt, str) else "tokens"
    thinking = body.get("thinking")
    if isinstance(thinking, dict):
        shape["thinking"] = _enum("thinking", thinking.get("type"))
    if isinstance(body.get("enable_thinking"), bool):
        shape["enable_thinking"] = body["enable_thinking"]
    kwargs = body.get("chat_template_kwargs")
    if isinstance(kwargs, dict) and isinstance(kwargs.get("enable_thinking"), bool):
        shape["enable_thinking"] = kwargs["enable_thinking"]
    for holder in ("reasoning", "output_config"):
        effort = body.get(holder)
        if isinstance(effort, dict) and "effort" in effort:
            shape["reasoning_effort"] = _enum("effort", effort["effort"])
    if isinstance(body.get("reasoning_effort"), str):
        shape["reasoning_effort"] = _enum("effort", body["reasoning_effort"])
    choice = body.get("tool_choice")
    if choice is not None:
        shape["tool_choice"] = _enum("tool_choice", choice.get("type") if isinstance(choice, dict) else choice)
    return shape
