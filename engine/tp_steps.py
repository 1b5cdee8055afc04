"""The tensor-parallel ranks kept in step with rank 0 (``parallel.py``).

Rank 0 owns everything the engine decides: the schedule, the caches' bookkeeping (which pages and
slots each request holds), sampling. Before each forward it broadcasts the step's description
(``StepMessage``: the flat run's token ids and positions, the ``StepMeta`` tensors, which rows'
logits are taken) with the changes its pools had outside a forward since the last one (a state
slot zeroed or copied, a KV page copied: the pools' ``journal``). Ranks 1 .. N-1 (``follow``) hold
pools of the same pages and slots over their own heads: they make the same changes, run the same
forward on their slices, and take part in the logits' gather; what they compute is never read
back. A message of None ends them.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from . import parallel
from .cache.manager import CacheManager
from .models.base import CausalLM, ForwardBatch, PromptRows, StepMeta, chunk_offsets, chunk_pairs

log = logging.getLogger("ninfer.engine")


@dataclass
class StepMessage:
    ops: list[tuple]  # the pools' journal since the last step, in order
    input_ids: torch.Tensor
    positions: torch.Tensor
    seq_lens: list[int]
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    write_index: torch.Tensor
    slot_ids: torch.Tensor
    kv_slots: torch.Tensor | None
    num_decode: int
    cu_seqlens: torch.Tensor | None  # the prompt rows' (int64), None without any
    max_seqlen: int
    slots_host: list[int]
    sample_index: Any  # the flat rows whose logits are taken: indices, ``...`` (every row) or None (none)


@dataclass
class PoolPlan:
    """The pools' sizes, chosen by rank 0 (from its free memory): the other ranks make theirs alike."""

    num_pages: int
    page_size: int
    num_slots: int
    write_slots: int = 0  # the KV pool's (exact 4-bit keys)


class Leader:
    """Rank 0's side: sends the pool plan once, then each step's description before its forward."""

    def __init__(self, caches: CacheManager) -> None:
        self.tp = parallel.current()
        self.journal: list[tuple] = []
        for pool in (caches.kv, caches.states):
            if pool is not None:
                pool.journal = self.journal
        self.tp.broadcast(PoolPlan(caches.kv.num_pages if caches.kv is not None else 0, caches.page_size,
                                   caches.states.num_slots if caches.states is not None else 0,
                                   caches.kv.write_slots if caches.kv is not None else 0))

    def send(self, input_ids: torch.Tensor, batch: ForwardBatch, sample_index: Any) -> None:
        meta, prompt = batch.step, batch.step.prompt
        ops, self.journal[:] = list(self.journal), []
        host = (lambda t: t.cpu()) if input_ids.device.type != "cpu" else (lambda t: t)
        self.tp.broadcast(StepMessage(
            ops=ops, input_ids=host(input_ids), positions=host(batch.positions), seq_lens=list(batch.seq_lens),
            block_tables=host(meta.block_tables), context_lens=host(meta.context_lens),
            write_index=host(meta.write_index), slot_ids=host(meta.slot_ids),
            kv_slots=None if meta.kv_slots is None else host(meta.kv_slots), num_decode=meta.num_decode,
            cu_seqlens=None if prompt is None else prompt.cu_seqlens_host.clone(),
            max_seqlen=0 if prompt is None else prompt.max_seqlen,
            slots_host=[] if prompt is None else list(prompt.slots_host),
            sample_index=host(sample_index) if isinstance(sample_index, torch.Tensor) else sample_index))

    def stop(self) -> None:
        """End the other ranks (their ``follow`` returns)."""
        self.tp.broadcast(None)


def follow(model: CausalLM, make_caches) -> None:
    """A rank >= 1's life after loading: its pools (``make_caches(plan)``, a ``CacheManager``), then
    every step rank 0 broadcasts, until it sends None."""
    tp = parallel.current()
    caches = make_caches(tp.broadcast())
    device = next(model.parameters()).device
    steps = 0
    with torch.inference_mode():
        while True:
            msg: StepMessage | None = tp.broadcast()
            if msg is None:
                break
            replay(msg.ops, caches)
            input_ids, batch = rebuild(msg, caches, device)
            hidden = model(input_ids, batch)
            rows = msg.sample_index
            if rows is not None:
                model.compute_logits(hidden[rows.to(device) if isinstance(rows, torch.Tensor) else rows])
            steps += 1
    log.info("tensor-parallel rank %d stopped after %d steps", tp.rank, steps)


def replay(ops: list[tuple], caches: CacheManager) -> None:
    """Make rank 0's pool changes in this rank's pools."""
    for kind, *at in ops:
        if kind == "clear":
            caches.states.clear(*at)
        elif kind == "copy_slot":
            caches.states.copy(*at)
        elif kind == "copy_page":
            caches.kv.copy_page(*at)
        elif kind == "clear_write_slot":
            caches.kv.clear_write_slot(*at)
        else:
            raise ValueError(f"unknown pool operation {kind!r}")


def rebuild(msg: StepMessage, caches: CacheManager, device: torch.device) -> tuple[torch.Tensor, ForwardBatch]:
    """The step's input ids and ``ForwardBatch`` over this rank's pools."""
    def dev(t: torch.Tensor) -> torch.Tensor:
        return t.to(device)

    prompt = None
    if msg.cu_seqlens is not None:
        cu = dev(msg.cu_seqlens)
        prompt = PromptRows(cu_seqlens=cu.to(torch.int32), cu_seqlens_long=cu, cu_seqlens_host=msg.cu_seqlens,
                            max_seqlen=msg.max_seqlen, slots_host=msg.slots_host,
                            chunks=dev(torch.tensor(chunk_pairs(msg.cu_seqlens.tolist()), dtype=torch.long).view(-1, 2)),
                            chunk_offsets=dev(torch.tensor(chunk_offsets(msg.cu_seqlens.tolist()), dtype=torch.long)))
    meta = StepMeta(kv=caches.kv, states=caches.states, attn_ordinal=caches.attn_ordinal,
                    gdn_ordinal=caches.gdn_ordinal, block_tables=dev(msg.block_tables),
                    context_lens=dev(msg.context_lens), write_index=dev(msg.write_index), slot_ids=dev(msg.slot_ids),
                    num_decode=msg.num_decode, prompt=prompt,
                    kv_slots=None if msg.kv_slots is None else dev(msg.kv_slots))
    batch = ForwardBatch(positions=dev(msg.positions), seq_lens=msg.seq_lens, caches=[None] * len(msg.seq_lens),
                         step=meta)
    return dev(msg.input_ids), batch
