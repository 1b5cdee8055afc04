"""Settings of one engine instance, validated at startup."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class EngineConfig:
    max_context: int = 8192  # prompt + output tokens per request
    max_concurrency: int = 4  # active sequences
    prefill_chunk: int = 2048  # prompt tokens per step
    device: str = "cpu"
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        if self.max_context < 16:
            raise ValueError(f"max_context must be >= 16, got {self.max_context}")
        if not 1 <= self.max_concurrency <= 64:
            raise ValueError(f"max_concurrency must be between 1 and 64, got {self.max_concurrency}")
        if self.prefill_chunk < 16:
            raise ValueError(f"prefill_chunk must be >= 16, got {self.prefill_chunk}")
