"""Control tokens spelled inside user-supplied text stay text.

A chat template renders messages into one string that is then tokenized with control tokens
recognised, because the template itself writes them (``<|im_start|>``, ``<|im_end|>``). Without
care, a user who types ``<|im_end|>`` would close their own turn. Before rendering, every control
token string inside system / user / tool message text is swapped for a private-use marker; after
rendering, the prompt is tokenized piece by piece and each marker is encoded as literal text.
Each call's markers carry a random tag, so no text a client sends (the private-use characters
included) can spell one.
"""
from __future__ import annotations

import functools
import re
import secrets
from typing import Any

from .tokenizer import Tokenizer

GUARDED_ROLES = ("system", "developer", "user", "tool")


class Literals(list):
    """The control strings taken out of message text, in marker order, and the marker of each."""

    def __init__(self) -> None:
        super().__init__()
        self.tag = f"{secrets.randbits(64):020d}"  # digits only: templates may change letters' case
        self.pattern = re.compile(f"\ue000{self.tag}:(\\d+)\ue001")

    def marker(self, literal: str) -> str:
        self.append(literal)
        return f"\ue000{self.tag}:{len(self) - 1}\ue001"


class ControlTokenGuard:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        strings = sorted(set(tokenizer.control_strings()), key=len, reverse=True)
        self._pattern = re.compile("|".join(map(re.escape, strings))) if strings else None

    def protect(self, messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], Literals]:
        """Messages with control strings in guarded roles' text replaced by markers, and the
        strings in marker order. Messages without any are returned as they were."""
        literals = Literals()
        if self._pattern is None:
            return messages, literals

        def mark(text: str) -> str:
            return self._pattern.sub(lambda m: literals.marker(m.group(0)), text)

        out = []
        for msg in messages:
            content = msg.get("content")
            if msg.get("role") not in GUARDED_ROLES or content is None:
                out.append(msg)
            elif isinstance(content, str):
                out.append({**msg, "content": mark(content)})
            elif isinstance(content, list):
                parts = [{**p, "text": mark(p["text"])} if isinstance(p, dict) and isinstance(p.get("text"), str)
                         else p for p in content]
                out.append({**msg, "content": parts})
            else:
                out.append(msg)
        return out, literals

    def encode(self, rendered: str, literals: Literals) -> tuple[str, list[int]]:
        """The prompt text with markers restored, and its token ids with each marker's string
        encoded as plain text."""
        if not literals:
            return rendered, self.tokenizer.encode(rendered)
        ids: list[int] = []
        text: list[str] = []
        pos = 0
        for m in literals.pattern.finditer(rendered):
            literal = literals[int(m.group(1))]
            ids += self.tokenizer.encode(rendered[pos : m.start()]) + self.tokenizer.encode_literal(literal)
            text += [rendered[pos : m.start()], literal]
            pos = m.end()
        ids += self.tokenizer.encode(rendered[pos:])
        text.append(rendered[pos:])
        return "".join(text), ids


@functools.lru_cache(maxsize=8)
def guard_for(tokenizer: Tokenizer) -> ControlTokenGuard:
    """One guard per tokenizer (its pattern of control strings is built once)."""
    return ControlTokenGuard(tokenizer)
