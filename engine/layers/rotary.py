"""Rotary position embedding (neox / rotate-half layout) on the first ``rotary_dim`` dims.

Frequencies ``base ** (-2i / rotary_dim)`` for ``i < rotary_dim / 2``, optionally rescaled
(``linear`` or ``llama3``). The pair for frequency ``i`` is dims ``(i, i + rotary_dim/2)`` of the
rotated part; dims past ``rotary_dim`` (partial rotary, Qwen3.5) pass through unchanged.

Multimodal RoPE (Qwen3.5's interleaved M-RoPE, ``mrope_section`` = (t, h, w)): a token has three
positions (time, height, width); frequency ``i`` takes the height position where ``i % 3 == 1``
and ``i < 3 * h``, the width one where ``i % 3 == 2`` and ``i < 3 * w``, the time one otherwise.
Text tokens have the same position on the three axes, which is plain RoPE: only the steps that
hold image tokens pass positions ``[3, N]``.
"""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def rope_inv_freq(rotary_dim: int, base: float, rope_scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies ``[rotary_dim // 2]`` in fp32 on the CPU, scaling applied."""
    if rotary_dim % 2:
        raise ValueError(f"rotary_dim must be even, got {rotary_dim}")
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device="cpu").float() / rotary_dim
    inv_freq = 1.0 / (base**exponents)
    scaling = dict(rope_scaling or {})
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    raise ValueError(
        f"unsupported rope scaling type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
    )


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1 scaling: long wavelengths divided by ``factor``, short ones kept, a smooth ramp between."""
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling.get("low_freq_factor", 1.0))
    high_freq_factor = float(scaling.get("high_freq_factor", 4.0))
    old_context = float(scaling.get("original_max_position_embeddings", 8192))
    wavelen = 2 * math.pi / inv_freq
    low_freq_wavelen = old_context / low_freq_factor  # longer than this: fully scaled
    high_freq_wavelen = old_context / high_freq_factor  # shorter than this: unchanged
    # ramp from 0 (fully scaled) to 1 (unchanged) across the medium band
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    medium = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, medium)
    return torch.where(wavelen < high_freq_wavelen, inv_freq, out)


def mrope_axes(freqs: int, section: list[int] | None) -> torch.Tensor:
    """Per frequency, the axis (0 time, 1 height, 2 width) its position comes from: interleaved
    sections (``mrope_section`` (t, h, w); None: every frequency on the time axis)."""
    axis = [0] * freqs
    if section:
        for i in range(freqs):
            if i % 3 == 1 and i < 3 * section[1]:
                axis[i] = 1
            elif i % 3 == 2 and i < 3 * section[2]:
                axis[i] = 2
    return torch.tensor(axis, dtype=torch.long, device="cpu")  # not a buffer: see RotaryEmbedding


class RotaryEmbedding(nn.Module):
    """Rotates the first ``rotary_dim`` dims of q ``[N, H, D]`` and k ``[N, Hkv, D]`` by position.

    Holds no parameters or buffers (the frequencies are a fixed CPU tensor, copied once per device),
    so a model built on the ``meta`` device needs nothing re-initialised. The rotation is computed
    in fp32 and cast back to the input dtype.
    """

    def __init__(
        self,
        head_dim: int,
        rotary_dim: int,
        base: float,
        rope_scaling: dict[str, Any] | None = None,
        max_positions: int = 4096,
        mrope_section: list[int] | None = None,
    ) -> None:
        super().__init__()
        if not 0 < rotary_dim <= head_dim:
            raise ValueError(f"rotary_dim {rotary_dim} must be in (0, head_dim={head_dim}]")
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim
        self.base = base
        self.max_positions = max_positions
        self.inv_freq = rope_inv_freq(rotary_dim, base, rope_scaling)  # not a buffer: see class doc
        self._inv_freq_by_device: dict[torch.device, torch.Tensor] = {}
        self.mrope_axis = mrope_axes(rotary_dim // 2, mrope_section)
        self._axis_by_device: dict[torch.device, torch.Tensor] = {}

    @classmethod
    def from_config(cls, config) -> "RotaryEmbedding":
        """The rotary embedding a ``ModelConfig`` describes (partial rotation included)."""
        return cls(config.head_dim, int(config.head_dim * config.partial_rotary_factor), config.rope_theta,
                   config.rope_scaling, config.max_position_embeddings, config.mrope_section)

    def inv_freq_on(self, device: torch.device) -> torch.Tensor:
        """The fp32 inverse frequencies ``[rotary_dim // 2]`` on ``device`` (copied once)."""
        inv_freq = self._inv_freq_by_device.get(device)
        if inv_freq is None:
            inv_freq = self._inv_freq_by_device[device] = self.inv_freq.to(device)
        return inv_freq

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 ``cos`` and ``sin``, each ``[N, rotary_dim // 2]``, for ``positions`` ``[N]``, or
        ``[3, N]`` (time, height, width: multimodal RoPE)."""
        inv_freq = self.inv_freq_on(positions.device)
        if positions.dim() == 2:
            axis = self._axis_by_device.get(positions.device)
            if axis is None:
                axis = self._axis_by_device[positions.device] = self.mrope_axis.to(positions.device)
            angles = positions.float()[axis].t() * inv_freq[None, :]  # [N, F]: each frequency's own axis
            return angles.cos(), angles.sin()
        angles = positions.float()[:, None] * inv_freq[None, :]
        return angles.cos(), angles.sin()

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, memo: dict | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q and k rotated together (one pass over their heads side by side), each contiguous.
        ``memo``: the step's (``ForwardBatch.memo``), where the factors for its positions are kept
        for the other layers."""
        factors = None if memo is None else memo.get(self)
        if factors is None:
            cos, sin = self.cos_sin(positions)
            factors = torch.cat([cos, cos], dim=-1)[:, None, :], torch.cat([-sin, sin], dim=-1)[:, None, :]
            if memo is not None:
                memo[self] = factors
        heads = q.shape[1]
        qk = self._rotate(torch.cat([q, k], dim=1), *factors)
        return qk[:, :heads].contiguous(), qk[:, heads:].contiguous()

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``x1 * cos - x2 * sin`` and ``x2 * cos + x1 * sin`` for the halves ``x1``, ``x2`` of
        the rotated dims, as ``x * [cos, cos] + [x2, x1] * [-sin, sin]`` (``cos``, ``sin`` those
        halves' factors: the same values, ``a + b * -s`` being ``a - b * s``): four operations
        instead of ten."""
        n, heads, _ = x.shape
        x32 = x.float()
        part = x32[..., : self.rotary_dim]
        swapped = part.reshape(n, heads, 2, self.rotary_dim // 2).flip(2).reshape(n, heads, self.rotary_dim)
        rotated = part * cos + swapped * sin
        if self.rotary_dim < self.head_dim:
            rotated = torch.cat([rotated, x32[..., self.rotary_dim :]], dim=-1)
        return rotated.to(x.dtype)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, rotary_dim={self.rotary_dim}, base={self.base}"
