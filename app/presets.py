"""The shipped presets table: measured settings for a model on a class of GPU.

Columns follow seed 003's table: lanes, context per request, prefill chunk, drafts. A row applies
to one model shape (``ModelShape.signature``, not a file name), one weight format, GPUs whose total
memory lies in ``[gpu_min_gib, gpu_max_gib)`` and a range of lanes. The planner still checks that
a row fits the memory free right now, and computes settings where no row applies.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from .footprint import GiB
from .model_info import ModelShape


@dataclass(frozen=True)
class Preset:
    model: str  # ModelShape.signature
    name: str
    weights: str
    gpu_min_gib: float
    gpu_max_gib: float
    lanes_min: int
    lanes_max: int
    context: int
    prefill_chunk: int
    drafts: int
    note: str  # where and how it was measured
    lanes: int = 0  # filled by match(): the lanes this row is used for

    def __post_init__(self) -> None:
        if not (1 <= self.lanes_min <= self.lanes_max and self.context >= 16 and self.prefill_chunk >= 16
                and self.drafts >= 0 and self.gpu_min_gib < self.gpu_max_gib):
            raise ValueError(f"bad preset row: {self}")


def load_presets(path: str | Path | None = None) -> list[Preset]:
    text = (Path(path).read_text(encoding="utf-8") if path is not None
            else resources.files("ninfer.app").joinpath("presets.json").read_text(encoding="utf-8"))
    return [Preset(**row) for row in json.loads(text)["rows"]]


def match(rows: list[Preset], shape: ModelShape, device, weights: str, want) -> Preset | None:
    """The row for this model, weight format, GPU and lane count, unless the user set the details."""
    if not device.cuda or want.context or want.prefill_chunk or want.drafts is not None:
        return None
    lanes = want.lanes or 1
    total_gib = device.total / GiB
    for row in rows:
        if (row.model == shape.signature and row.weights == weights
                and row.gpu_min_gib <= total_gib < row.gpu_max_gib and row.lanes_min <= lanes <= row.lanes_max):
            return Preset(**{**row.__dict__, "lanes": lanes})
    return None
