"""Grammar engines for constrained decoding, measured on a real vocabulary.

    python -m bench.grammar [--tokenizer qwen|smollm2] [--tokens 200]

For xgrammar and llguidance: the one-off set-up over the vocabulary, the compile time of a JSON
schema (nested objects, enums, arrays, optional fields: what SDKs' ``.parse()`` sends) cold and
cached, and the host time per generated token (next-token mask, then accepting the token) while
a valid document is fed to the matcher token by token. Prints a table.
"""
from __future__ import annotations

import argparse
import json
import time

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", choices=["qwen", "smollm2"], default="qwen")
    args = ap.parse_args()

    import torch

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
