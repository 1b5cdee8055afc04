"""Separates a model's reasoning from its answer in streamed output text.

Qwen3.5 / Qwen3.6 write ``reasoning\\n</think>\\n\\nanswer``; the opening ``<think>\\n`` is already in
the prompt when thinking is on (``starts_in_reasoning``), so the output begins inside the block
and only the close tag appears. Models whose prompt does not open the block may still begin
their output with ``<think>``; that opening is recognised before any other output text.

The split does not depend on how the text was chunked: a suffix that could be the start of a
tag is held back until the next ``push`` decides it. The separators around the close tag (one
newline before it, the newlines after it) belong to neither channel; every other byte ends up in
exactly one of them.

    parser = ReasoningParser(starts_in_reasoning=prompt.endswith("<think>\\n"))
    for piece in pieces:
        delta = parser.push(piece)      # ReasoningDelta(reasoning=..., content=...)
    delta = parser.finish()             # what was held back, at the end of the output
"""
from __future__ import annotations

from dataclasses import dataclass

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"


@dataclass(frozen=True)
class ReasoningDelta:
    """Text that became safe to show in each channel by one ``push`` (either may be "")."""

    reasoning: str = ""
    content: str = ""

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content)


def prompt_opens_reasoning(prompt: str, open_tag: str = THINK_OPEN) -> bool:
    """True when a rendered prompt ends inside an open reasoning block (``...<think>\\n``)."""
    return prompt.rstrip("\n").endswith(open_tag)


class ReasoningParser:
    """Streaming splitter of model text into ``reasoning`` and ``content``.

    ``starts_in_reasoning``: the prompt ended with an open ``<think>`` (see
    ``prompt_opens_reasoning``). Otherwise output is content, unless its first non-blank text is
    ``open_tag``. Once the block is closed everything after it is content, tags included.
    """

    def __init__(self, starts_in_reasoning: bool, open_tag: str = THINK_OPEN, close_tag: str = THINK_CLOSE) -> None:
        self.open_tag = open_tag
        self.close_tag = close_tag
        self._close_with_newline = "\n" + close_tag
        self._mode = "reasoning" if starts_in_reasoning else "start"  # start | reasoning | content
        self._held = ""
        self._strip_newlines = False  # drop the newlines that follow an open or close tag
        self.closed = False  # a reasoning block was closed (by the model or a forced close)

    @property
    def in_reasoning(self) -> bool:
        """The text pushed so far ends inside the reasoning block."""
        return self._mode == "reasoning"

    def push(self, text: str) -> ReasoningDelta:
        """Add model text; return what is now safe to emit in each channel."""
        reasoning: list[str] = []
        content: list[str] = []
        buf = self._held + text
        self._held = ""
        while buf:
            if self._mode == "start":
                stripped = buf.lstrip()
                if stripped.startswith(self.open_tag):
                    self._mode = "reasoning"
                    self._strip_newlines = True  # the newline after the open tag is a separator
                    buf = stripped[len(self.open_tag):]
                elif self.open_tag.startswith(stripped):  # blank, or a prefix of the open tag
                    self._held = buf
                    buf = ""
                else:
                    self._mode = "content"
            elif self._mode == "reasoning":
                if self._strip_newlines:
                    buf = buf.lstrip("\n")
                    if not buf:
                        break
                    self._strip_newlines = False
                end = buf.find(self.close_tag)
                if end < 0:
                    hold = _partial_suffix(buf, (self._close_with_newline, self.close_tag))
                    reasoning.append(buf[: len(buf) - hold])
                    self._held = buf[len(buf) - hold:]
                    buf = ""
                else:
                    before = buf[:end]
                    reasoning.append(before[:-1] if before.endswith("\n") else before)
                    buf = buf[end + len(self.close_tag):]
                    self._mode = "content"
                    self._strip_newlines = True
                    self.closed = True
            else:
                if self._strip_newlines:
                    buf = buf.lstrip("\n")
                    if not buf:
                        break
                    self._strip_newlines = False
                content.append(buf)
                buf = ""
        return ReasoningDelta("".join(reasoning), "".join(content))

    def finish(self) -> ReasoningDelta:
        """End of output: release held text (an unclosed block stays reasoning)."""
        held, self._held = self._held, ""
        if self._mode == "reasoning":
            return ReasoningDelta(reasoning=held)
        return ReasoningDelta(content=held)


def split_reasoning(text: str, starts_in_reasoning: bool) -> ReasoningDelta:
    """The whole output at once: ``(reasoning, content)`` exactly as streaming would give them."""
    parser = ReasoningParser(starts_in_reasoning)
    first, last = parser.push(text), parser.finish()
    return ReasoningDelta(first.reasoning + last.reasoning, first.content + last.content)


def _partial_suffix(buf: str, markers: tuple[str, ...]) -> int:
    """Length of the longest suffix of ``buf`` that is a proper prefix of one of ``markers``."""
    longest = min(len(buf), max(len(m) for m in markers) - 1)
    for n in range(longest, 0, -1):
        tail = buf[-n:]
        if any(m.startswith(tail) for m in markers):
            return n
    return 0
