"""Image bytes -> the vision tower's patches, as Qwen2-VL / Qwen3.5 checkpoints expect them.

An image is converted to RGB, resized (bicubic) so both sides are multiples of
``patch_size * merge_size`` with the pixel count kept within ``[min_pixels, max_pixels]`` and
the aspect ratio as close as it can be, scaled to [0, 1] and normalised by the checkpoint's mean
and standard deviation. It is then cut into ``patch_size`` squares, ordered by merge blocks
(``merge_size`` x ``merge_size`` neighbouring patches are consecutive: the merger fuses them into
one token). The tower takes each patch repeated ``temporal_patch_size`` times (a still image is
one frame of a video): a ``ProcessedImage`` holds the frame once and repeats it when asked
(``pixels``), which halves what a request in flight holds. The settings come from the
checkpoint's ``preprocessor_config.json``.
"""
from __future__ import annotations

import hashlib
import io
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

# the largest side ratio an image may have
MAX_ASPECT = 200


class MediaError(ValueError):
    """An image that cannot be read or used; the server answers 400 ``invalid_media``."""


@dataclass
class ProcessedImage:
    """One image ready for the vision tower."""

    frame: torch.Tensor  # [patches, channels, patch_size**2] fp32: each patch once
    grid: tuple[int, int, int]  # (frames, patch rows, patch columns)
    digest: str  # sha256 of the image bytes as sent
    merge_size: int = 2
    temporal_patch_size: int = 2

    @property
    def pixels(self) -> torch.Tensor:
        """The tower's input ``[patches, channels * temporal_patch_size * patch_size**2]``: each
        channel's patch repeated over the temporal patch (a new tensor)."""
        p, c, a = self.frame.shape
        return self.frame[:, :, None, :].expand(p, c, self.temporal_patch_size, a).reshape(p, -1)

    @property
    def nbytes(self) -> int:
        return self.frame.nbytes

    @property
    def tokens(self) -> int:
        """Placeholder tokens the image takes in the prompt."""
        t, h, w = self.grid
        return t * h * w // (self.merge_size ** 2)


def fitted_size(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """``(height, width)`` rounded to multiples of ``factor`` and scaled into the pixel budget."""
    if min(height, width) <= 0:
        raise MediaError(f"image of {width}x{height} pixels")
    if max(height, width) / min(height, width) > MAX_ASPECT:
        raise MediaError(f"image of {width}x{height} pixels: its sides differ by more than {MAX_ASPECT} times")
    h, w = round(height / factor) * factor, round(width / factor) * factor
    if h * w > max_pixels:
        scale = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / scale / factor) * factor)
        w = max(factor, math.floor(width / scale / factor) * factor)
    elif h * w < min_pixels:
        scale = math.sqrt(min_pixels / (height * width))
        h, w = math.ceil(height * scale / factor) * factor, math.ceil(width * scale / factor) * factor
    return h, w


@dataclass
class ImageProcessor:
    patch_size: int = 16
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    mean: tuple[float, ...] = (0.48145466, 0.4578275, 0.40821073)
    std: tuple[float, ...] = (0.26862954, 0.26130258, 0.27577711)
    max_image_pixels: int = field(default=100_000_000)  # decoded size refused above this (a decompression bomb)

    @classmethod
    def from_config(cls, cfg: dict[str, Any], vision: dict[str, Any] | None = None) -> "ImageProcessor":
        """From a ``preprocessor_config.json`` (and the vision config's patch sizes where it has none)."""
        vision = vision or {}
        size = cfg.get("size") or {}
        out = cls()
        out.patch_size = int(cfg.get("patch_size", vision.get("patch_size", out.patch_size)))
        out.temporal_patch_size = int(cfg.get("temporal_patch_size",
                                              vision.get("temporal_patch_size", out.temporal_patch_size)))
        out.merge_size = int(cfg.get("merge_size", vision.get("spatial_merge_size", out.merge_size)))
        out.min_pixels = int(cfg.get("min_pixels") or size.get("shortest_edge") or out.min_pixels)
        out.max_pixels = int(cfg.get("max_pixels") or size.get("longest_edge") or out.max_pixels)
        if cfg.get("image_mean") is not None:
            out.mean = tuple(float(x) for x in cfg["image_mean"])
        if cfg.get("image_std") is not None:
            out.std = tuple(float(x) for x in cfg["image_std"])
        return out

    @classmethod
    def from_dir(cls, path: str, vision: dict[str, Any] | None = None) -> "ImageProcessor":
        file = os.path.join(path, "preprocessor_config.json")
        cfg = {}
        if os.path.exists(file):
            with open(file, encoding="utf-8") as f:
                cfg = json.load(f)
        return cls.from_config(cfg, vision)

    def tokens_for(self, width: int, height: int) -> int:
        """Placeholder tokens an image of this size takes."""
        factor = self.patch_size * self.merge_size
        h, w = fitted_size(height, width, factor, self.min_pixels, self.max_pixels)
        return (h // self.patch_size) * (w // self.patch_size) // self.merge_size ** 2

    def process_bytes(self, data: bytes) -> ProcessedImage:
        """Decode and process an encoded image (PNG, JPEG, WebP, GIF's first frame ...)."""
        from PIL import Image, UnidentifiedImageError

        try:
            with Image.open(io.BytesIO(data)) as img:
                if img.width * img.height > self.max_image_pixels:
                    raise MediaError(f"image of {img.width}x{img.height} pixels is too large")
                img.load()
                rgb = img.convert("RGB")
        except MediaError:
            raise
        except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as exc:
            raise MediaError(f"not a readable image ({exc})") from None
        return self.process(rgb, hashlib.sha256(data).hexdigest())

    def process(self, image, digest: str = "") -> ProcessedImage:
        """Process a PIL image (converted to RGB)."""
        from PIL import Image

        image = image.convert("RGB")
        p, m, t = self.patch_size, self.merge_size, self.temporal_patch_size
        h, w = fitted_size(image.height, image.width, p * m, self.min_pixels, self.max_pixels)
        if (w, h) != image.size:
            image = image.resize((w, h), resample=Image.Resampling.BICUBIC)
        x = np.asarray(image, dtype=np.float32).transpose(2, 0, 1) / 255.0  # [3, h, w]
        x = (x - np.asarray(self.mean, np.float32)[:, None, None]) / np.asarray(self.std, np.float32)[:, None, None]
        gh, gw = h // p, w // p
        # [c, block rows, m, p, block cols, m, p] -> [block rows, block cols, m, m, c, p, p]
        x = x.reshape(3, gh // m, m, p, gw // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)
        frame = torch.from_numpy(np.ascontiguousarray(x).reshape(gh * gw, 3, p * p))
        return ProcessedImage(frame=frame, grid=(1, gh, gw), digest=digest or _digest_of(frame), merge_size=m,
                              temporal_patch_size=t)


def _digest_of(frame: torch.Tensor) -> str:
    return hashlib.sha256(frame.numpy().tobytes()).hexdigest()
