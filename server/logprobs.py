"""Log-probabilities and logit bias as the APIs write them: what every family shares.

The engine publishes per output token a ``TokenLogprob`` (id, log-probability, the best
alternatives); here they become OpenAI's entries (``token``, ``logprob``, ``bytes``,
``top_logprobs``), legacy Completions' parallel lists and llama.cpp's ``completion_probabilities``.
A bias request (OpenAI's map of token-id strings, llama.cpp's list of pairs or map, ids or text)
becomes the engine's ``{id: bias}``, ``false`` or -inf meaning never.
"""
from __future__ import annotations

import codecs
import math
from typing import Any, Iterable

from ..engine.frontend.tokenizer import Tokenizer
from ..engine.outputs import RequestOutput, TokenLogprob
from ..engine.sampling_params import MAX_LOGIT_BIAS
from .errors import invalid
from .state import ServerState


class TokenText:
    """A token's text (its bytes decoded; a piece of a character written with ``\\x`` escapes) and
    bytes, each token looked up once per answer."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._seen: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token: int) -> tuple[str, list[int]]:
        found = self._seen.get(token)
        if found is None:
            raw = self.tokenizer.token_bytes(token)
            found = self._seen[token] = (raw.decode("utf-8", errors="backslashreplace"), list(raw))
        return found


def new_logprobs(out: RequestOutput) -> list[TokenLogprob]:
    """The output's log-probabilities (none where the engine published none, as on an error)."""
    return list(out.logprobs or [])


def openai_entries(text: TokenText, logprobs: Iterable[TokenLogprob], top: int) -> list[dict[str, Any]]:
    """Chat Completions' and Responses' ``logprobs.content``: per token its text, log-probability,
    bytes and its ``top`` best alternatives, most likely first."""
    out = []
    for lp in logprobs:
        token, raw = text(lp.token)
        alternatives = []
        for t, value in lp.top[:top]:
            alt, alt_raw = text(t)
            alternatives.append({"token": alt, "logprob": value, "bytes": alt_raw})
        out.append({"token": token, "logprob": lp.logprob, "bytes": raw, "top_logprobs": alternatives})
    return out


class LegacyLogprobs:
    """Legacy Completions' ``logprobs`` object, built as tokens arrive: ``tokens``,
    ``token_logprobs``, ``top_logprobs`` (the chosen token and the ``top`` best, by text) and
    ``text_offset`` (each token's place in the choice's text, from ``offset``: the length of the
    text the tokens before it decode to, a character they leave unfinished counting as one)."""

    def __init__(self, text: TokenText, top: int, offset: int = 0) -> None:
        self.text = text
        self.top = top
        self.offset = offset
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def add(self, logprobs: Iterable[TokenLogprob]) -> dict[str, Any]:
        """The object for these tokens (a stream's chunk; the whole answer at once for a body)."""
        body: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for lp in logprobs:
            token, _ = self.text(lp.token)
            best = {token: lp.logprob}
            for t, value in lp.top[:self.top]:
                best.setdefault(self.text(t)[0], value)
            body["tokens"].append(token)
            body["token_logprobs"].append(lp.logprob)
            body["top_logprobs"].append(best)
            unfinished = 1 if self._utf8.getstate()[0] else 0
            body["text_offset"].append(self.offset + unfinished)
            self.offset += len(self._utf8.decode(bytes(self.text(lp.token)[1])))
        return body


def llamacpp_entries(text: TokenText, logprobs: Iterable[TokenLogprob], after_sampling: bool) -> list[dict[str, Any]]:
    """llama.cpp's ``completion_probabilities``: per token ``id``, ``token``, ``bytes`` and
    ``logprob`` with ``top_logprobs``, or after sampling ``prob`` with ``top_probs`` (only
    candidates the sampling chain left a probability)."""
    key, top_key = ("prob", "top_probs") if after_sampling else ("logprob", "top_logprobs")

    def value(v: float) -> float:
        return math.exp(v) if after_sampling else v

    out = []
    for lp in logprobs:
        token, raw = text(lp.token)
        entry: dict[str, Any] = {"id": lp.token, "token": token, "bytes": raw, key: value(lp.logprob)}
        alternatives = []
        for t, v in lp.top:
            alt, alt_raw = text(t)
            alternatives.append({"id": t, "token": alt, "bytes": alt_raw, key: value(v)})
        entry[top_key] = alternatives
        out.append(entry)
    return out


# ---------------------------------------------------------------------------- logit bias
def _bias_value(value: Any, param: str, allow_false: bool) -> float:
    if value is False and allow_false:
        return -math.inf
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise invalid(param, "a bias must be a number" + (" or false" if allow_false else ""))
    if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
        raise invalid(param, f"a bias must be between -{MAX_LOGIT_BIAS:g} and {MAX_LOGIT_BIAS:g}, got {value!r}")
    return float(value)


def _check_id(state: ServerState, token: int, param: str) -> int:
    limit = state.engine.loop.token_limit
    if not 0 <= token < limit:
        raise invalid(param, f"token id {token} is out of range [0, {limit})")
    return token


def openai_logit_bias(state: ServerState, bias: dict[str, Any] | None, param: str = "logit_bias") -> dict[int, float]:
    """OpenAI's ``logit_bias``: token-id strings to a bias in [-100, 100]."""
    out: dict[int, float] = {}
    for key, value in (bias or {}).items():
        at = f"{param}.{key}"
        try:
            token = int(key)
        except ValueError:
            raise invalid(at, f"logit_bias keys are token ids, got {key!r}") from None
        out[_check_id(state, token, at)] = _bias_value(value, at, allow_false=False)
    return out


def llamacpp_logit_bias(state: ServerState, bias: Any, param: str = "logit_bias") -> dict[int, float]:
    """llama.cpp's ``logit_bias``: a list of ``[token, bias]`` pairs or a map ``{token: bias}``;
    a token is an id (or an id string, in a map) or a text whose every token gets the bias;
    ``false`` means never."""
    if bias is None:
        return {}
    if isinstance(bias, dict):
        pairs = [(f"{param}.{k}", k, v) for k, v in bias.items()]
    elif isinstance(bias, list):
        pairs = []
        for i, pair in enumerate(bias):
            if not isinstance(pair, list) or len(pair) != 2:
                raise invalid(f"{param}[{i}]", "each logit_bias entry is a [token, bias] pair")
            pairs.append((f"{param}[{i}]", pair[0], pair[1]))
    else:
        raise invalid(param, "logit_bias must be a list of [token, bias] pairs or an object")
    out: dict[int, float] = {}
    for at, key, value in pairs:
        weight = _bias_value(value, at, allow_false=True)
        if isinstance(key, str):
            try:
                key = int(key)
            except ValueError:
                pass
        if isinstance(key, bool) or not isinstance(key, (int, str)):
            raise invalid(at, "a logit_bias token is a token id or a text")
        ids = [key] if isinstance(key, int) else state.tokenizer.encode(key)
        if not ids:
            raise invalid(at, "the text has no tokens")
        for token in ids:
            out[_check_id(state, token, at)] = weight
    return out
