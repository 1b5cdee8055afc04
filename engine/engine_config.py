"""Settings of one engine instance, validated at startup."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class EngineConfig:
    max_context: int = 8192  # prompt + output tokens per request
    max_concurrency: int = 4  # active sequences, each holding one state slot
    prefill_chunk: int = 2048  # prompt tokens per step
    kv_capacity: int | None = None  # tokens in the KV pool; None = sized from free memory
    page_size: int = 16  # tokens per KV page
    host_cache_mib: int = 1024  # host memory for snapshots of paused requests
    max_pending: int = 64  # requests waiting for admission beyond max_concurrency
    pending_timeout_s: float | None = None  # a request not admitted within this fails (None = never)
    cuda_graphs: bool = True  # capture decode steps in CUDA graphs (CUDA only)
    batched_decode: bool | None = None  # one forward over the pools per decode step (None = on CUDA)
    overlap: bool = True  # launch the next decode step before reading this one's tokens (batched decode)
    device: str = "cpu"
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        checks = [
            ("max_context", self.max_context >= 16, "must be >= 16"),
            ("max_concurrency", 1 <= self.max_concurrency <= 64, "must be between 1 and 64"),
            ("prefill_chunk", self.prefill_chunk >= 16, "must be >= 16"),
            ("kv_capacity", self.kv_capacity is None or self.kv_capacity >= self.max_context,
             f"must hold at least one request of max_context ({self.max_context}) tokens"),
            ("page_size", 1 <= self.page_size <= 1024, "must be between 1 and 1024"),
            ("host_cache_mib", self.host_cache_mib >= 0, "must be >= 0"),
            ("max_pending", self.max_pending >= 0, "must be >= 0"),
            ("pending_timeout_s", self.pending_timeout_s is None or self.pending_timeout_s > 0, "must be > 0"),
        ]
        for name, ok, why in checks:
            if not ok:
                raise ValueError(f"{name} {why}, got {getattr(self, name)!r}")
