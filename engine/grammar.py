"""Constrained decoding: a request's output held to a grammar, token by token.

A ``GrammarSpec`` (what the API asked for: any JSON object, a JSON schema, a regular expression, a
choice of strings, an EBNF / GBNF grammar, tool calls held to their schemas) travels in the
request's ``SamplingParams``; the server checks it when the request comes in
(``GrammarSpec.check``: a bad schema is the client's 400, not a failed request). In the engine,
``Grammars`` compiles it against the vocabulary on a thread of its own (xgrammar, which keeps
compiled grammars by their source: a schema sent again costs nothing), so a slow schema never holds
a step; the request joins the scheduler when its grammar is ready. Each constrained request holds a
``GrammarState`` (its matcher): before a token is drawn the matchers write their rows' allowed ids
as bitmasks (``GrammarMasks``: on several threads, into buffers kept between steps), which are
applied to the logits on the device (``apply_bitmask``), and every committed token moves its
matcher on. A decode step launched ahead runs its forward before the step it follows has been
read; its rows under a grammar are drawn once the matchers have taken that step's tokens
(``runner.py``). Output that starts inside a reasoning block is free until the block closes;
the grammar holds from the token after.

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


class GrammarMasks:
    """The bitmasks of a step's rows under a grammar (one bit per id: allowed or not), in buffers
    kept from step to step: on CUDA two pinned host buffers used in turn (one is refilled only
    once its last copy to the device is done) and one device buffer the copy lands in; on the
    CPU one buffer. Sized for ``rows`` rows (the engine's concurrency) on first use, grown if a
    step has more. The matchers fill their rows on several threads (xgrammar's batch matcher):
    a mask costs from a few microseconds (most JSON states) to over half a millisecond (a
    regular expression's character class over Qwen's 248K ids) a row."""

    def __init__(self, device: torch.device, rows: int = 8) -> None:
        self.device = device
        self.rows = max(1, rows)
        self._host: list[torch.Tensor] = []
        self._copied: list[Any] = []  # per host buffer, the event of its last copy (CUDA)
        self._dev: torch.Tensor | None = None
        self._turn = 0
        self._batch: Any = None

    def fill(self, states: Sequence[GrammarState | None], vocab: int) -> torch.Tensor:
        """``[len(states), ceil(vocab / 32)]`` int32 on the device: row ``i`` the ids
        ``states[i]`` allows now, every id where it is None. Valid until the next call."""
        n = len(states)
        host = self._buffer(n, (vocab + 31) // 32)[:n]
        held = [i for i, s in enumerate(states) if s is not None]
        for i, s in enumerate(states):
            if s is None:
                host[i].fill_(-1)
        if len(held) == 1:
            states[held[0]].matcher.fill_next_token_bitmask(host, held[0])
        elif held:
            self._matcher().batch_fill_next_token_bitmask([states[i].matcher for i in held], host, held)
        if self._dev is None:
            return host
        dev = self._dev[:n]
        dev.copy_(host, non_blocking=True)
        if self._copied[self._turn] is None:
            self._copied[self._turn] = torch.cuda.Event()
        self._copied[self._turn].record()
        return dev

    def _buffer(self, n: int, words: int) -> torch.Tensor:
        if not self._host or self._host[0].shape[0] < n or self._host[0].shape[1] != words:
            rows = max(n, self.rows, 2 * self._host[0].shape[0] if self._host else 0)
            cuda = self.device.type == "cuda"
            with torch.inference_mode(False):  # written in and out of inference mode
                self._host = [torch.empty(rows, words, dtype=torch.int32, pin_memory=cuda) for _ in range(1 + cuda)]
                self._dev = torch.empty(rows, words, dtype=torch.int32, device=self.device) if cuda else None
            self._copied = [None] * len(self._host)
        self._turn = (self._turn + 1) % len(self._host)
        if self._copied[self._turn] is not None:
            self._copied[self._turn].synchronize()  # its copy two steps ago: long done
        return self._host[self._turn]

    def _matcher(self) -> Any:
        if self._batch is None:
            import os

            import xgrammar as xgr

            self._batch = xgr.BatchGrammarMatcher(max(1, min(8, os.cpu_count() or 1)))
        return self._batch


class _Unpacked:
    """The CPU's mask lookup, per logits dtype: each mask byte's eight additive values (0 where
    the bit is set, -inf where not) and scratch for a step's worth, kept (a fresh 8 MB a step
    costs its page faults again)."""

    def __init__(self, dtype: torch.dtype) -> None:
        bits = (torch.arange(256).unsqueeze(-1) >> torch.arange(8)) & 1  # byte -> its bits, lowest first
        self.table = torch.where(bits == 1, 0.0, float("-inf")).to(dtype)
        self.index = torch.empty(0, dtype=torch.int32)
        self.values = torch.empty(0, 8, dtype=dtype)

    def additive(self, mask: torch.Tensor) -> torch.Tensor:
        """``[n, 32 * words]``: 0 at the ids ``mask`` ``[n, words]`` allows, -inf elsewhere."""
        packed = mask.contiguous().view(torch.uint8).view(-1)
        if self.index.numel() < packed.numel():
            with torch.inference_mode(False):  # written in and out of inference mode
                self.index = torch.empty(packed.numel(), dtype=torch.int32)
                self.values = torch.empty(packed.numel(), 8, dtype=self.table.dtype)
        index, values = self.index[: packed.numel()], self.values[: packed.numel()]
        index.copy_(packed)
        torch.index_select(self.table, 0, index, out=values)
        return values.view(mask.shape[0], -1)


_UNPACKED: dict[torch.dtype, _Unpacked] = {}


def apply_bitmask(logits: torch.Tensor, mask: torch.Tensor) -> None:
    """-inf, in place, at the ids each row of ``logits`` ``[n, V]`` has no bit for in its row of
    ``mask`` ``[n, ceil(V / 32)]`` (on the logits' device). On CUDA xgrammar's kernel; on the CPU
    each mask byte looked up as eight additive values (0 or -inf) and added, several times
    faster than xgrammar's CPU loop on Qwen's vocabulary; a NaN that makes (an allowed NaN, or
    -inf added to +inf) is -inf."""
    if logits.device.type == "cuda":
        import xgrammar as xgr

        xgr.apply_token_bitmask_inplace(logits, mask, vocab_size=logits.shape[-1])
        return
    unpacked = _UNPACKED.get(logits.dtype)
    if unpacked is None:
        unpacked = _UNPACKED[logits.dtype] = _Unpacked(logits.dtype)
    logits.add_(unpacked.additive(mask)[:, : logits.shape[-1]])
    logits.nan_to_num_(nan=float("-inf"), posinf=float("inf"), neginf=float("-inf"))


def constrain(logits: torch.Tensor, states: Sequence[GrammarState | None]) -> None:
    """Mask, in place, the ids each row's grammar does not allow now (rows whose state is None
    or does not constrain are left as they are), with buffers of its own (the engine's sampler
    keeps a ``GrammarMasks``)."""
    held = [s if s is not None and s.constrains else None for s in states]
    if any(s is not None for s in held):
        apply_bitmask(logits, GrammarMasks(logits.device, len(held)).fill(held, logits.shape[-1]))
