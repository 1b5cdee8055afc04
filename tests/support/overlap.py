"""Driving an engine through a scripted mix of requests, with and without overlapped decode
(shared by the CPU tests and the GPU tests with CUDA graphs)."""
from __future__ import annotations

from ninfer.engine.engine import LLMEngine
from ninfer.engine.engine_config import EngineConfig
from ninfer.engine.request import Request
from ninfer.engine.sampling_params import SamplingParams, ThinkingControl


def prompt(tok, i: int) -> list[int]:
    return tok.encode("Hello world! How are you today? The quick brown fox jumps over the lazy dog. " * 3)[: 6 + 9 * i]


def make(i: int, tok, **params) -> Request:
    return Request(f"r{i}", prompt(tok, i), SamplingParams(**{"temperature": 0.0, "ignore_eos": True, **params}),
                   max_total_tokens=160)


def count_launched_ahead(engine: LLMEngine):
    """Count the decode steps ``engine`` launches ahead from now on; call the result for the count."""
    count = 0
    launch_next = engine.runner.launch_next

    def counting(*a, **k):
        nonlocal count
        count += 1
        return launch_next(*a, **k)

    engine.runner.launch_next = counting
    return lambda: count


def drive(parts, overlap: bool, specs: dict, arrivals: dict | None = None, abort_at: dict | None = None,
          device: str = "cpu", cuda_graphs: bool = True, engine_out: list | None = None, prepare=None, **config):
    """Run requests built from ``specs`` (id -> params); ``arrivals`` adds a request once another
    has that many tokens, ``abort_at`` aborts one once it has that many; ``config``: more engine
    settings (``spec``, or in place of the defaults: ``kv_capacity``); ``engine_out`` gets the engine, ``prepare`` is called with it before the
    first request. Returns what each request's outputs said,
    and how many steps were launched ahead."""
    model, tok = parts
    settings = dict(max_context=160, max_concurrency=6, prefill_chunk=32, kv_capacity=2048, page_size=8,
                    overlap=overlap, device=device, cuda_graphs=cuda_graphs, dtype=next(model.parameters()).dtype)
    engine = LLMEngine(model, tok, EngineConfig(**{**settings, **config}))
    if engine_out is not None:
        engine_out.append(engine)
    if prepare is not None:
        prepare(engine)
    launched_ahead = count_launched_ahead(engine)
    reqs = {i: make(i, tok, **p) for i, p in specs.items()}
    arrivals, abort_at = dict(arrivals or {}), dict(abort_at or {})
    for i, r in reqs.items():
        if i not in arrivals:
            engine.add_request(r)
    seen: dict[str, dict] = {r.request_id: {"tokens": [], "text": "", "finish": None} for r in reqs.values()}

    def collect(out):
        s = seen[out.request_id]
        s["tokens"] += out.token_ids
        s["text"] += out.text
        if out.logprobs is not None:
            s.setdefault("logprobs", []).extend(out.logprobs)
        if out.finished:
            s["finish"] = out.finish_reason
            s["completion_tokens"] = out.completion_tokens

    while engine.has_work or arrivals:
        for i, (after, n) in list(arrivals.items()):
            if len(reqs[after].output_ids) >= n or reqs[after].is_finished:
                engine.add_request(reqs[i])
                del arrivals[i]
        for i, n in list(abort_at.items()):
            if len(reqs[i].output_ids) >= n:
                out = engine.abort(reqs[i].request_id)
                if out is not None:
                    collect(out)
                del abort_at[i]
        for out in engine.step():
            collect(out)
    assert engine.caches.idle()
    return seen, launched_ahead()


def reference_tokens(parts, i: int, n: int, **kw) -> list[int]:
    seen, _ = drive(parts, False, {i: {"max_tokens": n}}, **kw)
    return seen[f"r{i}"]["tokens"]


CLOSE = (5, 6, 7, 2)


def scenario(parts, **kw) -> tuple[dict, dict]:
    """Requests that end every way a request can while others decode: by length, abort, stop token,
    stop string; one gets forced thinking-close tokens, one samples with a seed and arrives late.
    Returns ``(specs, drive keywords)``; the stop token and string come from free runs."""
    _, tok = parts
    stop_token = reference_tokens(parts, 2, 16, **kw)[6]
    text = tok.decode(reference_tokens(parts, 5, 16, **kw))
    specs = {
        0: {"max_tokens": 20},
        1: {"max_tokens": 30},  # aborted at 5 tokens
        2: {"max_tokens": 16, "stop_token_ids": [stop_token]},
        3: {"max_tokens": 12, "thinking": ThinkingControl(end_id=2, budget=3, close_ids=CLOSE)},
        4: {"max_tokens": 10, "temperature": 0.8, "seed": 7},  # arrives once r0 has 3 tokens
        5: {"max_tokens": 16, "stop": [text[len(text) // 2 : len(text) // 2 + 3]]},
    }
    return specs, {"arrivals": {4: (0, 3)}, "abort_at": {1: 5}, **kw}


def check_scenario(seen: dict, specs: dict) -> None:
    """What the scenario's users must see, whichever way it ran."""
    assert seen["r0"]["finish"] == "length" and len(seen["r0"]["tokens"]) == 20
    assert seen["r1"]["finish"] == "abort" and len(seen["r1"]["tokens"]) == 5
    stop_token = specs[2]["stop_token_ids"][0]
    assert seen["r2"]["finish"] == "stop" and seen["r2"]["tokens"][-1] == stop_token
    assert seen["r2"]["tokens"].index(stop_token) == len(seen["r2"]["tokens"]) - 1
    assert seen["r3"]["tokens"][3:7] == list(CLOSE)
    assert seen["r4"]["finish"] == "length" and len(seen["r4"]["tokens"]) == 10
    assert seen["r5"]["finish"] == "stop" and specs[5]["stop"][0] not in seen["r5"]["text"]
