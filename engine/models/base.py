"""What every model implementation shares: the batch it runs on and its interface.

A forward pass runs on a flat run of tokens from one or more sequences (no padding). Token-wise
work (projections, norms, MLPs) runs on the whole run at once. Attention and the recurrent layers
take one of two paths, chosen by the batch, never by its tensors:

- ``batch.step`` (a :class:`StepMeta`, every engine step): all rows at once over the shared pools,
  decode rows and prompt chunks in the same forward.
- otherwise, the reference path over per-sequence caches (``SequenceCache``; the tests'
  numerical reference): each sequence on ``batch.slices`` with its own cache.

Either way a model's ``forward`` leaves what each layer needs in the caches or pools. On the
reference path it then advances each ``cache.num_tokens`` in ``batch.caches`` by that sequence's
new-token count (``ForwardBatch.advance_caches``); a step over the pools counts nothing in its
caches: how far a request has come is its one cursor, ``Request.num_computed``, which the runner
advances.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

import torch
from torch import nn

from .. import parallel
from ..cache.sequence import SequenceCache
from ..config import ModelConfig


@dataclass
class PromptRows:
    """The rows of a step that bring more than one new token: their tokens follow the decode
    rows' in the flat run, ``cu_seqlens`` counted from the first of them."""

    cu_seqlens: torch.Tensor  # [P + 1] int32 on the device
    cu_seqlens_long: torch.Tensor  # the same, int64 (fla-core's varlen kernels)
    cu_seqlens_host: torch.Tensor  # the same, int64 on the host: kernels size their grids without a sync
    max_seqlen: int  # the longest row's new tokens
    slots_host: list[int]  # each row's state slot, on the host (the torch path loops over rows)
    chunks: torch.Tensor  # [chunks, 2] int64 on the device: (row, chunk) of GDN_CHUNK-token chunks
    chunk_offsets: torch.Tensor  # [P + 1] int64 on the device: each row's first chunk in ``chunks``


GDN_CHUNK = 64  # the Gated DeltaNet prompt kernels' chunk: fla-core's, so one table serves its kernels and ours


def chunk_offsets(cu_seqlens: list[int], size: int = GDN_CHUNK) -> list[int]:
    """Each row's first (row, chunk) pair in :func:`chunk_pairs`'s table, and their count."""
    out = [0]
    for r in range(len(cu_seqlens) - 1):
        out.append(out[-1] - (-(cu_seqlens[r + 1] - cu_seqlens[r]) // size))
    return out


def chunk_pairs(cu_seqlens: list[int], size: int = GDN_CHUNK) -> list[int]:
    """The flat (row, chunk) pairs of rows bounded by ``cu_seqlens`` cut in ``size``-token
    chunks: the table by which the prompt kernels' programs find their tokens."""
    pairs = []
    for r in range(len(cu_seqlens) - 1):
        for c in range(-(-(cu_seqlens[r + 1] - cu_seqlens[r]) // size)):
            pairs += (r, c)
    return pairs


@dataclass
class VerifyRows:
    """The decode rows of a step that verify drafts (speculative decoding, ``spec.py``): each
    verifying request runs as ``1 + k`` decode rows over one state slot, the requests one after
    another from decode row ``first`` on (the plain decode rows before them). A Gated DeltaNet
    layer runs them all in one call (``layers/gdn_verify.py``), every request from its slot's
    states, which it only reads, and keeps the states after every position in ``conv`` /
    ``recurrent``: once the drafts are checked, ``commit`` copies the states after the last
    accepted position into the slot (all layers at once), with nothing computed again; a rejected
    draft leaves no trace in the slot."""

    first: int  # the decode row of the first verifying request's first position
    slots: torch.Tensor  # [Q] int64 on the device: each verifying request's state slot
    cu_seqlens: torch.Tensor  # [Q + 1] int64 on the device: each one's rows, counted from ``first``
    positions: int  # every verifying request's positions: the rows of the buffers
    requests: dict[int, tuple[int, int]]  # id(request) -> (its first row in the buffers, its positions)
    # [gdn layers, rows, ...] per state, the pools' shapes past their slot dim: allocated by the
    # first Gated DeltaNet layer that runs, or given (a captured verify step's)
    conv: torch.Tensor | None = None
    recurrent: torch.Tensor | None = None

    def buffers(self, states) -> tuple[torch.Tensor, torch.Tensor]:
        """The per-position state buffers (allocated on first use) for ``states``, the step's pool."""
        if self.conv is None:
            self.conv, self.recurrent = self.allocate(states, self.positions)
        return self.conv, self.recurrent

    @staticmethod
    def allocate(states, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Verify buffers of ``rows`` positions for the state pool ``states``."""
        return (states.conv.new_empty(states.conv.shape[0], rows, *states.conv.shape[2:]),
                states.recurrent.new_empty(states.recurrent.shape[0], rows, *states.recurrent.shape[2:]))

    def commit(self, states, request, slot: int, index: int) -> None:
        """Slot ``slot`` (``request``'s) takes the states after its position ``index`` of the
        verify row, in every Gated DeltaNet layer."""
        at, width = self.requests[id(request)]
        if not 0 <= index < width:
            raise ValueError(f"verify row of {width} positions: no state after position {index}")
        if self.conv is None:
            return
        states.conv[:, slot] = self.conv[:, at + index]
        states.recurrent[:, slot] = self.recurrent[:, at + index]


@dataclass
class StepMeta:
    """Device-side description of one step over the shared pools, built once per step.

    Row ``r`` is one sequence's new tokens. Rows ``0 .. num_decode`` bring one token each (a
    decoding sequence, or a one-token chunk): token ``r`` of the flat run is row ``r``'s. The
    rows after them (``prompt``) bring runs of tokens (prompt chunks, forced tokens). Layers run
    every row in one call per kernel, with no per-sequence Python loop on CUDA; a step of decode
    rows only reads no device value on the host, so it can be captured in a CUDA graph.
    """

    kv: Any  # PagedKVPool or None
    states: Any  # StateSlotPool or None
    attn_ordinal: dict[int, int]  # layer index -> index in the KV pool
    gdn_ordinal: dict[int, int]  # layer index -> index in the state pool
    block_tables: torch.Tensor  # [R, max_pages] int32
    context_lens: torch.Tensor  # [R] int32, tokens in each row's cache once this step's are in
    write_index: torch.Tensor  # [N] int64, flat pool row (page * page_size + offset) of every new token
    slot_ids: torch.Tensor  # [R] int64, state slot of each row
    num_decode: int = -1  # rows of one token (-1: every row)
    prompt: PromptRows | None = None
    verify: VerifyRows | None = None  # decode rows that verify drafts, in a model with recurrent layers
    kv_slots: torch.Tensor | None = None  # [N] int64, the KV write slot of every new token (None: none)

    def __post_init__(self) -> None:
        if self.num_decode < 0:
            self.num_decode = self.slot_ids.shape[0]


@dataclass
class ForwardBatch:
    positions: torch.Tensor  # [N] int64, absolute position of every token
    seq_lens: list[int]  # new tokens per sequence, sum == N
    caches: list[Any]  # one per sequence, in the same order: SequenceCache (reference path) or the rows'
    # PagedSequenceCache (``step``: the layers read the pools)
    step: StepMeta | None = None  # set for steps over the shared pools (the engine's every step)
    # a step with image tokens: every token's three M-RoPE positions ``[3, N]`` (``positions``
    # then still holds the time axis), and the image embeddings that replace the placeholders'
    # token embeddings: (flat token indices [M], rows [M, hidden])
    mrope: torch.Tensor | None = None
    embeds: tuple[torch.Tensor, torch.Tensor] | None = None
    # what the layers derive from the step's tensors alike, computed by the first and kept for the
    # rest (the RoPE factors for ``positions``, keyed by the rotary module: ``rotary.py``)
    memo: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def slices(self) -> list[tuple[int, int]]:
        out, start = [], 0
        for n in self.seq_lens:
            out.append((start, start + n))
            start += n
        return out

    def advance_caches(self) -> None:
        """Count the new tokens into each reference cache; a model calls this once, at the end of
        ``forward`` (a step over the pools has its cursors on the requests)."""
        if self.step is not None:
            return
        for cache, n in zip(self.caches, self.seq_lens):
            cache.num_tokens += n

    @classmethod
    def single(cls, num_new: int, cache: SequenceCache, device: torch.device | str = "cpu") -> "ForwardBatch":
        start = cache.num_tokens
        positions = torch.arange(start, start + num_new, dtype=torch.long, device=device)
        return cls(positions=positions, seq_lens=[num_new], caches=[cache])


class PreNormLayer(nn.Module):
    """A pre-norm decoder block, ``h += mixer(norm(h)); h += mlp(norm(h))``, over a residual stream
    passed along beside the branch output, so each residual add is fused with the norm after it
    (``RMSNorm(x, residual)``), or, where the next module has ``forward_residual`` (the mixers'
    input projections, the MoE router), with that module's first kernel. Subclasses hold
    ``input_layernorm``, ``post_attention_layernorm`` and ``mlp`` and say which token mixer runs
    (``mixer``).

    Under tensor parallelism (``parallel.py``) the mixer's and the MLP's outputs are each rank's
    partial sums (their last projections split by input columns): one all-reduce after each makes
    them whole, the only collectives of a block."""

    def mixer(self) -> nn.Module:
        raise NotImplementedError

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None,
                batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """``(mlp output, residual stream)``: the previous layer's output is added to the residual
        stream here; the stack adds the last one (:class:`PreNormStack`)."""
        mixer, tp = self.mixer(), parallel.current()
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
            mixed = mixer(hidden, batch)
        elif hasattr(mixer, "forward_residual"):  # decode: add + norm inside the input projection
            mixed, residual = mixer.forward_residual(hidden, residual, self.input_layernorm, batch)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
            mixed = mixer(hidden, batch)
        mixed = tp.all_reduce(mixed)
        fused = getattr(self.mlp, "forward_residual", None)  # MoE: add + norm + routing in one launch
        if fused is not None:
            out, residual = fused(mixed, residual, self.post_attention_layernorm)
            return tp.all_reduce(out), residual
        hidden, residual = self.post_attention_layernorm(mixed, residual)
        return tp.all_reduce(self.mlp(hidden)), residual


class PreNormStack(nn.Module):
    """The ``model.`` part of a checkpoint: ``embed_tokens``, ``layers`` (:class:`PreNormLayer`),
    final ``norm``, which also adds the last layer's output to the residual stream."""

    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        hidden, residual = self.embed_tokens(input_ids), None
        if batch.embeds is not None:  # image tokens: the vision tower's rows in place of the placeholders'
            index, rows = batch.embeds
            hidden = hidden.index_copy(0, index, rows.to(hidden.dtype))
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, batch)
        return self.norm(hidden, residual)[0]


class CausalLM(nn.Module):
    """Interface of a decoder-only model. Subclasses build their layers from ``ModelConfig``."""

    config: ModelConfig
    # ``visual``: the vision tower (``vision/encoder.py``), a submodule set by ``load_model`` with
    # --vision (``vision_tower`` reads it)

    @property
    def vision_tower(self) -> nn.Module | None:
        return self._modules.get("visual")

    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Hidden states ``[N, hidden]`` after the final norm for the flat token run.

        Appends to every cache in ``batch.caches`` and advances their ``num_tokens`` (see above), or
        writes the step's tokens into the pools (``batch.step``).
        Subclasses hold the decoder stack as ``self.model`` and the output head as ``self.lm_head``."""
        if input_ids.shape[0] != sum(batch.seq_lens):
            raise ValueError(f"{input_ids.shape[0]} input ids for seq_lens {batch.seq_lens}")
        hidden = self.model(input_ids, batch)
        batch.advance_caches()
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits ``[n, vocab]`` (fp32) for the given rows of hidden states."""
        return self.lm_head(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Take checkpoint tensors under their Hugging Face names (prefixes already normalised)."""
        raise NotImplementedError

    def new_cache(self) -> SequenceCache:
        return SequenceCache(self.config.num_hidden_layers)
