"""Settings of one engine instance, validated at startup."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .cache.kv_quant import KV4_GROUP, KV_DTYPES, page_shapes, storage_dtype
from .config import ModelConfig
from .layers.fused_linear import MAX_TENSOR_ELEMENTS

# fla-core's chunked Gated DeltaNet keeps one [K, V] state per head for every chunk of this many tokens
GDN_CHUNK = 64
# how weights are held (``loader.load_model``): "auto" as the checkpoint stores them, a GGUF
# file's Q4_0 / Q4_1 / Q4_K / Q5_K / Q6_K / Q8_0 matrices and GPTQ / AWQ projections kept quantized where a
# linear method takes them (``layers/linear.py``: 4 and 8-bit groups, on the CPU
# and the GPU), every other tensor (FP8 ones dequantized) in ``dtype``; "dense" every tensor dequantized
# to ``dtype``; "int8" / "int4" the projections quantized at load (per-row int8, int4 in groups of
# 128; int8 on the CPU only)
WEIGHT_FORMATS = ("auto", "dense", "int8", "int4")
QUANTIZED_AT_LOAD = {"int8": 8, "int4": 4}
# speculative decoding (``spec.py``): "off"; "ngram": drafts copied from where the sequence's
# last tokens occurred before (prompt lookup); "mtp": drafts from the checkpoint's MTP head
# (``models/mtp.py``); either verified by the model in the next step
SPEC_MODES = ("off", "ngram", "mtp")
# the Gated DeltaNet recurrent state's element type in its slots (``--state-dtype``)
STATE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# the untied LM head's groups on a GPU (``--head-weights``): where the projections are quantized at
# load "auto" is 8 bits; a GPTQ / AWQ checkpoint's head (stored in bf16) stays so under "auto" and is
# quantized at load under "int8" / "int4"; "int4" where a card has no room for 8 (the 27B's head:
# 1.3 GB in 8 bits, 0.7 in 4, 2.5 in bf16)
HEAD_WEIGHTS = {"auto": 8, "int8": 8, "int4": 4}
MAX_DRAFT_TOKENS = 8
MAX_MTP_DRAFT_TOKENS = 5
MAX_NGRAM = 8


@dataclass
class EngineConfig:
    max_context: int = 8192  # prompt + output tokens per request
    max_concurrency: int = 4  # active sequences, each holding one state slot
    prefill_chunk: int = 2048  # prompt tokens of one request per step
    # tokens per step over all rows: decode rows first (always), then prompt chunks of as many
    # requests as fit, oldest first (None = prefill_chunk)
    max_batched_tokens: int | None = None
    kv_capacity: int | None = None  # tokens in the KV pool; None = sized from free memory
    page_size: int = 16  # tokens per KV page
    host_cache_mib: int = 1024  # host memory for paused requests' snapshots and prefix checkpoints off the device
    max_pending: int = 64  # requests waiting for admission beyond max_concurrency
    pending_timeout_s: float | None = None  # a request not admitted within this fails (None = never)
    # prefix checkpoints (``cache/prefix.py``): a request's state kept where its prompt ends, so
    # a later prompt that starts with it goes on from there; at most this many kept (None: four
    # per concurrent request, at least 16, as memory allows: ``memory.prefix_checkpoints``)
    prefix_cache: bool = True
    prefix_checkpoints: int | None = None
    # a long prefill keeps a checkpoint every this many prompt tokens (the newest only), so a
    # prompt cancelled part-way and sent again goes on from the last one (0 = none)
    progress_anchor: int = 16384
    # a step with prompt rows beside decoding ones takes at most this many decode steps' time
    # (``pace.py``: its prompt tokens capped from the steps' measured times, the bound widened
    # where more requests wait for their first token than decode); 0: the token budget alone.
    # Off by default: where a step with prompt rows has a large fixed cost (the 9B's on an H100:
    # about 30 ms, its decode step 7.5), small chunks multiply it and a burst's first tokens wait
    decode_gap: float = 0.0
    cuda_graphs: bool = True  # capture decode steps, and steps with prompt rows in pieces, in CUDA graphs (CUDA only)
    # launch the next decode step before reading this one's tokens (None = on CUDA, where the
    # device runs on while the host reads; on a CPU the launch is the computation itself)
    overlap: bool | None = None
    device: str = "cpu"
    dtype: torch.dtype = torch.float32
    weights: str = "auto"  # one of WEIGHT_FORMATS
    head_weights: str = "auto"  # one of HEAD_WEIGHTS (with weights int8 / int4 on a GPU)
    # the token embedding's table in pinned host memory, its rows read in place by the GPU's
    # lookups (``layers/embedding.py``): the 27B's 2.5 GB off the card
    embedding_host: bool = False
    # the most GPU memory this process takes, in GiB (torch's per-process memory fraction; None:
    # the whole card): what the KV pool is sized against, and a limit the allocator holds to
    gpu_memory_gib: float | None = None
    # speculative decoding: drafts of up to ``draft_tokens`` tokens per decoding request, each
    # checked by the model in the step that runs it (``spec.py``); "ngram" takes them from the
    # latest earlier place where the sequence's last ``ngram_max`` .. ``ngram_min`` tokens occur
    spec: str = "off"  # one of SPEC_MODES
    draft_tokens: int = 4
    ngram_min: int = 1
    ngram_max: int = 3
    # the KV pages' element type, one of KV_DTYPES: "auto" the compute dtype, "bf16", or "fp8"
    # (e4m3) / "int8" with an fp32 scale per token and KV head, "4bit" two elements per byte, keys with
    # a range per page and channel, values with an fp32 scale per 32 of the head dim (``cache/kv_quant.py``)
    kv_dtype: str = "auto"
    # the Gated DeltaNet recurrent state's element type in its slots, one of STATE_DTYPES: updated
    # in fp32 by the layers either way, stored rounded to it once per step (bf16 / fp16 halve the
    # slots' and the prefix checkpoints' bytes)
    state_dtype: str = "fp32"
    # load the checkpoint's vision tower and take requests with images (``vision/``)
    vision: bool = False
    # torch's intra-op threads in the process that runs the engine (0: torch's default, one per
    # core); on a machine whose cores the gateway, its clients or other work share, fewer threads
    # leave them a core where the engine's threads would otherwise wait on each other
    cpu_threads: int = 0
    # on the CPU, torch's threads for a step of one token (one stream decoding; 0: as every
    # step). The server sets one fewer than the engine's threads: its gateway and the client
    # wake on every token of a lone stream, and on cores they share a step's threads stall on
    # whichever one they preempt (the embedded model through HTTP on 2 cores: 33.8 tok/s with two
    # threads, 46.4 with one; steps of several rows or prompt tokens keep every thread)
    cpu_threads_one_token: int = 0
    # tensor parallelism (``parallel.py``): ranks, one process each, every layer split over them;
    # without speculative decoding, the vision tower, the host tier or CUDA graphs
    tensor_parallel: int = 1

    def __post_init__(self) -> None:
        checks = [
            ("max_context", self.max_context >= 16, "must be >= 16"),
            ("max_concurrency", 1 <= self.max_concurrency <= 64, "must be between 1 and 64"),
            ("prefill_chunk", self.prefill_chunk >= 16, "must be >= 16"),
            ("max_batched_tokens", self.max_batched_tokens is None or self.max_batched_tokens >= 16, "must be >= 16"),
            ("kv_capacity", self.kv_capacity is None or self.kv_capacity >= self.max_context,
             f"must hold at least one request of max_context ({self.max_context}) tokens"),
            ("page_size", 1 <= self.page_size <= 1024, "must be between 1 and 1024"),
            ("host_cache_mib", self.host_cache_mib >= 0, "must be >= 0"),
            ("max_pending", self.max_pending >= 0, "must be >= 0"),
            ("pending_timeout_s", self.pending_timeout_s is None or self.pending_timeout_s > 0, "must be > 0"),
            ("prefix_checkpoints", self.prefix_checkpoints is None or 0 <= self.prefix_checkpoints <= 1024,
             "must be between 0 and 1024"),
            ("decode_gap", self.decode_gap == 0 or self.decode_gap >= 1.5,
             "must be 0 (none) or >= 1.5"),
            ("progress_anchor", self.progress_anchor == 0 or self.progress_anchor >= 16, "must be 0 (none) or >= 16"),
            ("weights", self.weights in WEIGHT_FORMATS, f"must be one of {', '.join(WEIGHT_FORMATS)}"),
            ("head_weights", self.head_weights in HEAD_WEIGHTS, f"must be one of {', '.join(HEAD_WEIGHTS)}"),
            ("head_weights", self.head_weights == "auto" or self.weights != "dense" and self.on_gpu,
             "applies to quantized weights on a GPU (--weights int8 / int4, or a GPTQ / AWQ checkpoint under "
             "--weights auto, with a CUDA device)"),
            ("embedding_host", not self.embedding_host or self.on_gpu and self.tensor_parallel == 1,
             "needs a CUDA device and no tensor parallelism (on the CPU the table is in host memory already)"),
            ("gpu_memory_gib", self.gpu_memory_gib is None or self.gpu_memory_gib > 0 and self.on_gpu,
             "must be > 0, with a CUDA device"),
            ("spec", self.spec in SPEC_MODES, f"must be one of {', '.join(SPEC_MODES)}"),
            ("draft_tokens", 1 <= self.draft_tokens <= MAX_DRAFT_TOKENS, f"must be between 1 and {MAX_DRAFT_TOKENS}"),
            ("draft_tokens", self.spec != "mtp" or self.draft_tokens <= MAX_MTP_DRAFT_TOKENS,
             f"must be between 1 and {MAX_MTP_DRAFT_TOKENS} with spec 'mtp'"),
            ("ngram_min", 1 <= self.ngram_min <= MAX_NGRAM, f"must be between 1 and {MAX_NGRAM}"),
            ("ngram_max", self.ngram_min <= self.ngram_max <= MAX_NGRAM,
             f"must be between ngram_min ({self.ngram_min}) and {MAX_NGRAM}"),
            ("kv_dtype", self.kv_dtype in KV_DTYPES, f"must be one of {', '.join(KV_DTYPES)}"),
            ("state_dtype", self.state_dtype in STATE_DTYPES, f"must be one of {', '.join(STATE_DTYPES)}"),
            ("cpu_threads", self.cpu_threads >= 0, "must be >= 0 (0: one per core)"),
            ("cpu_threads_one_token", self.cpu_threads_one_token >= 0, "must be >= 0 (0: as every step)"),
            ("tensor_parallel", 1 <= self.tensor_parallel <= 64, "must be between 1 and 64"),
        ]
        for name, ok, why in checks:
            if not ok:
                raise ValueError(f"{name} {why}, got {getattr(self, name)!r}")
        if self.tensor_parallel > 1:
            self._check_parallel()

    def _check_parallel(self) -> None:
        """What tensor parallelism does not run, refused at start with the flag to change."""
        tp = f"tensor_parallel {self.tensor_parallel} (--tp)"
        if self.spec != "off":
            raise ValueError(f"{tp} runs without speculative decoding: serve with --spec off")
        if self.vision:
            raise ValueError(f"{tp} runs without the vision tower: serve without --vision")
        if self.host_cache_mib:
            raise ValueError(f"{tp} keeps no host copies of the caches (prefix checkpoints, paused requests): "
                             "serve with --host-cache-mib 0")

    @property
    def on_gpu(self) -> bool:
        return torch.device(self.device).type == "cuda"

    @property
    def head_bits(self) -> int | None:
        """The LM head's bits asked for (None: "auto", as ``loader.load_model`` reads it)."""
        return None if self.head_weights == "auto" else HEAD_WEIGHTS[self.head_weights]

    @property
    def kv_storage_dtype(self) -> torch.dtype:
        """The KV pages' torch dtype (``kv_dtype`` resolved against ``dtype``)."""
        return storage_dtype(self.kv_dtype, self.dtype)

    @property
    def state_storage_dtype(self) -> torch.dtype:
        """The recurrent state slots' torch dtype."""
        return STATE_DTYPES[self.state_dtype]

    @property
    def step_tokens(self) -> int:
        """The step's token budget (``max_batched_tokens``, or ``prefill_chunk`` when unset)."""
        return self.prefill_chunk if self.max_batched_tokens is None else self.max_batched_tokens

    def check_for_model(self, model: ModelConfig) -> None:
        """Settings that depend on the model's shape; a ValueError names the flag and the
        largest value that works."""
        if self.spec == "mtp" and not model.mtp_layers:
            raise ValueError(f"spec 'mtp' needs the checkpoint's MTP head (mtp.* weights, mtp_num_hidden_layers), "
                             f"which this {model.family} model does not have (or was loaded without): "
                             "serve it with --spec ngram or off")
        if model.head_dim and self.kv_dtype != "auto":
            try:
                page_shapes(model.head_dim, self.kv_storage_dtype)
            except ValueError:
                raise ValueError(f"kv_dtype {self.kv_dtype!r} needs a head_dim that is even and a multiple of "
                                 f"{KV4_GROUP} (or below it); this model's is {model.head_dim}: use int8 or fp8"
                                 ) from None
        if self.vision and (model.vision is None or model.image_token_id is None):
            raise ValueError(f"vision needs a checkpoint with a vision tower (vision_config, model.visual.*), "
                             f"which this {model.family} model does not have: serve it without --vision")
        limit = max_prefill_chunk(model)
        for name, value, flag in (("prefill_chunk", self.prefill_chunk, "--prefill-chunk"),
                                  ("max_batched_tokens", self.step_tokens, "--max-batched-tokens")):
            if value > limit:
                raise ValueError(f"{name} {value} is too long for this model: a step's widest tensor would "
                                 f"reach 2^31 elements; the largest that works is {limit} ({flag})")


def max_prefill_chunk(model: ModelConfig) -> int:
    """The most prompt tokens one step can run: every tensor that spans the whole chunk stays
    under ``MAX_TENSOR_ELEMENTS`` (cuBLAS and the Triton kernels index with 32 bits). The MLP's
    intermediate runs on row blocks (``GatedMLP``); the widest left per token are the hidden
    state, the query projection (with its gates where attention is gated), the Gated DeltaNet's
    projections (Qwen3-Next's fused q/k/v/z; Qwen3.5's parts come out one by one past
    ``fused_linear.SPLIT_ROWS``) and its chunked kernel's per-chunk states. 174,762 tokens for
    the 27B, whose gated queries are 12,288 wide."""
    gated = model.family in ("qwen3_5", "qwen3_5_moe", "qwen3_next")
    widths = [model.hidden_size, model.num_attention_heads * model.head_dim * (2 if gated else 1)]
    if model.is_hybrid:
        key_dim = model.linear_num_key_heads * model.linear_key_head_dim
        value_dim = model.linear_num_value_heads * model.linear_value_head_dim
        widths.append(2 * key_dim + 2 * value_dim if model.family == "qwen3_next" else max(key_dim, value_dim))
        state = model.linear_num_value_heads * model.linear_key_head_dim * model.linear_value_head_dim
        widths.append(state // GDN_CHUNK)
    return MAX_TENSOR_ELEMENTS // max(widths)
