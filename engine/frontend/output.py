"""Turns a request's generated token ids into text deltas, honouring stop strings."""
from __future__ import annotations

from typing import Sequence

from .detokenizer import IncrementalDetokenizer
from .stop import StopMatcher
from .tokenizer import Tokenizer


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer, stops: Sequence[str], prompt_ids: Sequence[int] = ()) -> None:
        self._detok = IncrementalDetokenizer(tokenizer, prompt_ids)
        self._stops = StopMatcher(stops) if stops else None

    def push(self, token_id: int) -> tuple[str, str | None]:
        """Text now safe to show for ``token_id``, and the stop string it completed (if any)."""
        text = self._detok.push(token_id)
        if self._stops is None:
            return text, None
        return self._stops.push(text)

    def flush(self) -> str:
        """Everything held back, at the natural end of a request (never after a stop string)."""
        text = self._detok.flush()
        if self._stops is None:
            return text
        emitted, matched = self._stops.push(text)
        return emitted if matched is not None else emitted + self._stops.flush()
