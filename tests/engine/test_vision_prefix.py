"""Prefix checkpoints and images: a checkpoint past an image serves only a prompt with the same
image bytes there (the placeholders are keyed by the image's digest and grid); a returning
conversation with an image in its history goes on from its checkpoint without running the
vision tower again."""
from __future__ import annotations

import pytest
import torch

from ninfer.engine.engine import LLMEngine
from ninfer.engine.engine_config import EngineConfig
from ninfer.engine.loader import load_checkpoint, load_model
from ninfer.engine.request import Request
from ninfer.engine.sampling_params import SamplingParams
from ninfer.engine.vision.media import expand_images
from support.tiny import IMAGE_TOKEN_ID, VISION_END_ID, VISION_START_ID, save_tiny_qwen3_5_vl, tiny_png


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    path, _ = save_tiny_qwen3_5_vl(tmp_path_factory.mktemp("vl") / "ckpt")
    ckpt = load_checkpoint(path)
    return ckpt, load_model(ckpt, "cpu", torch.float32, vision=True)


def engine_of(parts, cache: bool = True) -> LLMEngine:
    ckpt, model = parts
    return LLMEngine(model, ckpt.tokenizer, EngineConfig(max_context=256, max_concurrency=2, prefill_chunk=32,
                                                         kv_capacity=1024, page_size=8, prefix_cache=cache))


def run(engine: LLMEngine, ckpt, ids: list[int], pngs: list[bytes], rid: str) -> Request:
    images = [ckpt.image_processor.process_bytes(b) for b in pngs]
    full, media = expand_images(ids, images, IMAGE_TOKEN_ID)
    req = Request(rid, full, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), max_total_tokens=256)
    req.media = media
    engine.add_request(req)
    while engine.has_work:
        engine.step()
    return req


def test_checkpoint_past_an_image_needs_the_same_image(parts):
    ckpt, _ = parts
    text = ckpt.tokenizer.encode("Hello world! How are you today?")
    ids = text + [VISION_START_ID, IMAGE_TOKEN_ID, VISION_END_ID] + text[:2]
    more = text[2:3]  # a short tail after the image: the image decides the answer
    first, other = tiny_png(40, 24, seed=1), tiny_png(40, 24, seed=2, noise=True)  # same grid, other bytes
    engine = engine_of(parts)
    a = run(engine, ckpt, ids, [first], "a")
    encoded = engine.counters.images_encoded
    assert encoded == 1

    # the same ids, the same placeholders, another image: no checkpoint past the image is taken
    b = run(engine, ckpt, ids + more, [other], "b")
    assert b.cached_tokens == 0 and engine.counters.images_encoded == encoded + 1
    alone = run(engine_of(parts, cache=False), ckpt, ids + more, [other], "b")
    assert b.output_ids == alone.output_ids
    with_first = run(engine_of(parts, cache=False), ckpt, ids + more, [first], "x").output_ids
    assert b.output_ids != with_first

    # the first prompt returns longer, its image in the history: on from past the image, not encoded again
    c = run(engine, ckpt, ids + more, [first], "c")
    assert c.cached_tokens == len(a.prompt_ids) and c.media.encoded == 0
    assert engine.counters.images_encoded == encoded + 1
    assert c.output_ids == with_first
