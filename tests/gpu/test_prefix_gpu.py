"""Prefix checkpoints on the GPU, with decode in CUDA graphs and the next step launched ahead: a
four-turn conversation goes on from where each answer ended and gives the tokens it gives
without the cache; two conversations through a one-checkpoint device tier hit from host memory."""
from __future__ import annotations

import pytest
import torch

from ninfer.engine.engine import LLMEngine
from ninfer.engine.engine_config import EngineConfig
from ninfer.engine.loader import load_checkpoint, load_model
from ninfer.engine.request import Request
from ninfer.engine.sampling_params import SamplingParams
from support.tiny import save_tiny_llama, save_tiny_qwen3_5

pytestmark = pytest.mark.gpu
BUILDERS = {"llama": save_tiny_llama, "qwen3_5": save_tiny_qwen3_5}


@pytest.fixture(scope="module", params=sorted(BUILDERS))
def model(request, tmp_path_factory):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    ckpt = load_checkpoint(BUILDERS[request.param](tmp_path_factory.mktemp(request.param) / "ckpt"))
    return load_model(ckpt, "cuda", torch.float32), ckpt.tokenizer


def engine(model, **kw) -> LLMEngine:
    m, tok = model
    return LLMEngine(m, tok, EngineConfig(**{"max_context": 512, "max_concurrency": 4, "prefill_chunk": 64,
                                             "kv_capacity": 4096, "device": "cuda", "dtype": torch.float32, **kw}))


def turn(eng: LLMEngine, name: str, ids: list[int]) -> tuple[list[int], int]:
    eng.add_request(Request(name, list(ids), SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
                            max_total_tokens=512))
    got, cached = [], 0
    while eng.has_work:
        for o in eng.step():
            got += list(o.token_ids or [])
            cached = o.cached_tokens if o.admitted else cached
    return got, cached


def conversation(eng: LLMEngine, start: int, turns: int = 4) -> list[tuple[list[int], int, int]]:
    ids, out = [start + i % 80 for i in range(45)], []
    for t in range(turns):
        got, cached = turn(eng, f"c{start}-{t}", ids)
        out.append((got, cached, len(ids)))
        ids = ids + got + [9 + t, 10, 11, 12]
    return out


def test_a_returning_conversation_on_the_gpu_goes_on_from_its_last_answer(model):
    eng = engine(model)
    assert eng.runner.graphs is not None
    with_cache, plain = conversation(eng, 5), conversation(engine(model, prefix_cache=False), 5)
    assert [g for g, _, _ in with_cache] == [g for g, _, _ in plain]
    for (got, _, prompt), (_, cached, _) in zip(with_cache, with_cache[1:]):
        # all but the answer's last token, or all of it where the step launched ahead ran it
        assert prompt + len(got) - 1 <= cached <= prompt + len(got)
    assert eng.caches.idle()


def test_two_conversations_through_one_device_checkpoint_hit_from_host_memory(model):
    eng = engine(model, prefix_checkpoints=1, host_cache_mib=64)
    a, b, plain = [], [], engine(model, prefix_cache=False)
    ids = {5: [5 + i % 80 for i in range(45)], 7: [7 + i % 70 for i in range(50)]}
    for t in range(3):
        for start, out in ((5, a), (7, b)):
            got, cached = turn(eng, f"c{start}-{t}", ids[start])
            out.append((got, cached))
            assert got == turn(plain, f"p{start}-{t}", ids[start])[0]
            ids[start] = ids[start] + got + [9 + t, 10, 11]
    assert all(cached > 0 for _, cached in a[1:] + b[1:])
    assert eng.caches.prefix.hits_host >= 4
    assert eng.caches.idle()
    eng.caches.prefix.clear()
    assert eng.caches.host_checkpoint_bytes == 0 and eng.caches.free_pages == eng.caches.kv.num_pages - 1
