"""Constrained decoding: a request's output held to a grammar, token by token.

A ``GrammarSpec`` (what the API asked for: any JSON object, a JSON schema, a regular expression, a
choice of strings, an EBNF / GBNF grammar, tool calls held to their schemas) travels in the
request's ``SamplingParams``; the server checks it when the request comes in
(``GrammarSpec.check``: a bad schema is the client's 400, not a failed request). In the engine,
``Grammars`` compiles it against the vocabulary on a thread of its own (xgrammar, which keeps
compiled grammars by their source: a schema sent again costs nothing), so a slow schema never holds
a step; the request joins the scheduler when its grammar is ready. Each constrained request holds a
``GrammarState`` (its matcher): before a token is drawn the matcher writes the row's allowed ids as
a bitmask, which is applied to the logits on the device (``constrain``), and every committed token
moves it on. Output that starts inside a reasoning block is free until the block closes; the
grammar holds from the token after.

xgrammar was measured against llguidance on the Qwen vocabulary (``python -m bench.grammar``): a
mask and a step of the matcher in 10 us a token against 26, a compiled schema cached by the
library, and the mask applied by one kernel on CUDA.
"""
from __future__ import annotations

import json
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from .frontend.tool_parser import CALL_CLOSE, CALL_OPEN

KINDS = ("json", "json_schema", "regex", "choice", "ebnf", "structural_tag")
# added tokens a grammar may write, as the text they stand for (the output parser reads it)
WRITTEN_MARKERS = frozenset([CALL_OPEN, CALL_CLOSE])


class GrammarError(ValueError):
    """A grammar that cannot be compiled; ``param`` names the request field it came from."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class GrammarSpec:
    """What a request's output must match. ``kind``: ``json`` (any JSON object), ``json_schema``
    (``source``: the schema as JSON text), ``regex``, ``choice`` (``source``: a JSON list of
    the strings allowed), ``ebnf`` (GBNF, llama.cpp's grammar syntax; the rule ``root`` starts),
    ``structural_tag`` (an xgrammar structural tag as JSON text: tool calls, ``tool_grammar.py``).
    ``param``: the request field it came from, for errors."""

    kind: str
    source: str = ""
    param: str = "response_format"

    @classmethod
    def json_schema(cls, schema: Any, param: str) -> GrammarSpec:
        if isinstance(schema, bool) or not isinstance(schema, (dict, str)):
            raise GrammarError(param, f"{param} must be a JSON schema object")
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as exc:
                raise GrammarError(param, f"{param} is not valid JSON: {exc}") from None
            if not isinstance(schema, dict):
                raise GrammarError(param, f"{param} must be a JSON schema object")
        # in its own order: the properties are written in it
        return cls("json_schema", json.dumps(schema, separators=(",", ":")), param)

    @classmethod
    def choice(cls, options: Any, param: str) -> GrammarSpec:
        if not isinstance(options, list) or not options or not all(isinstance(o, str) and o for o in options):
            raise GrammarError(param, f"{param} must be a non-empty list of non-empty strings")
        return cls("choice", json.dumps(options), param)

    def check(self) -> None:
        """Raise ``GrammarError`` when the grammar cannot be built (no vocabulary needed)."""
        grammar(self)

    def ebnf(self) -> str:
        """The grammar as EBNF (choices only; the others compile from their own source)."""
        options = json.loads(self.source)
        return "root ::= " + " | ".join(json.dumps(o) for o in options)


def grammar(spec: GrammarSpec) -> Any:
    """``spec`` as an ``xgrammar.Grammar`` (vocabulary-free), or ``GrammarError``."""
    import xgrammar as xgr

    if spec.kind not in KINDS:
        raise GrammarError(spec.param, f"unknown grammar kind {spec.kind!r}")
    try:
        if spec.kind == "json":
            return xgr.Grammar.builtin_json_grammar()
        if spec.kind == "json_schema":
            return xgr.Grammar.from_json_schema(spec.source, any_whitespace=False)
        if spec.kind == "regex":
            return xgr.Grammar.from_regex(spec.source)
        if spec.kind == "structural_tag":
            return xgr.Grammar.from_structural_tag(spec.source)
        return xgr.Grammar.from_ebnf(spec.ebnf() if spec.kind == "choice" else spec.source)
    except Exception as exc:  # noqa: BLE001 - xgrammar raises RuntimeError / ValueError subclasses
        raise GrammarError(spec.param, f"{spec.param} cannot be compiled: {_first_line(exc)}") from None


def _first_line(exc: Exception) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:300] if text else type(exc).__name__


class GrammarState:
    """One request's matcher. ``active``: whether the grammar holds now (not before a reasoning
    block that the output starts in has closed); ``failed``: a committed token it refused (a
    token forced past it), after which it no longer constrains."""

    def __init__(self, matcher: Any, active: bool) -> None:
        self.matcher = matcher
        self.active = active
        self.failed = False

    @property
    def constrains(self) -> bool:
        return self.active and not self.failed and not self.matcher.is_terminated()

    def accept(self, token: int) -> None:
        if self.constrains and not self.matcher.accept_token(token):
            self.failed = True


class Grammars:
    """Compiles grammars for one vocabulary on a thread of its own; ``vocab_size``: the logits'
    width (ids past the tokenizer's are never allowed)."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._compiler: Any = None
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")

    def compile(self, spec: GrammarSpec) -> Future:
        """A future of the compiled grammar (raises ``GrammarError``)."""
        return self._pool.submit(self._compile, spec)

    def matcher(self, compiled: Any, stop_ids: Sequence[int], active: bool) -> GrammarState:
        import xgrammar as xgr

        return GrammarState(xgr.GrammarMatcher(compiled, override_stop_tokens=sorted(stop_ids) or None), active)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _compile(self, spec: GrammarSpec) -> Any:
        compiler = self._vocabulary()
        try:
            if spec.kind == "json":
                return compiler.compile_builtin_json_grammar()
            if spec.kind == "json_schema":
                return compiler.compile_json_schema(spec.source, any_whitespace=False)
            if spec.kind == "regex":
                return compiler.compile_regex(spec.source)
            if spec.kind == "structural_tag":
                return compiler.compile_structural_tag(spec.source)
            return compiler.compile_grammar(spec.ebnf() if spec.kind == "choice" else spec.source)
        except Exception as exc:  # noqa: BLE001
            raise GrammarError(spec.param, f"{spec.param} cannot be compiled: {_first_line(exc)}") from None

    def _vocabulary(self) -> Any:
        """The compiler over the tokenizer's vocabulary, built on first use (a third of a second
        for Qwen's 248K ids): every id as the bytes it stands for, control tokens (``<|im_end|>``,
        ``<think>``) as none, so no grammar lets them be written as text; but the tool-call tags
        (``WRITTEN_MARKERS``), one token each in Qwen's vocabulary, stand for their text, so that
        a grammar of calls lets the model write them as it was trained to, not spelled in pieces."""
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr

                tok = self.tokenizer
                control = {i for s in tok.control_strings() if s not in WRITTEN_MARKERS
                           and (i := tok.token_to_id(s)) is not None}
                known = min(tok.vocab_size, self.vocab_size)
                raw = [b"" if i in control else tok.token_bytes(i) for i in range(known)]
                raw += [b""] * (self.vocab_size - known)
                info = xgr.TokenizerInfo(raw, xgr.VocabType.RAW, vocab_size=self.vocab_size)
                self._compiler = xgr.GrammarCompiler(info, max_threads=2)
            return self._compiler


def constrain(logits: torch.Tensor, states: Sequence[GrammarState | None]) -> None:
    """Mask, in place, the ids each row's grammar does not allow now (rows whose state is None
    or does not constrain are left as they are): the bitmask is filled on the host, copied
    without a wait and applied on the logits' device."""
    import xgrammar as xgr

    rows = [i for i, s in enumerate(states) if s is not None and s.constrains]
    if not rows:
        return
    vocab = logits.shape[-1]
    mask = xgr.allocate_token_bitmask(len(rows), vocab)
    for j, i in enumerate(rows):
        states[i].matcher.fill_next_token_bitmask(mask, j)
    if logits.device.type == "cuda":
        mask = mask.pin_memory().to(logits.device, non_blocking=True)
    xgr.apply_token_bitmask_inplace(logits, mask, vocab_size=vocab,
                                    indices=None if len(rows) == len(states) else rows)
