"""The token-count buckets of the CUDA graphs in pieces (``cuda_graph_mixed.py``) and what they
keep in memory, from the model's shapes alone (no torch: the launcher's plan reads it too)."""
from __future__ import annotations

# at most a fifth of a step's tokens padding above 32 (a 512-token prompt beside 8 decode rows
# runs as 576 tokens, not 768): the buckets keep nothing of their own, so more cost only capture time
BUCKETS = (16, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384, 448, 512, 576, 640, 768, 896, 1024,
           1280, 1536, 1792, 2048)
GDN_CHUNK = 64  # the Gated DeltaNet prompt kernels' chunk (models.base.GDN_CHUNK, whose module needs torch)
# of the device memory free before the caches are sized, the most the pieces keep (mostly the
# largest bucket's work while it is captured: 3.5% keeps a 16 GB card's 9B at 262,144 tokens with
# its LM head in 8 bits, the 2,048-token bucket left out there)
PIECES_SHARE = 0.035


def piece_tokens(setting: int, step_tokens: int) -> int:
    """The largest bucket worth capturing: the launch setting ``mixed_graph_tokens``, or less where
    the engine's step budget never fills it (the smallest bucket that holds a whole step)."""
    fits = [b for b in BUCKETS if b >= step_tokens]
    return min(setting, fits[0] if fits else BUCKETS[-1])


def activation_per_token(config, elt: int) -> int:
    """A step's activations per token, generously: a few hidden-sized buffers and the MLP's
    (the widest of the dense MLP and the routed experts a token reaches), ``elt`` bytes each."""
    inter = max(config.intermediate_size, config.moe_intermediate_size * max(config.num_experts_per_tok, 1))
    return (8 * config.hidden_size + 3 * inter) * elt


def kept_per_token(config, elt: int) -> tuple[int, int]:
    """The bytes a bucket keeps of its own per token (none: its final hidden states go to the
    shared output) and the shared static tensors' per token (``cuda_graph_mixed._Capture``: the
    final hidden states, one set of the cores' inputs and outputs per kind of core, attention's
    query (with its output gate on the hybrid models), key, value and output, the Gated
    DeltaNet's q/k/v, z, a, b and output), for a model of ``config`` whose activations take
    ``elt`` bytes: what the probe measures, from the shapes alone (the launcher's plan)."""
    types = config.layer_types
    shared = 0
    if any(t == "full_attention" for t in types):
        heads, kv, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        shared += heads * d * (2 if config.is_hybrid else 1) + 2 * kv * d + heads * d
    if any(t == "linear_attention" for t in types):
        key = config.linear_num_key_heads * config.linear_key_head_dim
        value = config.linear_num_value_heads * config.linear_value_head_dim
        shared += 2 * key + 2 * value + 2 * config.linear_num_value_heads + value
    return 0, (config.hidden_size + shared) * elt


def kept_bytes(buckets: list[int], per_token: float, shared_per_token: float, kinds: int) -> float:
    """What ``buckets`` keep: ``per_token`` bytes a token of each for each of ``kinds``, and the
    shared outputs ``shared_per_token`` a token of the largest."""
    return kinds * sum(buckets) * per_token + (max(buckets) * shared_per_token if buckets else 0)


def buckets_within(buckets: list[int], per_token: float, shared_per_token: float, kinds: int,
                   budget: int | None) -> list[int]:
    """The buckets, smallest first, whose pieces fit ``budget`` bytes (``kept_bytes``; None: no
    limit)."""
    kept = sorted(buckets)
    while budget is not None and kept and kept_bytes(kept, per_token, shared_per_token, kinds) > budget:
        kept.pop()
    return kept


def gdn_core_bytes(config, t: int, rows: int, elt: int) -> int:
    """What one Gated DeltaNet core inside a captured bucket of ``t`` tokens and up to ``rows``
    prompt rows takes in the graphs' pool while it runs (``backends.TritonLinearAttention.graph_rows``:
    the conv's q, k, v, fla-core's decay, strengths, A, w, u, new values and output, the chunks'
    states, the rows' gathered and final states, the output norm's result); one core's worth,
    the next core reusing it."""
    hk, hv = config.linear_num_key_heads, config.linear_num_value_heads
    dk, dv = config.linear_key_head_dim, config.linear_value_head_dim
    per_token = (2 * hk * dk + 6 * hv * dv + GDN_CHUNK * hv) * elt + 2 * hv * 4
    chunks = -(-t // GDN_CHUNK) + rows
    return t * per_token + chunks * hv * dk * dv * elt + 2 * rows * hv * dk * dv * 4


def rows_buckets_within(buckets: list[int], config, rows: int, elt: int, budget: int | None) -> list[int]:
    """The buckets of kinds ONE and FEW (``rows`` prompt rows at most), smallest first, that fit
    ``budget`` bytes: they keep nothing of their own (their outputs are the shared ones of kind
    PROMPT's buckets, at least as large), and the largest's core runs once at a time (None: no
    limit)."""
    kept = sorted(buckets)
    while budget is not None and kept and gdn_core_bytes(config, kept[-1], rows, elt) > budget:
        kept.pop()
    return kept
