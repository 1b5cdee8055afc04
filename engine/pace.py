"""How many prompt tokens a step may carry beside decoding rows.

Every decoding request waits for the whole step its token is in: beside a 512-token prompt chunk
of the 9B (about 25 ms) a decode step of 8 rows (6 ms) becomes a gap of 30 ms or more in each of
eight streams. ``StepPace`` keeps such a step within ``gap`` decode steps' time: it learns from
the steps it is shown what a step of decode rows alone takes and what each prompt token adds, and
caps the prompt tokens of a step that has decode rows. Where more requests wait for their first
token than decode, the bound widens in proportion: a burst of new prompts is served in full
chunks (those waiting outnumber the streams their steps slow), one long prompt beside many
streams in short ones.
"""
from __future__ import annotations


class StepPace:
    ALPHA = 0.25  # weight of the newest step in the running averages

    def __init__(self, gap: float, floor: int, most: int) -> None:
        self.gap = gap  # a step with prompt rows takes at most this many decode steps' time
        self.floor = floor  # the fewest prompt tokens a step may carry (prompts always advance)
        self.most = most  # the step's token budget (the cap never exceeds it)
        self.decode_s: float | None = None  # a step of decode rows alone
        self.per_token_s: float | None = None  # what one prompt token adds to a step

    def reset(self) -> None:
        """Forget what was learned (the warm-up's steps compile kernels: no measure of a step)."""
        self.decode_s = self.per_token_s = None

    def _mean(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.ALPHA * (new - old)

    def observe(self, decode_rows: int, prompt_tokens: int, seconds: float) -> None:
        """A step of ``decode_rows`` decoding rows and ``prompt_tokens`` prompt tokens took
        ``seconds``, from the end of the step before it (the gap its decoding requests saw)."""
        if not prompt_tokens:
            if decode_rows:
                self.decode_s = self._mean(self.decode_s, seconds)
            return
        base = self.decode_s if decode_rows and self.decode_s is not None else 0.0
        self.per_token_s = self._mean(self.per_token_s, max(seconds - base, 0.0) / prompt_tokens)

    def prompt_tokens(self, decoding: int, waiting: int) -> int:
        """The most prompt tokens for a step beside ``decoding`` decode rows while ``waiting``
        requests wait for their first token."""
        if not decoding or not self.decode_s or not self.per_token_s:
            return self.most
        gap = self.gap * max(1.0, waiting / decoding)
        n = int((gap - 1.0) * self.decode_s / self.per_token_s)
        return max(self.floor, min(self.most, n))
