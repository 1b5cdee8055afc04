"""The vision tower of Qwen3.5 / 3.6 checkpoints (``model.visual.*``).

Patches ``[P, channels * frames * patch**2]`` go through a patch embedding (a linear map: the
checkpoint's Conv3d with its stride equal to its kernel), plus a learned position table resampled
(bilinear, corners aligned) from its square grid to the image's patch grid, then ``depth``
pre-norm blocks (LayerNorm; bidirectional attention over the image's patches with a 2D rotary
embedding: the first half of each rotated pair's frequencies turn with the patch row, the second
with its column; a GELU MLP), then the merger: LayerNorm per patch, each ``merge x merge`` block
of patches (consecutive in the input) concatenated and projected to the language model's width.
"""
from __future__ import annotations

from typing import Any, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from .processor import ProcessedImage

_ACTIVATIONS = {
    "gelu": lambda x: F.gelu(x),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
}


class VisionBlock(nn.Module):
    def __init__(self, dim: int, heads: int, inner: int, act) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.fc1 = nn.Linear(dim, inner)
        self.fc2 = nn.Linear(inner, dim)
        self.act = act

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        n, dim = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(n, 3, self.heads, dim // self.heads).unbind(1)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        # [1, H, N, D]: four dimensions, so CUDA takes a flash / memory-efficient kernel (no N x N scores)
        q, k, v = (t.transpose(0, 1)[None] for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v)[0]
        x = x + self.proj(out.transpose(0, 1).reshape(n, dim))
        return x + self.fc2(self.act(self.fc1(self.norm2(x))))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotation of ``x`` ``[N, H, D]`` by ``cos`` / ``sin`` ``[N, D / 2]`` (fp32)."""
    half = x.shape[-1] // 2
    x32 = x.float()
    x1, x2 = x32[..., :half], x32[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)


class VisionEncoder(nn.Module):
    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        self.dim = int(cfg["hidden_size"])
        self.heads = int(cfg["num_heads"])
        self.patch = int(cfg["patch_size"])
        self.frames = int(cfg.get("temporal_patch_size", 2))
        self.channels = int(cfg.get("in_channels", 3))
        self.merge = int(cfg.get("spatial_merge_size", 2))
        self.out_dim = int(cfg["out_hidden_size"])
        positions = int(cfg["num_position_embeddings"])
        self.side = int(positions ** 0.5)
        act = _ACTIVATIONS[cfg.get("hidden_act", "gelu_pytorch_tanh")]
        self.theta = float((cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0))
        self.patch_embed = nn.Linear(self.channels * self.frames * self.patch ** 2, self.dim)
        self.pos_embed = nn.Parameter(torch.empty(positions, self.dim))
        self.blocks = nn.ModuleList(VisionBlock(self.dim, self.heads, int(cfg["intermediate_size"]), act)
                                    for _ in range(int(cfg["depth"])))
        merged = self.dim * self.merge ** 2
        self.merger_norm = nn.LayerNorm(self.dim, eps=1e-6)
        self.merger_fc1 = nn.Linear(merged, merged)
        self.merger_fc2 = nn.Linear(merged, self.out_dim)

    def _grid_positions(self, h: int, w: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """Row and column of every patch, in merge-block order."""
        m = self.merge
        rows = torch.arange(h, device=device)[:, None].expand(h, w)
        cols = torch.arange(w, device=device)[None, :].expand(h, w)

        def blocked(t: torch.Tensor) -> torch.Tensor:
            return t.reshape(h // m, m, w // m, m).transpose(1, 2).reshape(-1)

        return blocked(rows), blocked(cols)

    def _position_table(self, h: int, w: int) -> torch.Tensor:
        """The learned positions resampled to an ``h x w`` grid, ``[h * w, dim]`` in merge-block order."""
        table = self.pos_embed.float().view(self.side, self.side, self.dim).permute(2, 0, 1)[None]
        grid = F.interpolate(table, size=(h, w), mode="bilinear", align_corners=True)[0]  # [dim, h, w]
        m = self.merge
        grid = grid.reshape(self.dim, h // m, m, w // m, m).permute(1, 3, 2, 4, 0)
        return grid.reshape(h * w, self.dim)

    def _cos_sin(self, h: int, w: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        head = self.dim // self.heads
        quarter = head // 2
        inv_freq = 1.0 / (self.theta ** (torch.arange(0, quarter, 2, dtype=torch.float32, device=device) / quarter))
        rows, cols = self._grid_positions(h, w, device)
        angles = torch.cat([rows.float()[:, None] * inv_freq, cols.float()[:, None] * inv_freq], dim=-1)
        return angles.cos(), angles.sin()

    def forward(self, pixels: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        """One image's patches -> its token embeddings ``[t * h * w / merge**2, out_dim]``."""
        t, h, w = grid
        dtype = self.patch_embed.weight.dtype
        x = self.patch_embed(pixels.to(device=self.patch_embed.weight.device, dtype=dtype))
        x = x + self._position_table(h, w).repeat(t, 1).to(dtype)
        cos, sin = self._cos_sin(h, w, x.device)
        frame = h * w
        outs = []
        for f in range(t):  # attention within each frame
            y = x[f * frame : (f + 1) * frame]
            for block in self.blocks:
                y = block(y, cos, sin)
            outs.append(y)
        x = torch.cat(outs) if t > 1 else outs[0]
        x = self.merger_norm(x).view(-1, self.dim * self.merge ** 2)
        return self.merger_fc2(F.gelu(self.merger_fc1(x)))

    def encode(self, image: ProcessedImage) -> torch.Tensor:
        return self.forward(image.pixels, image.grid)

    # checkpoint name (after ``model.visual.``) -> ours
    _RENAMES = (("blocks.", "blocks."), ("merger.norm.", "merger_norm."), ("merger.linear_fc1.", "merger_fc1."),
                ("merger.linear_fc2.", "merger_fc2."), ("patch_embed.proj.", "patch_embed."))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Take ``model.visual.*`` tensors (names with or without that prefix)."""
        params = dict(self.named_parameters())
        seen = set()
        for name, tensor in weights:
            name = name.removeprefix("model.").removeprefix("visual.")
            ours = name
            if name == "pos_embed.weight":
                ours = "pos_embed"
            elif name.startswith("blocks."):
                ours = (name.replace(".attn.qkv.", ".qkv.").replace(".attn.proj.", ".proj.")
                        .replace(".mlp.linear_fc1.", ".fc1.").replace(".mlp.linear_fc2.", ".fc2."))
            else:
                for old, new in self._RENAMES:
                    if name.startswith(old):
                        ours = new + name[len(old):]
                        break
            if ours not in params:
                raise ValueError(f"vision tower: unexpected tensor model.visual.{name}")
            param = params[ours]
            if ours == "patch_embed.weight":
                tensor = tensor.reshape(tensor.shape[0], -1)
            if tuple(tensor.shape) != tuple(param.shape):
                raise ValueError(f"vision tower: model.visual.{name} has shape {tuple(tensor.shape)}, "
                                 f"expected {tuple(param.shape)}")
            with torch.no_grad():
                param.copy_(tensor.to(param.dtype))
            seen.add(ours)
        missing = sorted(set(params) - seen)
        if missing:
            raise ValueError(f"vision tower: missing tensors {', '.join(missing[:4])}")
