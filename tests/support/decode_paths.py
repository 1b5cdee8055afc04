"""The engine's path (one forward per step over the shared pools) and the models' reference
path (per-sequence caches), run on the same tiny checkpoints and prompts."""
from __future__ import annotations

import torch

from ninfer.engine.engine import LLMEngine
from ninfer.engine.engine_config import EngineConfig
from ninfer.engine.loader import load_checkpoint, load_model
from ninfer.engine.models.base import ForwardBatch
from ninfer.engine.request import Request
from ninfer.engine.sampling_params import SamplingParams
from support.tiny import save_tiny_llama, save_tiny_qwen3_5

BUILDERS = {"llama": save_tiny_llama, "qwen3_5": save_tiny_qwen3_5,
            "qwen3_5_moe": lambda p: save_tiny_qwen3_5(p, moe=True)}


def load_parts(name: str, tmp_path_factory, dtype: torch.dtype = torch.float32):
    """(model, tokenizer) of a tiny checkpoint on the CPU, fp32 unless ``dtype`` says otherwise."""
    ckpt = load_checkpoint(BUILDERS[name](tmp_path_factory.mktemp(name) / "ckpt"))
    return load_model(ckpt, "cpu", dtype), ckpt.tokenizer


def run(parts, requests: int = 4, max_tokens: int = 14) -> dict[str, list[int]]:
    """Greedy outputs of ``requests`` prompts of different lengths served together by the engine
    (one forward per step over the pools: their prompt chunks and decode rows share steps)."""
    model, tok = parts
    engine = LLMEngine(model, tok, EngineConfig(max_context=128, max_concurrency=4, prefill_chunk=32,
                                                kv_capacity=1024, page_size=8))
    reqs = [Request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
                    max_total_tokens=128) for i, p in enumerate(prompts(tok, requests))]
    for r in reqs:
        engine.add_request(r)
    while engine.has_work:
        engine.step()
    assert engine.caches.idle()
    return {r.request_id: r.output_ids for r in reqs}


def prompts(tok, requests: int) -> list[list[int]]:
    ids = tok.encode("Hello world! How are you today? The quick brown fox jumps over the lazy dog. " * 3)
    return [ids[i : 5 + 11 * i] for i in range(requests)]


def reference(parts, requests: int = 4, max_tokens: int = 14) -> dict[str, list[int]]:
    """The same requests' greedy outputs, each alone on the model's reference path (its own
    ``SequenceCache``, whole prompt in one forward, one token per forward after)."""
    model, tok = parts
    out = {}
    for i, p in enumerate(prompts(tok, requests)):
        cache, ids, got = model.new_cache(), list(p), []
        with torch.inference_mode():
            for _ in range(max_tokens):
                new = ids[cache.num_tokens:]
                hidden = model(torch.tensor(new), ForwardBatch.single(len(new), cache))
                logits = model.compute_logits(hidden[-1:])[0, : tok.vocab_size]
                got.append(int(logits.argmax()))
                ids.append(got[-1])
        out[f"r{i}"] = got
    return out
