"""Model shapes the benchmarks build (the launcher's table of known Qwen3.5 sizes)."""
from __future__ import annotations

import json
from pathlib import Path

from ninfer.engine.config import ModelConfig

_KNOWN = json.loads((Path(__file__).resolve().parents[1] / "app" / "known_models.json").read_text())
SHAPES = {name.lower(): cfg for name, cfg in _KNOWN.items() if not name.startswith("_")}


def shape_config(name: str) -> ModelConfig:
    return ModelConfig.from_hf_dict(SHAPES[name.lower()])
