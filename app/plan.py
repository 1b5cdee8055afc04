"""From a model, a device's free memory and what the user asked for, the settings that fit.

``make_plan`` picks lanes (concurrent requests), context per request, the KV pool, the prefill
chunk and the speculative draft count. A measured preset row wins when it fits the free memory
now; otherwise the plan computes the largest context on a ladder of round sizes. A model that cannot
fit raises ``DoesNotFit`` whose message says what would fit instead.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from ..engine.graph_buckets import activation_per_token
from .footprint import (WEIGHT_BITS, GiB, MiB, Settings, default_checkpoints, footprint, human, margin_bytes,
                        model_weight_bytes, weight_bytes)
from .model_info import ModelShape

CONTEXT_LADDER = (262144, 196608, 131072, 98304, 65536, 49152, 40960, 32768, 24576, 16384, 12288, 8192, 6144, 4096)
MIN_CONTEXT = 4096
AUTO_LANES = (8, 4, 2, 1)
AUTO_LANES_CONTEXT = 32768  # auto lanes: the most lanes that still give each request this much
PREFILL_LADDER = (4096, 2048, 1024, 512)
CPU_LANES, CPU_CONTEXT, CPU_PREFILL = 4, 8192, 512


# what the KV cache and the GDN state are held in, in the order tried where the context the model
# allows does not fit (KV element bytes, None: the compute dtype; state element bytes): fp8 KV
# costs under 0.5% perplexity, a bf16 state rounds once a step, 4-bit KV under 3%
KV_CHOICES = ((None, 4), (1, 4), (1, 2), (0.5, 4), (0.5, 2))
KV_FLAGS = {1: "fp8", 0.5: "4bit"}
# device prefix checkpoints kept where the usual number (``footprint.default_checkpoints``) leaves
# less context: a returning turn then comes back from the host tier more often. Each pass tries
# every way of holding the KV cache and the state with these; one checkpoint (the last pass)
# comes after the smallest KV formats with four
CHECKPOINT_PASSES = ((None, 4), (1,))
# an untied LM head quantized at load on a GPU: 8 bits (the server's default), 4 where 8 leave less context
HEAD_BITS_DEFAULT, HEAD_BITS_SMALL = WEIGHT_BITS["int8"], WEIGHT_BITS["4bit"]
# checkpoints kept quantized whose LM head is stored dense: the server quantizes it at load only
# when asked (``--head-weights int8 / int4``)
HEAD_STORED_DENSE = ("gptq", "awq")
HEAD_FLAGS = {HEAD_BITS_DEFAULT: "int8", HEAD_BITS_SMALL: "int4"}


class DoesNotFit(ValueError):
    """The model (or the asked settings) cannot fit; the message says what would."""


@dataclass(frozen=True)
class Device:
    name: str  # "NVIDIA GeForce RTX 4090" or "CPU"
    total: int  # bytes
    free: int  # bytes free before the server starts
    index: int | None = None  # CUDA index; None for the CPU
    # ``total`` is ``--gpu-memory-gib``'s cap on this process's torch allocations (torch's
    # per-process memory fraction), not the card's memory: the CUDA context lies outside it, and
    # no other program shares it
    held: bool = False

    @property
    def cuda(self) -> bool:
        return self.index is not None

    @property
    def flag(self) -> str:
        return f"cuda:{self.index}" if self.cuda else "cpu"

    @property
    def margin(self) -> int:
        return margin_bytes(self.total, self.cuda, self.held)

    def held_to(self, gib: float) -> "Device":
        """This GPU under ``--gpu-memory-gib gib``."""
        cap = int(gib * GiB)
        return Device(f"{self.name} held to {gib:g} GiB", cap, min(cap, self.free), self.index, held=True)


@dataclass(frozen=True)
class Want:
    """What the user picked; None means automatic."""

    lanes: int | None = None
    context: int | None = None
    drafts: int | None = None
    prefill_chunk: int | None = None
    weights: str | None = None
    vision: bool = False  # --vision given: the tower's weights and workspace planned for


@dataclass
class Plan:
    model: str
    device: Device
    settings: Settings
    parts: dict[str, int]
    margin: int
    source: str  # "plan" or the preset row's note
    reasons: list[str] = field(default_factory=list)

    quantize: str | None = None  # ninfer-serve --weights for a dense checkpoint quantized at load

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    def server_args(self) -> list[str]:
        """ninfer-serve flags. Drafts are computed but not passed: they are MTP drafts, which the
        server does not have yet (its ``--spec ngram`` is prompt lookup, for attention-only
        models); pass ``--spec mtp --draft-tokens`` here once it does."""
        s = self.settings
        return (["--device", self.device.flag, "--max-context", str(s.context), "--max-concurrency", str(s.lanes),
                 "--prefill-chunk", str(s.prefill_chunk), "--kv-capacity", str(s.kv_tokens)]
                + (["--weights", self.quantize] if self.quantize else [])
                + (["--kv-dtype", KV_FLAGS[s.kv_elt]] if s.kv_elt in KV_FLAGS else [])
                + (["--state-dtype", "bf16"] if s.state_elt == 2 else [])
                + (["--prefix-checkpoints", str(s.checkpoints)] if s.checkpoints else [])
                + (["--embedding-host"] if s.embedding_host else [])
                + (["--head-weights", HEAD_FLAGS[s.head_bits]] if s.head_bits == HEAD_BITS_SMALL
                   or s.head_bits is not None and not self.quantize else []))

    def describe(self) -> str:
        s = self.settings
        lines = [f"{self.model} on {self.device.name} ({human(self.device.free)} free of {human(self.device.total)})",
                 f"  {s.lanes} lane(s) x {s.context:,} tokens, KV pool {s.kv_tokens:,} tokens, "
                 f"prefill chunk {s.prefill_chunk}, drafts {s.drafts}, weights {s.weights}, "
                 f"KV {KV_FLAGS.get(s.kv_elt, 'bf16' if s.elt == 2 else 'fp32')}, "
                 f"state {'bf16' if s.state_elt == 2 else 'fp32'}, checkpoints {s.checkpoints}"
                 + (", token table in host memory" if s.embedding_host else "")
                 + (f", LM head {HEAD_FLAGS[s.head_bits]}" if s.head_bits in HEAD_FLAGS else "") + f"  [{self.source}]"]
        lines += [f"  {k:13s} {human(v)}" for k, v in self.parts.items() if v]
        lines.append(f"  {'total':13s} {human(self.total)} + margin {human(self.margin)}")
        lines += [f"  - {r}" for r in self.reasons]
        return "\n".join(lines)


def default_weights(shape: ModelShape, device: Device) -> str:
    """How the server holds the checkpoint as it is (``--weights auto``): GPTQ / AWQ groups stay
    quantized; FP8 checkpoints are dequantized at load, and GGUF files counted so (a conservative
    count where their 4-bit matrices stay quantized)."""
    if shape.quant_bits == 4 and not shape.gguf:
        return "4bit"
    if shape.quant_bits == 8 and not shape.gguf and shape.quant_method != "fp8":
        return "int8"
    return "bf16" if device.cuda else "fp32"


QUANTIZE_AT_LOAD = ("int8", "4bit")  # what a dense checkpoint can be quantized to when it does not fit
SERVER_WEIGHTS = {"int8": "int8", "4bit": "int4"}  # ninfer-serve --weights for a dense checkpoint


def _room_makers(shape: ModelShape, device: Device, s: Settings, formats: bool = True
                 ) -> list[tuple[bool, float | None]]:
    """Ways to hold an untied model's token table and LM head, in the order tried: as they are;
    the table in host memory (``--embedding-host``: a few KiB over the bus a token, nothing
    else); and, where the head is quantized at load, the head in 4 bits. Without ``formats``
    (lanes the plan adds on its own) only the first."""
    makers = [(False, s.head_bits)]
    if device.cuda and not shape.config.tie_word_embeddings and formats:
        makers.append((True, s.head_bits))
        if s.head_bits is None and shape.quant_method in HEAD_STORED_DENSE:
            makers.append((True, HEAD_BITS_DEFAULT))
        if s.head_bits is not None or shape.quant_method in HEAD_STORED_DENSE:
            makers.append((True, HEAD_BITS_SMALL))
    return makers


def _compact(shape: ModelShape, device: Device, s: Settings) -> Settings:
    """``s`` with the table and head held as small as ``_room_makers`` allows."""
    host, head = _room_makers(shape, device, s)[-1]
    return replace(s, embedding_host=host, head_bits=head)


def _fits(shape: ModelShape, device: Device, s: Settings) -> bool:
    return sum(footprint(shape, s).values()) + device.margin <= device.free


def _best_context(shape: ModelShape, device: Device, s: Settings, cap: int) -> int | None:
    rungs = sorted({r for r in CONTEXT_LADDER if r <= cap} | ({cap} if cap >= MIN_CONTEXT else set()), reverse=True)
    for ctx in rungs:
        if _fits(shape, device, replace(s, context=ctx)):
            return ctx
    return None


def _auto_drafts(shape: ModelShape, device: Device, lanes: int) -> int:
    if not device.cuda or shape.mtp_layers == 0:
        return 0
    return 4 if lanes == 1 else 3  # seed 003: 4 drafts at one request, 3 beside others


def _head_bits(shape: ModelShape, device: Device, weights: str) -> float | None:
    """The untied LM head's bits a weight as the server holds it: 8 where a dense checkpoint's
    projections are quantized at load on a GPU, else the compute dtype (None)."""
    untied = not shape.config.tie_word_embeddings
    return HEAD_BITS_DEFAULT if device.cuda and shape.dense and weights in SERVER_WEIGHTS and untied else None


def _auto_chunk(shape: ModelShape, device: Device, base: Settings) -> int:
    """The largest chunk whose activations take at most 5% of what is left after the weights."""
    room = device.free - device.margin - footprint(shape, _compact(shape, device, base))["weights"]
    per_token = activation_per_token(shape.config, base.elt)
    for chunk in PREFILL_LADDER:
        if chunk * per_token <= 0.05 * room:
            return chunk
    return PREFILL_LADDER[-1]


def make_plan(shape: ModelShape, device: Device, want: Want = Want(), presets: list | None = None) -> Plan:
    weights = want.weights or default_weights(shape, device)
    elt = 2 if device.cuda else 4
    cap = min(shape.max_context, want.context or shape.max_context)
    reasons: list[str] = []
    if want.weights in SERVER_WEIGHTS and not shape.dense:
        raise DoesNotFit(f"{shape.name} is a quantized checkpoint: its weights load as they are stored, and "
                         f"--weights {want.weights} quantizes dense (bf16 / fp16 / fp32) checkpoints only")
    if want.weights is None and device.cuda and shape.dense:  # too big as it is: quantized at load
        for fmt in QUANTIZE_AT_LOAD:
            trial = Settings(1, MIN_CONTEXT, PREFILL_LADDER[-1], 0, weights, elt, True, vision=want.vision,
                             head_bits=_head_bits(shape, device, weights), device_free=device.free,
                             held=device.held)
            if _fits(shape, device, _compact(shape, device, trial)):
                break
            reasons.append(f"weights {fmt}: {human(weight_bytes(shape.params, weights, elt))} at {weights} "
                           f"leaves no room on {device.name}")
            weights = fmt
    if want.drafts and shape.mtp_layers == 0:
        reasons.append("drafts off: the model has no MTP head")
    if want.vision and not shape.vision_params:
        reasons.append("--vision: the model has no vision tower (the server refuses it)")
    base = Settings(lanes=want.lanes or 1, context=MIN_CONTEXT, prefill_chunk=want.prefill_chunk or 512,
                    drafts=0, weights=weights, elt=elt, cuda=device.cuda, vision=want.vision,
                    head_bits=_head_bits(shape, device, weights), device_free=device.free, held=device.held)
    if not device.cuda and want.lanes is None and want.context is None:
        base = replace(base, lanes=CPU_LANES, prefill_chunk=want.prefill_chunk or CPU_PREFILL)
        cap = min(cap, CPU_CONTEXT)
    _check_weights(shape, device, base)

    if presets:
        from .presets import match

        row = match(presets, shape, device, weights, want)
        if row is not None:
            s = replace(base, lanes=row.lanes, context=min(row.context, shape.max_context),
                        prefill_chunk=row.prefill_chunk, drafts=row.drafts if shape.mtp_layers else 0)
            if _fits(shape, device, s):
                return _finish(shape, device, s, f"preset: {row.note}", reasons)
            reasons.append(f"preset '{row.note}' does not fit the free memory now; computed instead")

    chunk = want.prefill_chunk or (base.prefill_chunk if not device.cuda else _auto_chunk(shape, device, base))
    lane_choices = (want.lanes,) if want.lanes else ((base.lanes,) if not device.cuda else AUTO_LANES)
    for lanes in lane_choices:
        drafts_wanted = want.drafts if want.drafts is not None else _auto_drafts(shape, device, lanes)
        drafts_wanted = drafts_wanted if shape.mtp_layers else 0
        # lanes the plan adds on its own hold the KV cache and state as they are: smaller formats
        # buy the context of the lanes there are, never more lanes
        best = _best_for_lanes(shape, device, replace(base, lanes=lanes, prefill_chunk=chunk), cap, drafts_wanted,
                               want.drafts is not None, formats=want.lanes is not None or lanes == 1)
        if best is None:
            continue
        s = best
        if want.context and s.context < want.context:
            continue
        if want.lanes is None and device.cuda and lanes > 1 and s.context < min(cap, AUTO_LANES_CONTEXT):
            continue
        if s.drafts < drafts_wanted:
            reasons.append(f"drafts lowered from {drafts_wanted} to {s.drafts} to keep the context")
        if s.kv_elt in KV_FLAGS or s.state_elt == 2:
            reasons.append(f"KV {KV_FLAGS.get(s.kv_elt, 'bf16')}, state {'bf16' if s.state_elt == 2 else 'fp32'}: "
                           f"the context {'the model allows' if s.context == cap else 'that fits'} needs it")
        if s.checkpoints and s.checkpoints < default_checkpoints(shape, s, device.free - model_weight_bytes(shape, s)):
            reasons.append(f"{s.checkpoints} prefix checkpoint(s) on the device (the rest in host memory): "
                           "the context needs the room")
        if s.embedding_host:
            reasons.append("the token table in host memory (--embedding-host)"
                           + (f" and the LM head in {HEAD_FLAGS[s.head_bits]} (--head-weights {HEAD_FLAGS[s.head_bits]})"
                              if s.head_bits == HEAD_BITS_SMALL or s.head_bits is not None and not shape.dense else "")
                           + ": the context needs the room")
        return _finish(shape, device, s, "plan", reasons)
    raise DoesNotFit(_what_fits(shape, device, want, weights, chunk))


def _best_for_lanes(shape: ModelShape, device: Device, base: Settings, cap: int, drafts_wanted: int,
                    drafts_fixed: bool, formats: bool = True) -> Settings | None:
    """The settings with the most context for ``base``'s lanes: for each way of holding the KV
    cache and the GDN state (``KV_CHOICES`` on a GPU, in order; the first that reaches ``cap``
    wins; ``formats`` False: the first only), the most drafts that keep the most context, and the
    device prefix checkpoints the engine would keep (``default_checkpoints``), passed to it so that
    the two agree. Within each, the token table and head as ``_room_makers`` tries them, then
    again with fewer checkpoints (``CHECKPOINT_PASSES``) where the usual number leaves less than ``cap``."""
    best: Settings | None = None
    kept = CHECKPOINT_PASSES if formats else ((None,),)
    choices = [(kv, few) for tiers in kept for kv in (KV_CHOICES if device.cuda and formats else ((None, 4),))
               for few in tiers]  # the usual checkpoints (None) first
    for (kv_elt, state_elt), few in choices:
        if state_elt != 4 and not shape.n_gdn:
            continue
        for host, head in _room_makers(shape, device, base, formats):
            s = replace(base, kv_elt=kv_elt, state_elt=state_elt, embedding_host=host, head_bits=head)
            usual = default_checkpoints(shape, s, device.free - model_weight_bytes(shape, s))
            s = replace(s, checkpoints=usual if few is None else min(usual, few))
            for drafts in range(drafts_wanted, -1, -1):
                ctx = _best_context(shape, device, replace(s, drafts=drafts), cap)
                if ctx is not None and (best is None or ctx > best.context):
                    best = replace(s, drafts=drafts, context=ctx)
                if ctx == cap or drafts_fixed:
                    break
            if best is not None and best.context == cap:
                return best
    return best


def _finish(shape: ModelShape, device: Device, s: Settings, source: str, reasons: list[str]) -> Plan:
    quantize = SERVER_WEIGHTS.get(s.weights) if shape.dense else None
    return Plan(shape.name, device, s, footprint(shape, s), device.margin, source, reasons,
                quantize)


def _check_weights(shape: ModelShape, device: Device, base: Settings) -> None:
    minimal = _compact(shape, device, replace(base, lanes=1, context=MIN_CONTEXT, prefill_chunk=PREFILL_LADDER[-1],
                                              drafts=0))
    if _fits(shape, device, minimal):
        return
    w = model_weight_bytes(shape, minimal)
    msg = (f"{shape.name} ({shape.params.total / 1e9:.1f} B parameters) needs {human(w)} for its weights at "
           f"{base.weights}, and {device.name} has {human(device.free)} free "
           f"({human(device.margin)} kept back).")
    options = []
    for fmt in QUANTIZE_AT_LOAD:
        if fmt == base.weights or weight_bytes(shape.params, fmt, base.elt) >= w or not shape.dense:
            continue
        try:
            p = make_plan(shape, device, Want(lanes=1, weights=fmt))
            options.append(f"{shape.name} with {fmt} weights: 1 request of up to {p.settings.context:,} tokens")
        except DoesNotFit:
            pass
    per_param = w / shape.params.total
    other = sum(footprint(shape, minimal).values()) - w
    room = device.free - device.margin - other
    if room > 0:
        options.append(f"a model of up to about {room / per_param / 1e9:.1f} B parameters at {base.weights}")
    raise DoesNotFit(msg + (" What would fit: " + "; or ".join(options) + "." if options else
                            " Nothing fits: use the CPU (--device cpu) or a machine with more memory."))


def _what_fits(shape: ModelShape, device: Device, want: Want, weights: str, chunk: int) -> str:
    lanes = want.lanes or 1
    asked = f"{lanes} request(s)" + (f" of {want.context:,} tokens" if want.context else "")
    options = []
    for fewer in range(lanes, 0, -1):
        s = Settings(fewer, MIN_CONTEXT, chunk, 0, weights, 2 if device.cuda else 4, device.cuda, vision=want.vision,
                     device_free=device.free, held=device.held)
        ctx = _best_context(shape, device, s, min(shape.max_context, want.context or shape.max_context))
        if ctx is not None:
            options.append(f"{fewer} request(s) of up to {ctx:,} tokens")
            break
    if want.context:
        s = Settings(lanes, MIN_CONTEXT, chunk, 0, weights, 2 if device.cuda else 4, device.cuda, vision=want.vision,
                     device_free=device.free, held=device.held)
        ctx = _best_context(shape, device, s, shape.max_context)
        if ctx is not None and ctx < want.context:
            options.append(f"{lanes} request(s) of up to {ctx:,} tokens")
    return (f"{shape.name} at {weights} does not fit {asked} in the {human(device.free)} free on {device.name}. "
            + ("What would fit: " + "; or ".join(dict.fromkeys(options)) + "." if options
               else f"Not even 1 request of {MIN_CONTEXT:,} tokens fits."))


__all__ = ["Device", "Want", "Plan", "DoesNotFit", "make_plan", "GiB", "MiB"]
