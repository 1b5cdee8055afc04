"""After the engine's warm-up, no step compiles a kernel again: fifty steps of mixes that move
(prompt rows of new lengths, several at once, beside decode rows that come and go) run on the
kernel variants compiled at start, so no user's time to first token holds a compile."""
from __future__ import annotations

import random

import pytest
import torch

from ninfer.engine.engine import LLMEngine
from ninfer.engine.engine_config import EngineConfig
from ninfer.engine.loader import load_checkpoint, load_model
from ninfer.engine.request import Request
from ninfer.engine.sampling_params import SamplingParams
from support.tiny import save_tiny_qwen3_5

pytestmark = pytest.mark.gpu


class Compiles:
    """Names of the Triton kernels compiled while it is entered (Triton's post-compile hook)."""

    def __enter__(self) -> list[str]:
        import triton

        self.knobs = triton.knobs.runtime
        self.before = self.knobs.jit_post_compile_hook
        self.names: list[str] = []

        def hook(*args, **kwargs):
            self.names.append(kwargs.get("repr") or str(kwargs.get("fn")))
            return False

        self.knobs.jit_post_compile_hook = hook
        return self.names

    def __exit__(self, *exc) -> None:
        self.knobs.jit_post_compile_hook = self.before


@pytest.mark.parametrize("moe", [False, True])
def test_fifty_steps_of_moving_mixes_compile_nothing_after_the_warm_up(moe, tmp_path):
    ckpt = load_checkpoint(save_tiny_qwen3_5(tmp_path / "ckpt", moe=moe))
    engine = LLMEngine(load_model(ckpt, "cuda", torch.bfloat16), ckpt.tokenizer,
                       EngineConfig(max_context=1024, max_concurrency=16, prefill_chunk=512, kv_capacity=16384,
                                    page_size=16, device="cuda", dtype=torch.bfloat16))
    rng, count, steps, mixes = random.Random(0), 0, 0, set()
    with Compiles() as names:
        while steps < 50:
            if len(engine.running) + len(engine.waiting) < 16:
                for _ in range(rng.choice([0, 0, 1, 1, 2, 3])):
                    n = rng.choice([1, 2, 3, rng.randrange(4, 64), rng.randrange(64, 700)])
                    engine.add_request(Request(f"r{count}", [rng.randrange(3, 300) for _ in range(n)],
                                               SamplingParams(temperature=rng.choice([0.0, 0.8]), seed=count,
                                                              max_tokens=rng.randrange(1, 40), ignore_eos=True),
                                               max_total_tokens=1024))
                    count += 1
            if engine.has_work:
                engine.step()
                steps += 1
                mixes.add((len(engine.running), len(engine.waiting)))
    assert len(mixes) >= 10 and count >= 20  # the steps did move
    assert not names, f"{len(names)} kernel variants compiled after the warm-up: {sorted(set(names))[:8]}"
