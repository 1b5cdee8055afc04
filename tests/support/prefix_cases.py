"""What the prefix-cache tests share: the four tiny model families, an engine small enough to
fill, a loop that runs requests to the end and the request they send."""
from __future__ import annotations

import pytest
import torch

from ninfer.engine.engine import LLMEngine
from ninfer.engine.engine_config import EngineConfig
from ninfer.engine.loader import load_checkpoint, load_model
from ninfer.engine.request import Request
from ninfer.engine.sampling_params import SamplingParams
from support.tiny import save_tiny_llama, save_tiny_qwen3_5, save_tiny_qwen3_next

BUILDERS = {
    "llama": save_tiny_llama,
    "qwen3_5": save_tiny_qwen3_5,
    "qwen3_5_moe": lambda path: save_tiny_qwen3_5(path, moe=True),
    "qwen3_next": save_tiny_qwen3_next,
}


@pytest.fixture(scope="module", params=sorted(BUILDERS))
def parts(request, tmp_path_factory):
    """(model, tokenizer) of each family in turn, on the CPU in fp32."""
    ckpt = load_checkpoint(BUILDERS[request.param](tmp_path_factory.mktemp(request.param) / "ckpt"))
    return load_model(ckpt, "cpu", torch.float32), ckpt.tokenizer


def engine(parts, **kw) -> LLMEngine:
    model, tok = parts
    return LLMEngine(model, tok, EngineConfig(**{"max_context": 512, "max_concurrency": 3, "kv_capacity": 1536,
                                                 "prefill_chunk": 64, **kw}))


def run(eng: LLMEngine, requests: list[Request], each_step=None) -> dict[str, tuple[list[int], int]]:
    """Each request's output ids and the cached tokens its admission reported (``each_step``
    called after every step), then the engine's idle work, as the server's loop does it."""
    for r in requests:
        eng.add_request(r)
    out = {r.request_id: ([], None) for r in requests}
    while eng.has_work:
        for o in eng.step():
            ids, cached = out[o.request_id]
            out[o.request_id] = (ids + list(o.token_ids or []), o.cached_tokens if o.admitted else cached)
        if each_step is not None:
            each_step()
    while eng.idle_work():  # as the server's loop does once the engine has no work
        pass
    return out


def req(name: str, ids: list[int], n: int = 8, **kw) -> Request:
    """A greedy request for ``n`` tokens, eos ignored (``max_total_tokens`` 320 unless given)."""
    return Request(name, list(ids), SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True),
                   **{"max_total_tokens": 320, **kw})


def greedy_with_top5(parts, **settings) -> tuple[list[int], list[dict[int, float]]]:
    """24 greedy tokens after a 70-token prompt in three chunks (the later ones read what the
    earlier ones stored: pages, recurrent state), with each step's top-5 log-probabilities, on an
    engine of ``settings``."""
    eng = engine(parts, prefill_chunk=32, **settings)
    ids = [5 + (7 * i) % 80 for i in range(70)]
    eng.add_request(Request("a", ids, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=5),
                            max_total_tokens=320))
    toks, tops = [], []
    while eng.has_work:
        for o in eng.step():
            toks += list(o.token_ids or [])
            tops += [dict(t.top) for t in (o.logprobs or [])]
    return toks, tops
