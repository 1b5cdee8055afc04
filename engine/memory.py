"""How many KV pages to allocate at startup: a fixed ``kv_capacity`` or what free memory allows."""
from __future__ import annotations

import os

import torch

from .cache.kv_pool import PagedKVPool
from .cache.manager import kv_bytes_per_token, state_shapes
from .cache.state_pool import StateSlotPool
from .config import ModelConfig
from .engine_config import EngineConfig
from .graph_buckets import activation_per_token

DEVICE_FRACTION = 0.90  # of free GPU memory after weights, for state slots + KV + workspace
HOST_FRACTION = 0.25  # of available RAM when running on the CPU


def _gpu_free_bytes(device: torch.device, cap_gib: float | None) -> int:
    """The GPU's free bytes, what torch caches unheld given back first; under a cap what the cap
    leaves beside this process's allocations."""
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info(device)
    if cap_gib is not None:
        free = min(free, int(cap_gib * (1 << 30)) - torch.cuda.memory_reserved(device))
    return free


def free_memory_bytes(device: torch.device, cap_gib: float | None = None) -> int:
    """What the caches may take of the memory left on ``device``; on a GPU under a cap
    (``EngineConfig.gpu_memory_gib``) what the cap leaves beside this process's allocations.
    On a GPU the memory torch's allocator caches but no tensor holds is given back first, so it
    counts as free: a load's temporaries (the 9B's projections fused after they were made: about
    16 GB) would otherwise be missing from the KV pool and the CUDA-graph pieces' share."""
    if device.type == "cuda":
        return int(_gpu_free_bytes(device, cap_gib) * DEVICE_FRACTION)
    try:
        avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        avail = 8 << 30
    return int(avail * HOST_FRACTION)


def apply_memory_cap(config: EngineConfig) -> None:
    """Hold this process's GPU allocations to ``config.gpu_memory_gib`` (torch's per-process
    memory fraction), refused at start where the card has less."""
    if config.gpu_memory_gib is None:
        return
    device = torch.device(config.device)
    total = torch.cuda.get_device_properties(device).total_memory
    cap = int(config.gpu_memory_gib * (1 << 30))
    if cap > total:
        raise ValueError(f"--gpu-memory-gib {config.gpu_memory_gib:g} is more than the {total / (1 << 30):.1f} GiB "
                         f"of {torch.cuda.get_device_name(device)}")
    torch.cuda.set_per_process_memory_fraction(cap / total, device)


def workspace_bytes(model: ModelConfig, config: EngineConfig) -> int:
    """Activations of one step's tokens (its budget plus a token per decoding row), generously: a
    few hidden-sized and one logits-sized buffer. With speculative decoding every decoding row
    may verify ``draft_tokens`` more positions (their logits), and in a hybrid model keeps the
    Gated DeltaNet states after each of its ``1 + draft_tokens`` positions (``models/base.VerifyRows``).
    (Steps with prompt rows captured in pieces keep their tensors in the graphs' pool: they are
    captured before the caches are sized, so the free memory those are planned from counts them.)"""
    elt = torch.empty((), dtype=config.dtype).element_size()
    tokens = max(config.prefill_chunk, config.step_tokens) + config.max_concurrency
    drafts = config.draft_tokens if config.spec != "off" else 0
    verify = config.max_concurrency * (1 + drafts) * _slot_bytes(model, config) if drafts else 0
    return tokens * activation_per_token(model, elt) + \
        config.max_concurrency * (1 + drafts) * model.vocab_size * 4 + verify


def step_room_problem(free: int, model: ModelConfig, config: EngineConfig) -> str | None:
    """Where a KV cache of a given size (``--kv-capacity``) leaves ``free`` bytes, fewer than a
    step's activations take (``workspace_bytes``), what to change; None where they fit or the
    engine sized the cache itself (its budget counts them)."""
    if config.kv_capacity is None:
        return None
    need = workspace_bytes(model, config)
    if free >= need:
        return None
    gib = 1 << 30
    return (f"--kv-capacity {config.kv_capacity:,} leaves {free / gib:.2f} GiB of the GPU's memory for a step's "
            f"activations, which take about {need / gib:.2f} GiB at --prefill-chunk {config.prefill_chunk}: "
            f"lower --kv-capacity or --prefill-chunk"
            + (", or raise --gpu-memory-gib" if config.gpu_memory_gib is not None else ""))


def check_step_room(model: ModelConfig, config: EngineConfig) -> None:
    """At engine build, after the caches and the CUDA graphs took theirs: a step's activations fit
    what is left (``step_room_problem``), else a ValueError at start rather than running out of
    memory at the first long prompt."""
    device = torch.device(config.device)
    if device.type != "cuda" or config.kv_capacity is None:
        return
    problem = step_room_problem(_gpu_free_bytes(device, config.gpu_memory_gib), model, config)
    if problem:
        raise ValueError(problem)


def _slot_bytes(model: ModelConfig, config: EngineConfig) -> int:
    if not model.is_hybrid:
        return 0
    n_gdn = sum(t == "linear_attention" for t in model.layer_types)
    return StateSlotPool.bytes_per_slot(n_gdn, *state_shapes(model), config.dtype, config.state_storage_dtype)


def moving_slots(config: EngineConfig, checkpoints: int) -> int:
    """State slots kept for prefix checkpoints' copies to host memory in flight (CUDA, where the
    copies run beside the steps): a quarter of the checkpoints', 1 to 4."""
    if not checkpoints or not config.host_cache_mib or not str(config.device).startswith("cuda"):
        return 0
    return min(4, max(1, checkpoints // 4))


CHECKPOINTS_PER_TURN = 2  # a request leaves two: where its prompt ends and where its answer does


def checkpoints_ahead(config: EngineConfig, checkpoints: int) -> int:
    """Places in the prefix checkpoint table kept free while the engine is idle: two per
    concurrent request (a burst of new prompts keeps both of each one's checkpoints, none evicted
    in its steps), at most half the table."""
    return min(CHECKPOINTS_PER_TURN * config.max_concurrency, checkpoints // 2)


def _kv_tokens(model: ModelConfig, config: EngineConfig, checkpoints: int) -> int:
    """Tokens of KV that free memory holds beside the state slots (sequences', checkpoints' and
    their copies' in flight) and the write slots of 4-bit keys, up to what the running requests and the prefix checkpoints can use:
    a checkpoint holds the pages of its prefix, so a pool sized for the running requests alone
    would move every finished prompt's pages to host memory as the next prompt arrives, on that
    prompt's time."""
    slots = (config.max_concurrency + checkpoints + moving_slots(config, checkpoints)) * _slot_bytes(model, config)
    n_attn = sum(t == "full_attention" for t in model.layer_types)
    slots += (config.max_concurrency + 2) * PagedKVPool.bytes_per_write_slot(  # 4-bit keys' write slots
        n_attn, config.page_size, model.num_key_value_heads, model.head_dim, config.kv_storage_dtype, config.dtype)
    budget = free_memory_bytes(torch.device(config.device), config.gpu_memory_gib) - slots - workspace_bytes(model, config)
    wanted = (config.max_concurrency + checkpoints) * config.max_context
    return min(budget // kv_bytes_per_token(model, config.kv_storage_dtype, config.page_size), wanted)


CHECKPOINTS_PER_REQUEST = 4  # device prefix checkpoints kept per concurrent request by default
CHECKPOINT_SLOTS_SHARE = 0.25  # of the free memory, the most their state slots take by default


def prefix_checkpoints(model: ModelConfig, config: EngineConfig) -> int:
    """How many prefix checkpoints to keep on the device: ``config.prefix_checkpoints``, or by
    default ``CHECKPOINTS_PER_REQUEST`` per concurrent request (at least 16: conversations take
    turns, each request leaves one where its prompt ended and one where its answer did), halved
    while their state slots would take more than ``CHECKPOINT_SLOTS_SHARE`` of free memory; either
    way halved while the slots would leave the KV cache short of one ``max_context`` request (a
    hybrid model's checkpoint holds a slot of every GDN layer's state); 0 with the cache off."""
    if not config.prefix_cache:
        return 0
    n = config.prefix_checkpoints
    if n is None:
        n = max(16, CHECKPOINTS_PER_REQUEST * config.max_concurrency)
        budget = CHECKPOINT_SLOTS_SHARE * free_memory_bytes(torch.device(config.device), config.gpu_memory_gib)
        while n > 16 and n * _slot_bytes(model, config) > budget:
            n //= 2
    per_token = kv_bytes_per_token(model, config.kv_storage_dtype, config.page_size)
    if config.kv_capacity is not None or per_token == 0 or not model.is_hybrid:
        return n
    while n and _kv_tokens(model, config, n) < config.max_context:
        n //= 2
    return n


def plan_kv_pages(model: ModelConfig, config: EngineConfig, checkpoints: int = 0) -> int:
    page = config.page_size
    if config.kv_capacity is not None:
        return -(-config.kv_capacity // page)
    per_token = kv_bytes_per_token(model, config.kv_storage_dtype, config.page_size)
    if per_token == 0:  # no full-attention layers
        return 1
    tokens = _kv_tokens(model, config, checkpoints)
    if tokens < config.max_context:
        raise ValueError(
            f"free memory holds a KV cache of {max(tokens, 0)} tokens, less than max_context "
            f"({config.max_context}); lower --max-context or --max-concurrency, or set --kv-capacity"
        )
    return -(-tokens // page)
