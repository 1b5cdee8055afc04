"""A prompt's images: where their placeholder tokens lie, their embeddings, and the prompt's
three-axis M-RoPE positions.

Each image is one ``image_token_id`` in the rendered prompt (between the vision start and end
tokens the chat template writes), expanded here to as many placeholders as the image has tokens.
Positions: a text token is one past the largest position before it, on all three axes; an image
whose grid is ``rows x cols`` tokens (after the merge) starting where the next text position
``p`` would be takes ``(p, p + row, p + col)`` for its tokens, and the text after it goes on from
``p + max(rows, cols)``. So past the prompt every position is its index plus ``delta`` (the
same on the three axes), which a request keeps for its decode steps.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch

from .processor import MediaError, ProcessedImage


@dataclass
class PlacedImage:
    image: ProcessedImage
    start: int  # its first placeholder's index in the prompt
    embeds: torch.Tensor | None = None  # the vision tower's output, once encoded

    @property
    def end(self) -> int:
        return self.start + self.image.tokens


@dataclass
class MediaPrompt:
    images: list[PlacedImage]
    positions: torch.Tensor  # [3, prompt length] int64 on the host
    delta: int  # position - index past the prompt
    encoded: int = field(default=0)  # images run through the vision tower for this request
    _keyed: list[int] | None = field(default=None, repr=False)

    @property
    def length(self) -> int:
        return self.positions.shape[1]

    def rows(self, start: int, n: int) -> torch.Tensor:
        """Positions ``[3, n]`` of tokens ``start .. start + n``."""
        inside = max(0, min(self.length, start + n) - start)
        parts = [self.positions[:, start : start + inside]] if inside else []
        if inside < n:
            tail = torch.arange(start + inside, start + n, dtype=torch.long) + self.delta
            parts.append(tail[None].expand(3, -1))
        return torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]

    def overlapping(self, start: int, end: int) -> list[PlacedImage]:
        return [im for im in self.images if im.start < end and im.end > start]

    def keyed(self, prompt_ids: list[int]) -> list[int]:
        """The prompt's ids as the prefix cache knows them: each image's placeholders replaced by
        a negative id made of its bytes' digest and its grid, so a checkpoint past an image is found
        only by a prompt with the same image there (computed once per request)."""
        if self._keyed is None:
            ids = list(prompt_ids)
            for im in self.images:
                tag = -1 - (int(hashlib.sha256(f"{im.image.digest}:{im.image.grid}".encode()).hexdigest()[:15], 16))
                ids[im.start : im.end] = [tag] * (im.end - im.start)
            self._keyed = ids
        return self._keyed

    def digests(self) -> list[tuple[int, str, tuple[int, int, int]]]:
        """``(start, digest, grid)`` of every image, in prompt order."""
        return [(im.start, im.image.digest, im.image.grid) for im in self.images]


def expand_images(ids: list[int], images: list[ProcessedImage], image_token_id: int) -> tuple[list[int], MediaPrompt]:
    """The prompt with each image's one placeholder expanded to its tokens, and its ``MediaPrompt``."""
    found = [i for i, t in enumerate(ids) if t == image_token_id]
    if len(found) != len(images):
        raise MediaError(f"the prompt has {len(found)} image placeholders for {len(images)} images")
    out: list[int] = []
    placed = []
    prev = 0
    for at, image in zip(found, images):
        out.extend(ids[prev:at])
        placed.append(PlacedImage(image, len(out)))
        out.extend([image_token_id] * image.tokens)
        prev = at + 1
    out.extend(ids[prev:])
    return out, media_prompt(len(out), placed)


def media_prompt(length: int, placed: list[PlacedImage]) -> MediaPrompt:
    """The M-RoPE positions of a prompt of ``length`` tokens with images at ``placed``."""
    parts, cur, index = [], 0, 0
    for im in placed:
        text = im.start - index
        if text:
            parts.append((torch.arange(text, dtype=torch.long) + cur)[None].expand(3, -1))
            cur += text
        t, h, w = im.image.grid
        m = im.image.merge_size
        rows, cols = h // m, w // m
        tt = torch.arange(t, dtype=torch.long)[:, None, None].expand(t, rows, cols)
        hh = torch.arange(rows, dtype=torch.long)[None, :, None].expand(t, rows, cols)
        ww = torch.arange(cols, dtype=torch.long)[None, None, :].expand(t, rows, cols)
        parts.append(torch.stack([tt, hh, ww]).reshape(3, -1) + cur)
        cur += max(rows, cols)
        index = im.end
    if length > index:
        parts.append((torch.arange(length - index, dtype=torch.long) + cur)[None].expand(3, -1))
    positions = torch.cat(parts, dim=1).contiguous() if parts else torch.zeros(3, 0, dtype=torch.long)
    delta = int(positions.max()) + 1 - length if length else 0
    return MediaPrompt(placed, positions, delta)
