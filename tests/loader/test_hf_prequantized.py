"""Pre-quantized Hugging Face checkpoints (``loader/hf_quant.py``): a tiny random Qwen3.5 written by
the test in Qwen's FP8 block-wise format, as GPTQ (v1 and v2 zero points, act-order groups, one group
a row, 8-bit, gptqmodel's ``dynamic`` rules) and as AWQ, each loaded against a dense checkpoint of
the exactly dequantized weights: the same logits where the weights load dense, the same values for
the matrices kept quantized, and the projections held by the CPU's int4 method."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ninfer.engine.layers.embedding import Embedding
from ninfer.engine.layers.linear import GroupQuantized, Int4CpuMethod, Linear, quantize_rtn
from ninfer.engine.loader import load_checkpoint, load_model, placed_quantized
from ninfer.engine.models.base import ForwardBatch
from support.tiny import save_tiny_qwen3_5, save_tokenizer

# the projections a quantizer takes; the GDN's 4-row in_proj_a / in_proj_b, norms, conv1d, the
# embedding and the head stay as stored, as in Qwen's and gptqmodel's releases
QUANTIZED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
             "in_proj_qkv", "in_proj_z", "out_proj")
IDS = list(range(3, 40))


def save_base(path: Path, intermediate: int) -> Path:
    """A 4-layer hybrid Qwen3.5 (hidden 256) saved by transformers in fp32."""
    import transformers

    path.mkdir(parents=True)
    vocab = save_tokenizer(path)
    torch.manual_seed(0)
    cfg = transformers.Qwen3_5TextConfig(
        vocab_size=vocab, hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64,
        linear_value_head_dim=64, intermediate_size=intermediate, max_position_embeddings=512, eos_token_id=2,
        layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"])
    transformers.Qwen3_5ForCausalLM(cfg).save_pretrained(path)
    return path


def write_checkpoint(base: Path, dest: Path, tensors: dict[str, torch.Tensor],
                     quantization_config: dict | None) -> Path:
    """``base``'s config and tokenizer with ``tensors`` as its weights."""
    dest.mkdir(parents=True)
    for f in base.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, dest / f.name)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(dest / "model.safetensors"))
    cfg = json.loads((base / "config.json").read_text())
    cfg.pop("quantization_config", None)
    if quantization_config is not None:
        cfg["quantization_config"] = quantization_config
    (dest / "config.json").write_text(json.dumps(cfg))
    return dest


def projections(state: dict[str, torch.Tensor]) -> list[str]:
    """The modules (``P`` of ``P.weight``) a quantizer takes."""
    return [n.removesuffix(".weight") for n, t in state.items()
            if n.endswith(".weight") and t.dim() == 2 and n.rsplit(".", 2)[-2] in QUANTIZED]


def pack(values: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Unsigned ``values`` packed ``32 / bits`` to an int32 along ``dim``, low bits first."""
    per = 32 // bits
    v = values.long()
    if dim == 0:
        v = v.view(-1, per, v.shape[1])
        words = sum(v[:, j, :] << (bits * j) for j in range(per))
    else:
        v = v.view(v.shape[0], -1, per)
        words = sum(v[..., j] << (bits * j) for j in range(per))
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def rtn(w: torch.Tensor, g_idx: torch.Tensor, groups: int, bits: int, sym: bool):
    """Round to nearest over the columns of each group: fp16 scales, integer zeros ``[groups, out]``,
    integers ``[out, in]`` and the exact value they stand for."""
    maxq = 2**bits - 1
    scale, zero = torch.empty(groups, w.shape[0]), torch.empty(groups, w.shape[0], dtype=torch.long)
    for g in range(groups):
        cols = w[:, g_idx == g]
        lo, hi = cols.amin(1).clamp(max=0), cols.amax(1).clamp(min=0)
        if sym:
            s, z = 2 * torch.maximum(lo.abs(), hi) / maxq, torch.full_like(lo, (maxq + 1) // 2, dtype=torch.long)
        else:
            s = (hi - lo) / maxq
            z = (-lo / s).round().long()
        scale[g], zero[g] = s.half().float(), z
    s_col, z_col = scale[g_idx.long()].t(), zero[g_idx.long()].t()
    q = ((w / s_col).round() + z_col).clamp(0, maxq).long()
    return scale, zero, q, s_col * (q - z_col).float()


def gptq(w: torch.Tensor, bits: int = 4, group: int = 128, v1: bool = True, sym: bool = True,
         act_order: bool = False) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """``w`` as gptqmodel saves it (``qweight``, ``qzeros``, ``scales``, ``g_idx``) and its value."""
    cols = w.shape[1]
    group = cols if group == -1 else group
    order = torch.randperm(cols) if act_order else torch.arange(cols)  # the order columns are quantized in
    g_idx = torch.empty(cols, dtype=torch.int32)
    g_idx[order] = (torch.arange(cols) // group).int()
    scale, zero, q, value = rtn(w, g_idx, cols // group, bits, sym)
    stored = zero - 1 if v1 else zero  # the classic format keeps zero - 1
    assert int(stored.min()) >= 0
    return {"qweight": pack(q.t(), bits, 0), "qzeros": pack(stored, bits, 1), "scales": scale.half(),
            "g_idx": g_idx}, value


AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def awq_pack(values: torch.Tensor) -> torch.Tensor:
    """``[rows, out]`` nibbles packed 8 a word along ``out`` in AWQ's order."""
    v = values.view(values.shape[0], -1, 8)[..., AWQ_ORDER]
    return pack(v.reshape(values.shape[0], -1), 4, 1)


def awq(w: torch.Tensor, group: int = 128) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    cols = w.shape[1]
    scale, zero, q, value = rtn(w, torch.arange(cols) // group, cols // group, 4, sym=False)
    return {"qweight": awq_pack(q.t()), "qzeros": awq_pack(zero), "scales": scale.half()}, value


def fp8(w: torch.Tensor, block: int = 128, scale_dtype=torch.float32) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    out, cols = w.shape
    rb, cb = -(-out // block), -(-cols // block)
    pad = torch.zeros(rb * block, cb * block)
    pad[:out, :cols] = w.abs()
    amax = pad.view(rb, block, cb, block).amax(dim=(1, 3))
    scale = (amax / 448).clamp_min(1e-12).to(scale_dtype)
    full = scale.float().repeat_interleave(block, 0)[:out].repeat_interleave(block, 1)[:, :cols]
    q = (w / full).clamp(-448, 448).to(torch.float8_e4m3fn)
    return {"weight": q, "weight_scale_inv": scale}, q.float() * full


def quantized_checkpoint(base: Path, dest: Path, quantize, quantization_config: dict,
                         skip: tuple[str, ...] = ()) -> tuple[Path, Path]:
    """``base`` written quantized by ``quantize(name, weight) -> (parts, value)`` (projections
    named in ``skip`` left as stored), and beside it the dense checkpoint of the values."""
    state = load_file(str(base / "model.safetensors"))
    quant, dense = dict(state), dict(state)
    for module in projections(state):
        if any(s in module for s in skip):
            continue
        parts, value = quantize(module, state[f"{module}.weight"])
        del quant[f"{module}.weight"]
        quant.update({f"{module}.{k}": v for k, v in parts.items()})
        dense[f"{module}.weight"] = value
    return (write_checkpoint(base, dest / "quantized", quant, quantization_config),
            write_checkpoint(base, dest / "dense", dense, None))


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model.compute_logits(model(torch.tensor(IDS), ForwardBatch.single(len(IDS), model.new_cache())))


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


def held(model) -> set[str]:
    return {n for n, m in model.named_modules() if isinstance(m, Linear) and m.quantized}


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return save_base(tmp_path_factory.mktemp("base") / "qwen", intermediate=512)


def gptq_config(bits=4, group=128, desc_act=False, sym=True, fmt="gptq", **more) -> dict:
    return {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": desc_act, "sym": sym,
            "checkpoint_format": fmt, **more}


# name -> (quantize(module, weight), quantization_config, projections left unquantized)
CASES = {
    "gptq-v1-sym": (lambda m, w: gptq(w), gptq_config(), ()),
    "gptq-v2-asym": (lambda m, w: gptq(w, v1=False, sym=False), gptq_config(sym=False, fmt="gptq_v2"), ()),
    "gptq-desc-act": (lambda m, w: gptq(w, act_order=True), gptq_config(desc_act=True), ()),
    "gptq-row-groups": (lambda m, w: gptq(w, group=-1), gptq_config(group=-1), ()),
    "gptq-8bit": (lambda m, w: gptq(w, bits=8), gptq_config(bits=8), ()),
    "gptq-dynamic": (lambda m, w: gptq(w, bits=8 if m.endswith("down_proj") else 4, group=64 if "mlp" in m else 128),
                     gptq_config(dynamic={r"+:.*down_proj": {"bits": 8, "group_size": 64},
                                          r".*mlp\.(gate|up)_proj": {"group_size": 64},
                                          r"-:.*in_proj_z": {}}), ("in_proj_z",)),
    "awq": (lambda m, w: awq(w), {"quant_method": "awq", "version": "gemm", "bits": 4, "group_size": 128,
                                  "zero_point": True, "modules_to_not_convert": ["in_proj_a", "in_proj_b"]}, ()),
}


@pytest.fixture(scope="module", params=list(CASES))
def case(request, base, tmp_path_factory):
    quantize, config, skip = CASES[request.param]
    torch.manual_seed(1)
    quant, dense = quantized_checkpoint(base, tmp_path_factory.mktemp(request.param), quantize, config, skip)
    return request.param, load_checkpoint(quant), load_checkpoint(dense)


def test_packed_weights_read_as_the_values_they_stand_for(case):
    """Each matrix kept quantized (GroupQuantized) dequantizes to the exact value; the others
    come dense and exact."""
    name, ckpt, dense = case
    want = dict(dense.weights())
    got = dict(ckpt.quantized_weights())
    assert got.keys() == want.keys()
    kept = {n for n, t in got.items() if isinstance(t, GroupQuantized)}
    for n, t in got.items():
        assert torch.equal(t.dequantize() if n in kept else t, want[n]), n
    quantized = {f"{m}.weight" for m in projections(want) if not (name == "gptq-dynamic" and "in_proj_z" in m)}
    # act-order groups scatter over the row: dequantized at load
    assert kept == (set() if name == "gptq-desc-act" else quantized)
    assert all(torch.equal(t, want[n]) for n, t in ckpt.weights())


def test_dense_load_gives_the_dequantized_checkpoints_logits(case):
    """``--weights dense``: every projection dequantized at load, the logits of the dense checkpoint."""
    _, ckpt, dense = case
    model = load_model(ckpt, "cpu", torch.float32, "dense")
    assert not held(model)
    assert relative_error(logits(model), logits(load_model(dense, "cpu", torch.float32, "dense"))) < 1e-4


def expected_held(name: str, model) -> set[str]:
    linears = {n for n, m in model.named_modules() if isinstance(m, Linear)}
    quantized = {n for n in linears if n.rsplit(".", 1)[-1] in QUANTIZED}
    if name == "gptq-desc-act":
        return set()
    if name == "gptq-row-groups":  # a row of 512 is one group, more than the int4 matmul takes (256)
        return {n for n in quantized if not n.endswith("mlp.down_proj")}
    if name == "gptq-dynamic":
        return {n for n in quantized if not n.endswith("in_proj_z")}
    return quantized


def test_auto_keeps_them_quantized_on_the_cpu(case):
    name, ckpt, dense = case
    model = load_model(ckpt, "cpu", torch.float32, "auto")
    assert held(model) == expected_held(name, model)
    for n in held(model):
        method = model.get_submodule(n).method
        assert isinstance(method, Int4CpuMethod)
        assert method.parts == (2 if name == "gptq-8bit" or (name == "gptq-dynamic" and n.endswith("down_proj")) else 1)
    want = logits(load_model(dense, "cpu", torch.float32, "dense"))
    got = logits(model)
    if not held(model):  # all dequantized at load: the dense checkpoint's logits
        assert relative_error(got, want) < 1e-4
    else:  # the int4 matmul's bf16 activations and scales: as near as the bf16 model is
        bf16 = logits(load_model(dense, "cpu", torch.bfloat16, "dense")).float()
        assert relative_error(got, want) < max(3 * relative_error(bf16, want), 0.01)


def test_moe_experts_are_dequantized_and_the_shared_expert_kept(tmp_path):
    """A GPTQ MoE (one group a row): the per-expert matrices are dequantized for the experts'
    stacked weights; the shared expert's projections stay quantized where the int4 matmul takes
    their rows (gate / up: 64 columns), its 48-column down projection is dequantized."""
    torch.manual_seed(1)
    quant, dense = quantized_checkpoint(save_tiny_qwen3_5(tmp_path / "base", moe=True), tmp_path,
                                        lambda m, w: gptq(w, group=-1), gptq_config(group=-1))
    ckpt, ref = load_checkpoint(quant), load_checkpoint(dense)
    want = load_model(ref, "cpu", torch.float32, "dense")
    assert relative_error(logits(load_model(ckpt, "cpu", torch.float32, "dense")), logits(want)) < 1e-4
    model = load_model(ckpt, "cpu", torch.float32, "auto")
    for layer, ref_layer in zip(model.model.layers, want.model.layers):
        moe, ref_moe = layer.mlp, ref_layer.mlp
        assert moe.shared_expert.gate_proj.quantized and not moe.shared_expert.down_proj.quantized
        assert torch.equal(moe.experts.gate_up_proj, ref_moe.experts.gate_up_proj)
        assert torch.equal(moe.experts.down_proj, ref_moe.experts.down_proj)
    assert bool(torch.isfinite(logits(model)).all())


@pytest.fixture(scope="module")
def fp8_case(tmp_path_factory):
    """FP8 over a 320-wide MLP: blocks of 128 ragged in rows (gate / up) and columns (down); the
    down projections' scales in bf16, as some releases store them."""
    base = save_base(tmp_path_factory.mktemp("fp8base") / "qwen", intermediate=320)
    config = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128], "activation_scheme": "dynamic",
              "modules_to_not_convert": ["lm_head", "model.embed_tokens", "in_proj_a", "in_proj_b"]}

    def quantize(module: str, w: torch.Tensor):
        parts, value = fp8(w, scale_dtype=torch.bfloat16 if module.endswith("down_proj") else torch.float32)
        if module.endswith("o_proj"):  # a static scheme's activation scale: not used, dropped
            parts["input_scale"] = torch.tensor(0.5)
        return parts, value

    quant, dense = quantized_checkpoint(base, tmp_path_factory.mktemp("fp8"), quantize, config)
    return load_checkpoint(quant), load_checkpoint(dense)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_blocks_load_as_the_dequantized_checkpoint(fp8_case, dtype):
    ckpt, dense = fp8_case
    assert ckpt.quantized_weights is None  # FP8 is always dequantized at load
    got = dict(ckpt.weights())
    want = dict(dense.weights())
    assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want)
    model = load_model(ckpt, "cpu", dtype, "auto")
    assert not held(model)
    assert relative_error(logits(model), logits(load_model(dense, "cpu", dtype, "auto"))) < 1e-4


def test_gpu_keeps_4_and_8_bit_groups_and_dequantizes_the_rest(base):
    """``placed_quantized`` on the GPU (decided on shapes alone): 4-bit and 8-bit groups of even
    size stay for the Triton method; a MoE expert's and an embedding table are dequantized."""
    model = load_model(load_checkpoint(base), "cpu", torch.float32, "dense")
    w = torch.randn(256, 256)
    four, eight = quantize_rtn(w, 4), quantize_rtn(w, 8)
    table = quantize_rtn(torch.randn(*model.model.embed_tokens.weight.shape), 4)
    tensors = [("model.layers.0.mlp.down_proj.weight", four), ("model.layers.1.mlp.down_proj.weight", eight),
               ("model.layers.0.mlp.experts.3.down_proj.weight", four), ("model.embed_tokens.weight", table)]
    cuda = dict(placed_quantized(model, tensors, torch.device("cuda")))
    assert cuda["model.layers.0.mlp.down_proj.weight"] is four and cuda["model.layers.1.mlp.down_proj.weight"] is eight
    assert all(isinstance(cuda[n], torch.Tensor) for n, _ in tensors[2:])
    assert torch.equal(cuda["model.embed_tokens.weight"], table.dequantize())
    cpu = dict(placed_quantized(model, tensors, torch.device("cpu")))
    assert cpu["model.layers.1.mlp.down_proj.weight"] is eight and cpu["model.embed_tokens.weight"] is table
    assert isinstance(model.model.embed_tokens, Embedding)


# --- what is refused, by name ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def gptq_files(base, tmp_path_factory):
    torch.manual_seed(1)
    quant, _ = quantized_checkpoint(base, tmp_path_factory.mktemp("bad"), lambda m, w: gptq(w), gptq_config())
    return quant


def variant(src: Path, dest: Path, config: dict | None = None, drop: tuple[str, ...] = (),
            change: dict[str, torch.Tensor] | None = None) -> Path:
    tensors = load_file(str(src / "model.safetensors"))
    for n in drop:
        del tensors[n]
    tensors.update(change or {})
    qc = json.loads((src / "config.json").read_text())["quantization_config"]
    return write_checkpoint(src, dest, tensors, {**qc, **(config or {})})


@pytest.mark.parametrize("config, message", [
    ({"bits": 3}, "quantization_config.bits 3 is not supported for GPTQ"),
    ({"bits": 2}, "quantization_config.bits 2"),
    ({"checkpoint_format": "marlin"}, "quantization_config.checkpoint_format 'marlin'"),
    ({"group_size": 0}, "quantization_config.group_size 0"),
    ({"quant_method": "bitsandbytes"}, "quantization_config.quant_method 'bitsandbytes' is not supported"),
    ({"quant_method": "awq", "bits": 8}, "quantization_config.bits 8 is not supported for AWQ"),
    ({"quant_method": "awq", "version": "gemv"}, "quantization_config.version 'gemv'"),
    ({"quant_method": "fp8", "weight_block_size": [128]}, "quantization_config.weight_block_size"),
])
def test_unsupported_settings_are_refused_by_field(gptq_files, tmp_path, config, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace(".", r"\.")):
        load_checkpoint(variant(gptq_files, tmp_path / "v", config))


def test_autogptq_quantize_config_json_is_read(gptq_files, tmp_path):
    """Older AutoGPTQ saves keep the settings in ``quantize_config.json``, not in ``config.json``."""
    qc = json.loads((gptq_files / "config.json").read_text())["quantization_config"]
    legacy = write_checkpoint(gptq_files, tmp_path / "legacy", load_file(str(gptq_files / "model.safetensors")), None)
    (legacy / "quantize_config.json").write_text(json.dumps({k: v for k, v in qc.items() if k != "quant_method"}))
    got, want = dict(load_checkpoint(legacy).weights()), dict(load_checkpoint(gptq_files).weights())
    assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want)


def test_a_missing_part_is_named(gptq_files, tmp_path):
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.down_proj\.scales"):
        load_checkpoint(variant(gptq_files, tmp_path / "a", drop=("model.layers.0.mlp.down_proj.scales",)))
    with pytest.raises(ValueError, match=r"model\.layers\.3\.mlp\.up_proj\.qzeros"):
        load_checkpoint(variant(gptq_files, tmp_path / "b", drop=("model.layers.3.mlp.up_proj.qzeros",)))


def test_parts_that_do_not_fit_are_named(gptq_files, tmp_path):
    """8-bit words read as the config's 4 bits: g_idx has half the columns qweight packs."""
    name = "model.layers.1.mlp.gate_proj"
    tensors = load_file(str(gptq_files / "model.safetensors"))
    short = {f"{name}.qweight": tensors[f"{name}.qweight"][:16]}
    ckpt = load_checkpoint(variant(gptq_files, tmp_path / "a", change=short))
    with pytest.raises(ValueError, match=rf"{name}\.g_idx has 256 columns"):
        dict(ckpt.weights())
    bad_scales = tensors[f"{name}.scales"][:, :100]
    ckpt = load_checkpoint(variant(gptq_files, tmp_path / "b", change={f"{name}.scales": bad_scales}))
    with pytest.raises(ValueError, match=rf"{name}\.scales has shape \(2, 100\)"):
        load_model(ckpt, "cpu", torch.float32, "auto")


def test_float8_without_its_scale_is_named(tmp_path, base):
    state = load_file(str(base / "model.safetensors"))
    name = "model.layers.0.mlp.up_proj.weight"
    state[name] = state[name].to(torch.float8_e4m3fn)
    ckpt = load_checkpoint(write_checkpoint(base, tmp_path / "f", state, {"quant_method": "fp8",
                                                                          "weight_block_size": [128, 128]}))
    with pytest.raises(ValueError, match=rf"{name} is float8 with no {name}_scale_inv"):
        dict(ckpt.weights())


# --- the LM head of a checkpoint kept quantized (--head-weights) -----------------------------------

def test_head_weights_are_refused_for_dense_weights(base):
    """``--head-weights int4`` quantizes the head of quantized weights only: a dense checkpoint
    served dense is refused by name, at the config where the weights are dense by flag."""
    from ninfer.engine.engine_config import EngineConfig

    with pytest.raises(ValueError, match="--head-weights applies to quantized weights"):
        load_model(load_checkpoint(base), "cpu", torch.float32, "auto", head_bits=4)
    with pytest.raises(ValueError, match="head_weights applies to quantized weights on a GPU"):
        EngineConfig(device="cpu", weights="auto", head_weights="int4")
    with pytest.raises(ValueError, match="head_weights applies to quantized weights on a GPU"):
        EngineConfig(device="cuda", weights="dense", head_weights="int8")


@pytest.mark.gpu
@pytest.mark.parametrize("bits", [8, 4])
def test_a_gptq_checkpoints_bf16_head_is_quantized_at_load_when_asked(case, bits):
    """A GPTQ checkpoint under ``--weights auto`` on the GPU keeps its bf16 head without
    ``--head-weights``; with it the head is held in ``bits``-bit groups by the Triton method, its
    logits those of the stored head quantized alike (RTN), and the projections stay as stored."""
    from ninfer.engine.layers.linear import TritonGroupMethod

    name, ckpt, _ = case
    if name != "gptq-v1-sym":
        pytest.skip("one GPTQ layout is enough here")
    as_stored = load_model(ckpt, "cuda", torch.bfloat16, "auto")
    assert not as_stored.lm_head.quantized and as_stored.lm_head.weight.dtype == torch.bfloat16
    held_head = load_model(ckpt, "cuda", torch.bfloat16, "auto", head_bits=bits)
    method = held_head.lm_head.method
    assert isinstance(method, TritonGroupMethod) and method.bits == bits
    assert held(held_head) == held(as_stored) == expected_held(name, held_head)
    # the head is quantized from its stored values (fp32 here), as the loader reads them: rounded
    # to bf16 first, about 1.5% of the 4-bit codes would land one step away
    stored = dict(ckpt.weights())["lm_head.weight"].cuda()
    want = quantize_rtn(stored, bits).dequantize().float()
    h = torch.randn(5, stored.shape[1], device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        got = held_head.lm_head(h).float()
    assert relative_error(got, h.float() @ want.t()) < 0.01
