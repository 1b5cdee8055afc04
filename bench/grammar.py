"""Grammar engines for constrained decoding, measured on a real vocabulary; and what a grammar
costs a decode step.

    python -m bench.grammar [--tokenizer qwen|smollm2]
    python -m bench.grammar --engine --shape qwen3.5-0.8b [--batch 8] [--tokens 128]

For xgrammar and llguidance: the one-off set-up over the vocabulary, the compile time of a JSON
schema (nested objects, enums, arrays, optional fields: what SDKs' ``.parse()`` sends) cold and
cached, and the host time per generated token (next-token mask, then accepting the token) while
a valid document is fed to the matcher token by token. Prints a table.

``--engine``: random bf16 weights at a real shape on the GPU with the Qwen tokenizer; ``--batch``
requests decode ``--tokens`` greedy tokens each, free, then every one held to a grammar (the
regular expression ``[a-z ]+``: never complete, so both runs have the same length), the engine
as the server builds it (CUDA graphs for the free rows). Prints decode tok/s of both and their
ratio.
"""
from __future__ import annotations

import argparse
import json
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


def engine_cost(shape: str, batch: int, tokens: int, rounds: int = 3) -> None:
    from ninfer.engine.engine import LLMEngine
    from ninfer.engine.engine_config import EngineConfig
    from ninfer.engine.grammar import GrammarSpec
    from ninfer.engine.layers.fused_linear import fuse_model_projections
    from ninfer.engine.models.registry import build_model
    from ninfer.engine.request import Request
    from ninfer.engine.sampling_params import SamplingParams

    from .decode import DTYPE, _sync, randomize_
    from .shapes import shape_config

    tok = _tokenizer("qwen")
    device = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU only to try the bench itself
    dtype = DTYPE if device == "cuda" else torch.float32
    model = build_model(shape_config(shape), dtype=dtype, device=device)
    randomize_(model)
    fuse_model_projections(model)
    engine = LLMEngine(model, tok, EngineConfig(max_context=1024, max_concurrency=batch, device=device,
                                                dtype=dtype, prefix_cache=False))
    spec = GrammarSpec("regex", "[a-z ]+", "guided_regex")
    prompt = tok.encode("Write a long line of lowercase words about the sea. ")

    def run(tag: str, grammar) -> float:
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
        assert all(len(r.output_ids) == tokens for r in reqs), [len(r.output_ids) for r in reqs]
        return batch * (tokens - 1) / (time.perf_counter() - started)

    run("warm-free", None), run("warm-held", spec)
    free = max(run(f"free{k}-", None) for k in range(rounds))
    held = max(run(f"held{k}-", spec) for k in range(rounds))
    where = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    print(f"{shape}, batch {batch}, {tokens} tokens each, torch {torch.__version__}, {where}\n")
    print("| rows | decode tok/s | against free |")
    print("|---|---|---|")
    print(f"| free | {free:,.0f} | 1.00x |")
    print(f"| under a grammar | {held:,.0f} | {held / free:.2f}x |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", choices=["qwen", "smollm2"], default="qwen")
    ap.add_argument("--engine", action="store_true", help="the cost of a grammar to decode steps (GPU)")
    ap.add_argument("--shape", default="qwen3.5-0.8b")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=128)
    args = ap.parse_args()
    if args.engine:
        engine_cost(args.shape, args.batch, args.tokens)
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
