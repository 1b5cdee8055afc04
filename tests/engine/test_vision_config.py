"""``--vision`` against checkpoints without a vision tower, and requests with images against a
model loaded without one: refused with the setting named."""
from __future__ import annotations

import pytest
import torch

from ninfer.engine.engine import LLMEngine
from ninfer.engine.engine_config import EngineConfig
from ninfer.engine.loader import load_checkpoint, load_model
from ninfer.engine.request import Request
from ninfer.engine.sampling_params import SamplingParams
from ninfer.engine.vision.media import expand_images
from support.tiny import IMAGE_TOKEN_ID, save_tiny_qwen3_5, save_tiny_qwen3_5_vl, tiny_png


def test_vision_needs_a_tower(tmp_path):
    ckpt = load_checkpoint(save_tiny_qwen3_5(tmp_path / "text"))
    assert ckpt.vision_weights is None and ckpt.image_processor is None
    with pytest.raises(ValueError, match="without --vision"):
        EngineConfig(vision=True).check_for_model(ckpt.config)
    with pytest.raises(ValueError, match="no vision tower"):
        load_model(ckpt, "cpu", torch.float32, vision=True)


def test_images_need_the_tower_loaded(tmp_path):
    path, _ = save_tiny_qwen3_5_vl(tmp_path / "vl")
    ckpt = load_checkpoint(path)
    model = load_model(ckpt, "cpu", torch.float32)  # the tower skipped: no memory spent on it
    assert model.vision_tower is None and ckpt.vision_weights is not None
    EngineConfig(vision=True).check_for_model(ckpt.config)
    ids, media = expand_images([7, IMAGE_TOKEN_ID, 8], [ckpt.image_processor.process_bytes(tiny_png(16, 16))],
                               IMAGE_TOKEN_ID)
    engine = LLMEngine(model, ckpt.tokenizer, EngineConfig(max_context=64, max_concurrency=1, kv_capacity=64))
    req = Request("r", ids, SamplingParams(max_tokens=2), max_total_tokens=64)
    req.media = media
    with pytest.raises(ValueError, match="--vision"):
        engine.add_request(req)
