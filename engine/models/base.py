"""What every model implementation shares: the batch it runs on and its interface.

A forward pass runs on a flat run of tokens from one or more sequences (no padding). Token-wise
work (projections, norms, MLPs) runs on the whole run at once; attention and the recurrent layers
work per sequence on ``batch.slices`` with that sequence's cache.

Cache contract: a model's ``forward`` appends what each layer needs to every sequence's cache and,
once all layers have run, advances each ``cache.num_tokens`` by that sequence's new-token count
(``ForwardBatch.advance_caches``). Callers never touch ``num_tokens`` themselves.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

import torch
from torch import nn

from ..cache.sequence import SequenceCache
from ..config import ModelConfig


@dataclass
class DecodeMeta:
    """Device-side description of a decode step (one new token per sequence) over the shared pools.

    With it, layers run the whole batch at once with no per-sequence Python loop and no host
    sync, so the step can be captured in a CUDA graph. Row ``b`` is sequence ``b``.
    """

    kv: Any  # PagedKVPool or None
    states: Any  # StateSlotPool or None
    attn_ordinal: dict[int, int]  # layer index -> index in the KV pool
    gdn_ordinal: dict[int, int]  # layer index -> index in the state pool
    block_tables: torch.Tensor  # [B, max_pages] int32
    context_lens: torch.Tensor  # [B] int32, tokens including the new one
    write_index: torch.Tensor  # [B] int64, flat pool row (page * page_size + offset) of the new token
    slot_ids: torch.Tensor  # [B] int64, state slot of each sequence


@dataclass
class ForwardBatch:
    positions: torch.Tensor  # [N] int64, absolute position of every token
    seq_lens: list[int]  # new tokens per sequence, sum == N
    caches: list[Any]  # one per sequence, in the same order (SequenceCache or PagedSequenceCache)
    decode: DecodeMeta | None = None  # set for batched decode steps over the pools
    _write_rows: torch.Tensor | None = field(default=None, repr=False)  # kv_write_rows, once built

    @property
    def slices(self) -> list[tuple[int, int]]:
        out, start = [], 0
        for n in self.seq_lens:
            out.append((start, start + n))
            start += n
        return out

    def kv_write_rows(self, device: torch.device) -> torch.Tensor:
        """Flat KV pool rows of every new token (paged caches), the same for every attention layer:
        built once per forward."""
        if self._write_rows is None:
            self._write_rows = torch.cat([c.write_rows(e - s, device) for (s, e), c in zip(self.slices, self.caches)])
        return self._write_rows

    def advance_caches(self) -> None:
        """Count the new tokens into each cache; a model calls this once, at the end of ``forward``."""
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
    (``mixer``)."""

    def mixer(self) -> nn.Module:
        raise NotImplementedError

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None,
                batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """``(mlp output, residual stream)``: the previous layer's output is added to the residual
        stream here; the stack adds the last one (:class:`PreNormStack`)."""
        mixer = self.mixer()
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
            mixed = mixer(hidden, batch)
        elif hasattr(mixer, "forward_residual"):  # decode: add + norm inside the input projection
            mixed, residual = mixer.forward_residual(hidden, residual, self.input_layernorm, batch)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
            mixed = mixer(hidden, batch)
        fused = getattr(self.mlp, "forward_residual", None)  # MoE: add + norm + routing in one launch
        if fused is not None:
            return fused(mixed, residual, self.post_attention_layernorm)
        hidden, residual = self.post_attention_layernorm(mixed, residual)
        return self.mlp(hidden), residual


class PreNormStack(nn.Module):
    """The ``model.`` part of a checkpoint: ``embed_tokens``, ``layers`` (:class:`PreNormLayer`),
    final ``norm``, which also adds the last layer's output to the residual stream."""

    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        hidden, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, batch)
        return self.norm(hidden, residual)[0]


class CausalLM(nn.Module):
    """Interface of a decoder-only model. Subclasses build their layers from ``ModelConfig``."""

    config: ModelConfig

    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Hidden states ``[N, hidden]`` after the final norm for the flat token run.

        Appends to every cache in ``batch.caches`` and advances their ``num_tokens`` (see above).
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
