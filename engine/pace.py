"""How many prompt tokens a step may carry beside decoding rows.

Every decoding request waits for the whole step its token is in: beside a 512-token prompt chunk
of the 9B (about 25 ms) a decode step of 8 rows (6 ms) becomes a gap of 30 ms or more in each of
eight streams. ``StepPace`` keeps such a step within ``gap`` decode steps' time: it learns from
the steps it is shown what a step of decode rows alone takes and what prompt tokens add (a fixed
part and a part per token, a line through the steps seen), and caps the prompt tokens of a step
that has decode rows; where the fixed part alone passes the bound, it caps nothing (smaller
chunks would only repeat it). Where more requests wait for their first
token than decode, the bound widens in proportion: a burst of new prompts is served in full
chunks (those waiting outnumber the streams their steps slow), one long prompt beside many
streams in short ones.
"""
from __future__ import annotations


class StepPace:
    ALPHA = 0.25  # weight of the newest step in the running averages

    def __init__(self, gap: float, floor: int, most: int) -> None:
        self.gap = gap  # a step with prompt rows takes at most this many decode steps' time
        self.floor = floor  # the fewest prompt tokens a capped step carries
        self.most = most  # the step's token budget (the cap never exceeds it)
        self.decode_s: float | None = None  # a step of decode rows alone
        # what prompt tokens add to a step, ``fixed + per_token * tokens``: decayed sums over the
        # steps with prompt rows (weight, tokens, seconds, tokens^2, tokens * seconds)
        self._sums = [0.0] * 5

    def reset(self) -> None:
        """Forget what was learned (the warm-up's steps compile kernels: no measure of a step)."""
        self.decode_s = None
        self._sums = [0.0] * 5

    def observe(self, decode_rows: int, prompt_tokens: int, seconds: float) -> None:
        """A step of ``decode_rows`` decoding rows and ``prompt_tokens`` prompt tokens took
        ``seconds``, from the end of the step before it (the gap its decoding requests saw)."""
        if not prompt_tokens:
            if decode_rows:
                old = self.decode_s
                self.decode_s = seconds if old is None else old + self.ALPHA * (seconds - old)
            return
        base = self.decode_s if decode_rows and self.decode_s is not None else 0.0
        x, y = float(prompt_tokens), max(seconds - base, 0.0)
        keep = 1.0 - self.ALPHA
        self._sums = [keep * a + b for a, b in zip(self._sums, (1.0, x, y, x * x, x * y))]

    def cost(self) -> tuple[float, float] | None:
        """What prompt tokens add to a step: (fixed seconds, seconds a token), a line through the
        steps seen; where they were all of one size, nothing fixed (all of it per token). None
        before any."""
        w, sx, sy, sxx, sxy = self._sums
        if not w or not sx:
            return None
        mx, my = sx / w, sy / w
        var = sxx / w - mx * mx
        if var <= (0.05 * mx) ** 2:  # one size of step: the fixed part cannot be told apart
            return 0.0, my / mx
        per_token = max((sxy / w - mx * my) / var, 1e-9)
        return max(my - per_token * mx, 0.0), per_token

    def prompt_tokens(self, decoding: int, waiting: int) -> int:
        """The most prompt tokens for a step beside ``decoding`` decode rows while ``waiting``
        requests wait for their first token: the whole budget where no chunk of at least
        ``floor`` tokens keeps the step within the gap (its fixed cost alone passes it: cutting
        the prompt would only repeat that cost)."""
        cost = self.cost()
        if not decoding or not self.decode_s or cost is None:
            return self.most
        fixed, per_token = cost
        gap = self.gap * max(1.0, waiting / decoding)
        room = (gap - 1.0) * self.decode_s - fixed
        if room < per_token * self.floor:
            return self.most
        return min(self.most, int(room / per_token))
