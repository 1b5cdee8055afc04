"""Bytes a running server takes for one model and one choice of settings.

Every term is computed from the model's shapes; the engine's own formulas (``engine/memory.py``,
``kv_bytes_per_token`` and ``StateSlotPool.bytes_per_slot``) are mirrored here without importing
torch, and tests check that the two agree.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..engine.graph_buckets import BUCKETS, PIECES_SHARE, activation_per_token, buckets_within, kept_bytes, kept_per_token, piece_tokens
from .model_info import ModelShape, ParamCounts

MiB = 1 << 20
GiB = 1 << 30

# bits per quantised matrix weight, scales included (group 128 with a 16-bit scale and zero point
# for 4-bit; a 16-bit scale per 128-block for 8-bit); the formats the server holds weights in
WEIGHT_BITS = {"fp32": 32.0, "bf16": 16.0, "fp16": 16.0, "int8": 8.125, "4bit": 4.25}
# a 4-bit checkpoint stored symmetric (GPTQ's sym): held as its scales alone, no offsets
# (``layers/linear.TritonGroupMethod``'s zero point 8)
SYMMETRIC_4BIT = 4.125
CUDA_CONTEXT = 640 * MiB  # CUDA context, cuBLAS workspace and the caching allocator's slack
# of it, what lies inside torch's allocator (cuBLAS workspaces, the allocator's rounding): all
# that a cap on the process's torch allocations (``--gpu-memory-gib``) holds of it
ALLOCATOR_SHARE = 128 * MiB
HELD_MARGIN = 256 * MiB  # kept under such a cap: nothing else shares it, the plan's own error
GRAPH_ALLOWANCE = 64 * MiB  # CUDA graphs: a fixed part and a part per lane (decode batch sizes)
GRAPH_PER_LANE = 4 * MiB
# steps with prompt rows replayed from CUDA graphs in pieces: each bucket up to this many tokens
# or a whole step's chunk keeps its tensors in the graphs' pool, all of them within a share of
# the memory the weights leave (``engine/cuda_graph_mixed.py``, the launch setting
# ``mixed_graph_tokens``)
PIECE_TOKENS = 2048
SCORE_BLOCK = (1 << 26) * 4  # engine/layers/attention.py: fp32 score block per query chunk
# weights held quantized on a GPU: prompt rows dequantize a block of this many weight elements
# at a time into one buffer for cuBLAS (``engine/layers/linear.DEQUANT_BLOCK_ELEMENTS``)
DEQUANT_BLOCK_ELEMENTS = 1 << 25
# prefix checkpoints kept on the device by default: their state slots (hybrid models), as the
# engine sizes them (``engine/memory.prefix_checkpoints``): four per lane, at least 16, halved
# while their slots would take more than a quarter of the free memory
CHECKPOINTS_PER_LANE, MIN_CHECKPOINTS, CHECKPOINT_SHARE = 4, 16, 0.25


def weight_bytes(params: ParamCounts, fmt: str, compute_bytes: int, bits: float | None = None) -> int:
    """Matrices in ``fmt`` (at ``bits`` a weight where given); embeddings, norms and the like in
    the compute dtype (never below 16-bit)."""
    bits = WEIGHT_BITS[fmt] if bits is None else bits
    rest = (params.embeddings + params.other) * max(compute_bytes, 2 if bits < 16 else compute_bytes)
    return int(params.matrices * bits / 8) + rest


def model_weight_bytes(shape: ModelShape, s: "Settings") -> int:
    """``weight_bytes`` on the device for ``s``: an untied model's token table off it with
    ``embedding_host``, and its LM head at ``head_bits`` a weight where set (``--head-weights``)."""
    symmetric = s.weights == "4bit" and shape.quant_symmetric
    full = weight_bytes(shape.params, s.weights, s.elt, SYMMETRIC_4BIT if symmetric else None)
    if shape.config.tie_word_embeddings:
        return full
    table = head = shape.params.embeddings // 2
    per = max(s.elt, 2 if WEIGHT_BITS[s.weights] < 16 else s.elt)
    saved = table * per if s.embedding_host else 0
    if s.head_bits is not None:
        saved += head * per - int(head * s.head_bits / 8)
    return full - saved


KV_SCALE_BYTES = 4  # one-byte KV elements (--kv-dtype fp8 / int8): an fp32 scale per token and KV head
KV4_GROUP = 32  # 4-bit KV values (--kv-dtype 4bit): an fp16 scale per group of 32 of the head dim
KV4_SCALE_BYTES = 2
KV4_KEY_RANGE_BYTES = 4  # 4-bit KV keys: an fp16 step and minimum per channel and page
KV_PAGE = 16  # tokens per KV page (the engine's default page_size)


def kv_bytes_per_token(shape: ModelShape, elt: float, attention_layers: int | None = None) -> int:
    """K and V of one token in every attention layer, ``elt`` bytes per element (1: fp8 / int8,
    0.5: 4bit, with their scales)."""
    layers = shape.n_attention if attention_layers is None else attention_layers
    d = shape.config.head_dim
    heads = shape.config.num_key_value_heads
    if elt == 0.5:  # key codes and ranges per page, value codes and their groups' scales
        page = layers * heads * (KV_PAGE * (d + KV4_SCALE_BYTES * (d // min(KV4_GROUP, d))) + KV4_KEY_RANGE_BYTES * d)
        return -(-page // KV_PAGE)
    row = d * int(elt) + (KV_SCALE_BYTES if elt == 1 else 0)
    return 2 * layers * heads * row


def state_bytes_per_lane(shape: ModelShape, elt: int, state_elt: int = 4) -> int:
    """Conv state (compute dtype) + recurrent state (``state_elt`` bytes: 4 fp32, 2 for
    ``--state-dtype`` bf16 / fp16) of every GDN layer for one sequence."""
    c = shape.config
    if not shape.n_gdn:
        return 0
    key_dim = c.linear_num_key_heads * c.linear_key_head_dim
    conv = (c.linear_conv_kernel_dim - 1) * (2 * key_dim + c.linear_num_value_heads * c.linear_value_head_dim)
    recurrent = c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim
    return shape.n_gdn * (conv * elt + recurrent * state_elt)


@dataclass(frozen=True)
class Settings:
    lanes: int
    context: int
    prefill_chunk: int
    drafts: int
    weights: str  # a WEIGHT_BITS key
    elt: int  # bytes of the compute dtype (and of the KV cache's elements, unless kv_elt says)
    cuda: bool
    page_size: int = 16
    kv_elt: float | None = None  # bytes of a KV element: 1 for --kv-dtype fp8 / int8, 0.5 for 4bit (None: elt)
    state_elt: int = 4  # bytes of a GDN recurrent state element: 2 for --state-dtype bf16 / fp16
    vision: bool = False  # --vision: the vision tower and its largest image's activations
    checkpoints: int = 0  # prefix checkpoints kept on the device (--prefix-checkpoints): a state slot each
    embedding_host: bool = False  # --embedding-host: an untied model's token table in host memory
    head_bits: float | None = None  # bits a weight of an untied LM head held quantized (None: the compute dtype)
    device_free: int = 0  # bytes free on the device before the server loads (0: not known, no share taken)
    held: bool = False  # the device's memory is --gpu-memory-gib's cap on torch's allocations

    @property
    def kv_tokens(self) -> int:
        """The shared KV pool: every lane can hold a whole context at once."""
        tokens = self.lanes * self.context
        return -(-tokens // self.page_size) * self.page_size


def footprint(shape: ModelShape, s: Settings) -> dict[str, int]:
    """Bytes by part; their sum is what the server takes on the device."""
    c = shape.config
    mtp = s.drafts > 0 and shape.mtp_layers > 0
    workspace = s.prefill_chunk * activation_per_token(c, s.elt)  # engine/memory.py
    workspace += s.lanes * (s.drafts + 1) * c.vocab_size * 4  # fp32 logits of every decode row
    if s.cuda and WEIGHT_BITS[s.weights] < 16:
        workspace += DEQUANT_BLOCK_ELEMENTS * s.elt
    if not s.cuda and shape.n_attention:  # the CPU's attention gathers a sequence's K/V, expanded to fp32 per head
        gathered = 2 * c.num_key_value_heads * c.head_dim * s.elt
        expanded = 2 * c.num_attention_heads * c.head_dim * 4
        workspace += s.context * (gathered + expanded) + SCORE_BLOCK
    parts = {
        "weights": model_weight_bytes(shape, s),
        "mtp_weights": weight_bytes(shape.mtp_params, s.weights, s.elt) if mtp else 0,
        "kv_pool": s.kv_tokens * kv_bytes_per_token(shape, s.kv_elt or s.elt),
        "mtp_kv": s.kv_tokens * kv_bytes_per_token(shape, s.kv_elt or s.elt, shape.mtp_layers) if mtp else 0,
        # one state per lane, plus one per draft position so that a rejected draft needs no replay
        "states": s.lanes * (1 + s.drafts) * state_bytes_per_lane(shape, s.elt, s.state_elt),
        # a state slot per prefix checkpoint on the device, and (CUDA) a few for their copies to
        # host memory in flight (``engine/memory.moving_slots``)
        "checkpoints": (s.checkpoints + (min(4, max(1, s.checkpoints // 4)) if s.cuda and s.checkpoints else 0))
        * state_bytes_per_lane(shape, s.elt, s.state_elt),
        "workspace": workspace,
        "cuda_graphs": GRAPH_ALLOWANCE + s.lanes * GRAPH_PER_LANE + piece_bytes(shape, s) if s.cuda else 0,
        "cuda_context": context_bytes(s),
        "vision": (shape.vision_params + shape.vision_activations) * s.elt if s.vision else 0,
    }
    return parts


def piece_bytes(shape: ModelShape, s: Settings) -> int:
    """What the pieces' buckets keep (``cuda_graph_mixed.kept_per_token``): every bucket that
    holds at most ``PIECE_TOKENS`` or the step's chunk, within ``PIECES_SHARE`` of what the weights
    leave of ``s.device_free`` (all of them where that is not known), as the engine captures them,
    the largest bucket's activations while it is captured counted in."""
    per_token, shared = kept_per_token(shape.config, s.elt)
    top = piece_tokens(PIECE_TOKENS, s.prefill_chunk)
    budget = None
    if s.device_free:
        left = s.device_free - model_weight_bytes(shape, s) - context_bytes(s)
        budget = int(PIECES_SHARE * max(left, 0))
    shared += activation_per_token(shape.config, s.elt)  # the largest bucket's work while it is captured
    kept = buckets_within([b for b in BUCKETS if b <= top], per_token, shared, 1, budget)
    return int(kept_bytes(kept, per_token, shared, 1)) if kept else 0


def default_checkpoints(shape: ModelShape, s: Settings, free: int) -> int:
    """The device prefix checkpoints the engine keeps by default for ``s``'s lanes with ``free``
    bytes free (0 where a checkpoint holds no state slot: attention-only models share pages)."""
    slot = state_bytes_per_lane(shape, s.elt, s.state_elt)
    if not slot:
        return 0
    n = max(MIN_CHECKPOINTS, CHECKPOINTS_PER_LANE * s.lanes)
    while n > MIN_CHECKPOINTS and n * slot > CHECKPOINT_SHARE * free:
        n //= 2
    return n


def context_bytes(s: Settings) -> int:
    """The CUDA context's part of the footprint: all of it on a card, what torch's allocator holds of
    it under ``--gpu-memory-gib`` (the context itself lies outside that cap)."""
    return 0 if not s.cuda else ALLOCATOR_SHARE if s.held else CUDA_CONTEXT


def margin_bytes(total: int, cuda: bool, held: bool = False) -> int:
    """Left free for the desktop and other programs (under WSL the driver pages GPU memory to system
    RAM when it runs short, which slows every kernel: better to leave some); under a cap on this
    process's allocations, which no other program shares, ``HELD_MARGIN``."""
    if held:
        return HELD_MARGIN
    if cuda:
        return max(512 * MiB, int(total * 0.03))
    return max(1 * GiB, int(total * 0.10))


def human(n: float) -> str:
    return f"{n / GiB:.1f} GiB" if n >= GiB else f"{n / MiB:.0f} MiB"
