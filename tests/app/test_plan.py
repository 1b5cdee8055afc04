"""Memory plan on the real Qwen3.5 shapes (reference/qwen3_5.md) and five GPU sizes."""
from __future__ import annotations

import json
from importlib import resources

import pytest
import torch

from ninfer.app.footprint import MiB, kv_bytes_per_token, model_weight_bytes, state_bytes_per_lane, weight_bytes
from ninfer.app.model_info import shape_from_dict
from ninfer.app.plan import HEAD_BITS_DEFAULT, HEAD_BITS_SMALL, MIN_CONTEXT, Device, DoesNotFit, Want, make_plan
from ninfer.app.presets import Preset, load_presets

KNOWN = {k: v for k, v in json.loads(resources.files("ninfer.app").joinpath("known_models.json").read_text()).items()
         if not k.startswith("_")}
SHAPES = {name: shape_from_dict(cfg, name) for name, cfg in KNOWN.items()}
# total memory as NVML reports it for a 16 GB (RTX 5060 Ti), 24 GB (RTX 4090), 32 GB (RTX 5090),
# 80 GB (H100) and 141 GB (H200) card; 400 MiB already taken by a desktop
GPUS = {16: 16311, 24: 24564, 32: 32607, 80: 81559, 141: 143771}
DESKTOP_MIB = 400


def gpu(gb: int) -> Device:
    return Device(f"{gb} GB GPU", GPUS[gb] * MiB, (GPUS[gb] - DESKTOP_MIB) * MiB, 0)


def test_parameter_counts_match_the_model_names():
    billions = {name: s.params.total / 1e9 for name, s in SHAPES.items()}
    assert billions["Qwen3.5-0.8B"] == pytest.approx(0.75, abs=0.05)  # + a 0.1 B vision tower, not loaded
    assert billions["Qwen3.5-9B"] == pytest.approx(9.0, abs=0.3)
    assert billions["Qwen3.5-27B"] == pytest.approx(27.0, abs=0.5)
    assert billions["Qwen3.5-35B-A3B"] == pytest.approx(35.0, abs=1.0)
    assert SHAPES["Qwen3.5-27B"].n_attention == 16 and SHAPES["Qwen3.5-27B"].n_gdn == 48


def test_byte_math_agrees_with_the_engine():
    from ninfer.app.footprint import DEQUANT_BLOCK_ELEMENTS
    from ninfer.engine.cache.manager import kv_bytes_per_token as engine_kv
    from ninfer.engine.cache.manager import state_shapes
    from ninfer.engine.cache.state_pool import StateSlotPool
    from ninfer.engine.layers import linear

    assert DEQUANT_BLOCK_ELEMENTS == linear.DEQUANT_BLOCK_ELEMENTS  # the quantized weights' dequantize buffer

    for shape in SHAPES.values():
        assert kv_bytes_per_token(shape, 2) == engine_kv(shape.config, torch.bfloat16)
        assert kv_bytes_per_token(shape, 1) == engine_kv(shape.config, torch.int8) == \
            engine_kv(shape.config, torch.float8_e4m3fn)  # one byte and an fp32 scale per row
        assert kv_bytes_per_token(shape, 0.5) == engine_kv(shape.config, torch.uint8)  # 4bit: a scale per 32
        engine_state = StateSlotPool.bytes_per_slot(shape.n_gdn, *state_shapes(shape.config), torch.bfloat16)
        assert state_bytes_per_lane(shape, 2) == engine_state
        assert state_bytes_per_lane(shape, 2, 2) == StateSlotPool.bytes_per_slot(
            shape.n_gdn, *state_shapes(shape.config), torch.bfloat16, torch.float16)


def test_parameter_count_matches_a_built_model():
    """Shrink the 35B-A3B's widths, keep its structure (MoE, shared expert, GDN, gated attention),
    build it with the engine and count its parameters."""
    from ninfer.engine.config import ModelConfig
    from ninfer.engine.models.registry import build_model

    cfg = dict(KNOWN["Qwen3.5-35B-A3B"], hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
               shared_expert_intermediate_size=32, linear_num_key_heads=2, linear_num_value_heads=4,
               linear_key_head_dim=16, linear_value_head_dim=16, vocab_size=300)
    shape = shape_from_dict(cfg, "tiny")
    with torch.device("meta"):
        model = build_model(ModelConfig.from_hf_dict(cfg))
    assert sum(p.numel() for p in model.parameters()) == shape.params.total


@pytest.mark.parametrize("name", list(SHAPES))
@pytest.mark.parametrize("weights", ["bf16", "4bit"])
@pytest.mark.parametrize("gb", list(GPUS))
def test_every_plan_fits_or_is_refused_with_what_fits(name, weights, gb):
    shape, device = SHAPES[name], gpu(gb)
    contexts = []
    for lanes in (1, 2, 4, 8, 16):
        try:
            plan = make_plan(shape, device, Want(lanes=lanes, weights=weights), load_presets())
        except DoesNotFit as exc:
            message = str(exc)
            assert shape.name in message and "fit" in message
            if lanes == 1:  # nothing fits at all: the message names an alternative or says why none
                assert "What would fit:" in message or "Nothing fits" in message
            contexts.append(0)
            continue
        assert plan.total + plan.margin <= device.free, plan.describe()
        assert plan.margin >= 512 * MiB
        # the weights as the server holds them: at most the format's bytes, less where the
        # token table is in host memory or the LM head in 4 bits
        held = model_weight_bytes(shape, plan.settings)
        assert plan.parts["weights"] == held <= weight_bytes(shape.params, weights, 2)
        assert (held < weight_bytes(shape.params, weights, 2)) == (plan.settings.embedding_host
                                                                     or plan.settings.head_bits is not None)
        s = plan.settings
        assert s.lanes == lanes and MIN_CONTEXT <= s.context <= shape.max_context
        assert s.kv_tokens >= s.lanes * s.context
        contexts.append(s.context)
    # more lanes never give more context per request, and below the model's limit they give less
    assert contexts == sorted(contexts, reverse=True)
    for a, b in zip(contexts, contexts[1:]):
        if b and a < shape.max_context:
            assert b < a


def test_small_model_on_big_gpu_gets_full_context_and_drafts():
    plan = make_plan(SHAPES["Qwen3.5-0.8B"], gpu(141), Want(lanes=1))
    assert plan.settings.context == 262144 and plan.settings.drafts == 4
    assert plan.parts["mtp_weights"] > 0 and plan.parts["mtp_kv"] > 0


def test_refusal_names_what_would_fit():
    with pytest.raises(DoesNotFit) as info:
        make_plan(SHAPES["Qwen3.5-27B"], gpu(24), Want(weights="bf16"))
    msg = str(info.value)
    assert "47.7 GiB" in msg and "4bit weights: 1 request of up to" in msg  # 50.1 GiB, its token table in host memory
    with pytest.raises(DoesNotFit) as info:
        make_plan(SHAPES["Qwen3.5-9B"], gpu(24), Want(lanes=8, context=262144))
    assert "What would fit: " in str(info.value) and "request(s) of up to" in str(info.value)


def test_auto_lanes_keep_long_context_and_cpu_mode_is_modest():
    plan = make_plan(SHAPES["Qwen3.5-27B"], gpu(24), Want(weights="4bit"))
    assert plan.settings.lanes == 1  # tight: one request with the most context
    cpu = Device("CPU", 32 << 30, 24 << 30, None)
    plan = make_plan(SHAPES["Qwen3.5-0.8B"], cpu)
    assert plan.settings.drafts == 0 and plan.settings.context <= 8192
    assert plan.server_args()[:2] == ["--device", "cpu"]


def test_server_args_only_use_flags_ninfer_serve_accepts():
    from ninfer.server.cli import build_parser

    plan = make_plan(SHAPES["Qwen3.5-9B"], gpu(80))
    args = build_parser().parse_args(plan.server_args())
    s = plan.settings
    assert (args.max_context, args.max_concurrency, args.prefill_chunk) == (s.context, s.lanes, s.prefill_chunk)
    assert int(args.kv_capacity) == s.kv_tokens and args.device == "cuda:0"


def test_preset_row_wins_when_it_fits_and_is_checked_when_not():
    shape = SHAPES["Qwen3.5-9B"]
    row = Preset(model=shape.signature, name="Qwen3.5-9B", weights="bf16", gpu_min_gib=70, gpu_max_gib=100,
                 lanes_min=1, lanes_max=2, context=131072, prefill_chunk=1024, drafts=2, note="test row")
    plan = make_plan(shape, gpu(80), Want(lanes=2), [row])
    assert plan.source == "preset: test row"
    assert (plan.settings.context, plan.settings.prefill_chunk, plan.settings.drafts) == (131072, 1024, 2)
    busy = Device("80 GB GPU", GPUS[80] * MiB, 22000 * MiB, 0)  # someone else holds most of it
    plan = make_plan(shape, busy, Want(lanes=2), [row])
    assert plan.source == "plan" and any("does not fit" in r for r in plan.reasons)
    assert plan.total + plan.margin <= busy.free


def test_shipped_presets_load_and_name_known_shapes():
    signatures = {s.signature for s in SHAPES.values()}
    for row in load_presets():
        assert row.model in signatures, row


def test_a_dense_checkpoint_too_big_for_the_card_is_quantized_at_load():
    """The 9B in bf16 (18 GB) on a 16 GB card: the plan takes int8, then int4, and the server
    command says so; on a card it fits, bf16 and no --weights flag."""
    from ninfer.server.cli import build_parser

    plan = make_plan(SHAPES["Qwen3.5-9B"], gpu(16))
    assert plan.settings.weights in ("int8", "4bit") and any("leaves no room" in r for r in plan.reasons)
    args = build_parser().parse_args(plan.server_args())
    assert args.weights == {"int8": "int8", "4bit": "int4"}[plan.settings.weights]
    assert plan.total + plan.margin <= gpu(16).free
    roomy = make_plan(SHAPES["Qwen3.5-9B"], gpu(80))
    assert roomy.settings.weights == "bf16" and "--weights" not in roomy.server_args()


def test_quantized_checkpoints_load_as_stored():
    cfg = dict(KNOWN["Qwen3.5-9B"])
    gptq = shape_from_dict({**cfg, "quantization_config": {"quant_method": "gptq", "bits": 4}}, "gptq")
    fp8 = shape_from_dict({**cfg, "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}},
                          "fp8")
    plan = make_plan(gptq, gpu(16))
    assert plan.settings.weights == "4bit" and "--weights" not in plan.server_args()  # auto keeps its groups
    assert make_plan(fp8, gpu(80)).settings.weights == "bf16"  # dequantized at load: counted in bf16
    with pytest.raises(DoesNotFit, match="quantized checkpoint"):
        make_plan(gptq, gpu(80), Want(weights="int8"))


def test_vision_tower_counted_and_planned_with_vision():
    """A ``Qwen3_5ForConditionalGeneration`` config: the tower's parameters are those of the
    engine's built tower, and ``--vision`` plans its weights and its largest image's activations."""
    from ninfer.app.model_info import count_vision
    from ninfer.engine.vision.encoder import VisionEncoder

    vision = dict(depth=3, hidden_size=48, intermediate_size=80, num_heads=4, out_hidden_size=64, patch_size=4,
                  temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=16, in_channels=3)
    params, activations = count_vision({"vision_config": vision}, max_pixels=64 * 64)
    assert params == sum(p.numel() for p in VisionEncoder(vision).parameters())
    assert activations == (64 * 64 // 16) * (6 * 48 + 2 * 80)
    assert count_vision(KNOWN["Qwen3.5-9B"]) == (0, 0)

    cfg = {"model_type": "qwen3_5", "text_config": KNOWN["Qwen3.5-9B"],
           "vision_config": dict(vision, depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16,
                                 out_hidden_size=4096, patch_size=16, num_position_embeddings=2304)}
    shape = shape_from_dict(cfg, "Qwen3.5-9B-VL")
    assert 0.4e9 < shape.vision_params < 0.5e9
    without, with_vision = make_plan(shape, gpu(80), Want(lanes=1)), make_plan(shape, gpu(80), Want(lanes=1, vision=True))
    assert without.parts["vision"] == 0
    assert with_vision.parts["vision"] == (shape.vision_params + shape.vision_activations) * 2
    assert "vision" in with_vision.describe()


def test_a_16_gb_card_holds_the_9b_at_its_whole_context_with_a_smaller_kv_cache():
    """One request of the 9B on an RTX 5060 Ti: its token table in host memory, and with 8-bit
    weights the KV cache in fp8, is what lets the model's 262,144 tokens fit (before the table
    moved: 4-bit KV with 8-bit weights, fp8 with 4-bit ones); the server is told so, and the
    device prefix checkpoints the plan counted."""
    from ninfer.server.cli import build_parser

    shape = SHAPES["Qwen3.5-9B"]
    for weights, kv in ((None, "fp8"), ("4bit", "auto")):
        plan = make_plan(shape, gpu(16), Want(lanes=1, weights=weights))
        s = plan.settings
        assert s.context == 262144 and plan.total + plan.margin <= gpu(16).free, plan.describe()
        args = build_parser().parse_args(plan.server_args())
        assert args.kv_dtype == kv and args.prefix_checkpoints == s.checkpoints == 16
        assert args.embedding_host and args.head_weights == "auto"
        moving = min(4, max(1, s.checkpoints // 4))  # their copies to host in flight
        assert plan.parts["checkpoints"] == (s.checkpoints + moving) * state_bytes_per_lane(shape, 2, s.state_elt)
    # where the context fits as it is, nothing is made smaller
    plan = make_plan(shape, gpu(80), Want(lanes=1))
    assert plan.settings.context == 262144 and (plan.settings.kv_elt, plan.settings.state_elt) == (None, 4)
    assert "--kv-dtype" not in plan.server_args() and "--state-dtype" not in plan.server_args()


def test_the_27b_on_a_16_gb_card():
    """The 27B in bf16 (50 GiB) on an RTX 5060 Ti: 4-bit weights, the token table in host memory,
    the LM head in 4 bits, 4-bit KV, a bf16 state and four device checkpoints, each of which buys
    context (before: refused, its 16.8 GiB of weights counted with the table and a 16-bit head);
    the server's command carries every one of them (40,960 tokens: 49,152 until the plan counted
    the 64 MiB buffer prompt rows dequantize the weights into). Under a 16 GiB cap (an H200 held to
    16 GiB, no desktop) the same plan reaches 64K."""
    from ninfer.server.cli import build_parser

    shape = SHAPES["Qwen3.5-27B"]
    plan = make_plan(shape, gpu(16))
    s = plan.settings
    assert (s.weights, s.kv_elt, s.state_elt, s.embedding_host, s.checkpoints) == ("4bit", 0.5, 2, True, 4)
    assert s.lanes == 1 and s.context >= 40960 and plan.total + plan.margin <= gpu(16).free
    assert plan.parts["weights"] < 12.8 * (1 << 30)
    args = build_parser().parse_args(plan.server_args())
    assert (args.weights, args.head_weights, args.kv_dtype, args.state_dtype) == ("int4", "int4", "4bit", "bf16")
    assert args.embedding_host and args.prefix_checkpoints == 4
    capped = make_plan(shape, Device("H200 held to 16 GiB", 16 << 30, 16 << 30, 0))
    assert capped.settings.context >= 65536


def test_a_gptq_27b_under_16_gib_holds_its_head_in_4_bits():
    """The 27B as a GPTQ checkpoint (4-bit groups of 128, the head stored in bf16: 14.4 GiB) on a
    card held to 16 GiB: refused before the head could be quantized at load; now the token table
    goes to host memory and the head to 4 bits (``--head-weights int4``), which the server takes
    for a checkpoint kept quantized, and the context is what the room left allows. The 9B's
    bf16 head goes to 8 bits, where that reaches the model's whole context."""
    from ninfer.server.cli import build_parser

    capped = Device("H200 held to 16 GiB", 16 << 30, 16 << 30, 0)
    gptq = {"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 128}}
    shape = shape_from_dict({**KNOWN["Qwen3.5-27B"], **gptq}, "27B-gptq")
    plan = make_plan(shape, capped, Want(lanes=1))
    s = plan.settings
    assert (s.weights, s.embedding_host, s.head_bits) == ("4bit", True, HEAD_BITS_SMALL)
    assert s.context >= 65536 and plan.total + plan.margin <= capped.free, plan.describe()
    args = build_parser().parse_args(plan.server_args())
    assert args.head_weights == "int4" and args.embedding_host and args.weights == "auto"
    assert "LM head int4" in plan.describe()
    nine = make_plan(shape_from_dict({**KNOWN["Qwen3.5-9B"], **gptq}, "9B-gptq"), capped, Want(lanes=1))
    assert nine.settings.context == 262144 and nine.settings.head_bits == HEAD_BITS_DEFAULT
    assert build_parser().parse_args(nine.server_args()).head_weights == "int8"
    # a roomy card keeps the stored head, and passes no flag
    roomy = make_plan(shape, gpu(80), Want(lanes=1))
    assert roomy.settings.head_bits is None and "--head-weights" not in roomy.server_args()


def test_a_symmetric_gptq_checkpoint_is_planned_without_zero_points():
    """GPTQ's ``sym`` (its default) holds scales alone on the GPU: the 27B's matrices at 4.125
    bits a weight, 0.35 GiB below an asymmetric checkpoint's 4.25, which the context gets."""
    from ninfer.app.footprint import model_weight_bytes

    capped = Device("H200 held to 16 GiB", 16 << 30, 16 << 30, 0)
    plans, held = {}, {}
    for sym in (True, False):
        gptq = {"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": sym}}
        shape = shape_from_dict({**KNOWN["Qwen3.5-27B"], **gptq}, "27B-gptq")
        assert shape.quant_symmetric is sym
        plans[sym] = make_plan(shape, capped, Want(lanes=1))
        held[sym] = model_weight_bytes(shape, plans[True].settings)
    sym, asym = held[True], held[False]
    matrices = shape.params.matrices
    assert asym - sym == pytest.approx(matrices * 0.125 / 8, rel=0.01) and asym - sym > 0.35 * (1 << 30)
    assert plans[True].settings.context >= plans[False].settings.context


def test_lanes_the_plan_adds_keep_the_kv_cache_as_it_is():
    plan = make_plan(SHAPES["Qwen3.5-9B"], gpu(16))
    assert plan.settings.lanes > 1 and plan.settings.kv_elt is None and plan.settings.state_elt == 4


@pytest.mark.parametrize("name", list(SHAPES))
@pytest.mark.parametrize("bits, weights", [(4, "4bit"), (8, "int8")])
def test_the_plan_counts_the_bytes_the_engine_holds_at_the_real_shapes(name, bits, weights):
    """Each known model built at its real shape on the meta device (no memory), loaded
    through ``--weights int4|int8`` as on a GPU (every projection and the MoE experts held
    quantized, the LM head in 8 bits): the bytes the model holds are the planner's, within 1%."""
    from ninfer.app.footprint import Settings
    from ninfer.engine.config import ModelConfig
    from ninfer.engine.loader import quantized_at_load
    from ninfer.engine.models.registry import build_model

    shape = SHAPES[name]
    cfg = ModelConfig.from_hf_dict(KNOWN[name])
    source = build_model(cfg, torch.bfloat16, "meta")
    model = build_model(cfg, torch.bfloat16, "meta", lazy=True)
    model.load_weights(quantized_at_load(model, source.state_dict().items(), bits, torch.device("meta")))
    tensors = {id(t): t for t in list(model.parameters()) + list(model.buffers())}
    held = sum(t.numel() * t.element_size() for t in tensors.values())
    planned = model_weight_bytes(shape, Settings(lanes=1, context=4096, prefill_chunk=2048, drafts=0, weights=weights,
                                                 elt=2, cuda=True, head_bits=8))
    assert held == pytest.approx(planned, rel=0.01), (held / 2**30, planned / 2**30)


def test_a_kv_cache_given_its_size_must_leave_a_steps_activations_room():
    """The engine refuses at start a ``--kv-capacity`` that leaves fewer bytes than a step's
    activations take (the 9B's 4,096-token chunk: about 0.55 GiB), naming what to lower, where it
    would otherwise run out of memory at the first long prompt; an engine-sized cache (no
    capacity given) counted them itself."""
    from ninfer.engine.config import ModelConfig
    from ninfer.engine.engine_config import EngineConfig
    from ninfer.engine.memory import step_room_problem, workspace_bytes

    model = ModelConfig.from_hf_dict(KNOWN["Qwen3.5-9B"])
    config = EngineConfig(device="cuda", dtype=torch.bfloat16, max_context=262144, max_concurrency=1,
                          prefill_chunk=4096, kv_capacity=262144, gpu_memory_gib=16)
    need = workspace_bytes(model, config)
    assert 0.5 * (1 << 30) < need < 0.6 * (1 << 30)
    problem = step_room_problem(int(0.21 * (1 << 30)), model, config)
    assert problem.startswith("--kv-capacity 262,144 leaves 0.21 GiB") and "--prefill-chunk 4096" in problem
    assert "lower --kv-capacity or --prefill-chunk, or raise --gpu-memory-gib" in problem
    assert step_room_problem(need, model, config) is None
    sized = EngineConfig(device="cuda", dtype=torch.bfloat16, max_context=262144, max_concurrency=1,
                         prefill_chunk=4096)
    assert step_room_problem(0, model, sized) is None


def test_a_27b_gptq_held_to_16_gib_plans_128k_with_4bit_kv_and_64k_with_fp8(tmp_path):
    """``--gpu-memory-gib 16`` holds torch's allocations to 16 GiB (an H200 standing in for a 16 GB
    card): the CUDA context lies outside the cap and no other program shares it, so the launcher
    plans it as such (``Device.held_to``). The symmetric GPTQ 27B with its table in host memory and
    its head in 4 bits takes 131,072 tokens of 4-bit KV (fp16 value scales) and one device
    checkpoint; fp8 KV fits 65,536; the 9B its whole 262,144."""
    from dataclasses import replace

    from ninfer.app.footprint import footprint
    from ninfer.app.gpu_probe import GpuInfo, Probe
    from ninfer.app.launch import parse_options, resolve

    card = Device("NVIDIA H200", 140 << 30, 139 << 30, 0)
    held = card.held_to(16)
    assert held.held and held.total == held.free == 16 << 30
    gptq = {"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True}}
    shape = shape_from_dict({**KNOWN["Qwen3.5-27B"], **gptq}, "27B-gptq")
    plan = make_plan(shape, held, Want(lanes=1))
    s = plan.settings
    assert (s.context, s.kv_elt, s.state_elt, s.checkpoints, s.embedding_host, s.head_bits) == \
        (131072, 0.5, 2, 1, True, HEAD_BITS_SMALL), plan.describe()
    assert plan.total + plan.margin <= held.free and plan.parts["cuda_context"] < 256 * MiB
    assert "1 prefix checkpoint(s) on the device" in plan.describe()
    fp8 = replace(s, kv_elt=1, state_elt=4, context=65536)
    assert sum(footprint(shape, fp8).values()) + held.margin <= held.free
    # the same settings on a card of 16 GiB, its CUDA context and a desktop's margin in it, do not fit
    assert sum(footprint(shape, replace(s, held=False)).values()) + Device("16 GiB", 16 << 30, 16 << 30, 0).margin \
        > 16 << 30
    nine = make_plan(shape_from_dict({**KNOWN["Qwen3.5-9B"], **gptq}, "9B-gptq"), held, Want(lanes=1))
    assert nine.settings.context == 262144

    # the launcher plans for the cap given to the server after --
    (tmp_path / "config.json").write_text(json.dumps({**KNOWN["Qwen3.5-27B"], **gptq}))
    probed = Probe([GpuInfo(0, "NVIDIA H200", 140 << 30, 139 << 30, "9.0")])
    resolved = resolve(parse_options([str(tmp_path), "--", "--gpu-memory-gib", "16"]), probe_result=probed)
    assert resolved.plan.device.held and resolved.plan.device.name == "NVIDIA H200 held to 16 GiB"
    assert resolved.plan.settings.context == 131072
    assert resolved.command[-2:] == ["--gpu-memory-gib", "16"]
