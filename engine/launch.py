"""The GPU kernels' launch choices: one settings object, read at start from data files.

``LaunchSettings``' own values are meant for any CUDA GPU the engine supports (tiles sized to
fit a consumer card's shared memory by count, not yet timed on one); ``tuned/<gpu>.json`` (``nvidia-h200.json``: the name
``torch.cuda.get_device_name`` gives, lower case, spaces as dashes; the longest file name that
starts it wins) holds what was measured on that GPU, and a file given with ``--tuned-config``
goes over both. A file sets some of the fields (tables merge entry by entry; keys of ints joined
by commas); its ``about`` entry says how they were measured. ``bench.gemv_tune`` prints its
entries in this form; ``bench.attention_tune``, ``bench.moe_tune`` and ``bench.prefill_attention
--sweep`` print the tiles they time.

The kernels read the settings in force (``current()``) at each launch: the server installs them
once in the engine's process (``use``), before the warm-up and graph capture; benchmarks install
theirs with changes (``bench.decode --set``).
"""
from __future__ import annotations

import ast
import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

TUNED = Path(__file__).with_name("tuned")
PDL_MODES = {"off": 0, "first": 1, "late": 2}

Shape = tuple[int, ...]


@dataclass(frozen=True)
class LaunchSettings:
    # programmatic dependent launch of the decode kernels (``layers/pdl.py``): "late" releases
    # the next kernel after this one's wait, "first" before it, "off"
    pdl: str = "late"
    # the argmax inside a captured decode step (else the sampler takes it after), and the step's
    # positions / lengths / KV write rows advanced inside it (``cuda_graphs.py``)
    greedy_in_graph: bool = True
    advance_in_graph: bool = True
    # steps of decode and verify rows (speculative decoding) replayed from CUDA graphs too
    # (``cuda_graph_verify.py``; else they run eagerly)
    verify_in_graph: bool = True
    # the Triton GEMV for few-row projections (``layers/fused_linear.py``): up to this many rows;
    # tiles by row bound (the first bound >= M wins); by default only for K >= min_k_per_n * N;
    # measured exceptions by (M, N, K), None where cuBLAS wins; the add + RMSNorm + GEMV launch
    # only at the (M, N, K) listed
    gemv_max_rows: int = 8
    gemv_row_tiles: tuple[tuple[int, dict], ...] = ((4, {"BLOCK_N": 2, "BLOCK_K": 512, "num_warps": 2}),)
    gemv_min_k_per_n: int = 2
    gemv_shape_tiles: dict[Shape, dict | None] = field(default_factory=dict)
    norm_gemv_shape_tiles: dict[Shape, dict] = field(default_factory=dict)
    # paged decode attention (``layers/paged_attention_triton.py``): phase-1 programs wanted per
    # SM, at most this many splits, head-dim columns per merge program; by (query heads, KV heads,
    # head_dim) any of those and BLOCK_N / num_warps / num_stages
    attention_programs_per_sm: int = 2
    attention_max_splits: int = 64
    attention_reduce_block_d: int = 64
    attention_shape_tiles: dict[Shape, dict] = field(default_factory=dict)
    # prompt attention over pages (``layers/prefill_attention_triton.py``), by head_dim
    prefill_attention_tiles: dict[int, dict] = field(default_factory=lambda: {
        64: {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2},
        128: {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2},
        256: {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 1},
    })
    # ... over 4-bit pages, by head_dim: these keys over the tiles above (the keys' and values'
    # unpacking holds more shared memory a stage; the H200's head-dim-256 tiles with two stages
    # need 256 KiB of its 227)
    prefill_attention_4bit_tiles: dict[int, dict] = field(default_factory=lambda: {
        64: {"num_stages": 1}, 128: {"num_stages": 1}, 256: {"BLOCK_N": 32, "num_stages": 1},
    })
    # MoE decode (``layers/moe_triton.py``): the fused norm + router launch reads its router rows
    # before its wait; its programs by token bound (past the last bound the unfused launches
    # run); the grouped GEMVs' tiles (down: one token, more tokens)
    moe_router_before_wait: bool = True
    moe_norm_route_tiles: tuple[tuple[int, dict], ...] = (
        (1, {"ROWS": 1, "TOKENS": 1, "num_warps": 1}),
        (4, {"ROWS": 2, "TOKENS": 1, "num_warps": 1}),
        (48, {"ROWS": 8, "TOKENS": 1, "num_warps": 4}),
    )
    moe_gate_up_tiles: dict = field(default_factory=lambda: {"BLOCK_N": 1, "BLOCK_K": 512, "num_warps": 2})
    moe_down_tiles_one_token: dict = field(default_factory=lambda: {"BLOCK_N": 1, "BLOCK_K": 256, "num_warps": 2,
                                                                    "ALL_SLOTS": True})
    moe_down_tiles: dict = field(default_factory=lambda: {"BLOCK_N": 8, "BLOCK_K": 128, "num_warps": 8,
                                                          "ALL_SLOTS": False})
    # the Gated DeltaNet verify kernel (``layers/gdn_verify_triton.py``): value columns per
    # program and warps (at a 128 x 128 head for sm_90: 189 registers a thread at 32 x 4 warps,
    # 125 at 16 x 4, 118 at 32 x 8; 128 columns spill)
    gdn_verify_tiles: dict = field(default_factory=lambda: {"BLOCK_V": 32, "num_warps": 4})
    # a step's Gated DeltaNet prompt rows run through the verify kernel's recurrent form (one
    # launch, each row's final states copied into its slot: ``backends.TritonLinearAttention``)
    # when none is longer than ``gdn_recurrent_prompt_tokens`` and the rows times the longest come
    # to at most ``gdn_recurrent_step_tokens``, else through the Triton conv and fla-core's chunked
    # rule (0: always the chunked form). The recurrent form walks each row token by token in one
    # launch; the chunked one costs about a millisecond of host time a layer. H100, 9B shape, one
    # prompt beside 8 decoding requests (bench.decode --prefill N --beside 8): 64 tokens 5,936
    # against 2,824 tok/s, their gap p99 1.7x against 3.6x alone; 128: 11,592 / 5,655, 1.7x / 3.7x;
    # 256: 14,699 / 10,974; 512: 15,468 / 21,619 (the chunked form ahead). 64 streams of
    # 200-token prompts through the recurrent form: 4,102 against 4,501 tok/s, TTFT p99 0.85 s
    # against 0.47 s (many rows: the GPU, not the host, sets the pace)
    gdn_recurrent_prompt_tokens: int = 128
    gdn_recurrent_step_tokens: int = 256
    # steps with prompt rows of up to this many tokens replayed from CUDA graphs in pieces, the
    # token mixers' cores eager between them (``cuda_graph_mixed.py``; 0: every such step eager;
    # on an H200 the 9B's 512-token prompt 9,779 -> 20,368 tok/s)
    mixed_graph_tokens: int = 2048
    # steps of up to ``gdn_graph_rows`` prompt rows beside decode rows, of up to this many tokens,
    # with the Gated DeltaNet cores inside the pieces (``cuda_graph_mixed`` kinds ONE and FEW:
    # only the attention cores eager between them; 0: those cores eager too). H100, 9B shape,
    # a 512-token prompt beside 8 decoding requests: 13,725 -> 22,126 tok/s, their gap p99 5.5x
    # -> 3.3x of a decode step alone; the 0.8B's 64 streams through HTTP 12,066 -> 13,207 tok/s
    # (RESULTS 2026-12-07, seventh session). Captured after the caches, within what they leave.
    gdn_graph_tokens: int = 2048
    gdn_graph_rows: int = 16
    # decode and verify rows (up to 64) of a 4-bit or 8-bit weight through the split-K GEMV on the tensor
    # cores (``quant_gemv_triton.int4_gemv_split_triton``, groups it takes), else the scalar GEMV
    int4_split_gemv: bool = True
    # its tiles: weight rows a program, columns a chunk (at most a group), warps, and the programs
    # a multiprocessor the K split aims at (``PER_SM``; optional: ``num_stages``)
    int4_split_tiles: dict = field(default_factory=lambda: {"BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4,
                                                            "PER_SM": 4})
    # one decode row against a 4-bit weight prepared once by a small kernel before the split GEMV
    # (its dot tiles and chunk sums: ``quant_gemv_triton.x_pack``): the GEMV alone 18% faster on
    # the 27B's projections (H100, RESULTS 2026-12-07 fifth session); the 27B's whole decode step
    # at b=1, the extra launch included: 84.4 -> 95.4 tok/s (41.8% -> 46.9% of the bandwidth floor)
    int4_x_pack: bool = True

    def __post_init__(self) -> None:
        if self.pdl not in PDL_MODES:
            raise ValueError(f"launch setting pdl={self.pdl!r}: expected one of {', '.join(PDL_MODES)}")

    @property
    def pdl_mode(self) -> int:
        return PDL_MODES[self.pdl]

    def changed(self, **changes: Any) -> LaunchSettings:
        return dataclasses.replace(self, **changes)

    def merged(self, data: dict, source: str) -> LaunchSettings:
        """These settings with a data file's entries over them (tables merge key by key)."""
        changes = {}
        for name, value in data.items():
            if name == "about":
                continue
            if name not in _FIELDS:
                raise ValueError(f"{source}: {name!r} is not a launch setting")
            value = _parse(name, value, source)
            current = getattr(self, name)
            changes[name] = {**current, **value} if isinstance(current, dict) else value
        return self.changed(**changes)


_FIELDS = {f.name: f for f in dataclasses.fields(LaunchSettings)}
_DEFAULTS = LaunchSettings()
# the settings keyed by shape (the others that hold a dict are one set of tiles)
_TABLES = {"gemv_shape_tiles", "norm_gemv_shape_tiles", "attention_shape_tiles", "prefill_attention_tiles",
           "prefill_attention_4bit_tiles"}


def _key(text: str, source: str, name: str) -> int | Shape:
    try:
        parts = tuple(int(p) for p in str(text).split(","))
    except ValueError:
        raise ValueError(f"{source}: {name} key {text!r} is not an int or ints joined by commas") from None
    return parts[0] if len(parts) == 1 else parts


def _parse(name: str, value: Any, source: str) -> Any:
    """A data file's value in the field's own type (JSON has no tuples or int keys)."""
    default = getattr(_DEFAULTS, name)
    if name in _TABLES:
        if not isinstance(value, dict):
            raise ValueError(f"{source}: {name} must be a table, got {type(value).__name__}")
        return {_key(k, source, name): v for k, v in value.items()}
    if isinstance(default, tuple):
        if not isinstance(value, list) or not all(isinstance(e, list) and len(e) == 2 for e in value):
            raise ValueError(f"{source}: {name} must be a list of [bound, tiles] pairs")
        return tuple((int(bound), dict(tiles)) for bound, tiles in value)
    if type(value) is not type(default):
        raise ValueError(f"{source}: {name} holds {type(default).__name__}, got {type(value).__name__}")
    return value


def gpu_key(name: str) -> str:
    return "-".join(name.lower().split())


def file_for(name: str | None) -> Path | None:
    """The data file measured on a GPU named ``name`` (None: no GPU, or none measured there)."""
    if not name:
        return None
    key = gpu_key(name)
    own = sorted((p for p in TUNED.glob("*.json") if key.startswith(p.stem)), key=lambda p: len(p.stem))
    return own[-1] if own else None


def gpu_name(device: torch.device | None) -> str | None:
    return torch.cuda.get_device_name(device) if device is not None and device.type == "cuda" else None


def load(gpu: str | None = None, extra: str | Path | dict | None = None) -> LaunchSettings:
    """The settings for the GPU named ``gpu`` (its file over the defaults; None: no GPU), and
    ``extra`` (a file or a mapping of the same form) over them."""
    settings, own = _DEFAULTS, file_for(gpu)
    if own is not None:
        settings = settings.merged(_read(own), own.name)
    if isinstance(extra, dict):
        settings = settings.merged(extra, "launch settings")
    elif extra is not None:
        settings = settings.merged(_read(Path(extra)), str(extra))
    return settings


def _read(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise ValueError(f"tuned config {path}: {e.strerror or e}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"tuned config {path}: not JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"tuned config {path}: expected a JSON object")
    return data


_active: LaunchSettings | None = None


def current() -> LaunchSettings:
    """The settings in force; on first use those of the current CUDA device (or the defaults)."""
    global _active
    if _active is None:
        _active = load(gpu_name(torch.device("cuda")) if torch.cuda.is_available() else None)
    return _active


def use(settings: LaunchSettings) -> LaunchSettings:
    """Put ``settings`` in force; returns those they replace."""
    global _active
    before, _active = current(), settings
    return before


class using:
    """``with using(settings, **changes):`` ``settings`` (default: those in force) with
    ``changes`` in force inside, those before put back after."""

    def __init__(self, settings: LaunchSettings | None = None, **changes: Any) -> None:
        self.settings, self.changes = settings, changes

    def __enter__(self) -> LaunchSettings:
        self._before = current()
        use((self.settings or self._before).changed(**self.changes))
        return current()

    def __exit__(self, *exc) -> None:
        use(self._before)


def changes_from_specs(specs: list[str]) -> tuple[dict[str, Any], list[str]]:
    """``NAME=VALUE`` or ``NAME[KEY]=VALUE`` (Python literals; ``KEY`` an entry of a table
    setting) -> the changes to the settings in force and the lines to print; ValueError naming
    the spec for anything else, before anything is changed."""
    base, staged, lines = current(), {}, []
    for spec in specs:
        target, sep, text = spec.partition("=")
        target, key_text = target.strip(), None
        if target.endswith("]") and "[" in target:
            target, _, key_text = target[:-1].partition("[")
        if not sep or not target:
            raise ValueError(f"--set {spec!r}: expected NAME=VALUE or NAME[KEY]=VALUE")
        if target not in _FIELDS:
            raise ValueError(f"--set {spec!r}: {target} is not a launch setting "
                             f"(one of {', '.join(_FIELDS)})")
        current_value, value = staged.get(target, getattr(base, target)), _literal(spec, text)
        if key_text is None:
            if type(value) is not type(current_value):
                raise ValueError(f"--set {spec!r}: {target} holds {type(current_value).__name__}, "
                                 f"not {type(value).__name__}")
            staged[target] = value
            lines.append(f"{target}={value!r}")
            continue
        if not isinstance(current_value, dict):
            raise ValueError(f"--set {spec!r}: {target} holds {type(current_value).__name__}, not a table")
        key = _literal(spec, key_text)
        if not (isinstance(value, dict) or (value is None and target == "gemv_shape_tiles")):
            raise ValueError(f"--set {spec!r}: {target} holds dict values, not {type(value).__name__}")
        staged[target] = {**current_value, key: value}
        lines.append(f"{target}[{key!r}]={value!r}")
    base.changed(**staged)  # the whole set checked (pdl's values) before anything is used
    return staged, lines


def _literal(spec: str, text: str) -> Any:
    try:
        return ast.literal_eval(text.strip())
    except (ValueError, SyntaxError):
        raise ValueError(f"--set {spec!r}: {text.strip()!r} is not a Python literal") from None
