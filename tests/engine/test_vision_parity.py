"""Images in: parity with transformers on CPU fp32 for a tiny random
``Qwen3_5ForConditionalGeneration`` (dense and MoE) with its vision tower.

The image processor gives transformers' pixels exactly; the vision tower's embeddings, the
prompt logits for a prompt with two images of different sizes (placeholders expanded, M-RoPE
positions on three axes) agree to 1e-4; 32 greedy tokens served by the engine (prompt chunks that
cut through the images, decode positions continuing from the image grids) are the tokens
transformers' argmax picks at every step.
"""
from __future__ import annotations

import io

import pytest
import torch
import transformers
from PIL import Image

from ninfer.engine.engine import LLMEngine
from ninfer.engine.engine_config import EngineConfig
from ninfer.engine.loader import load_checkpoint, load_model
from ninfer.engine.models.base import ForwardBatch
from ninfer.engine.request import Request
from ninfer.engine.sampling_params import SamplingParams
from ninfer.engine.vision.media import expand_images
from support.tiny import IMAGE_TOKEN_ID, VISION_END_ID, VISION_START_ID, save_tiny_qwen3_5_vl, tiny_png

LOGIT_TOL, NEW_TOKENS = 1e-4, 32
SIZES = [(40, 24), (57, 31)]  # 6 x 10 and 8 x 14 patches: 15 and 28 tokens


@pytest.fixture(scope="module", params=["dense", "moe"])
def tiny_vl(request, tmp_path_factory):
    path, hf = save_tiny_qwen3_5_vl(tmp_path_factory.mktemp(request.param) / "ckpt", moe=request.param == "moe",
                                    noise=0.05)
    ckpt = load_checkpoint(path)
    return path, hf, ckpt, load_model(ckpt, "cpu", torch.float32, vision=True)


def prompt_with_images(vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(1)

    def text(n):
        return torch.randint(7, vocab, (n,), generator=g).tolist()

    image = [VISION_START_ID, IMAGE_TOKEN_ID, VISION_END_ID]
    return text(10) + image + text(7) + image + text(5)


def reference_inputs(path, pngs: list[bytes], ids: list[int]):
    proc = transformers.Qwen2VLImageProcessorPil.from_pretrained(path)
    out = proc(images=[Image.open(io.BytesIO(b)) for b in pngs], return_tensors="pt")
    ids_t = torch.tensor([ids])
    return dict(input_ids=ids_t, pixel_values=out["pixel_values"], image_grid_thw=out["image_grid_thw"],
                mm_token_type_ids=(ids_t == IMAGE_TOKEN_ID).int())


def test_processor_and_tower_match_transformers(tiny_vl):
    path, hf, ckpt, model = tiny_vl
    proc = transformers.Qwen2VLImageProcessorPil.from_pretrained(path)
    for i, (w, h) in enumerate(SIZES + [(200, 100), (9, 13)]):
        png = tiny_png(w, h, seed=i)
        ours = ckpt.image_processor.process_bytes(png)
        ref = proc(images=[Image.open(io.BytesIO(png))], return_tensors="pt")
        assert list(ours.grid) == ref["image_grid_thw"][0].tolist()
        assert ours.tokens == ckpt.image_processor.tokens_for(w, h)
        torch.testing.assert_close(ours.pixels, ref["pixel_values"], atol=1e-6, rtol=0)
        with torch.no_grad():
            expected = hf.model.get_image_features(ref["pixel_values"], ref["image_grid_thw"]).pooler_output[0]
            diff = (model.visual.encode(ours) - expected).abs().max().item()
        assert diff < LOGIT_TOL, f"{w}x{h}: vision embeddings differ by {diff:.3g}"


def test_two_images_logits_and_greedy_match_transformers(tiny_vl):
    path, hf, ckpt, model = tiny_vl
    pngs = [tiny_png(w, h, seed=i) for i, (w, h) in enumerate(SIZES)]
    images = [ckpt.image_processor.process_bytes(b) for b in pngs]
    ids, media = expand_images(prompt_with_images(ckpt.config.vocab_size), images, IMAGE_TOKEN_ID)
    assert len(ids) == 10 + (15 + 2) + 7 + (28 + 2) + 5 and media.delta < 0  # the grids take fewer positions than tokens
    inputs = reference_inputs(path, pngs, ids)

    with torch.no_grad():
        expected = hf(**inputs).logits[0].float()
        # the model's reference path: one forward over the prompt, image rows in place of the placeholders
        embeds = [model.visual.encode(im.image) for im in media.images]
        index = torch.cat([torch.arange(im.start, im.end) for im in media.images])
        batch = ForwardBatch.single(len(ids), model.new_cache())
        batch.mrope, batch.embeds = media.rows(0, len(ids)), (index, torch.cat(embeds))
        logits = model.compute_logits(model(torch.tensor(ids), batch))
    diff = (logits - expected).abs().max().item()
    assert diff < LOGIT_TOL, f"prompt logits differ by {diff:.3g}"

    # the engine: prompt chunks of 16 tokens cut through both images; then decode steps
    engine = LLMEngine(model, ckpt.tokenizer, EngineConfig(max_context=256, max_concurrency=2, prefill_chunk=16,
                                                            kv_capacity=512, page_size=8))
    req = Request("img", ids, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True),
                  max_total_tokens=256)
    req.media = media
    engine.add_request(req)
    while engine.has_work:
        engine.step()
    tokens = req.output_ids
    assert len(tokens) == NEW_TOKENS and media.encoded == 2

    # transformers over the prompt and those tokens: its argmax at every step is the token served
    with torch.no_grad():
        full = {**inputs, "input_ids": torch.tensor([ids + tokens[:-1]])}
        full["mm_token_type_ids"] = (full["input_ids"] == IMAGE_TOKEN_ID).int()
        steps = hf(**full).logits[0, len(ids) - 1 :].float()
    assert steps.argmax(-1).tolist() == tokens
    margin = min(float(s.topk(2).values.diff().abs()) for s in steps)
    assert margin > 2 * LOGIT_TOL, f"near tie in the reference ({margin:.2g}); pick another seed"
