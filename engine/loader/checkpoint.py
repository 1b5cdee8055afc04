"""The result of reading a model from disk, whatever its format."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch

from ..config import ModelConfig
from ..frontend.tokenizer import Tokenizer


@dataclass
class GenerationDefaults:
    """Sampling defaults and stop ids from ``generation_config.json`` (or GGUF metadata)."""

    eos_token_ids: list[int] = field(default_factory=list)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None


@dataclass
class Checkpoint:
    config: ModelConfig
    weights: Callable[[], Iterable[tuple[str, torch.Tensor]]]  # (HF name, tensor), read lazily
    tokenizer: Tokenizer | None
    chat_template: str | None
    generation: GenerationDefaults
    source: str  # path it was read from
    skipped_prefixes: tuple[str, ...] = ()  # weight groups recognised and not loaded (mtp., visual.)
