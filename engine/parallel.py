"""Tensor parallelism (``--tp N``): one process per rank, each holding a slice of every layer.

Rank 0 is the engine process (scheduling, sampling, the caches' bookkeeping); ranks 1 .. N-1 run
the same forward on their slices (``tp_steps.py``). What is split, in contiguous equal parts:

- attention: query heads (``q_proj`` rows, gate rows with them), KV heads (replicated where there
  are fewer than ranks: rank ``r`` keeps the one its query heads read), ``o_proj`` columns;
- Gated DeltaNet: key and value heads (the q / k / v channel groups of ``in_proj_qkv`` and of the
  conv, ``in_proj_z`` / ``b`` / ``a``, ``A_log``, ``dt_bias``; Qwen3-Next's per-key-head
  ``in_proj_qkvz`` / ``in_proj_ba`` rows), ``out_proj`` columns, and so their state slots;
- MLP and shared expert: the intermediate size (gate / up rows, down columns); MoE experts: every
  expert's intermediate size (the router is whole on every rank);
- the LM head: the vocabulary, logits gathered on every rank (``LMHead``).

A row-parallel projection (``o_proj``, ``out_proj``, ``down_proj``, the MoE block's output) gives
a partial sum on each rank: one all-reduce per block adds them (``models/base.PreNormLayer``); a
bias of such a projection is kept on rank 0 only. Norms, the embedding and the routers are whole.
Each rank reads only its slices of the safetensors files (``Sharder`` on ``get_slice``).

Collectives go through ``torch.distributed``: gloo on the CPU, NCCL on CUDA (rank ``r`` on
``cuda:r``). ``current()`` is this process's context (one rank of one when not parallel).
"""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, replace
from typing import Any

import torch

from .config import ModelConfig

# ranks wait on each other as long as the server is idle; a dead rank is seen at once (its
# connections close), not by this timeout
GROUP_TIMEOUT = datetime.timedelta(days=365)


@dataclass(frozen=True)
class Rendezvous:
    """Where rank ``rank`` of ``world_size`` finds the others (``init_method`` of
    ``torch.distributed``: rank 0's store at an address the launching process chose)."""

    rank: int
    world_size: int
    init_method: str


@dataclass
class TPContext:
    rank: int = 0
    world_size: int = 1
    group: Any = None  # the torch.distributed process group (None: a single process)

    @property
    def parallel(self) -> bool:
        return self.world_size > 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of ``x`` over the ranks (in place; ``x`` itself when not parallel)."""
        if self.world_size > 1:
            import torch.distributed as dist

            dist.all_reduce(x, group=self.group)
        return x

    def gather_last(self, x: torch.Tensor, size: int) -> torch.Tensor:
        """Every rank's ``x`` ``[n, k]`` side by side ``[n, world * k]``, cut to ``size`` columns."""
        if self.world_size == 1:
            return x[:, :size]
        import torch.distributed as dist

        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)[:, :size]

    def broadcast(self, obj: Any = None) -> Any:
        """Rank 0's ``obj`` on every rank (pickled; tensors in it on the host)."""
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]


_current = TPContext()


def current() -> TPContext:
    return _current


def join(rendezvous: Rendezvous, device: str) -> tuple[TPContext, str]:
    """Join the ranks' group (gloo on the CPU, NCCL on CUDA) and make it this process's context;
    the device this rank runs on."""
    global _current
    import torch.distributed as dist

    os.environ["NCCL_NVLS_ENABLE"] = "0"
    backend = "gloo"
    if device.startswith("cuda"):
        backend = "nccl"
        device = f"cuda:{rendezvous.rank}"
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=rendezvous.init_method, rank=rendezvous.rank,
                            world_size=rendezvous.world_size, timeout=GROUP_TIMEOUT)
    _current = TPContext(rendezvous.rank, rendezvous.world_size, dist.group.WORLD)
    return _current, device


def leave() -> None:
    global _current
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    _current = TPContext()


# ---------------------------------------------------------------------- the config
def check_shardable(config: ModelConfig, world: int) -> None:
    """A ValueError naming what does not split into ``world`` equal parts."""
    if world == 1:
        return
    parts = [("attention heads", config.num_attention_heads)]
    kv = config.num_key_value_heads
    if kv and kv % world and world % kv:
        raise ValueError(f"--tp {world}: the model's {kv} KV heads neither split into {world} parts "
                         f"nor are replicated evenly over {world} ranks")
    if config.is_hybrid:
        parts.append(("Gated DeltaNet key heads", config.linear_num_key_heads))
    if config.intermediate_size:
        parts.append(("MLP intermediate size", config.intermediate_size))
    if config.is_moe:
        parts.append(("expert intermediate size", config.moe_intermediate_size))
        if config.shared_expert_intermediate_size:
            parts.append(("shared expert intermediate size", config.shared_expert_intermediate_size))
    for what, n in parts:
        if n % world:
            raise ValueError(f"--tp {world}: the model's {what} ({n}) do not split into {world} equal parts")


def shard_config(config: ModelConfig, world: int) -> ModelConfig:
    """What one rank's layers hold (the vocabulary stays whole: the LM head splits it itself)."""
    if world == 1:
        return config
    return replace(
        config,
        num_attention_heads=config.num_attention_heads // world,
        num_key_value_heads=max(config.num_key_value_heads // world, 1),
        intermediate_size=config.intermediate_size // world,
        linear_num_key_heads=config.linear_num_key_heads // world,
        linear_num_value_heads=config.linear_num_value_heads // world,
        moe_intermediate_size=config.moe_intermediate_size // world,
        shared_expert_intermediate_size=config.shared_expert_intermediate_size // world,
    )


def vocab_shard(vocab: int, world: int) -> int:
    """Rows of the LM head per rank (the last rank's padded)."""
    return -(-vocab // world)


# ---------------------------------------------------------------------- the tensors
# (name ending, rule): "rows" / "cols" split dim 0 / the last dim in equal parts; "kv" the KV
# heads' rows; "qkv" the q / k / v channel groups of a Gated DeltaNet's conv input, each split;
# "experts_gate_up" the gate and up halves of fused experts, each split; "rank0" a row-parallel
# projection's bias; "vocab" the LM head's rows
_RULES = (
    ("self_attn.q_proj.weight", "rows"), ("self_attn.q_proj.bias", "rows"),
    ("self_attn.k_proj.weight", "kv"), ("self_attn.k_proj.bias", "kv"),
    ("self_attn.v_proj.weight", "kv"), ("self_attn.v_proj.bias", "kv"),
    ("self_attn.o_proj.weight", "cols"), ("self_attn.o_proj.bias", "rank0"),
    ("linear_attn.in_proj_qkv.weight", "qkv"), ("linear_attn.conv1d.weight", "qkv"),
    ("linear_attn.in_proj_z.weight", "rows"), ("linear_attn.in_proj_b.weight", "rows"),
    ("linear_attn.in_proj_a.weight", "rows"), ("linear_attn.A_log", "rows"), ("linear_attn.dt_bias", "rows"),
    ("linear_attn.in_proj_qkvz.weight", "rows"), ("linear_attn.in_proj_ba.weight", "rows"),
    ("linear_attn.out_proj.weight", "cols"),
    ("gate_proj.weight", "rows"), ("gate_proj.bias", "rows"), ("up_proj.weight", "rows"),
    ("up_proj.bias", "rows"), ("down_proj.weight", "cols"), ("down_proj.bias", "rank0"),
    ("experts.gate_up_proj", "experts_gate_up"), ("experts.down_proj", "cols"),
    ("lm_head.weight", "vocab"),
)


def _shape(src) -> tuple[int, ...]:
    return tuple(src.shape) if isinstance(src, torch.Tensor) else tuple(src.get_shape())


def _take(src, dim: int, lo: int, hi: int) -> torch.Tensor:
    """Rows ``lo:hi`` of dim ``dim`` of a tensor or a safetensors slice (which reads only them)."""
    dims = len(_shape(src))
    index = (slice(None),) * (dim % dims) + (slice(lo, hi),)
    out = src[index]
    return out.clone() if isinstance(src, torch.Tensor) else out  # (not a view that keeps the whole alive)


class Sharder:
    """``sharder(name, source)``: rank ``rank``'s part of the checkpoint tensor ``name`` (as the
    model names it), from a tensor or a safetensors slice (``safe_open(...).get_slice``)."""

    def __init__(self, config: ModelConfig, rank: int, world: int) -> None:
        self.config, self.rank, self.world = config, rank, world

    def rule(self, name: str) -> str | None:
        return next((rule for end, rule in _RULES if name.endswith(end)), None)

    def __call__(self, name: str, src) -> torch.Tensor:
        rule = self.rule(name) if self.world > 1 else None
        if rule is None:  # whole on every rank
            return src if isinstance(src, torch.Tensor) else src[...]
        shape = _shape(src)
        r, n = self.rank, self.world
        if rule in ("rows", "cols"):
            dim = 0 if rule == "rows" else -1
            part = shape[dim] // n
            return _take(src, dim, r * part, (r + 1) * part)
        if rule == "kv":
            heads = self.config.num_key_value_heads
            size = shape[0] // heads
            if heads >= n:
                part = shape[0] // n
                return _take(src, 0, r * part, (r + 1) * part)
            head = r * heads // n  # the KV head the rank's query heads read
            return _take(src, 0, head * size, (head + 1) * size)
        if rule == "qkv":
            c = self.config
            key, value = c.linear_num_key_heads * c.linear_key_head_dim, c.linear_num_value_heads * c.linear_value_head_dim
            parts, at = [], 0
            for width in (key, key, value):
                part = width // n
                parts.append(_take(src, 0, at + r * part, at + (r + 1) * part))
                at += width
            return torch.cat(parts)
        if rule == "experts_gate_up":
            half = shape[1] // 2
            part = half // n
            return torch.cat([_take(src, 1, r * part, (r + 1) * part),
                              _take(src, 1, half + r * part, half + (r + 1) * part)], dim=1)
        if rule == "rank0":
            whole = _take(src, 0, 0, shape[0])
            return whole if r == 0 else whole.zero_()
        # "vocab": this rank's rows, the last rank's padded with zeros to the same count
        rows = vocab_shard(shape[0], n)
        part = _take(src, 0, min(r * rows, shape[0]), min((r + 1) * rows, shape[0]))
        if part.shape[0] < rows:
            part = torch.cat([part, part.new_zeros(rows - part.shape[0], *part.shape[1:])])
        return part
