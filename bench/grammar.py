"""Grammar engines for constrained decoding, measured on a real vocabulary; and what a grammar
costs a decode step.

    python -m bench.grammar [--tokenizer qwen|smollm2]
    python -m bench.grammar --engine --shape qwen3.5-0.8b [--batch 8] [--tokens 128]
    python -m bench.grammar --engine --shape tiny [--batch 8] [--tokens 64] [--rounds 3] [--profile FILE]
    python -m bench.grammar --sampler [--batch 8]

For xgrammar and llguidance: the one-off set-up over the vocabulary, the compile time of a JSON
schema (nested objects, enums, arrays, optional fields: what SDKs' ``.parse()`` sends) cold and
cached, and the host time per generated token (next-token mask, then accepting the token) while
a valid document is fed to the matcher token by token. Prints a table.

``--engine``: random bf16 weights at a real shape on the GPU with the Qwen tokenizer; ``--batch``
requests decode ``--tokens`` greedy tokens each, free, then every one held to a grammar (the
regular expression ``[a-z ]+``, or ``--regex``: never complete, so both runs have the same
length), the engine as the server builds it (CUDA graphs, decode steps launched ahead); the
two kinds of run take turns ``--rounds`` times, the best of each kept. Prints decode tok/s of
both, their ratio and the wall time per decode step; the difference of the two step times is
what the grammar costs a step. ``[a-z ]+`` is a dear mask for xgrammar: a character class
repeated up to the grammar's end leaves most ids to be checked one by one at every step (0.7 ms
a row on Qwen's 248K ids on a 2-core VM, against 5 us for ``[^0-9]+`` or a JSON string).
``--shape tiny`` (the default without CUDA): a 4-layer Qwen3.5 of width 64 with the real Qwen
vocabulary, fp32 on the CPU: the forward is small, so the step times are mostly the host's
(masks, sampling, the engine's bookkeeping). ``--profile FILE``: one more constrained run under
``torch.profiler``, its table by self time written to FILE. ``--sampler``: one sampling call of
``--batch`` greedy rows on the CPU, free and held to ``[a-z ]+`` and ``[^0-9]+`` (a cheap mask).
"""
from __future__ import annotations

import argparse
import json
import re
import time

import torch

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {
            "type": "object",
            "properties": {"street": {"type": "string"}, "city": {"type": "string"},
                           "zip": {"anyOf": [{"type": "string"}, {"type": "null"}]}},
            "required": ["street", "city", "zip"], "additionalProperties": False,
        },
        "scores": {"type": "array", "items": {"type": "number"}},
    },
    "required": ["name", "age", "role", "tags", "address", "scores"],
    "additionalProperties": False,
}

DOCUMENT = {"name": "Ada Lovelace", "age": 36, "role": "admin", "tags": ["math", "engines", "poetry"],
            "address": {"street": "12 St James's Square", "city": "London", "zip": None},
            "scores": [9.5, 8.25, 10, 7.75]}


def _tokenizer(name: str):
    if name == "qwen":
        from ninfer.engine.frontend.qwen_tiktoken import load_qwen_tiktoken

        return load_qwen_tiktoken()
    from ninfer.engine.loader.embedded import embedded_model_path
    from ninfer.engine.loader.gguf_loader import load_gguf

    return load_gguf(embedded_model_path()).tokenizer


def _time(fn, repeat: int = 1) -> float:
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) / repeat


TINY = {  # the 0.8B's vocabulary and layer pattern at test-model width: a step is mostly host time
    "model_type": "qwen3_5_text", "vocab_size": 248320, "hidden_size": 64, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 96,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8,
    "linear_value_head_dim": 8, "linear_conv_kernel_dim": 4, "full_attention_interval": 4,
    "tie_word_embeddings": True, "max_position_embeddings": 4096,
}


def engine_cost(shape: str, batch: int, tokens: int, rounds: int = 3, profile: str | None = None,
                regex: str = "[a-z ]+") -> None:
    from ninfer.engine.engine import LLMEngine
    from ninfer.engine.engine_config import EngineConfig
    from ninfer.engine.grammar import GrammarSpec
    from ninfer.engine.layers.fused_linear import fuse_model_projections
    from ninfer.engine.models.registry import build_model
    from ninfer.engine.request import Request
    from ninfer.engine.sampling_params import SamplingParams

    from .decode import DTYPE, _sync, randomize_
    from ninfer.engine.config import ModelConfig

    from .shapes import shape_config

    tok = _tokenizer("qwen")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = DTYPE if device == "cuda" else torch.float32
    cfg = ModelConfig.from_hf_dict(TINY) if shape == "tiny" else shape_config(shape)
    model = build_model(cfg, dtype=dtype, device=device)
    randomize_(model)
    fuse_model_projections(model)
    engine = LLMEngine(model, tok, EngineConfig(max_context=1024, max_concurrency=batch, device=device,
                                                dtype=dtype, prefix_cache=False))
    spec = GrammarSpec("regex", regex, "guided_regex")
    prompt = tok.encode("Write a long line of lowercase words about the sea. ")

    def run(tag: str, grammar) -> tuple[float, float]:
        reqs = [Request(f"{tag}{i}", prompt + [i], SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True,
                                                                  grammar=grammar), max_total_tokens=1024)
                for i in range(batch)]
        for r in reqs:
            engine.add_request(r)
        started = None
        while engine.has_work:
            outs = engine.step()
            if started is None and any(o.token_ids for o in outs):
                _sync()
                started = time.perf_counter()
        _sync()
        took = time.perf_counter() - started
        assert all(len(r.output_ids) == tokens for r in reqs), [len(r.output_ids) for r in reqs]
        if grammar is not None:
            assert all(re.fullmatch(regex, tok.decode(r.output_ids)) for r in reqs)
        return batch * (tokens - 1) / took, took / (tokens - 1)

    run("warm-free", None), run("warm-held", spec)
    # the two kinds of run take turns, the best of each kept: a shared machine's slow spells
    # fall on both
    best = {"free": (0.0, 0.0), "held": (0.0, 0.0)}
    for k in range(rounds):
        best["free"] = max(best["free"], run(f"free{k}-", None))
        best["held"] = max(best["held"], run(f"held{k}-", spec))
    (free, free_step), (held, held_step) = best["free"], best["held"]
    where = torch.cuda.get_device_name() if device == "cuda" else f"CPU ({torch.get_num_threads()} threads)"
    print(f"{shape}, batch {batch}, {tokens} tokens each, regex {regex!r}, torch {torch.__version__}, {where}\n")
    print("| rows | decode tok/s | against free | ms per decode step |")
    print("|---|---|---|---|")
    print(f"| free | {free:,.0f} | 1.00x | {free_step * 1e3:.2f} |")
    print(f"| under a grammar | {held:,.0f} | {held / free:.2f}x | {held_step * 1e3:.2f} |")
    print(f"\nwhat the grammar adds to a step: {(held_step - free_step) * 1e3:.2f} ms")
    if profile:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as profiler

        with profiler(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else []),
                      with_stack=False) as prof:
            run("profiled-", spec)
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
        with open(profile, "w") as f:
            f.write(table)
        print(f"profile of one constrained run: {profile}")


def sampler_cost(batch: int, rounds: int = 25) -> None:
    """The host time of one ``Sampler.sample`` over ``batch`` rows of Qwen-width fp32 logits on
    the CPU, free and every row held to a regular expression: the best of ``rounds`` (short
    calls, so a shared machine's slow spells fall out)."""
    from ninfer.engine.grammar import Grammars, GrammarSpec
    from ninfer.engine.request import Request
    from ninfer.engine.sampler import Sampler
    from ninfer.engine.sampling_params import SamplingParams

    tok = _tokenizer("qwen")
    vocab = tok.vocab_size
    grammars = Grammars(tok, vocab)
    sampler = Sampler(torch.device("cpu"))
    wide = torch.randn(batch, TINY["vocab_size"], generator=torch.Generator().manual_seed(0))

    def rows(regex: str | None) -> list:
        out = []
        for i in range(batch):
            r = Request(f"r{i}", [1], SamplingParams(temperature=0.0, max_tokens=8), max_total_tokens=64)
            if regex is not None:
                r.grammar = grammars.matcher(grammars.compile(GrammarSpec("regex", regex)).result(), [], True)
                for t in tok.encode(" the sea"):
                    r.grammar.accept(t)
            out.append(r)
        return out

    kinds = {"free": rows(None), "[a-z ]+": rows("[a-z ]+"), "[^0-9]+": rows("[^0-9]+")}
    best = dict.fromkeys(kinds, float("inf"))
    with torch.inference_mode():
        for _ in range(rounds):
            for name, reqs in kinds.items():
                logits = wide.clone()[:, :vocab]  # the LM head's columns the tokenizer decodes, as the engine's
                start = time.perf_counter()
                sampler.sample(logits, reqs).tolist()
                best[name] = min(best[name], time.perf_counter() - start)
    grammars.close()
    print(f"Sampler.sample, {batch} greedy rows of {vocab} fp32 logits, CPU ({torch.get_num_threads()} threads)\n")
    print("| rows | ms | held - free ms |")
    print("|---|---|---|")
    for name, t in best.items():
        more = "" if name == "free" else f"{(t - best['free']) * 1e3:.2f}"
        print(f"| {name} | {t * 1e3:.2f} | {more} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", choices=["qwen", "smollm2"], default="qwen")
    ap.add_argument("--engine", action="store_true", help="the cost of a grammar to decode steps")
    ap.add_argument("--sampler", action="store_true", help="the host cost of a grammar to one sampling call (CPU)")
    ap.add_argument("--shape", default=None, help="a known shape, or tiny (default: qwen3.5-0.8b on CUDA, else tiny)")
    ap.add_argument("--profile", default=None, help="--engine: write a torch.profiler table of a constrained run here")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3, help="--engine: runs of each kind, the best kept")
    ap.add_argument("--regex", default="[a-z ]+", help="--engine: what the held rows are held to (never complete)")
    args = ap.parse_args()
    if args.sampler:
        sampler_cost(args.batch)
        return
    if args.engine:
        shape = args.shape or ("qwen3.5-0.8b" if torch.cuda.is_available() else "tiny")
        engine_cost(shape, args.batch, args.tokens, args.rounds, profile=args.profile, regex=args.regex)
        return


    tok = _tokenizer(args.tokenizer)
    vocab = tok.vocab_size
    control = {i for s in tok.control_strings() if (i := tok.token_to_id(s)) is not None}
    eos = tok.token_to_id("<|im_end|>") or 0
    raw = [b"" if i in control else tok.token_bytes(i) for i in range(vocab)]
    doc = tok.encode(json.dumps(DOCUMENT)) + [eos]
    rows = []

    import xgrammar as xgr

    setup = time.perf_counter()
    info = xgr.TokenizerInfo(raw, xgr.VocabType.RAW, vocab_size=vocab, stop_token_ids=[eos])
    compiler = xgr.GrammarCompiler(info)
    setup = time.perf_counter() - setup
    text = json.dumps(SCHEMA)
    cold = _time(lambda: compiler.compile_json_schema(text))
    cached = _time(lambda: compiler.compile_json_schema(text), 20)
    compiled = compiler.compile_json_schema(text)
    matcher = xgr.GrammarMatcher(compiled)
    mask = xgr.allocate_token_bitmask(1, vocab)
    start = time.perf_counter()
    for t in doc:
        matcher.fill_next_token_bitmask(mask)
        assert matcher.accept_token(t), "xgrammar refused a valid document"
    per_token = (time.perf_counter() - start) / len(doc)
    rows.append(("xgrammar", setup, cold, cached, per_token, matcher.is_terminated()))

    import llguidance
    import llguidance.torch as llt

    class _Vocab:
        eos_token_id, bos_token_id, tokens, special_token_ids = eos, None, raw, sorted(control)

        def __call__(self, s):
            return tok.encode(s.decode("utf-8", "replace") if isinstance(s, bytes) else s)

    setup = time.perf_counter()
    lltok = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Vocab()))
    setup = time.perf_counter() - setup
    grammar = llguidance.LLMatcher.grammar_from_json_schema(text)
    cold = _time(lambda: llguidance.LLMatcher(lltok, grammar))
    cached = _time(lambda: llguidance.LLMatcher(lltok, grammar), 20)
    m = llguidance.LLMatcher(lltok, grammar)
    lmask = llt.allocate_token_bitmask(1, lltok.vocab_size)
    start = time.perf_counter()
    for t in doc:
        llt.fill_next_token_bitmask(m, lmask, 0)
        assert m.consume_token(t), f"llguidance refused a valid document: {m.get_error()}"
    per_token = (time.perf_counter() - start) / len(doc)
    rows.append(("llguidance", setup, cold, cached, per_token, m.is_stopped()))

    print(f"vocabulary {vocab} ({args.tokenizer}), document {len(doc)} tokens, torch {torch.__version__}\n")
    print("| engine | vocabulary set-up ms | schema compile ms (cold) | compile ms (again) | mask+accept us/token | finished |")
    print("|---|---|---|---|---|---|")
    for name, s, c, again, per, done in rows:
        print(f"| {name} | {s * 1e3:.0f} | {c * 1e3:.1f} | {again * 1e3:.2f} | {per * 1e6:.0f} | {done} |")


if __name__ == "__main__":
    main()
