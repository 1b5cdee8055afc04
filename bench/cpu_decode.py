"""One-stream CPU decode of a real checkpoint, its weights held each way ``--weights`` lists.

    python -m bench.cpu_decode [--model PATH] [--weights auto,dense] [--tokens 64] [--rounds 3]
                               [--prompt-tokens 128] [--perplexity] [--profile] [--json FILE]

The embedded SmolLM2 by default. For each weight format one engine (``EngineConfig.weights``) runs
a greedy request of ``--tokens`` tokens after a ``--prompt-tokens`` prompt, the formats taking
turns for ``--rounds`` rounds (other work on the cores moves the figures between runs, so the
formats are timed side by side); each round times the decode steps after the prompt's. Prints the
best and median tok/s, ms per token and the bytes the weights take; ``--perplexity`` adds each
format's perplexity on numpy's license text (4096 tokens in 1024-token windows, the quality test's
measure); ``--profile`` the top functions of one more round per format by own time (cProfile).
"""
from __future__ import annotations

import argparse
import cProfile
import importlib.metadata
import io
import json
import math
import platform
import pstats
import statistics
import time

import torch
import torch.nn.functional as F

from ninfer.engine.engine import LLMEngine
from ninfer.engine.engine_config import EngineConfig
from ninfer.engine.loader import load_checkpoint, load_model
from ninfer.engine.models.base import ForwardBatch
from ninfer.engine.request import Request
from ninfer.engine.sampling_params import SamplingParams

PPL_TOKENS, PPL_WINDOW = 4096, 1024


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the parameters, the packed buffers of quantized projections and quantized tables."""
    tensors = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()  # views (fused parts) once
               for t in list(model.parameters()) + list(model.buffers())}
    total = sum(tensors.values())
    for m in model.modules():
        table = getattr(m, "table", None)
        if table is not None:
            total += sum(t.numel() * t.element_size() for t in (table.q, table.scale, table.offset) if t is not None)
    return total


def decode_round(engine: LLMEngine, prompt: list[int], tokens: int) -> float:
    """Seconds per decoded token of one greedy request (its prompt steps not timed)."""
    engine.add_request(Request(f"b{time.monotonic_ns()}", prompt,
                               SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True),
                               max_total_tokens=len(prompt) + tokens + 1))
    while not any(r.num_computed >= len(prompt) for r in engine.running):
        engine.step()
    start, steps = time.perf_counter(), 0
    while engine.has_work:
        engine.step()
        steps += 1
    return (time.perf_counter() - start) / max(steps, 1)


def english_ids(tokenizer) -> list[int]:
    files = importlib.metadata.distribution("numpy").files or []
    path = min((f for f in files if f.name == "LICENSE.txt" and "dist-info" in str(f)), key=lambda f: len(str(f)))
    return tokenizer.encode(path.read_text(encoding="utf-8"))[: PPL_TOKENS + 1]


@torch.no_grad()
def perplexity(model, ids: list[int]) -> float:
    nll, count = 0.0, 0
    for start in range(0, len(ids) - 1, PPL_WINDOW):
        window = ids[start : start + PPL_WINDOW + 1]
        hidden = model(torch.tensor(window[:-1]), ForwardBatch.single(len(window) - 1, model.new_cache()))
        nll += F.cross_entropy(model.compute_logits(hidden), torch.tensor(window[1:]), reduction="sum").item()
        count += len(window) - 1
    return math.exp(nll / count)


def profile_round(engine: LLMEngine, prompt: list[int], tokens: int, top: int = 14) -> str:
    prof = cProfile.Profile()
    prof.enable()
    decode_round(engine, prompt, tokens)
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    return out.getvalue()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint (default: the embedded model)")
    p.add_argument("--weights", default="auto,dense")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--perplexity", action="store_true")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)

    ckpt = load_checkpoint(args.model)
    tok = ckpt.tokenizer
    text = "The quick brown fox jumps over the lazy dog. " * (args.prompt_tokens // 8 + 1)
    prompt = tok.encode(text)[: args.prompt_tokens]
    config = EngineConfig(max_context=args.prompt_tokens + args.tokens + 64, max_concurrency=1)
    formats = args.weights.split(",")
    engines, rows = {}, {}
    for w in formats:
        start = time.perf_counter()
        model = load_model(ckpt, "cpu", torch.float32, w)
        engines[w] = LLMEngine(model, tok, config)
        rows[w] = {"load_s": time.perf_counter() - start, "weight_mib": weight_bytes(model) / 2**20, "s_per_tok": []}
        decode_round(engines[w], prompt, 8)  # warm-up
    for _ in range(args.rounds):
        for w in formats:
            rows[w]["s_per_tok"].append(decode_round(engines[w], prompt, args.tokens))
    if args.perplexity:
        ids = english_ids(tok)
        for w in formats:
            rows[w]["perplexity"] = perplexity(engines[w].model, ids)

    print(f"\n{ckpt.source}, one stream, {len(prompt)}-token prompt, {args.tokens} tokens, "
          f"{torch.get_num_threads()} threads, load average {open('/proc/loadavg').read().split()[0]}")
    print("| weights | best tok/s | median tok/s | ms/token (median) | weights MiB | load s |"
          + (" perplexity |" if args.perplexity else ""))
    print("|---|---|---|---|---|---|" + ("---|" if args.perplexity else ""))
    for w in formats:
        r = rows[w]
        med = statistics.median(r["s_per_tok"])
        r.update(best_tok_s=1 / min(r["s_per_tok"]), median_tok_s=1 / med, median_ms=med * 1e3)
        line = (f"| {w} | {r['best_tok_s']:.1f} | {r['median_tok_s']:.1f} | {r['median_ms']:.1f} | "
                f"{r['weight_mib']:.0f} | {r['load_s']:.1f} |")
        print(line + (f" {r['perplexity']:.4f} |" if args.perplexity else ""))
    if args.profile:
        for w in formats:
            print(f"\n--- profile, weights {w} ---")
            print(profile_round(engines[w], prompt, args.tokens))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"model": ckpt.source, "machine": platform.processor() or platform.machine(),
                       "threads": torch.get_num_threads(), "args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
