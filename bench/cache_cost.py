"""What the prefix cache costs and gives, engine-direct: the same load with it on and off.

    python -m bench.cache_cost --shape qwen3.5-0.8b [--streams 64] [--prompt-tokens 200]
                               [--output-tokens 256] [--modes on,host0,off] [--max-context N]
                               [--conversation 30000] [--profile] [--trace-turn T] [--json FILE]

Random bf16 weights at the real shape are made on the GPU (no checkpoint, no server), with the
server's cache settings (16 prefix checkpoints, the host tier at its size on a GPU). For each mode
(``on``: the defaults; ``host0``: no host tier; ``off``: no prefix cache) one engine runs
``--streams`` requests of distinct prompts, all added at once, to the end: steps, wall time,
output tok/s and the engine's time to first token. ``--conversation N`` then runs, per mode, a
conversation as a returning user makes it, after another user's N-token prompt: a first turn of
N tokens, two returning turns with the answer and 256 new tokens; time to first token of each.
``--profile`` prints where the host time of the streams run goes (cProfile, by cumulative time);
``--trace-turn T`` prints ``torch.profiler``'s table of the conversation's turn ``T`` (0 the first,
2 the last; host and device time per op, by device time and by host time).
"""
from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import pstats
import time

import torch

from .decode import DTYPE, NullTokenizer, _sync, randomize_
from .shapes import SHAPES, shape_config

MODES = {"on": {}, "host0": {"host_cache_mib": 0}, "off": {"prefix_cache": False}}
HOST_CACHE_MIB = 22 << 10  # the server's 'auto' on a GPU


def build(cfg, mode: str, streams: int, max_context: int, device: str):
    from ninfer.engine.engine import LLMEngine
    from ninfer.engine.engine_config import EngineConfig
    from ninfer.engine.layers.fused_linear import fuse_model_projections
    from ninfer.engine.models.registry import build_model

    dtype = DTYPE if device == "cuda" else torch.float32
    model = build_model(cfg, dtype=dtype, device=device)
    randomize_(model)
    fuse_model_projections(model)
    settings = {"host_cache_mib": HOST_CACHE_MIB if device == "cuda" else 1024, **MODES[mode]}
    ecfg = EngineConfig(max_context=max_context, max_concurrency=streams, device=device, dtype=dtype, **settings)
    return LLMEngine(model, NullTokenizer(cfg.vocab_size), ecfg)


def requests(n: int, prompt: int, out: int, vocab: int, tag: str, limit: int, prompts=None):
    from ninfer.engine.request import Request
    from ninfer.engine.sampling_params import SamplingParams

    g = torch.Generator().manual_seed(hash(tag) % (1 << 31))
    ids = prompts or [torch.randint(0, vocab, (prompt,), generator=g).tolist() for _ in range(n)]
    return [Request(f"{tag}{i}", p, SamplingParams(temperature=0.0, max_tokens=out, ignore_eos=True),
                    max_total_tokens=limit) for i, p in enumerate(ids)]


def run_to_end(engine, reqs, profile: cProfile.Profile | None = None) -> dict:
    """Add ``reqs`` at once and step until they are done: steps, wall, tok/s, TTFT p50/p99."""
    _sync()
    t0 = time.perf_counter()
    for r in reqs:
        engine.add_request(r)
    first: dict[str, float] = {}
    steps = 0
    if profile is not None:
        profile.enable()
    while engine.has_work:
        for out in engine.step():
            if out.token_ids and out.request_id not in first:
                first[out.request_id] = time.perf_counter() - t0
        steps += 1
    _sync()
    if profile is not None:
        profile.disable()
    wall = time.perf_counter() - t0
    ttft = sorted(first.values())
    tokens = sum(len(r.output_ids) for r in reqs)
    res = {"steps": steps, "wall_s": wall, "tok_s": tokens / wall, "ttft_p50_s": ttft[len(ttft) // 2],
           "ttft_p99_s": ttft[min(len(ttft) - 1, int(len(ttft) * 0.99))]}
    if torch.cuda.is_available():  # the caching allocator's retries (a full device frees and retries, synchronized)
        res["alloc_retries"] = torch.cuda.memory_stats().get("num_alloc_retries", 0)
    return res


def conversation(engine, cfg, length: int, out: int = 32, turn: int = 256, trace: int | None = None,
                 top: int = 40) -> list[float]:
    """Another user's prompt of ``length`` tokens, then three turns of one conversation (the
    first of ``length`` tokens, each later one the conversation so far + ``turn`` new tokens):
    the time to first token of each turn. ``trace``: print the ``top`` ops of that turn."""
    limit = engine.config.max_context
    run_to_end(engine, requests(1, length, 4, cfg.vocab_size, "other", limit))
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, cfg.vocab_size, (length,), generator=g).tolist()
    times = []
    for t in range(3):
        (req,) = requests(1, 0, out, cfg.vocab_size, f"turn{t}-", limit, prompts=[list(ids)])
        if trace == t:
            from torch.profiler import ProfilerActivity, profile
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
            with profile(activities=acts) as prof:
                times.append(run_to_end(engine, [req])["ttft_p50_s"])
            table = prof.key_averages()
            for key in (["self_cuda_time_total"] if torch.cuda.is_available() else []) + ["self_cpu_time_total"]:
                print(f"## turn {t}, by {key}\n" + table.table(sort_by=key, row_limit=top),
                      flush=True)
        else:
            times.append(run_to_end(engine, [req])["ttft_p50_s"])
        ids += req.output_ids + torch.randint(0, cfg.vocab_size, (turn,), generator=g).tolist()
    return times


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.cache_cost", description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), required=True)
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=200)
    p.add_argument("--output-tokens", type=int, default=256)
    p.add_argument("--modes", default="on,host0,off")
    p.add_argument("--rounds", type=int, default=2, help="runs of the streams load per mode (the first warms up)")
    p.add_argument("--conversation", type=int, default=0, help="tokens of the first turn (0: none)")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--trace-turn", type=int, choices=(0, 1, 2), default=None,
                   help="torch.profiler over this turn of the conversation (0: the first)")
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--max-context", type=int, default=None,
                   help="the engines' context limit (default 8192, or the conversation's; the server's is 32768), "
                        "which sizes the KV pool with the cache on")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    if any(m not in MODES for m in modes):
        p.error(f"--modes: each of {', '.join(MODES)}")
    cfg = shape_config(args.shape)
    max_context = args.max_context or max(8192, args.conversation + 2048)
    results = {}
    for mode in modes:
        engine = build(cfg, mode, args.streams, max_context, args.device)
        rounds = []
        for i in range(args.rounds):
            prof = cProfile.Profile() if args.profile and i == args.rounds - 1 else None
            reqs = requests(args.streams, args.prompt_tokens, args.output_tokens, cfg.vocab_size, f"{mode}-{i}-",
                            max_context)
            rounds.append(run_to_end(engine, reqs, prof))
            # what the server's loop does between bursts: the idle work (checkpoints evicted ahead),
            # then the host memory it pins once idle for a while
            while engine.idle_work() or engine.caches.grow_host():
                pass
            if prof is not None:
                for order in ("cumulative", "tottime"):
                    s = io.StringIO()
                    pstats.Stats(prof, stream=s).sort_stats(order).print_stats(args.top)
                    print(f"## {mode}: host time of the streams run (cProfile, {order})\n{s.getvalue()}", flush=True)
        res = {"streams": rounds[-1], "rounds_tok_s": [round(r["tok_s"]) for r in rounds]}
        if args.conversation:
            res["conversation_ttft_s"] = conversation(engine, cfg, args.conversation, trace=args.trace_turn,
                                                   top=args.top)
        results[mode] = res
        print(mode, json.dumps(res), flush=True)
        del engine
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    base = results.get("off")
    print(f"\n{args.shape}, {args.streams} streams of {args.prompt_tokens} tokens, {args.output_tokens} out, "
          f"engine-direct on {torch.cuda.get_device_name() if args.device == 'cuda' else 'the CPU'}")
    print("| mode | steps | wall s | tok/s | vs off | TTFT p50 | TTFT p99 |" +
          (" conversation TTFT: first, returning, returning |" if args.conversation else ""))
    print("|---|---|---|---|---|---|---|" + ("---|" if args.conversation else ""))
    for mode, res in results.items():
        s = res["streams"]
        ratio = f"{s['tok_s'] / base['streams']['tok_s']:.3f}" if base else "-"
        conv = (" " + ", ".join(f"{t:.3f}" for t in res["conversation_ttft_s"]) + " |") if args.conversation else ""
        print(f"| {mode} | {s['steps']} | {s['wall_s']:.2f} | {s['tok_s']:,.0f} | {ratio} | {s['ttft_p50_s']:.3f} | "
              f"{s['ttft_p99_s']:.3f} |{conv}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
