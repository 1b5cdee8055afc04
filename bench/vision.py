"""Images in: an image of N megapixels through the image processing, the vision tower and the
prompt's prefill, at a multimodal checkpoint's shape, with HF transformers as the peer.

    python -m bench.vision --shape qwen3.5-27b [--megapixels 1,4] [--text 64] [--reps 3]
                           [--prefill-chunk N] [--no-hf] [--json FILE]
    python -m bench.vision --shape tiny    (a two-block tower over a four-layer model, 0.25 and 1 MP:
                                            the CPU's smoke run)

Random weights at the real shape (``shapes.vision_shape``: the language model as bench.decode
builds it, with the checkpoint's M-RoPE, and the 27-block tower), bf16 made on the GPU (fp32 on
the CPU). Each image is a square of random RGB pixels (1 MP: 1024 x 1024, 4 MP: 2048 x 2048)
written as PNG, taken as the server takes one: decoded and processed
(``ImageProcessor.process_bytes`` with Qwen3.5's ``preprocessor_config.json``: 16-pixel patches,
2 x 2 merged, up to 16 Mi pixels, so neither image is scaled), its one placeholder expanded to
the image's tokens (``expand_images``) in a prompt of ``--text`` random tokens around it, and
the request served by ``LLMEngine`` to its first token (the runner encodes the image with the
prompt's first chunk, then prefills it; the whole prompt in one step unless ``--prefill-chunk``).
Timed: the processing (host, median of ``--reps``), the tower's encode alone as the runner calls
it (the patches copied to the GPU in it; synchronised, median of ``--reps`` after one warm-up),
the request to its first token (after one warm-up request; no prefix cache), and the same
request with the image's embeddings given (the runner then encodes nothing: the prefill alone);
the prompt's tok/s of each. Then ninfer's model is freed and the peer built: transformers'
``Qwen3_5ForConditionalGeneration`` at the same shape with random weights of its own (not a copy
of ours: the times do not depend on the values); its ``Qwen2VLImageProcessorPil`` on the same
PNG, ``get_image_features`` (the tower, the patches already on the GPU), one forward over the
same prompt (encode included, ``logits_to_keep=1``) and one with the image's rows already in its
input embeddings (the same M-RoPE positions). It prints a table with both and their ratio and
writes JSON.
"""
from __future__ import annotations

import argparse
import gc
import io
import json
import platform
import statistics
import time

import numpy as np
import torch

from ninfer.engine.config import ModelConfig

from .decode import NullTokenizer, _timed, randomize_
from .shapes import PREPROCESSOR, VISION, vision_shape

MEGAPIXEL_SIDE = 1024  # 1 MP: a 1024 x 1024 image


def image_png(megapixels: float, seed: int = 0) -> bytes:
    """A square PNG of random RGB pixels, ``megapixels`` * 1024 * 1024 of them (the side rounded)."""
    from PIL import Image

    side = round(MEGAPIXEL_SIDE * megapixels ** 0.5)
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    pixels = rng.integers(0, 256, size=(side, side, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(buf, format="PNG", compress_level=1)
    return buf.getvalue()


def prompt_ids(cfg: ModelConfig, text: int, seed: int = 1) -> list[int]:
    """``text`` random text tokens, the first half before the image's one placeholder (between the
    vision start and end tokens, as Qwen3.5's chat template renders an image part) and the rest
    after it; no text token is one of the vision tokens."""
    special = (cfg.vision_start_token_id, cfg.image_token_id, cfg.vision_end_token_id)
    lo, hi = (0, min(special)) if min(special) > cfg.vocab_size // 2 else (max(special) + 1, cfg.vocab_size)
    ids = torch.randint(lo, hi, (text,), generator=torch.Generator().manual_seed(seed)).tolist()
    return ids[: text // 2] + list(special) + ids[text // 2:]


def _median_s(fn, reps: int, warm: int = 1) -> float:
    for _ in range(warm):
        fn()
    return statistics.median(_timed(fn) for _ in range(reps))


def _empty_cache() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _peak_gb() -> float | None:
    return torch.cuda.max_memory_allocated() / 1e9 if torch.cuda.is_available() else None


def _reset_peak() -> None:
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def build_ours(cfg: ModelConfig, device: str, dtype: torch.dtype):
    """The language model with its vision tower (``model.visual``), random weights, projections
    fused as ``load_model`` leaves them on the GPU."""
    from ninfer.engine.layers.fused_linear import fuse_model_projections
    from ninfer.engine.models.registry import build_model
    from ninfer.engine.vision.encoder import VisionEncoder

    model = build_model(cfg, dtype=dtype, device=device)
    randomize_(model)
    with torch.device(device):
        visual = VisionEncoder(cfg.vision).to(dtype)
    randomize_(visual)
    model.visual = visual.eval()
    model.eval()
    if device == "cuda":
        fuse_model_projections(model)
    return model


def bench_ours(shape: str | dict, megapixels: list[float], text: int, reps: int, device: str = "cuda",
               prefill_chunk: int | None = None) -> dict:
    from ninfer.engine.engine import LLMEngine
    from ninfer.engine.engine_config import EngineConfig
    from ninfer.engine.request import Request
    from ninfer.engine.sampling_params import SamplingParams
    from ninfer.engine.vision.media import expand_images
    from ninfer.engine.vision.processor import ImageProcessor

    raw = vision_shape(shape) if isinstance(shape, str) else shape  # a name of VISION or a config dict
    cfg = ModelConfig.from_hf_dict(raw)
    proc = ImageProcessor.from_config(PREPROCESSOR, cfg.vision)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    ids = prompt_ids(cfg, text)
    longest = len(ids) - 1 + max(proc.tokens_for(*(2 * [round(MEGAPIXEL_SIDE * mp ** 0.5)])) for mp in megapixels)
    model = build_ours(cfg, device, dtype)
    max_ctx = longest + 16
    ecfg = EngineConfig(max_context=max_ctx, max_concurrency=1, prefill_chunk=prefill_chunk or max(longest, 2048),
                        kv_capacity=max_ctx, page_size=16, host_cache_mib=0, device=device, dtype=dtype,
                        vision=True, prefix_cache=False)
    ecfg.check_for_model(cfg)
    engine = LLMEngine(model, NullTokenizer(cfg.vocab_size), ecfg)
    out: dict = {}
    for mp in megapixels:
        png = image_png(mp)
        pre_s = _median_s(lambda: proc.process_bytes(png), reps)
        image = proc.process_bytes(png)
        with torch.inference_mode():
            encode_s = _median_s(lambda: model.visual.encode(image), reps)
        with torch.inference_mode():
            embeds = model.visual.encode(image)
        full, _ = expand_images(ids, [image], cfg.image_token_id)
        timed = {}
        for k, given in enumerate((None, None, embeds)):  # the first warms the prompt's shapes up
            req = Request(f"v{mp}-{k}", full, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True),
                          max_total_tokens=max_ctx)
            req.media = expand_images(ids, [image], cfg.image_token_id)[1]
            req.media.images[0].embeds = given  # given: the runner takes them and runs no encode
            _reset_peak()

            def serve():
                engine.add_request(req)
                while engine.has_work:
                    engine.step()

            timed["given" if given is not None else "encoded"] = _timed(serve), _peak_gb()
            if req.media.encoded != (given is None) or len(req.output_ids) != 1:
                raise RuntimeError(f"{mp} MP: the request encoded {req.media.encoded} images and made "
                                   f"{len(req.output_ids)} tokens")
        (request_s, peak), (given_s, _) = timed["encoded"], timed["given"]
        _, rows, cols = image.grid
        out[mp] = {"pixels": f"{cols * proc.patch_size}x{rows * proc.patch_size}", "patches": rows * cols,
                   "image_tokens": image.tokens, "prompt_tokens": len(full), "preprocess_ms": pre_s * 1e3,
                   "encode_ms": encode_s * 1e3, "request_ms": request_s * 1e3, "prefill_tok_s": len(full) / request_s,
                   "embeds_given_ms": given_s * 1e3, "prefill_tok_s_embeds_given": len(full) / given_s,
                   "peak_gb": peak}
    del engine, model
    _empty_cache()
    return out


def _hf_model(raw: dict, device: str, dtype: torch.dtype):
    import transformers

    conf = transformers.Qwen3_5Config(
        text_config={k: v for k, v in raw["text_config"].items() if k not in ("model_type", "architectures")},
        vision_config=raw["vision_config"],
        **{k: raw[k] for k in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id",
                               "tie_word_embeddings")})
    with torch.device(device):
        model = transformers.Qwen3_5ForConditionalGeneration._from_config(conf, dtype=dtype)
    model.eval()
    randomize_(model)
    return model


def _hf_processor():
    import transformers

    return transformers.Qwen2VLImageProcessorPil(
        patch_size=PREPROCESSOR["patch_size"], temporal_patch_size=PREPROCESSOR["temporal_patch_size"],
        merge_size=PREPROCESSOR["merge_size"], size=PREPROCESSOR["size"], image_mean=PREPROCESSOR["image_mean"],
        image_std=PREPROCESSOR["image_std"])


def bench_hf(shape: str | dict, megapixels: list[float], text: int, reps: int, device: str = "cuda") -> dict:
    import transformers
    from PIL import Image

    from ninfer.engine.vision.media import expand_images
    from ninfer.engine.vision.processor import ImageProcessor

    raw = vision_shape(shape) if isinstance(shape, str) else shape  # a name of VISION or a config dict
    cfg = ModelConfig.from_hf_dict(raw)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    _empty_cache()  # what ninfer's run left
    model = _hf_model(raw, device, dtype)
    proc, ours = _hf_processor(), ImageProcessor.from_config(PREPROCESSOR, cfg.vision)
    ids = prompt_ids(cfg, text)
    out: dict = {"transformers": transformers.__version__, "weights": "random, its own"}

    def process(png: bytes):
        with Image.open(io.BytesIO(png)) as img:
            return proc(images=[img.convert("RGB")], return_tensors="pt")

    with torch.inference_mode():
        for mp in megapixels:
            png = image_png(mp)
            row: dict = {"preprocess_ms": _median_s(lambda: process(png), reps) * 1e3}
            inputs = process(png)
            pixels = inputs["pixel_values"].to(device=device, dtype=dtype)
            grid = inputs["image_grid_thw"].to(device)
            image = ours.process_bytes(png)  # the same grid: the prompt's placeholders and M-RoPE positions
            if list(image.grid) != inputs["image_grid_thw"][0].tolist():
                raise RuntimeError(f"{mp} MP: transformers' grid {inputs['image_grid_thw'][0].tolist()}, "
                                   f"ninfer's {list(image.grid)}")
            full_ids, placed = expand_images(ids, [image], cfg.image_token_id)
            full = torch.tensor([full_ids], device=device)
            row.update(image_tokens=image.tokens, prompt_tokens=full.shape[1])
            try:
                row["encode_ms"] = _median_s(lambda: model.model.get_image_features(pixels, grid), reps) * 1e3
                _empty_cache()
                _reset_peak()
                mask = (full == cfg.image_token_id).int()
                forward_s = _median_s(lambda: model(input_ids=full, pixel_values=pixels, image_grid_thw=grid,
                                                    mm_token_type_ids=mask, use_cache=True, logits_to_keep=1), 1)
                row.update(forward_ms=forward_s * 1e3, prefill_tok_s=full.shape[1] / forward_s, peak_gb=_peak_gb())
                # the language model alone: the image's rows put in its token embeddings, the M-RoPE positions given
                features = model.model.get_image_features(pixels, grid).pooler_output
                embeds = model.get_input_embeddings()(full)
                embeds[mask.bool()] = torch.cat(list(features)).to(embeds.dtype)
                positions = placed.positions[:, None, :].to(device)
                _empty_cache()
                given_s = _median_s(lambda: model(inputs_embeds=embeds, position_ids=positions, use_cache=True,
                                                  logits_to_keep=1), 1)
                row.update(embeds_given_ms=given_s * 1e3, prefill_tok_s_embeds_given=full.shape[1] / given_s)
                del features, embeds, positions
            except torch.OutOfMemoryError:
                row["error"] = "out of memory"
            _empty_cache()
            out[mp] = row
    del model
    _empty_cache()
    return out


def _ratio(a: dict, b: dict, key: str, lower_is_better: bool = False) -> str:
    if key not in a or key not in b:
        return "-"
    return f"{(b[key] / a[key]) if lower_is_better else (a[key] / b[key]):.2f}x"


def table(shape: str, ours: dict, hf: dict | None = None) -> str:
    """One row per image and figure: ninfer's, the peer's, and how many times faster ninfer is."""
    hf = hf or {}
    peer = f"HF transformers {hf['transformers']}" if "transformers" in hf else "HF transformers"
    rows = [f"| shape | image | work | ninfer | {peer} | ninfer / HF |",
            "|---|---|---|---|---|---|"]
    for mp, o in ours.items():
        h = hf.get(mp, {})
        image = f"{mp:g} MP ({o['pixels']}, {o['image_tokens']} tokens)"

        def ms(d, key):
            return f"{d[key]:.1f} ms" if key in d else d.get("error", "-")

        def rate(d, key):
            return f"{d[key]:.0f} tok/s" if key in d else d.get("error", "-")

        peak = f", peak {o['peak_gb']:.1f} GB" if o.get("peak_gb") else ""
        hpeak = f", peak {h['peak_gb']:.1f} GB" if h.get("peak_gb") else ""
        forward = f" ({h['forward_ms']:.1f} ms one forward{hpeak})" if "forward_ms" in h else ""
        rows += [
            f"| {shape} | {image} | preprocess (PNG decode + patches) | {ms(o, 'preprocess_ms')} | "
            f"{ms(h, 'preprocess_ms')} | {_ratio(o, h, 'preprocess_ms', True)} |",
            f"| {shape} | {image} | encode (vision tower) | {ms(o, 'encode_ms')} | {ms(h, 'encode_ms')} | "
            f"{_ratio(o, h, 'encode_ms', True)} |",
            f"| {shape} | {image} | prefill of {o['prompt_tokens']} tokens, encode in it | "
            f"{rate(o, 'prefill_tok_s')} ({o['request_ms']:.1f} ms to the first token{peak}) | "
            f"{rate(h, 'prefill_tok_s')}{forward} | "
            f"{_ratio(o, h, 'prefill_tok_s')} |",
            f"| {shape} | {image} | prefill, the image's embeddings given | {rate(o, 'prefill_tok_s_embeds_given')} "
            f"({o['embeds_given_ms']:.1f} ms) | {rate(h, 'prefill_tok_s_embeds_given')}"
            f"{' (' + ms(h, 'embeds_given_ms') + ')' if 'embeds_given_ms' in h else ''} | "
            f"{_ratio(o, h, 'prefill_tok_s_embeds_given')} |",
        ]
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.vision", description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="qwen3.5-27b", choices=sorted(VISION))
    p.add_argument("--megapixels", default=None,
                   help="image sizes, each a square of N * 1024 * 1024 pixels (default 1,4; with --shape tiny 0.25,1)")
    p.add_argument("--text", type=int, default=64, help="text tokens of the prompt around the image")
    p.add_argument("--reps", type=int, default=3, help="timed repeats of the processing and the encode")
    p.add_argument("--prefill-chunk", type=int, default=None,
                   help="prompt tokens per step (default: the whole prompt in one step; the server's is 2048)")
    p.add_argument("--no-hf", action="store_true")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and args.shape != "tiny":
        p.error(f"--shape {args.shape} needs a CUDA GPU (--shape tiny runs on the CPU)")
    sizes = args.megapixels or ("0.25,1" if args.shape == "tiny" else "1,4")
    megapixels = [float(x) for x in sizes.split(",") if x]
    gpu = torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu"
    print(f"{args.shape} on {gpu}: tower {VISION[args.shape]['depth']} blocks of {VISION[args.shape]['hidden_size']}, "
          f"{'bf16' if device == 'cuda' else 'fp32'}, random weights", flush=True)
    results: dict = {"ninfer": bench_ours(args.shape, megapixels, args.text, args.reps, device, args.prefill_chunk)}
    print(table(args.shape, results["ninfer"]), flush=True)  # ours first, in case the peer stalls
    if not args.no_hf:
        results["hf"] = bench_hf(args.shape, megapixels, args.text, args.reps, device)
        print("\n" + table(args.shape, results["ninfer"], results["hf"]), flush=True)
    if args.json:
        report = {"date": time.strftime("%Y-%m-%d"), "host": platform.node(), "device": gpu, "torch": torch.__version__,
                  "args": vars(args), "shape": vision_shape(args.shape), "results": results}
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
