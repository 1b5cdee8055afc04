"""Token ids -> text, one token at a time, never emitting half a character.

A short window of ids is decoded each step: ``window[:read]`` is the last emitted piece, kept
as context so tokenizers whose decode depends on neighbours (SentencePiece's leading-space
marker) decode the new tokens as in the full text, and ``window[read:]`` is pending. New text is
``decode(window) - decode(window[:read])``; while it ends in U+FFFD, a multi-byte character may
still be split across tokens and it is held back. On emission the window slides forward.
"""
from __future__ import annotations

from typing import Sequence

from .tokenizer import Tokenizer

REPLACEMENT = "\ufffd"
PROMPT_CONTEXT = 6  # prompt tokens kept as context for the first generated tokens
MAX_PENDING = 8  # past this many held tokens, release what is provably complete


class IncrementalDetokenizer:
    """``push`` each generated id and stream what it returns; ``flush`` at the end.

    With no prompt, the pieces join to ``tokenizer.decode(generated)``; with ``prompt_ids`` they
    join to the text the generated ids add after the prompt (a leading space kept, for example).
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = ()) -> None:
        self.tokenizer = tokenizer
        start = max(len(prompt_ids) - PROMPT_CONTEXT, 0)
        self._ids: list[int] = [int(i) for i in prompt_ids[start:]]  # the window
        self._read = len(self._ids)  # ids before this are context, already emitted
        self._read_text = self._decode(0, self._read)

    def push(self, token_id: int) -> str:
        """Add one token; return the text that is now complete (possibly "")."""
        self._ids.append(token_id)
        text = self._decode(0, len(self._ids))
        if len(text) > len(self._read_text) and not text.endswith(REPLACEMENT):
            return self._advance(len(self._ids), text)
        if len(self._ids) - self._read > MAX_PENDING:
            return self._release_complete(text)
        return ""

    def flush(self) -> str:
        """Return held-back text; bytes that never formed a character come out as U+FFFD."""
        if self._read == len(self._ids):
            return ""
        return self._advance(len(self._ids), self._decode(0, len(self._ids)))

    @property
    def pending(self) -> int:
        """Tokens received whose text has not been returned yet."""
        return len(self._ids) - self._read

    def _decode(self, start: int, end: int) -> str:
        return self.tokenizer.decode(self._ids[start:end]) if end > start else ""

    def _advance(self, read: int, text: str) -> str:
        """Return ``text`` (the decode of ``window[:read]``) past what was emitted; slide the window."""
        piece = text[len(self._read_text):]
        del self._ids[: self._read]  # the tokens just emitted become the new context
        self._read = read - self._read
        self._read_text = self._decode(0, self._read)
        return piece

    def _release_complete(self, text: str) -> str:
        """Many tokens held (genuinely invalid bytes): emit up to the last clean character boundary.

        A cut is clean when decoding both sides separately gives the same text as decoding
        together, so no character straddles it and the text before it can no longer change.
        """
        for cut in range(len(self._ids) - 1, self._read, -1):
            head = self._decode(0, cut)
            if head + self._decode(cut, len(self._ids)) == text and len(head) > len(self._read_text):
                return self._advance(cut, head)
        return ""
