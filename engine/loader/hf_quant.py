"""Pre-quantized Hugging Face checkpoints: FP8 block-wise, GPTQ (4 / 8-bit) and AWQ (4-bit) tensors.

``config.json``'s ``quantization_config`` (or, from older AutoGPTQ saves, ``quantize_config.json``)
names the format (``read_quant_config``); the tensors of each quantized projection ``P`` are:

- FP8 (``quant_method`` "fp8", as Qwen publishes its ``-FP8`` releases): ``P.weight`` float8
  (e4m3 or e5m2) ``[out, in]`` and ``P.weight_scale_inv`` ``[ceil(out / bo), ceil(in / bi)]``
  for ``weight_block_size`` ``[bo, bi]`` (one scale for the whole matrix without it); value =
  fp8 value * the scale of its block, the last blocks of a row or column ragged. Always
  dequantized at load (``fp8_dequantize``). A ``static`` activation scheme's ``P.input_scale``
  is dropped: the activations are not quantized here.
- GPTQ (``quant_method`` "gptq", gptqmodel / AutoGPTQ): ``P.qweight`` int32 ``[in * bits / 32,
  out]``, ``32 / bits`` values a word along the input dim, low bits first; ``P.qzeros`` int32
  ``[groups, out * bits / 32]``, zero points packed the same way along the output dim;
  ``P.scales`` ``[groups, out]``; ``P.g_idx`` int32 ``[in]``, the group of each input column
  (unsorted with ``desc_act``; without it, column ``i`` is in group ``i // group_size``);
  value = ``scale[g] * (q - zero[g])``. The classic ``checkpoint_format`` "gptq" stores zero - 1
  (read back without wrapping, as AutoGPTQ's kernels do), "gptq_v2" the zero itself.
  ``group_size`` -1 is one group per row; gptqmodel's ``dynamic`` rules may give a projection
  other ``bits`` / ``group_size``.
- AWQ (``quant_method`` "awq", AutoAWQ's ``gemm`` version): ``P.qweight`` int32 ``[in, out / 8]``
  and ``P.qzeros`` int32 ``[in / group, out / 8]``, 8 nibbles a word holding output columns
  0, 2, 4, 6, 1, 3, 5, 7 of its 8 (low nibble first); ``P.scales`` ``[in / group, out]``; value =
  ``scale * (q - zero)``.

GPTQ and AWQ projections whose groups are runs of consecutive input columns become
``GroupQuantized`` weights (``value = scale * q + offset``, ``offset = -scale * zero``; 8-bit
GPTQ as ``q - 128`` with ``offset = scale * (128 - zero)``), which the layers' linear methods
keep quantized (``Checkpoint.quantized_weights``, ``loader.load_model``). Act-order groups
(``desc_act``: a group's columns scattered over the row) and rows that do not split into whole
groups are dequantized at load instead, as is every projection with ``--weights dense``. With
fp16 or bf16 scales every GPTQ / AWQ product is exact in fp32 (a scale of at most 11 significant
bits times an integer below 2^9), so a matrix has the same value whichever route it takes. An FP8
value is computed once in fp32 and rounded to the model's dtype as it is copied in, as a dense
checkpoint saved from that product would be.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, replace
from typing import Any, Callable

import torch

from ..layers.linear import GroupQuantized

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
FP8_FORMATS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
METHODS = ("fp8", "gptq", "awq")
GPTQ_FORMATS = {"gptq": 1, "gptq_v2": 0}  # checkpoint_format -> what is added to a stored zero
GPTQ_BITS = (4, 8)
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # output column (of 8) held by nibble i of an AWQ word
AWQ_UNORDER = tuple(AWQ_ORDER.index(c) for c in range(8))  # nibble holding output column c
# tensors of a quantized projection besides its anchor (``qweight`` / fp8 ``weight``)
PACKED_PARTS = {"gptq": ("qzeros", "scales", "g_idx"), "awq": ("qzeros", "scales")}
PACKED_REQUIRED = ("qzeros", "scales")
FP8_SCALE = "weight_scale_inv"
FP8_DROPPED = ("input_scale",)


@dataclass(frozen=True)
class QuantConfig:
    """A checkpoint's ``quantization_config``, checked."""

    method: str  # "fp8", "gptq" or "awq"
    bits: int = 8
    group: int = 0  # input columns a group (GPTQ / AWQ); -1 one group a row
    zero_offset: int = 0  # added to a stored zero point (1 for the classic GPTQ format)
    block: tuple[int, int] | None = None  # FP8 (rows, columns) a scale; None one scale a matrix
    # gptqmodel's per-projection rules: (pattern, overrides of bits / group_size); "-:" rules
    # (projections left unquantized) need nothing, those are stored dense
    dynamic: tuple[tuple[str, dict[str, int]], ...] = ()

    @property
    def packed(self) -> bool:
        """GPTQ or AWQ: integers packed in int32 words."""
        return self.method in ("gptq", "awq")

    @property
    def kind(self) -> str:
        return self.method.upper()

    def for_module(self, module: str) -> "QuantConfig":
        """The settings of projection ``module`` (its name as saved) after ``dynamic`` rules."""
        for pattern, overrides in self.dynamic:
            if re.match(pattern, module):
                return replace(self, bits=overrides.get("bits", self.bits),
                               group=overrides.get("group_size", self.group))
        return self


def _field(qc: dict[str, Any], key: str, kind: type, default: Any = None) -> Any:
    value = qc.get(key, default)
    try:
        return None if value is None else kind(value)
    except (TypeError, ValueError):
        raise ValueError(f"quantization_config.{key} {value!r} is not a {kind.__name__}") from None


def _group_size(qc: dict[str, Any], allow_row: bool) -> int:
    group = _field(qc, "group_size", int, 128)
    if group == 0 or group < -1 or (group == -1 and not allow_row):
        raise ValueError(f"quantization_config.group_size {group} is not supported "
                         f"(a positive number of columns{', or -1' if allow_row else ''})")
    return group


def read_quant_config(cfg: dict[str, Any], path: str | None = None) -> QuantConfig | None:
    """The checked quantization settings of a checkpoint's ``config.json`` ``cfg`` (its
    ``quantization_config``, at the top or in ``text_config``; else ``quantize_config.json`` in
    ``path``), or None for an unquantized one. A setting this loader cannot read is a ValueError
    naming the field."""
    qc = cfg.get("quantization_config") or (cfg.get("text_config") or {}).get("quantization_config")
    if qc is None and path is not None:
        legacy = os.path.join(path, "quantize_config.json")
        if os.path.exists(legacy):
            with open(legacy, encoding="utf-8") as f:
                qc = {"quant_method": "gptq", **json.load(f)}
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise ValueError("quantization_config is not an object")
    method = str(qc.get("quant_method", "")).lower()
    if method not in METHODS:
        raise ValueError(f"quantization_config.quant_method {qc.get('quant_method')!r} is not supported "
                         f"({', '.join(METHODS)} are)")
    if method == "fp8":
        fmt = str(qc.get("fmt", "e4m3")).lower()
        if fmt not in FP8_FORMATS:
            raise ValueError(f"quantization_config.fmt {fmt!r} is not supported ({', '.join(FP8_FORMATS)})")
        block = qc.get("weight_block_size")
        if block is not None:
            if (not isinstance(block, (list, tuple)) or len(block) != 2
                    or not all(isinstance(b, int) and b > 0 for b in block)):
                raise ValueError(f"quantization_config.weight_block_size {block!r} is not two positive sizes")
            block = (int(block[0]), int(block[1]))
        scheme = str(qc.get("activation_scheme", "dynamic")).lower()
        if scheme not in ("dynamic", "static"):
            raise ValueError(f"quantization_config.activation_scheme {scheme!r} is not supported")
        return QuantConfig("fp8", block=block)
    bits = _field(qc, "bits", int, 4 if method == "awq" else None)
    if method == "awq":
        if bits != 4:
            raise ValueError(f"quantization_config.bits {bits} is not supported for AWQ (4)")
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"quantization_config.version {qc.get('version')!r} is not supported for AWQ "
                             "(the gemm layout is)")
        if not qc.get("zero_point", True):
            raise ValueError("quantization_config.zero_point false is not supported for AWQ")
        return QuantConfig("awq", bits=4, group=_group_size(qc, allow_row=False))
    if bits not in GPTQ_BITS:
        raise ValueError(f"quantization_config.bits {bits} is not supported for GPTQ (4 or 8)")
    if qc.get("is_marlin_format"):
        raise ValueError("quantization_config.is_marlin_format: Marlin-packed GPTQ is not supported")
    fmt = str(qc.get("checkpoint_format") or qc.get("format") or "gptq").lower()
    if fmt not in GPTQ_FORMATS:
        raise ValueError(f"quantization_config.checkpoint_format {fmt!r} is not supported "
                         f"({', '.join(GPTQ_FORMATS)} are)")
    pack = str(qc.get("pack_dtype", "int32")).lower().removeprefix("torch.")
    if pack != "int32":
        raise ValueError(f"quantization_config.pack_dtype {pack!r} is not supported (int32)")
    return QuantConfig("gptq", bits=bits, group=_group_size(qc, allow_row=True), zero_offset=GPTQ_FORMATS[fmt],
                       dynamic=_dynamic_rules(qc.get("dynamic")))


def _dynamic_rules(dynamic: Any) -> tuple[tuple[str, dict[str, int]], ...]:
    if not dynamic:
        return ()
    if not isinstance(dynamic, dict):
        raise ValueError("quantization_config.dynamic is not an object")
    rules = []
    for key, overrides in dynamic.items():
        if key.startswith("-:"):
            continue
        pattern = key.removeprefix("+:")
        picked = {k: int(overrides[k]) for k in ("bits", "group_size") if k in (overrides or {})}
        if "bits" in picked and picked["bits"] not in GPTQ_BITS:
            raise ValueError(f"quantization_config.dynamic[{key!r}].bits {picked['bits']} is not supported "
                             "for GPTQ (4 or 8)")
        if picked.get("group_size", 1) == 0 or picked.get("group_size", 1) < -1:
            raise ValueError(f"quantization_config.dynamic[{key!r}].group_size {picked['group_size']} "
                             "is not supported")
        rules.append((pattern, picked))
    return tuple(rules)


@dataclass
class QuantPlan:
    """Which tensors of a checkpoint (names as saved) make up its quantized projections."""

    anchors: dict[str, str]  # anchor tensor (``P.qweight`` / fp8 ``P.weight``) -> projection P
    parts: set[str]  # the other tensors of those projections, read with their anchor
    dropped: set[str]  # tensors not loaded at all (an FP8 static scheme's input scales)


def plan_tensors(names: set[str], quant: QuantConfig) -> QuantPlan:
    """The projections of ``quant``'s format among ``names``; a projection that lacks a tensor it
    needs, or a part without its projection, is a ValueError naming the tensor."""
    anchors: dict[str, str] = {}
    parts: set[str] = set()
    dropped: set[str] = set()
    if quant.method == "fp8":
        for name in names:
            module, _, attr = name.rpartition(".")
            if attr == FP8_SCALE:
                if f"{module}.weight" not in names:
                    raise ValueError(f"checkpoint tensor {name!r} has no {module}.weight to scale")
                anchors[f"{module}.weight"] = module
                parts.add(name)
            elif attr in FP8_DROPPED:
                dropped.add(name)
        return QuantPlan(anchors, parts, dropped)
    known = PACKED_PARTS[quant.method]
    for name in names:
        module, _, attr = name.rpartition(".")
        if attr == "qweight":
            anchors[name] = module
            for part in PACKED_REQUIRED:
                if f"{module}.{part}" not in names:
                    raise ValueError(f"{quant.kind} projection {module!r} has no {module}.{part} tensor")
            parts.update(f"{module}.{p}" for p in known if f"{module}.{p}" in names)
        elif attr in known and f"{module}.qweight" not in names:
            raise ValueError(f"checkpoint tensor {name!r} has no {module}.qweight to go with")
    return QuantPlan(anchors, parts, dropped)


def fp8_dequantize(name: str, weight: torch.Tensor, scale: torch.Tensor,
                   block: tuple[int, int] | None) -> torch.Tensor:
    """The fp32 ``[out, in]`` value of FP8 tensor ``name`` and its ``weight_scale_inv``."""
    if weight.dtype not in FP8_DTYPES:
        raise ValueError(f"{name} has a {FP8_SCALE} and dtype {str(weight.dtype).removeprefix('torch.')}, "
                         "not float8")
    if weight.dim() != 2:
        raise ValueError(f"{name}: float8 tensor of shape {tuple(weight.shape)} is not a matrix")
    out, cols = weight.shape
    bo, bi = block or (out, cols)
    want = (-(-out // bo), -(-cols // bi))
    if scale.numel() == 1 and block is None:
        scale = scale.reshape(1, 1)
    if tuple(scale.shape) != want:
        raise ValueError(f"{name}_scale_inv has shape {tuple(scale.shape)}; a [{out}, {cols}] weight in "
                         f"blocks of {bo} x {bi} needs {want}")
    scale = scale.float()
    if out % bo == 0 and cols % bi == 0:  # whole blocks: the scales broadcast over a view
        blocks = weight.float().view(want[0], bo, want[1], bi)
        return (blocks * scale[:, None, :, None]).view(out, cols)
    return weight.float() * scale.repeat_interleave(bo, 0)[:out].repeat_interleave(bi, 1)[:, :cols]


def unpack(words: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 ``words`` holding ``32 / bits`` unsigned values each along ``dim`` (low bits first),
    as int32 values, that dim ``32 / bits`` times longer."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    mask = (1 << bits) - 1
    if dim == 0:
        values = (words[:, None, :] >> shifts[None, :, None]) & mask
        return values.reshape(-1, words.shape[1])
    values = (words[:, :, None] >> shifts) & mask
    return values.reshape(words.shape[0], -1)


@dataclass
class PackedWeight:
    """A GPTQ / AWQ projection read: integers ``q`` (uint8) ``[out, in]``, per-group ``scale``
    and integer ``zero`` (int32: a classic GPTQ zero may read back as 2^bits) ``[groups, out]``,
    ``g_idx`` the group of each input column."""

    name: str  # the projection's name as saved
    kind: str
    bits: int
    q: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    g_idx: torch.Tensor
    group: int  # columns a group where groups are consecutive runs of them, else 0

    def dequantize(self) -> torch.Tensor:
        """The fp32 ``[out, in]`` value, ``scale[g] * (q - zero[g])`` column by column."""
        scale, zero = self.scale.t().contiguous(), self.zero.t().float().contiguous()
        if self.group:  # runs of columns: broadcast over a view
            out, cols = self.q.shape
            q = self.q.view(out, cols // self.group, self.group).float()
            return ((q - zero[..., None]) * scale[..., None]).view(out, cols)
        return (self.q.float() - zero.index_select(1, self.g_idx)) * scale.index_select(1, self.g_idx)

    def group_quantized(self) -> GroupQuantized | None:
        """The same value as a ``GroupQuantized`` weight, or None where its groups are not runs of
        ``group`` consecutive columns."""
        if not self.group:
            return None
        scale = self.scale.t().contiguous()
        zero = self.zero.t().float()
        if self.bits == 4:
            return GroupQuantized(self.q, scale, -scale * zero, self.group, 4, self.kind)
        return GroupQuantized((self.q.to(torch.int16) - 128).to(torch.int8), scale, scale * (128 - zero),
                              self.group, 8, self.kind)


def _int32(name: str, t: torch.Tensor, dims: int = 2) -> torch.Tensor:
    if t.dtype != torch.int32 or t.dim() != dims:
        raise ValueError(f"{name} is {str(t.dtype).removeprefix('torch.')} {tuple(t.shape)}, "
                         f"not an int32 {'matrix' if dims == 2 else 'vector'}")
    return t


def _check_shape(name: str, t: torch.Tensor, want: tuple[int, ...], why: str) -> None:
    if tuple(t.shape) != want:
        raise ValueError(f"{name} has shape {tuple(t.shape)}; {why} needs {want}")


def _contiguous_group(g_idx: torch.Tensor, group: int) -> int:
    """``group`` where ``g_idx`` puts column ``i`` in group ``i // group`` and the row splits into
    whole groups, else 0."""
    cols = g_idx.numel()
    if group <= 0 or cols % group:
        return 0
    trivial = torch.arange(cols, dtype=g_idx.dtype) // group
    return group if torch.equal(g_idx, trivial) else 0


def read_gptq(module: str, get: Callable[[str], torch.Tensor | None], quant: QuantConfig) -> PackedWeight:
    """GPTQ projection ``module`` (name as saved) from its tensors (``get(name)``, None when absent)."""
    quant = quant.for_module(module)
    bits, per = quant.bits, 32 // quant.bits
    qweight = _int32(f"{module}.qweight", get(f"{module}.qweight"))
    cols, out = qweight.shape[0] * per, qweight.shape[1]
    g_idx = get(f"{module}.g_idx")
    if g_idx is not None:
        g_idx = _int32(f"{module}.g_idx", g_idx, dims=1)
        if g_idx.numel() != cols:
            raise ValueError(f"{module}.g_idx has {g_idx.numel()} columns, and {module}.qweight "
                             f"{tuple(qweight.shape)} packs {cols} at {bits} bits (quantization_config.bits)")
    group = cols if quant.group == -1 else quant.group
    groups = -(-cols // group)
    scales = get(f"{module}.scales")
    _check_shape(f"{module}.scales", scales, (groups, out), f"{cols} columns in groups of {group}")
    if out % per:
        raise ValueError(f"{module}: {out} output rows do not pack into {module}.qzeros at {bits} bits")
    qzeros = _int32(f"{module}.qzeros", get(f"{module}.qzeros"))
    _check_shape(f"{module}.qzeros", qzeros, (groups, out // per), f"{groups} groups of {out} zero points")
    if g_idx is None:
        g_idx = torch.arange(cols, dtype=torch.int32) // group
    elif int(g_idx.min()) < 0 or int(g_idx.max()) >= groups:
        raise ValueError(f"{module}.g_idx names groups outside 0 .. {groups - 1}")
    g_idx = g_idx.long()
    return PackedWeight(module, "GPTQ", bits, unpack(qweight, bits, 0).to(torch.uint8).t().contiguous(), scales.float(),
                        unpack(qzeros, bits, 1) + quant.zero_offset, g_idx, _contiguous_group(g_idx, group))


def read_awq(module: str, get: Callable[[str], torch.Tensor | None], quant: QuantConfig) -> PackedWeight:
    """AWQ (gemm) projection ``module`` (name as saved) from its tensors."""
    qweight = _int32(f"{module}.qweight", get(f"{module}.qweight"))
    cols, out = qweight.shape[0], qweight.shape[1] * 8
    group = quant.group
    if cols % group:
        raise ValueError(f"{module}: {cols} input columns do not split into AWQ groups of {group}")
    scales = get(f"{module}.scales")
    _check_shape(f"{module}.scales", scales, (cols // group, out), f"{cols} columns in groups of {group}")
    qzeros = _int32(f"{module}.qzeros", get(f"{module}.qzeros"))
    _check_shape(f"{module}.qzeros", qzeros, (cols // group, out // 8), f"{cols // group} groups of {out} zero points")

    def columns(words: torch.Tensor) -> torch.Tensor:  # nibbles in AWQ's order -> output columns in order
        values = unpack(words, 4, 1)
        return values.view(values.shape[0], -1, 8)[..., list(AWQ_UNORDER)].reshape(values.shape[0], -1)

    g_idx = torch.arange(cols) // group
    return PackedWeight(module, "AWQ", 4, columns(qweight).to(torch.uint8).t().contiguous(), scales.float(),
                        columns(qzeros),
                        g_idx, group)


READERS = {"gptq": read_gptq, "awq": read_awq}
