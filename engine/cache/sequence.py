"""Per-sequence cache: the simple reference cache for one request.

Full-attention layers keep growing K/V tensors; Gated DeltaNet layers keep a conv state (the last
``kernel - 1`` pre-activation qkv rows) and a recurrent state ``[Hv, K, V]`` in fp32. Layers read
and write it through the methods below, so a paged cache can take its place behind the same calls.
"""
from __future__ import annotations

import torch


class SequenceCache:
    def __init__(self, num_layers: int) -> None:
        self.num_layers = num_layers
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self.conv_states: list[torch.Tensor | None] = [None] * num_layers
        self.recurrent_states: list[torch.Tensor | None] = [None] * num_layers
        self.num_tokens = 0  # tokens whose effect is in the cache; the model's forward advances it

    def append_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``[t, Hkv, D]`` keys/values for ``layer``; return all cached keys/values."""
        if self.keys[layer] is None:
            self.keys[layer], self.values[layer] = k, v
        else:
            self.keys[layer] = torch.cat([self.keys[layer], k], dim=0)
            self.values[layer] = torch.cat([self.values[layer], v], dim=0)
        return self.keys[layer], self.values[layer]

    def kv_len(self, layer: int) -> int:
        k = self.keys[layer]
        return 0 if k is None else k.shape[0]

    def nbytes(self) -> int:
        tensors = self.keys + self.values + self.conv_states + self.recurrent_states
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)
