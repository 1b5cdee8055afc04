"""Gated DeltaNet kernels and layer: chunked == token loop, and the cache continues a sequence exactly."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ninfer.engine.cache.sequence import SequenceCache
from ninfer.engine.layers.gated_delta_net import GatedDeltaNet, Qwen3NextGatedDeltaNet
from ninfer.engine.layers.gdn_ops import causal_conv1d, chunk_gated_delta_rule, recurrent_gated_delta_rule
from ninfer.engine.models.base import ForwardBatch

HK, HV, DK, DV = 2, 4, 16, 8


def random_inputs(t: int, with_state: bool):
    q = F.normalize(torch.randn(t, HK, DK), dim=-1)
    k = F.normalize(torch.randn(t, HK, DK), dim=-1)
    v = torch.randn(t, HV, DV)
    g = -torch.rand(t, HV) * 3  # decays from 1 down to e^-3 per token
    beta = torch.rand(t, HV)
    state = torch.randn(HV, DK, DV) if with_state else None
    return q, k, v, g, beta, state


@pytest.mark.parametrize("t", [1, 5, 16, 63, 64, 100, 130])
@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("chunk", [16, 64])
def test_chunked_matches_recurrent(t, with_state, chunk):
    q, k, v, g, beta, state = random_inputs(t, with_state)
    out_ref, state_ref = recurrent_gated_delta_rule(q, k, v, g, beta, state)
    out, final = chunk_gated_delta_rule(q, k, v, g, beta, state, chunk=chunk)
    assert out.shape == (t, HV, DV) and final.shape == (HV, DK, DV) and final.dtype == torch.float32
    torch.testing.assert_close(out, out_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(final, state_ref, atol=1e-5, rtol=1e-5)


def test_recurrence_by_definition():
    """One token from a known state, written out by hand (value head j uses key head j // 2)."""
    q, k, v, g, beta, state = random_inputs(1, True)
    out, final = recurrent_gated_delta_rule(q, k, v, g, beta, state, scale=0.5)
    for j in range(HV):
        kj, qj = k[0, j // 2], q[0, j // 2]
        s = state[j] * g[0, j].exp()
        s = s + torch.outer(kj, beta[0, j] * (v[0, j] - s.t() @ kj))
        torch.testing.assert_close(final[j], s)
        torch.testing.assert_close(out[0, j], s.t() @ (qj * 0.5))


def test_state_carries_across_calls():
    q, k, v, g, beta, state = random_inputs(90, True)
    whole, final = chunk_gated_delta_rule(q, k, v, g, beta, state)
    first, mid = chunk_gated_delta_rule(q[:50], k[:50], v[:50], g[:50], beta[:50], state)
    second, end = recurrent_gated_delta_rule(q[50:], k[50:], v[50:], g[50:], beta[50:], mid)
    torch.testing.assert_close(torch.cat([first, second]), whole, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(end, final, atol=1e-5, rtol=1e-5)


def test_causal_conv1d_in_pieces():
    channels, width, t = 12, 4, 30
    x, weight = torch.randn(t, channels), torch.randn(channels, 1, width)
    expected = F.silu(F.conv1d(x.t()[None], weight, padding=width - 1, groups=channels)[0, :, :t].t())
    out, state = causal_conv1d(x, weight, None)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(state, x[-(width - 1):])
    pieces, state = [], None
    for a, b in [(0, 2), (2, 3), (3, 17), (17, 30)]:  # pieces shorter than the kernel too
        piece, state = causal_conv1d(x[a:b], weight, state)
        pieces.append(piece)
    torch.testing.assert_close(torch.cat(pieces), expected)


def make_layer(cls=GatedDeltaNet, hidden=32) -> GatedDeltaNet:
    layer = cls(0, hidden, HK, HV, DK, DV, conv_kernel=4)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
        layer.A_log.copy_(torch.rand(HV).log())
    return layer


def run_layer(layer, x_pieces, cache):
    outs = []
    for x in x_pieces:
        batch = ForwardBatch.single(x.shape[0], cache)
        outs.append(layer(x, batch))
        batch.advance_caches()
    return torch.cat(outs)


@pytest.mark.parametrize("cls", [GatedDeltaNet, Qwen3NextGatedDeltaNet])
def test_prefill_in_pieces_matches_one_prefill(cls):
    layer = make_layer(cls)
    x = torch.randn(58, 32)
    with torch.no_grad():
        whole_cache, piece_cache = SequenceCache(1), SequenceCache(1)
        whole = run_layer(layer, [x], whole_cache)
        pieces = run_layer(layer, [x[:37], x[37:38], x[38:]], piece_cache)
    torch.testing.assert_close(pieces, whole, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(
        piece_cache.recurrent_states[0], whole_cache.recurrent_states[0], atol=1e-5, rtol=1e-5
    )
    torch.testing.assert_close(piece_cache.conv_states[0], whole_cache.conv_states[0])


def test_two_sequences_in_one_batch_match_separate_runs():
    layer = make_layer()
    xa, xb = torch.randn(20, 32), torch.randn(9, 32)
    with torch.no_grad():
        alone_a = run_layer(layer, [xa], SequenceCache(1))
        alone_b = run_layer(layer, [xb], SequenceCache(1))
        caches = [SequenceCache(1), SequenceCache(1)]
        positions = torch.cat([torch.arange(20), torch.arange(9)])
        together = layer(torch.cat([xa, xb]), ForwardBatch(positions, [20, 9], caches))
    torch.testing.assert_close(together, torch.cat([alone_a, alone_b]), atol=1e-5, rtol=1e-5)


def test_qwen3_next_fused_layout_is_per_key_head():
    """Fused rows grouped per key head [q, k, v_group, z_group] / [b_group, a_group] equal the
    separate Qwen3.5 projections; reading them as flat [Q|K|V|Z] would scramble heads."""
    sep = make_layer(GatedDeltaNet)
    fused = Qwen3NextGatedDeltaNet(0, 32, HK, HV, DK, DV, conv_kernel=4)
    group = HV // HK
    q, k, v = sep.in_proj_qkv.weight.split([HK * DK, HK * DK, HV * DV])
    z, b, a = sep.in_proj_z.weight, sep.in_proj_b.weight, sep.in_proj_a.weight
    qkvz_rows, ba_rows = [], []
    for h in range(HK):
        vs = slice(h * group * DV, (h + 1) * group * DV)
        qkvz_rows += [q[h * DK:(h + 1) * DK], k[h * DK:(h + 1) * DK], v[vs], z[vs]]
        ba_rows += [b[h * group:(h + 1) * group], a[h * group:(h + 1) * group]]
    with torch.no_grad():
        fused.in_proj_qkvz.weight.copy_(torch.cat(qkvz_rows))
        fused.in_proj_ba.weight.copy_(torch.cat(ba_rows))
        for name in ("conv1d.weight", "A_log", "dt_bias", "norm.weight", "out_proj.weight"):
            fused.get_parameter(name).copy_(sep.get_parameter(name))
        x = torch.randn(40, 32)
        expected = run_layer(sep, [x], SequenceCache(1))
        got = run_layer(fused, [x], SequenceCache(1))
    torch.testing.assert_close(got, expected)
