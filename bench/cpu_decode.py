"""One-stream CPU decode of a real checkpoint, its weights held each way ``--weights`` lists.

    python -m bench.cpu_decode [--model PATH] [--weights auto,dense] [--tokens 64] [--rounds 3]
                               [--prompt-tokens 128] [--perplexity] [--profile] [--json FILE]
                               [--spec off,ngram] [--draft-tokens 4] [--task text|copy]

The embedded SmolLM2 by default. For each weight format one engine (``EngineConfig.weights``) runs
a greedy request of ``--tokens`` tokens after a ``--prompt-tokens`` prompt, the formats taking
turns for ``--rounds`` rounds (other work on the cores moves the figures between runs, so the
formats are timed side by side); each round times the decode steps after the prompt's. Prints the
best and median tok/s, ms per token and the bytes the weights take; ``--perplexity`` adds each
format's perplexity on numpy's license text (4096 tokens in 1024-token windows, the quality test's
measure); ``--profile`` the top functions of one more round per format by own time (cProfile).

``--spec off,ngram`` times each format with and without speculative decoding (``--draft-tokens``),
side by side in the same way, and adds the drafted and accepted tokens per round. ``--task copy``
gives the model work that drafts copy from: the chat prompt asks it to repeat a 460-token code
block with one name changed (``COPY_TASK``), its answer opened as a code block, and the request
ends where the block closes, at the model's end of turn or at ``--tokens``; the outputs with and
without drafts are compared token for token.
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
from ninfer.engine.layers.linear import Fp16CpuMethod
from ninfer.engine.loader import load_checkpoint, load_model
from ninfer.engine.models.base import ForwardBatch
from ninfer.engine.request import Request
from ninfer.engine.sampling_params import SamplingParams

PPL_TOKENS, PPL_WINDOW = 4096, 1024

# --task copy: a code block of about 400 tokens (SmolLM2's vocabulary) the model is asked to
# repeat with one edit, the prompt-lookup case (an editor's "apply this change" request)
COPY_CODE = '''import json
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Inventory:
    """Items in stock, by name, with their prices and counts."""

    path: Path
    items: dict[str, dict[str, float]] = field(default_factory=dict)

    def load(self) -> None:
        if self.path.exists():
            self.items = json.loads(self.path.read_text(encoding="utf-8"))

    def save(self) -> None:
        self.path.write_text(json.dumps(self.items, indent=2), encoding="utf-8")

    def add(self, name: str, price: float, count: int = 1) -> None:
        entry = self.items.setdefault(name, {"price": price, "count": 0})
        entry["price"] = price
        entry["count"] += count

    def remove(self, name: str, count: int = 1) -> bool:
        entry = self.items.get(name)
        if entry is None or entry["count"] < count:
            return False
        entry["count"] -= count
        if entry["count"] == 0:
            del self.items[name]
        return True

    def total_value(self) -> float:
        return sum(entry["price"] * entry["count"] for entry in self.items.values())

    def cheapest(self) -> str | None:
        if not self.items:
            return None
        return min(self.items, key=lambda name: self.items[name]["price"])


def main() -> None:
    inventory = Inventory(Path("inventory.json"))
    inventory.load()
    inventory.add("apple", 0.5, 10)
    inventory.add("pear", 0.75, 4)
    inventory.remove("apple", 3)
    print(f"total value: {inventory.total_value():.2f}")
    print(f"cheapest item: {inventory.cheapest()}")
    inventory.save()
'''
COPY_TASK = ("Here is a Python file:\n\n```python\n" + COPY_CODE + "```\n\nWrite out the whole file again, "
             "unchanged except that the method total_value is renamed to stock_value everywhere.")
COPY_PREFILL = "```python\n"  # the answer starts as a code block, which ends the request when it closes


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the parameters, the packed buffers of quantized projections, quantized tables and
    weights held outside buffers (``Fp16CpuMethod.nbytes``: an LM head in fp16)."""
    tensors = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()  # views (fused parts) once
               for t in list(model.parameters()) + list(model.buffers())}
    total = sum(tensors.values())
    for m in model.modules():
        if isinstance(m, Fp16CpuMethod):
            total += m.nbytes
        table = getattr(m, "table", None)
        if table is not None:
            total += sum(t.numel() * t.element_size() for t in (table.q, table.scale, table.offset) if t is not None)
    return total


def decode_round(engine: LLMEngine, prompt: list[int], tokens: int, eos: frozenset[int] | None = None,
                 out: dict | None = None, stop: list[str] | None = None) -> float:
    """Seconds per decoded token of one greedy request (its prompt steps not timed): to ``tokens``,
    or to its end of turn when ``eos`` is given, or a ``stop`` string; ``out`` gets its tokens and
    steps."""
    req = Request(f"b{time.monotonic_ns()}", prompt,
                  SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=eos is None, stop=stop or []),
                  max_total_tokens=len(prompt) + tokens + 1, eos_ids=eos or frozenset())
    engine.add_request(req)
    while not any(r.num_computed >= len(prompt) for r in engine.running):
        engine.step()
    first = len(req.output_ids)
    start, steps = time.perf_counter(), 0
    while engine.has_work:
        engine.step()
        steps += 1
    if out is not None:
        out.update(tokens=list(req.output_ids), steps=steps)
    return (time.perf_counter() - start) / max(len(req.output_ids) - first, 1)


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
    p.add_argument("--spec", default="off", help="comma-separated: off, ngram (each timed per weight format)")
    p.add_argument("--draft-tokens", type=int, default=4)
    p.add_argument("--task", choices=["text", "copy"], default="text",
                   help="text: a repeated sentence as the prompt, --tokens without stopping; copy: repeat an "
                        "edited code block (COPY_TASK) through the chat template, to the end of turn")
    args = p.parse_args(argv)

    ckpt = load_checkpoint(args.model)
    tok = ckpt.tokenizer
    eos = None
    if args.task == "copy":
        from ninfer.server.bootstrap import eos_ids, resolve_template

        template = resolve_template(ckpt, tok, None)
        prompt = tok.encode(template.render([{"role": "user", "content": COPY_TASK}]) + COPY_PREFILL)
        eos = eos_ids(ckpt, tok)
    else:
        text = "The quick brown fox jumps over the lazy dog. " * (args.prompt_tokens // 8 + 1)
        prompt = tok.encode(text)[: args.prompt_tokens]
    stop = ["```"] if args.task == "copy" else None
    modes = args.spec.split(",")
    runs = [(w, m) for w in args.weights.split(",") for m in modes]
    engines, rows, models = {}, {}, {}
    for w, m in runs:
        start = time.perf_counter()
        if w not in models:
            models[w] = load_model(ckpt, "cpu", torch.float32, w)
        model = models[w]
        config = EngineConfig(max_context=len(prompt) + args.tokens + 64, max_concurrency=1, spec=m,
                              draft_tokens=args.draft_tokens)
        engines[w, m] = LLMEngine(model, tok, config)
        rows[w, m] = {"load_s": time.perf_counter() - start, "weight_mib": weight_bytes(model) / 2**20,
                      "s_per_tok": []}
        decode_round(engines[w, m], prompt, 8)  # warm-up
    outputs = {}
    for _ in range(args.rounds):
        for run in runs:
            engine = engines[run]
            before = (engine.counters.spec_rounds, engine.counters.spec_draft_tokens,
                      engine.counters.spec_accepted_tokens)
            rows[run]["s_per_tok"].append(decode_round(engine, prompt, args.tokens, eos, out := {}, stop))
            c = engine.counters
            rounds, drafted, kept = (c.spec_rounds - before[0], c.spec_draft_tokens - before[1],
                                     c.spec_accepted_tokens - before[2])
            rows[run].update(tokens=len(out["tokens"]), steps=out["steps"], rounds=rounds, drafted=drafted,
                             accepted=kept)
            outputs[run] = out["tokens"]
    if args.perplexity:
        ids = english_ids(tok)
        for run in runs:
            rows[run]["perplexity"] = perplexity(engines[run].model, ids)

    task = (f"copy task ({len(prompt)}-token prompt, to the code block's end or {args.tokens} tokens)"
            if args.task == "copy" else f"{len(prompt)}-token prompt, {args.tokens} tokens")
    print(f"\n{ckpt.source}, one stream, {task}, {torch.get_num_threads()} threads, "
          f"load average {open('/proc/loadavg').read().split()[0]}")
    spec = len(modes) > 1 or modes != ["off"]
    print("| weights |" + (" spec | tokens | accepted / round | drafted / round |" if spec else "")
          + " best tok/s | median tok/s | ms/token (median) | weights MiB | load s |"
          + (" perplexity |" if args.perplexity else ""))
    print("|---|" + ("---|---|---|---|" if spec else "") + "---|---|---|---|---|" + ("---|" if args.perplexity else ""))
    for run in runs:
        r = rows[run]
        med = statistics.median(r["s_per_tok"])
        r.update(best_tok_s=1 / min(r["s_per_tok"]), median_tok_s=1 / med, median_ms=med * 1e3)
        cols = ""
        if spec:
            per = (lambda n: f"{n / r['rounds']:.2f}") if r["rounds"] else (lambda n: "-")
            cols = f" {run[1]} | {r['tokens']} | {per(r['accepted'])} | {per(r['drafted'])} |"
        line = (f"| {run[0]} |{cols} {r['best_tok_s']:.1f} | {r['median_tok_s']:.1f} | {r['median_ms']:.1f} | "
                f"{r['weight_mib']:.0f} | {r['load_s']:.1f} |")
        print(line + (f" {r['perplexity']:.4f} |" if args.perplexity else ""))
    for w in args.weights.split(","):
        if len(modes) > 1:
            same = all(outputs[w, m] == outputs[w, modes[0]] for m in modes)
            print(f"weights {w}: outputs {'the same' if same else 'DIFFER'} with and without drafts")
    if args.task == "copy":
        print("\n--- output ---\n" + tok.decode(outputs[runs[0]]))
    if args.profile:
        for run in runs:
            print(f"\n--- profile, weights {run[0]}, spec {run[1]} ---")
            print(profile_round(engines[run], prompt, args.tokens))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"model": ckpt.source, "machine": platform.processor() or platform.machine(),
                       "threads": torch.get_num_threads(), "args": vars(args),
                       "rows": {f"{w}/{m}": r for (w, m), r in rows.items()}}, f, indent=1)


if __name__ == "__main__":
    main()
