"""Stop strings over streamed text.

Text that could be the start of a stop string is held back until it either completes the stop
or cannot any more, so a stop split across tokens (or ``push`` calls) is still caught and never
partly emitted. When several stops could match, the one that completes first wins (the longest
of those ending at the same place), so the result does not depend on how the text was chunked.
"""
from __future__ import annotations

from typing import Sequence


class StopMatcher:
    def __init__(self, stops: Sequence[str]) -> None:
        if isinstance(stops, str):
            raise TypeError("stops must be a sequence of strings, not a single string")
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        self.stops: tuple[str, ...] = tuple(dict.fromkeys(stops))  # unique, order kept
        self.matched: str | None = None  # the stop string found, once found
        self._held = ""

    @property
    def stopped(self) -> bool:
        return self.matched is not None

    def push(self, text: str) -> tuple[str, str | None]:
        """Return (text safe to emit now, matched stop or None); nothing more after a match."""
        if self.stopped:
            return "", None
        buffer = self._held + text
        match = self._first_match(buffer)
        if match is not None:
            start, stop = match
            self.matched, self._held = stop, ""
            return buffer[:start], stop
        hold = self._partial_suffix(buffer)
        self._held = buffer[len(buffer) - hold:] if hold else ""
        return buffer[: len(buffer) - hold], None

    def flush(self) -> str:
        """Release held-back text at the end of the stream (no stop completed)."""
        held, self._held = self._held, ""
        return "" if self.stopped else held

    def _first_match(self, buffer: str) -> tuple[int, str] | None:
        """(start, stop) of the occurrence that ends first; ties go to the one starting first."""
        best: tuple[int, int, str] | None = None
        for stop in self.stops:
            start = buffer.find(stop)
            if start < 0:
                continue
            key = (start + len(stop), start, stop)
            if best is None or key[:2] < best[:2]:
                best = key
        return None if best is None else (best[1], best[2])

    def _partial_suffix(self, buffer: str) -> int:
        """Length of the longest suffix of ``buffer`` that is a proper prefix of some stop."""
        longest = min(len(buffer), max((len(s) for s in self.stops), default=1) - 1)
        for n in range(longest, 0, -1):
            tail = buffer[-n:]
            if any(len(s) > n and s.startswith(tail) for s in self.stops):
                return n
        return 0
