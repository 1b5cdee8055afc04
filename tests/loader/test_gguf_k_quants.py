"""GGUF Q5_K and Q6_K matrices kept quantized (8-bit groups: Q5_K's of 32 with offsets, Q6_K's
symmetric of 16): the blocks read exactly as gguf dequantizes them, the CPU method's product, and
Q4_K_M / Q5_K_M-like files (llama and Qwen3.5) held quantized end to end, giving the logits of
their dequantized load."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize

from ninfer.engine.layers.linear import GroupQuantized, Int4CpuMethod, Linear, cpu_method_fits, widen_groups
from ninfer.engine.loader import load_model
from ninfer.engine.loader.gguf_loader import load_gguf, open_gguf
from ninfer.engine.loader.gguf_quant import group_quantized
from support.k_quants import K_QUANTS, encode, mixed_type, random_blocks
from support.llama_gguf import HF_NAMES, LlamaDims, llama_layers, llama_meta, logits

HIDDEN, HEADS, KV_HEADS, FFN, LAYERS, VOCAB = 256, 4, 2, 512, 2, 128
DIMS = LlamaDims(HIDDEN, HEADS, KV_HEADS, FFN, LAYERS, VOCAB)
IDS = list(range(3, 40)) + [7, 7, 300, 12]
PARTS = {Q.Q4_K: 1, Q.Q5_K: 2, Q.Q6_K: 4, Q.Q8_0: 2}  # int4 products of the CPU method per type


@pytest.mark.parametrize("qtype, group, bits", [(Q.Q5_K, 32, 8), (Q.Q6_K, 16, 8), (Q.Q4_K, 32, 4)])
def test_random_blocks_read_as_gguf_dequantizes_them(gguf_writer, qtype, group, bits):
    path = gguf_writer([("blk.0.ffn_up.weight", random_blocks(qtype, 32, 768, seed=3), qtype)])
    tensor = open_gguf(path).tensors[0]
    g = group_quantized(tensor)
    assert tuple(g.shape) == (32, 768) and (g.group, g.bits, g.kind) == (group, bits, qtype.name)
    assert torch.equal(g.dequantize(), torch.from_numpy(dequantize(tensor.data, qtype)))
    if qtype == Q.Q6_K:  # symmetric, q - 32 over the whole range
        assert g.offset is None and (int(g.q.min()), int(g.q.max())) == (-32, 31)
    elif qtype == Q.Q5_K:
        assert (int(g.q.min()), int(g.q.max())) == (0, 31)
    rows = torch.tensor([5, 0, 31])
    assert torch.equal(g.dequantize(rows), g.dequantize()[rows])


@pytest.mark.parametrize("qtype", K_QUANTS)
def test_encoded_weights_are_the_weights_rounded(qtype):
    w = np.random.default_rng(4).standard_normal((16, 512)).astype(np.float32)
    back = dequantize(encode(w, qtype), qtype)
    bound = {Q.Q4_K: 0.08, Q.Q5_K: 0.04, Q.Q6_K: 0.03}[qtype]
    assert np.abs(back - w).max() <= bound * np.abs(w).max()


@pytest.mark.parametrize("qtype", [Q.Q5_K, Q.Q6_K])
def test_cpu_method_gives_the_dequantized_product(gguf_writer, qtype):
    path = gguf_writer([("blk.0.ffn_up.weight", random_blocks(qtype, 48, 512, seed=5), qtype)])
    g = group_quantized(open_gguf(path).tensors[0])
    assert cpu_method_fits(g)
    parts = widen_groups(g)  # Q6_K: two weights in groups of 32, each with its half of every 32 columns
    assert len(parts) == (2 if qtype == Q.Q6_K else 1) and all(p.group == 32 for p in parts)
    assert torch.equal(sum(p.dequantize() for p in parts), g.dequantize())
    method = Int4CpuMethod.from_groups(g)
    assert method.parts == PARTS[qtype] and method.group == 32
    x = torch.randn(3, 512)
    want = x @ g.dequantize().T
    # bf16 activations, scales and outputs in the int4 matmul
    assert (method(x) - want).abs().max() <= 0.01 * want.abs().max()


def test_groups_that_do_not_widen_are_not_taken():
    q = torch.zeros(16, 64, dtype=torch.int8)
    with_offset = GroupQuantized(q, torch.ones(16, 4), torch.ones(16, 4), 16, 8, "test")
    assert not cpu_method_fits(with_offset)  # a zero integer would not be a zero value
    assert cpu_method_fits(GroupQuantized(q, torch.ones(16, 8), None, 8, 8, "test"))  # four ways
    assert not cpu_method_fits(GroupQuantized(q[:, :48], torch.ones(16, 4), None, 12, 8, "test"))
    with pytest.raises(ValueError, match="do not widen"):
        widen_groups(with_offset)


def write_mixed_llama(writer, base: Q) -> tuple[object, dict[str, Q]]:
    """A llama whose matrices take ``mixed_type``'s types; the file and each HF name's type."""
    rng = np.random.default_rng(0)
    types: dict[str, Q] = {}

    def matrix(name: str, kind: str, layer: int | None, w: np.ndarray):
        qtype = mixed_type(kind, layer, LAYERS, w.shape[1], base)
        if layer is not None:
            types[f"model.layers.{layer}.{HF_NAMES[kind]}"] = qtype
        return name, encode(w, qtype) if qtype in K_QUANTS else w, qtype

    emb = rng.standard_normal((VOCAB, HIDDEN)).astype(np.float32)
    out = rng.standard_normal((VOCAB, HIDDEN)).astype(np.float32) / np.sqrt(HIDDEN)
    tensors = [matrix("token_embd.weight", "token_embd", None, emb), matrix("output.weight", "output", None, out),
               ("output_norm.weight", np.ones(HIDDEN, np.float32), None)]
    tensors += llama_layers(rng, DIMS, matrix)
    return writer(tensors, llama_meta(DIMS)), types


def held_bytes(module: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])


@pytest.mark.parametrize("base", [Q.Q4_K, Q.Q5_K])
def test_mixed_llama_is_held_quantized_and_gives_the_dequantized_logits(gguf_writer, base):
    path, types = write_mixed_llama(gguf_writer, base)
    assert {Q.Q6_K, base} == set(types.values())
    ckpt = load_gguf(path)
    kept = load_model(ckpt, "cpu", torch.float32)
    dense = load_model(ckpt, "cpu", torch.float32, weights="dense")
    modules = dict(kept.named_modules())
    for name, qtype in types.items():  # every matrix held as its type's int4 parts, none dense
        lin = modules[name]
        assert isinstance(lin, Linear) and lin.weight is None and lin.quantized, name
        assert isinstance(lin.method, Int4CpuMethod) and lin.method.parts == PARTS[qtype], name
    assert kept.model.embed_tokens.table is not None and kept.model.embed_tokens.table.kind == base.name
    # the projections' bytes: Q6_K 2.5 a weight (four int4 parts), Q5_K 1.25, Q4_K 0.625; dense fp32 4
    weights = sum(modules[n].in_features * modules[n].out_features for n in types)
    want = sum(modules[n].in_features * modules[n].out_features * 0.625 * PARTS[t] for n, t in types.items())
    got = sum(held_bytes(modules[n].method) for n in types)
    assert got == want and got < 0.5 * 4 * weights
    ids = [5, 17, 99, 3, 64, 127, 0, 42]
    got, want = logits(kept, ids), logits(dense, ids)
    assert got.shape == (len(ids), VOCAB)
    # bf16 activations in the products: close, and the same ranking at the top
    assert (got - want).abs().max() <= 0.02 * want.abs().max()
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_mixed_qwen35_is_held_quantized_and_gives_the_dequantized_logits(tmp_path):
    from support.qwen35_gguf import tiny_model, write_qwen35_gguf

    model = tiny_model(hidden_size=256, intermediate_size=512)
    layers = model.config.num_hidden_layers
    path = write_qwen35_gguf(tmp_path / "q4_k_m.gguf", model, mix=lambda kind, layer, cols:
                             mixed_type(kind, layer, layers, cols))
    ckpt = load_gguf(path)
    reader_types = {t.name: Q(t.tensor_type) for t in open_gguf(path).tensors}
    assert reader_types["blk.1.attn_v.weight"] == Q.Q6_K and reader_types["blk.0.ffn_down.weight"] == Q.Q6_K
    assert reader_types["blk.3.ffn_down.weight"] == Q.Q4_K and reader_types["output.weight"] == Q.Q6_K
    assert reader_types["blk.0.attn_qkv.weight"] == Q.Q4_K and reader_types["blk.0.ssm_out.weight"] == Q.Q8_0
    weights = dict(ckpt.weights())
    kept_weights = {n: w for n, w in ckpt.quantized_weights() if isinstance(w, GroupQuantized)}
    kinds = {w.kind for w in kept_weights.values()}
    assert kinds == {"Q4_K", "Q6_K", "Q8_0"}
    for name, w in kept_weights.items():  # each exactly its dequantized self, reordered rows and columns too
        assert torch.equal(w.dequantize(), weights[name]), name
    kept = load_model(ckpt, "cpu", torch.float32, "auto")
    modules = dict(kept.named_modules())
    held = {n for n, m in modules.items() if isinstance(m, Linear) and m.quantized}
    six = {"model.layers.1.self_attn.v_proj", "model.layers.3.self_attn.v_proj", "model.layers.0.mlp.down_proj",
           "model.layers.1.mlp.down_proj"}
    assert six | {"model.layers.0.linear_attn.in_proj_qkv", "model.layers.2.mlp.down_proj"} <= held
    assert all(modules[n].method.parts == 4 for n in six)
    want = logits(load_model(ckpt, "cpu", torch.float32, "dense"), IDS)
    got = logits(kept, IDS)
    bf16 = logits(load_model(ckpt, "cpu", torch.bfloat16, "dense"), IDS).float()
    assert (got - want).abs().max() <= max((bf16 - want).abs().max(), 0.02 * want.abs().max())


IDS = list(range(3, 40)) + [7, 7, 300, 12]
