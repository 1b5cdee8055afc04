"""Sparse MoE block: grouped expert compute equals the dense definition; per-expert names fuse on load."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ninfer.engine.layers.moe import SparseMoeBlock, fuse_expert_weights

H, E, K, I, S = 16, 6, 2, 8, 12


def make_block(norm_topk_prob=True, shared=S) -> SparseMoeBlock:
    block = SparseMoeBlock(H, E, K, I, shared, norm_topk_prob)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn_like(p) * 0.5)
    return block


def dense_reference(block: SparseMoeBlock, x: torch.Tensor) -> torch.Tensor:
    """Every expert on every token, weighted by the (renormalised) top-k softmax, zero elsewhere."""
    probs = torch.softmax(x @ block.gate.weight.t(), dim=-1)
    top, ids = probs.topk(K, dim=-1)
    if block.norm_topk_prob:
        top = top / top.sum(-1, keepdim=True)
    mix = torch.zeros_like(probs).scatter(1, ids, top)  # [N, E]
    out = torch.zeros_like(x)
    for e in range(E):
        gate, up = (x @ block.experts.gate_up_proj[e].t()).split(I, dim=-1)
        out += mix[:, e:e + 1] * ((F.silu(gate) * up) @ block.experts.down_proj[e].t())
    if block.shared_expert is not None:
        out += torch.sigmoid(x @ block.shared_expert_gate.weight.t()) * block.shared_expert(x)
    return out


@pytest.mark.parametrize("norm_topk_prob", [True, False])
@pytest.mark.parametrize("shared", [S, 0])
def test_grouped_experts_match_dense_definition(norm_topk_prob, shared):
    block = make_block(norm_topk_prob, shared)
    x = torch.randn(33, H)
    with torch.no_grad():
        torch.testing.assert_close(block(x), dense_reference(block, x), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(block(x[:1]), dense_reference(block, x[:1]), atol=1e-5, rtol=1e-5)


def test_fuse_expert_weights_stacks_gate_first():
    per_expert = []
    for e in range(E):
        for kind, shape in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
            per_expert.append((f"model.layers.0.mlp.experts.{e}.{kind}.weight", torch.randn(shape)))
    stream = [("model.norm.weight", torch.ones(H))] + per_expert
    fused = dict(fuse_expert_weights(stream, E))
    p = "model.layers.0.mlp.experts"
    assert set(fused) == {"model.norm.weight", f"{p}.gate_up_proj", f"{p}.down_proj"}
    source = dict(per_expert)
    gate_up = fused[f"{p}.gate_up_proj"]
    assert gate_up.shape == (E, 2 * I, H)
    torch.testing.assert_close(gate_up[3, :I], source[f"{p}.3.gate_proj.weight"])
    torch.testing.assert_close(gate_up[3, I:], source[f"{p}.3.up_proj.weight"])
    torch.testing.assert_close(fused[f"{p}.down_proj"][5], source[f"{p}.5.down_proj.weight"])


def test_fuse_expert_weights_names_missing_experts():
    stream = [(f"model.layers.1.mlp.experts.{e}.gate_proj.weight", torch.zeros(I, H)) for e in range(E)]
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.experts\.0\.up_proj\.weight"):
        list(fuse_expert_weights(stream, E))
