"""Steps replayed from CUDA graphs in pieces, one set of pieces per token-count bucket: those with
prompt rows, and (``--spec mtp``, where no other graph runs) those of decode and verify rows.

What a step computes token by token (the embedding, every projection, norm, MLP and MoE, the
final norm) depends only on how many tokens it holds; what its token mixers compute over their
rows (attention's K/V write and its decode and prompt kernels, the Gated DeltaNet's conv and
recurrence from the state slots: the backends' ``step``) depends on the rows. So a step of at
most the largest bucket's tokens runs as the graphs captured for the smallest bucket that holds
it (of its kind: with prompt rows, or without, whose token-wise work differs a little): the
pieces between the token mixers' cores replayed, each core called eagerly between them on the
step's real tokens with the step's own description, its result copied into the static tensor
the next piece reads. The pieces are captured once, at
engine build, with the cores cut out (``_Capture``: a layer's backend stands in for the real one
while the forward runs, ends the piece, and hands back the static output); the padding tokens
past the step's own run through the pieces (finite values, whatever the last step left) and
never reach a core, the KV pages or the state slots.

A bucket's pieces take one launch each from the host instead of one per kernel: at the 9B
shape a layer's projections, norms, residual adds and MLP, about a dozen launches, become one
replay, and only the cores pay Python's cost per kernel.

Steps that stay eager: images (embeddings placed in the run, three-axis positions), embedding
requests (their final hidden states outlive the step), tensor parallelism, and more tokens than
the largest bucket (long prompt chunks are GPU-bound). Steps of decode rows only and of decode
and verify rows have whole graphs of their own (``cuda_graphs.py``, ``cuda_graph_verify.py``),
except with the MTP head, whose drafts take every step's final hidden states (a view of the
bucket's static output, read before the next step runs): there those steps take the pieces.
"""
from __future__ import annotations

import contextlib
import logging
from typing import Callable

import torch

from .models.base import CausalLM, ForwardBatch, PromptRows, StepMeta

log = logging.getLogger("ninfer.engine")

BUCKETS = (16, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048)  # at most a third of padding above 32


class _Core:
    """One token mixer's call: its layer, its token-major inputs (static tensors the piece
    before it leaves) and the static output the piece after it reads."""

    def __init__(self, layer, inputs: tuple, out: torch.Tensor, attention: bool) -> None:
        self.layer, self.inputs, self.out, self.attention = layer, inputs, out, attention

    def run(self, n: int, batch: ForwardBatch) -> None:
        """The real backend's step over the first ``n`` tokens, with the step's description."""
        layer, meta = self.layer, batch.step
        if self.attention:
            q, k, v = (x[:n] for x in self.inputs)
            out = layer.backend.step(layer, q, k, v, batch.positions, meta, batch.memo)
        else:
            groups, z, a, b = self.inputs
            out = layer.backend.step(layer, tuple(g[:n] for g in groups), z[:n], a[:n], b[:n], meta)
        self.out[:n].copy_(out)


class _Capture:
    """Stands in for the layers' backends while a bucket's forward runs: at each token mixer's
    step it ends the piece being captured (``cut``), records the core and returns its static
    output; without a capture (the warm-up run) it only hands the outputs back."""

    def __init__(self, outputs: list[torch.Tensor], cut: Callable[[], None] | None) -> None:
        self.outputs, self.cut, self.cores = outputs, cut, []

    def _out(self, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        i = len(self.cores)
        if i == len(self.outputs):  # the warm-up run: made here, outside any capture
            self.outputs.append(torch.zeros(shape, dtype=like.dtype, device=like.device))
        return self.outputs[i]

    def attention(self, layer, q, k, v, positions, meta, memo) -> torch.Tensor:
        out = self._out((q.shape[0], layer.num_heads, layer.head_dim), q)
        self._record(_Core(layer, (q, k, v), out, attention=True))
        return out

    def linear_attention(self, layer, groups, z, a, b, meta) -> torch.Tensor:
        out = self._out((z.shape[0], layer.value_dim), z)
        self._record(_Core(layer, (tuple(groups), z, a, b), out, attention=False))
        return out

    def _record(self, core: _Core) -> None:
        self.cores.append(core)
        if self.cut is not None:
            self.cut()


class _Stand:
    """A layer's backend while a forward is captured: its ``step`` is the capture's."""

    def __init__(self, step) -> None:
        self.step = step


def _mixers(model: torch.nn.Module):
    from .layers.attention import Attention
    from .layers.gated_delta_net import GatedDeltaNet

    for module in model.modules():
        if isinstance(module, (Attention, GatedDeltaNet)):
            yield module, isinstance(module, Attention)


class _Bucket:
    def __init__(self, pieces: list, cores: list[_Core], hidden: torch.Tensor) -> None:
        self.pieces, self.cores, self.hidden = pieces, cores, hidden


def piece_tokens(setting: int, step_tokens: int) -> int:
    """The largest bucket worth capturing: the launch setting ``mixed_graph_tokens``, or less where
    the engine's step budget never fills it (the smallest bucket that holds a whole step)."""
    fits = [b for b in BUCKETS if b >= step_tokens]
    return min(setting, fits[0] if fits else BUCKETS[-1])


PROMPT, ROWS = "prompt", "rows"  # the kinds of step: with prompt rows, or of decode and verify rows only


class MixedGraphs:
    """The pieces of every bucket up to ``max_tokens`` for each of ``kinds``, and a step's run
    through them.

    ``graph`` makes a graph (``torch.cuda.CUDAGraph``; tests on a CPU give a recording of the
    pieces' operations that replays them over the same tensors), ``pool`` the memory pool the
    captures share (the decode graphs', when there are some)."""

    def __init__(self, model: CausalLM, device: torch.device, max_tokens: int,
                 graph: Callable[[], object] | None = None, pool=None, kinds: tuple[str, ...] = (PROMPT,)) -> None:
        self.model, self.device, self.kinds = model, device, kinds
        self.buckets = [b for b in BUCKETS if b <= max_tokens]
        self.graph = graph or torch.cuda.CUDAGraph
        self.pool = pool if pool is not None or device.type != "cuda" else torch.cuda.graph_pool_handle()
        top = self.buckets[-1] if self.buckets else 0
        self.input_ids = torch.zeros(top, dtype=torch.long, device=device)
        self.positions = torch.zeros(top, dtype=torch.long, device=device)
        self.captured: dict[tuple[str, int], _Bucket] = {}

    def _batch(self, kind: str, t: int) -> ForwardBatch:
        """The batch a bucket's forward is captured with: a step of the kind whose description
        no piece reads (the cores, which read it, are cut out)."""
        none = torch.zeros(0, dtype=torch.long, device=self.device)
        prompt = PromptRows(cu_seqlens=none, cu_seqlens_long=none, cu_seqlens_host=none.cpu(), max_seqlen=t,
                            slots_host=[], chunks=none) if kind == PROMPT else None
        meta = StepMeta(kv=None, states=None, attn_ordinal={}, gdn_ordinal={}, block_tables=none, context_lens=none,
                        write_index=none, slot_ids=torch.zeros(t, dtype=torch.long, device=self.device),
                        num_decode=0 if kind == PROMPT else t, prompt=prompt)
        return ForwardBatch(positions=self.positions[:t], seq_lens=[t], caches=[], step=meta)

    def _forward(self, kind: str, t: int, capture: _Capture) -> torch.Tensor:
        mixers = list(_mixers(self.model))
        saved = [(m, m.backend) for m, _ in mixers]
        try:
            for m, attention in mixers:
                m.backend = _Stand(capture.attention if attention else capture.linear_attention)
            return self.model(self.input_ids[:t], self._batch(kind, t))
        finally:
            for m, backend in saved:
                m.backend = backend

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket of every kind, largest first (the smaller ones reuse its memory).
        A bucket that cannot be captured ends the capture of its kind: the steps it would have
        taken stay eager."""
        for kind in self.kinds:
            for t in reversed(self.buckets):
                try:
                    self.captured[kind, t] = self._capture(kind, t)
                except Exception as exc:  # a piece that reads a device value on the host, or the like
                    log.warning("steps of kind %r stay eager: the %d-token bucket could not be captured (%s)",
                                kind, t, exc)
                    for key in [key for key in self.captured if key[0] == kind]:
                        del self.captured[key]
                    break
        if self.captured:
            log.info("captured CUDA graphs in pieces for steps of %s tokens",
                     ", ".join(f"{kind}: {sorted(t for k, t in self.captured if k == kind)}" for kind in self.kinds))

    def _capture(self, kind: str, t: int) -> _Bucket:
        outputs: list[torch.Tensor] = []
        cuda = self.device.type == "cuda"
        stream = torch.cuda.Stream(self.device) if cuda else None
        if cuda:
            stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream) if cuda else contextlib.nullcontext():
            for _ in range(2):  # warm-up: the pieces' kernels compiled and tuned outside the capture
                self._forward(kind, t, _Capture(outputs, None))
            pieces = [self.graph()]

            def cut() -> None:
                pieces[-1].capture_end()
                pieces.append(self.graph())
                pieces[-1].capture_begin(pool=self.pool)

            capture = _Capture(outputs, cut)
            pieces[0].capture_begin(pool=self.pool)
            try:
                hidden = self._forward(kind, t, capture)
            finally:
                pieces[-1].capture_end()
        if cuda:
            torch.cuda.current_stream(self.device).wait_stream(stream)
            torch.cuda.synchronize(self.device)
        return _Bucket(pieces, capture.cores, hidden)

    def bucket(self, kind: str, n: int) -> int | None:
        return next((t for t in self.buckets if t >= n and (kind, t) in self.captured), None)

    @staticmethod
    def kind(batch: ForwardBatch) -> str:
        return ROWS if batch.step.prompt is None else PROMPT

    def fits(self, batch: ForwardBatch, n: int) -> bool:
        """Whether a step of ``n`` tokens described by ``batch`` runs through the pieces."""
        return (batch.step is not None and batch.mrope is None and batch.embeds is None
                and self.bucket(self.kind(batch), n) is not None)

    def run(self, input_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """The step's final hidden states ``[n, hidden]``: a view of the bucket's static output,
        valid until the next step."""
        n = input_ids.shape[0]
        kind = self.kind(batch)
        b = self.captured[kind, self.bucket(kind, n)]
        self.input_ids[:n].copy_(input_ids)
        for piece, core in zip(b.pieces, b.cores):
            piece.replay()
            core.run(n, batch)
        b.pieces[-1].replay()
        return b.hidden[:n]
