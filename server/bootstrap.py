"""From command-line settings to a loaded model, a running engine and the gateway's state."""
from __future__ import annotations

import argparse
import dataclasses
import logging
import os
from pathlib import Path

import torch

from ..engine import launch, parallel
from ..engine.async_engine import AsyncEngine
from ..engine.engine import LLMEngine
from ..engine.engine_config import EngineConfig
from ..engine.frontend.chat_template import ChatTemplate, builtin_template
from ..engine.frontend.tokenizer import Tokenizer
from ..engine.loader import Checkpoint, load_checkpoint, load_model
from ..engine.loop import EngineLoop
from ..engine.process import EngineProcess
from . import observability
from .middleware import cors_settings
from .state import SamplingDefaults, ServerState, ThinkingDefaults
from .workers import PrepareWorkers

log = logging.getLogger("ninfer.server")

MAX_DEFAULT_CONTEXT = 32768
QWEN_FAMILIES = ("qwen3_5", "qwen3_5_moe", "qwen3_next")


def resolve_device(name: str) -> str:
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: no CUDA device is available (torch {torch.__version__})")
    if name != "cpu" and not name.startswith("cuda"):
        raise ValueError(f"--device must be auto, cpu, cuda or cuda:N, got {name!r}")
    return name


def resolve_dtype(name: str, device: str) -> torch.dtype:
    from .cli import DTYPES

    if name == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    return DTYPES[name]


def resolve_tokenizer(ckpt: Checkpoint, source: str | None) -> Tokenizer:
    if source is None and ckpt.tokenizer is not None:
        return ckpt.tokenizer
    if source is None and ckpt.config.family in QWEN_FAMILIES:
        source = "qwen3.6"
    if source in ("qwen3.5", "qwen3.6"):
        from ..engine.frontend.qwen_tiktoken import load_qwen_tiktoken

        return load_qwen_tiktoken(source)
    if source is not None and (Path(source) / "tokenizer.json").is_file():
        from ..engine.frontend.hf_tokenizer import HFTokenizer

        return HFTokenizer.from_dir(source)
    raise ValueError(
        f"{ckpt.source} has no tokenizer; pass --tokenizer DIR (with tokenizer.json) or --tokenizer qwen3.6"
    )


def resolve_template(ckpt: Checkpoint, tokenizer: Tokenizer, path: str | None) -> ChatTemplate:
    if path is not None:
        source = Path(path).read_text(encoding="utf-8")
    elif ckpt.chat_template:
        source = ckpt.chat_template
    elif ckpt.config.family in QWEN_FAMILIES:
        source = builtin_template("qwen3_5")
    else:
        raise ValueError(f"{ckpt.source} has no chat template; pass --chat-template FILE")
    return ChatTemplate(source, bos_token=tokenizer.bos_token or "", eos_token=tokenizer.eos_token or "")


def sampling_defaults(args: argparse.Namespace, ckpt: Checkpoint) -> SamplingDefaults:
    gen = ckpt.generation
    base = SamplingDefaults()

    def pick(flag, from_config, fallback):
        return flag if flag is not None else from_config if from_config is not None else fallback

    return SamplingDefaults(
        temperature=pick(args.temperature, gen.temperature, base.temperature),
        top_p=pick(args.top_p, gen.top_p, base.top_p),
        top_k=pick(args.top_k, gen.top_k, base.top_k),
        min_p=pick(args.min_p, gen.min_p, base.min_p),
        repetition_penalty=pick(args.repetition_penalty, gen.repetition_penalty, base.repetition_penalty),
    )


def gateway_settings(args: argparse.Namespace) -> dict:
    """The gateway's own flags as ``ServerState`` fields (validated here, at startup)."""
    from .openai_responses.sealing import ReasoningSeal
    from .openai_responses.store import ResponseStore

    for flag, value in (("--max-request-mib", args.max_request_mib), ("--response-store-mib", args.response_store_mib)):
        if value <= 0:
            raise ValueError(f"{flag} must be > 0, got {value}")
    if args.default_max_tokens is not None and args.default_max_tokens < 0:
        raise ValueError(f"--default-max-tokens must be >= 0, got {args.default_max_tokens}")
    # without --cors, pages served from this machine may call the API, as llama-server allows
    origins = ("localhost",) if args.cors is None else tuple(o.strip() for o in args.cors.split(",") if o.strip())
    cors_settings(origins)  # refuses what is not an origin at start
    return dict(
        thinking=ThinkingDefaults(enable_thinking=False if args.no_thinking else None,
                                  preserve_thinking=True if args.preserve_thinking else None,
                                  budget=args.default_thinking_budget, loop=args.reasoning_loop),
        default_max_tokens=args.default_max_tokens,
        max_request_bytes=int(args.max_request_mib * (1 << 20)),
        cors_origins=origins,
        responses=ResponseStore(int(args.response_store_mib * (1 << 20))),
        reasoning_seal=ReasoningSeal.from_file(Path(args.reasoning_key_file) if args.reasoning_key_file else None),
        strict_tools=args.strict_tools,
        strict_model_names=args.strict_model_names,
        workers=PrepareWorkers(args.prepare_threads),
    )


def public_names(args: argparse.Namespace, default_id) -> dict:
    """``model_id`` and ``aliases``: ``--model-id`` then ``--served-model-name`` in order, without
    repeats; the model's own name (``default_id(args.model)``) when neither is given."""
    given = [args.model_id] if args.model_id else []
    names = list(dict.fromkeys([*given, *(getattr(args, "served_model_name", None) or [])]))
    for name in names:
        if not name.strip():
            raise ValueError("--model-id / --served-model-name: a model name must not be empty")
    if not names:
        names = [default_id(args.model)]
    return dict(model_id=names[0], aliases=tuple(names[1:]))


def eos_ids(ckpt: Checkpoint, tokenizer: Tokenizer) -> frozenset[int]:
    ids = set(ckpt.generation.eos_token_ids) | set(ckpt.config.eos_token_ids)
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)


def engine_config(args: argparse.Namespace, max_context: int, device: str, dtype: torch.dtype) -> EngineConfig:
    return EngineConfig(
        max_context=max_context,
        max_concurrency=args.max_concurrency,
        prefill_chunk=args.prefill_chunk,
        max_batched_tokens=args.max_batched_tokens,
        kv_capacity=None if args.kv_capacity == "auto" else int(args.kv_capacity),
        page_size=args.kv_page_size,
        host_cache_mib=host_cache_mib(args.host_cache_mib, device, args.tp),
        max_pending=args.max_pending_requests,
        pending_timeout_s=args.pending_timeout_ms / 1000.0 if args.pending_timeout_ms else None,
        prefix_cache=args.prefix_cache,
        prefix_checkpoints=args.prefix_checkpoints,
        progress_anchor=args.progress_anchor,
        decode_gap=args.decode_gap,
        device=device,
        dtype=dtype,
        weights=args.weights,
        head_weights=args.head_weights,
        embedding_host=args.embedding_host,
        gpu_memory_gib=args.gpu_memory_gib,
        spec=args.spec,
        draft_tokens=args.draft_tokens,
        ngram_min=args.ngram_min,
        ngram_max=args.ngram_max,
        kv_dtype=args.kv_dtype,
        state_dtype=args.state_dtype,
        vision=args.vision,
        cpu_threads=args.cpu_threads,
        tensor_parallel=args.tp,
    )


def media_settings(args: argparse.Namespace, ckpt: Checkpoint, config: EngineConfig):
    """How requests' images are read (``server/media.py``): None without --vision."""
    if not config.vision:
        return None
    from .media import MediaSettings

    if args.media_live_mib <= 0:
        raise ValueError(f"--media-live-mib must be > 0, got {args.media_live_mib}")
    return MediaSettings(ckpt.image_processor, ckpt.config.image_token_id, allow_remote=args.allow_remote_media,
                         live_bytes=int(args.media_live_mib * (1 << 20)))


def host_cache_mib(value: str, device: str, tp: int = 1) -> int:
    """``--host-cache-mib``: a number, or for 'auto' on a GPU 22 GiB, or 45% of the machine's RAM
    when that is less (what is not used is not taken); 1024 on a CPU, whose KV pool is host memory
    already (only paused requests' snapshots); 0 under tensor parallelism (``--tp``), which keeps
    no host copies."""
    if value != "auto":
        return int(value)
    if tp > 1:
        return 0
    if not str(device).startswith("cuda"):
        return 1024
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 1024
    return min(22 << 10, int(ram * 0.45) >> 20)


def _settings(args: argparse.Namespace) -> tuple[Checkpoint, EngineConfig]:
    """The checkpoint (its metadata: weights are read by ``load_model``) and engine settings
    ``args`` name, checked against each other."""
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    ckpt = load_checkpoint(args.model)
    max_context = args.max_context or min(ckpt.config.max_position_embeddings, MAX_DEFAULT_CONTEXT)
    config = engine_config(args, max_context, device, dtype)
    config.check_for_model(ckpt.config)  # before the weights are read
    if config.tensor_parallel > 1:
        parallel.check_shardable(ckpt.config, config.tensor_parallel)
        if config.weights == "auto" and ckpt.quantized_weights is not None:
            raise ValueError(f"{ckpt.source} holds quantized weights, which --tp splits only dequantized: "
                             "serve it with --weights dense")
    launch.load(None, args.tuned_config)  # a bad --tuned-config file stops the start here
    return ckpt, config


def _resolve(args: argparse.Namespace) -> tuple[Checkpoint, Tokenizer, EngineConfig]:
    """``_settings`` and the tokenizer."""
    ckpt, config = _settings(args)
    return ckpt, resolve_tokenizer(ckpt, args.tokenizer), config


def _engine(ckpt: Checkpoint, tokenizer: Tokenizer, config: EngineConfig, tuned_config: str | None,
            shard: parallel.Sharder | None = None) -> LLMEngine:
    """The engine, built under the kernel launch settings of its GPU (``engine/launch.py``), with
    torch's intra-op threads set for this process (``EngineConfig.cpu_threads``); ``shard``:
    tensor parallelism's rank 0, holding its part of the model."""
    from ..engine.memory import apply_memory_cap

    apply_cpu_threads(config)
    config = one_token_threads(config)
    apply_memory_cap(config)
    launch.use(launch.load(launch.gpu_name(torch.device(config.device)), tuned_config))
    return LLMEngine(load_model(ckpt, config.device, config.dtype, config.weights, mtp=config.spec == "mtp",
                                vision=config.vision, shard=shard, embedding_host=config.embedding_host,
                                head_bits=config.head_bits), tokenizer, config)


def _join(rendezvous: parallel.Rendezvous, ckpt: Checkpoint,
          config: EngineConfig) -> tuple[parallel.Sharder, EngineConfig]:
    """This process as one tensor-parallel rank: its group joined, its part of the checkpoint and
    its device (rank ``r`` on ``cuda:r``)."""
    tp, device = parallel.join(rendezvous, config.device)
    return parallel.Sharder(ckpt.config, tp.rank, tp.world_size), dataclasses.replace(config, device=device)


def serve_rank(args: argparse.Namespace, rendezvous: parallel.Rendezvous) -> None:
    """A tensor-parallel rank >= 1 (``--tp``): its part of the model loaded, then the steps rank 0
    sends run until it ends them (``engine/tp_steps.py``)."""
    from ..engine.cache.manager import CacheManager
    from ..engine.tp_steps import follow

    ckpt, config = _settings(args)
    shard, config = _join(rendezvous, ckpt, config)
    apply_cpu_threads(config)
    launch.use(launch.load(launch.gpu_name(torch.device(config.device)), args.tuned_config))
    model = load_model(ckpt, config.device, config.dtype, config.weights, shard=shard)

    def caches(plan) -> CacheManager:
        return CacheManager(model.config, max(plan.num_pages, 1), plan.page_size, plan.num_slots, config.dtype,
                            config.device, kv_dtype=config.kv_storage_dtype, state_dtype=config.state_storage_dtype,
                            write_slots=plan.write_slots)

    follow(model, caches)
    parallel.leave()


def apply_cpu_threads(config: EngineConfig) -> None:
    """torch's intra-op threads for this process, ``config.cpu_threads`` when set: every thread
    that runs torch ops from then on (the engine loop's too) takes that many."""
    if config.cpu_threads:
        torch.set_num_threads(config.cpu_threads)


def one_token_threads(config: EngineConfig) -> EngineConfig:
    """On the CPU, ``config`` with its steps of one token on one fewer thread than the others
    (``EngineConfig.cpu_threads_one_token``, unless set): the gateway and its clients share
    these cores and wake on every token of a lone stream."""
    threads = torch.get_num_threads()
    if torch.device(config.device).type != "cpu" or config.cpu_threads_one_token or threads < 2:
        return config
    return dataclasses.replace(config, cpu_threads_one_token=threads - 1)


def build_engine(args: argparse.Namespace, rendezvous: parallel.Rendezvous | None = None) -> LLMEngine:
    """The engine ``args`` name, weights loaded: what the engine process runs (``rendezvous``:
    as tensor parallelism's rank 0)."""
    ckpt, tokenizer, config = _resolve(args)
    shard = None
    if rendezvous is not None:
        shard, config = _join(rendezvous, ckpt, config)
    return _engine(ckpt, tokenizer, config, args.tuned_config, shard)


def build_state(args: argparse.Namespace) -> tuple[ServerState, EngineLoop | EngineProcess]:
    """Load the model named by ``args`` and assemble the engine and gateway state around it:
    the engine in a process of its own, built and warmed up when this returns (``process.py``),
    or with ``--engine-thread`` on a thread of this one."""
    ckpt, tokenizer, config = _resolve(args)
    template = resolve_template(ckpt, tokenizer, args.chat_template)
    if args.engine_thread:
        if config.tensor_parallel > 1:
            raise ValueError("--tp runs the engine in processes of its own: serve without --engine-thread")
        loop = EngineLoop(_engine(ckpt, tokenizer, config, args.tuned_config))
    else:
        loop = EngineProcess(build_engine, (args,), logging.getLogger().getEffectiveLevel(),
                             ranks=config.tensor_parallel, serve_rank=serve_rank)
        loop.launch()
    try:
        return assemble_state(args, ckpt, loop, tokenizer, template, config)
    except BaseException:
        loop.stop()
        raise


def assemble_state(args: argparse.Namespace, ckpt: Checkpoint, loop: EngineLoop | EngineProcess, tokenizer: Tokenizer,
                   template: ChatTemplate, config: EngineConfig) -> tuple[ServerState, EngineLoop | EngineProcess]:
    from .cli import default_model_id

    if not template.renders_tools:
        log.warning("the chat template has no place for tool definitions: requests' tools are left out of "
                    "the prompt, and each answer names them in the x-ninfer-omitted-tools header")
    state = ServerState(
        engine=AsyncEngine(loop, config, eos_ids(ckpt, tokenizer)),
        tokenizer=tokenizer,
        template=template,
        **public_names(args, default_model_id),
        max_context=config.max_context,
        sampling=sampling_defaults(args, ckpt),
        generation=ckpt.generation,
        api_key=args.api_key,
        pooling=ckpt.pooling,
        media=media_settings(args, ckpt, config),
        **gateway_settings(args),
    )
    state.observability = observability.setup(args, state)
    return state, loop
