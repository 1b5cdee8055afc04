"""Checks of the fused decode path against each module's own torch path, shared by the GPU tests
(real sizes, bf16, CUDA) and the interpreter tests (small sizes, fp32, Triton's CPU interpreter).

Each check builds one module with random weights, runs the same input through the torch path and
the Triton path (``on_triton`` patched per module) and compares what comes out and what was
written into the pools.
"""
from __future__ import annotations

from types import SimpleNamespace

import torch

from ninfer.engine.layers.backends import Backends, use_backends


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out).all()
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def _randomize(module: torch.nn.Module, std: float) -> None:
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0.0, std)


def check_norm_gemv(device: str, dtype: torch.dtype, m: int, n: int, k: int, tiles: dict | None,
                    tol: float) -> None:
    """The GEMV with the pre-norm add + RMSNorm in front against ``RMSNorm(x, residual)`` then
    ``F.linear``, computed in fp32 on the CPU; the residual sum must come out exactly as the add
    rounds it."""
    from ninfer.engine.layers.gemv_triton import norm_gemv_triton
    from ninfer.engine.layers.norm import RMSNorm

    for zero_centered in (True, False):
        norm = RMSNorm(k, 1e-6, zero_centered)
        torch.nn.init.normal_(norm.weight, 0.0 if zero_centered else 1.0, 0.3)
        x = torch.randn(m, k, dtype=dtype, device=device)
        residual = torch.randn(m, k, dtype=dtype, device=device) * 4
        w = torch.randn(n, k, dtype=dtype, device=device) * k**-0.5
        y, res_out = norm_gemv_triton(x, residual, norm.weight.to(device), norm.eps, zero_centered, w, tiles)
        assert y.shape == (m, n) and y.dtype == dtype and res_out.dtype == dtype
        assert torch.equal(res_out, x + residual)
        total = (x + residual).cpu().float()
        ref = torch.nn.functional.linear(norm(total), w.cpu().float())
        assert rel_err(y.cpu(), ref) < tol, (m, n, k, tiles, zero_centered)


def check_attention_decode(monkeypatch, device: str, dtype: torch.dtype, qwen: bool, hidden: int,
                           heads: int, kv_heads: int, head_dim: int, rotary_dim: int) -> None:
    """q/k norm + RoPE + K/V write kernel and the gated merge against the module's torch path."""
    from ninfer.engine.layers.attention import Attention
    from ninfer.engine.layers.rotary import RotaryEmbedding
    from ninfer.engine.models.base import ForwardBatch

    rotary = RotaryEmbedding(head_dim, rotary_dim, 1e7 if qwen else 5e5)
    attn = Attention(0, hidden, heads, kv_heads, head_dim, rotary, qk_norm="zero_centered" if qwen else None,
                     gated=qwen).to(device=device, dtype=dtype)
    _randomize(attn, 0.05)
    attn.fuse_projections()
    b, pages, page = 3, 64, 16
    kv = [torch.randn(pages, page, kv_heads, head_dim, device=device, dtype=dtype) for _ in range(2)]
    lens = torch.tensor([5, 300, 77], dtype=torch.int32, device=device)
    tables = torch.stack([torch.randperm(pages, device=device)[:20] for _ in range(b)]).int()
    last = lens.long() - 1
    write = tables.long()[torch.arange(b, device=device), last // page] * page + last % page
    positions = last + torch.tensor([0, 1000, 50000], device=device)
    hidden_states = torch.randn(b, hidden, device=device, dtype=dtype)

    def run(fused: bool):
        pools = [t.clone() for t in kv]
        meta = SimpleNamespace(attn_ordinal={0: 0}, kv=SimpleNamespace(layer=lambda a: (*pools, None, None)),
                               write_index=write, block_tables=tables, context_lens=lens,
                               num_decode=b, prompt=None)
        batch = ForwardBatch(positions=positions, seq_lens=[1] * b, caches=[], step=meta)
        attn.backend = Backends.for_device(device).attention if fused else Backends.named("torch").attention
        return attn(hidden_states, batch), pools

    out, (k_new, v_new) = run(True)
    ref, (k_ref, v_ref) = run(False)
    assert rel_err(out, ref) < 2e-2
    assert rel_err(k_new, k_ref) < 1e-2 and torch.equal(v_new, v_ref)
    assert not torch.equal(k_new, kv[0])  # the step wrote its keys


def check_gdn_decode(device: str, dtype: torch.dtype, hidden: int, k_heads: int, v_heads: int,
                     head_dim: int, block_v: int | None = None, state_dtype: torch.dtype = torch.float32) -> None:
    """The fused decode step (conv, recurrence and output norm, in place on the pools) against the
    layer's torch decode path run on the CPU in fp32 math (on CUDA that path hands q / k to fla in
    bf16), for two steps in a row: the second reads the conv state the first shifted, so a key
    head's q / k state shifted too early or twice (the per-(slot, key head) arrival counters)
    shows up there. ``block_v``: value columns per program (the module's ``BLOCK_V`` when None);
    ``state_dtype``: the recurrent state pool's (``--state-dtype``), both paths rounding to it."""
    import copy

    from ninfer.engine.layers import gdn_decode_triton
    from ninfer.engine.layers.gated_delta_net import GatedDeltaNet

    block_v = min(block_v or gdn_decode_triton.BLOCK_V, head_dim)

    layer = GatedDeltaNet(0, hidden, num_k_heads=k_heads, num_v_heads=v_heads, head_k_dim=head_dim,
                          head_v_dim=head_dim)
    _randomize(layer, 0.5)
    ref_layer = copy.deepcopy(layer)
    layer = layer.to(device)
    b, slots = 5, 9
    conv = torch.randn(1, slots, 3, layer.conv_dim, device=device, dtype=dtype)
    rec = (torch.randn(1, slots, v_heads, head_dim, head_dim, device=device) * 0.1).to(state_dtype)
    counts = torch.zeros(slots, v_heads, dtype=torch.int64, device=device)
    slot_ids = torch.tensor([7, 2, 0, 5, 3], device=device)

    conv_ref, rec_ref = conv.cpu().clone(), rec.cpu().clone()
    ref_meta = SimpleNamespace(gdn_ordinal={0: 0}, states=SimpleNamespace(conv=conv_ref, recurrent=rec_ref),
                               slot_ids=slot_ids.cpu())
    for _ in range(2):
        qkv = torch.randn(b, layer.conv_dim, device=device, dtype=dtype)
        z = torch.randn(b, layer.value_dim, device=device, dtype=dtype)
        a = torch.randn(b, v_heads, device=device, dtype=dtype)
        bb = torch.randn(b, v_heads, device=device, dtype=dtype)
        out = gdn_decode_triton.gdn_decode_step_triton(
            qkv, z, a, bb, conv[0], layer.conv1d.weight, layer.A_log, layer.dt_bias, rec[0], slot_ids, counts,
            layer.norm.weight, layer.norm.eps, k_heads, block_v)
        beta = torch.sigmoid(bb.float()).cpu()
        g = (-torch.exp(layer.A_log.float()) * torch.nn.functional.softplus(a.float() + layer.dt_bias.float())).cpu()
        o = ref_layer._decode(qkv.cpu(), g, beta, slot_ids.cpu(), ref_meta)
        ref = ref_layer.norm(o, z.cpu().view(b, v_heads, head_dim)).reshape(b, -1)
        assert rel_err(out.cpu(), ref) < 2e-2
        assert rel_err(rec[0, slot_ids].cpu().float(), rec_ref[0, slot_ids.cpu()].float()) < \
            (1e-3 if state_dtype == torch.float32 else 1e-2)  # an ulp of bf16 where the two round apart
        torch.testing.assert_close(conv[0, slot_ids].cpu().float(), conv_ref[0, slot_ids.cpu()].float())
    untouched = [s for s in range(slots) if s not in slot_ids.tolist()]
    torch.testing.assert_close(rec[0, untouched].cpu(), rec_ref[0, untouched])
    torch.testing.assert_close(conv[0, untouched].cpu(), conv_ref[0, untouched])
    # each program (value head, column block) arrived once per step
    assert (counts[slot_ids, :k_heads] == 2 * (v_heads // k_heads) * (head_dim // block_v)).all()


def check_gdn_decode_skips_unused_rows(device: str, dtype: torch.dtype, hidden: int, k_heads: int, v_heads: int,
                                       head_dim: int) -> None:
    """Rows whose slot id is -1 (a captured step's rows past its real ones): the kernel leaves
    their output rows as they were in ``out`` and touches no slot or counter; the real rows come
    out as in a launch over them alone."""
    from ninfer.engine.layers import gdn_decode_triton
    from ninfer.engine.layers.gated_delta_net import GatedDeltaNet

    layer = GatedDeltaNet(0, hidden, num_k_heads=k_heads, num_v_heads=v_heads, head_k_dim=head_dim,
                          head_v_dim=head_dim).to(device)
    _randomize(layer, 0.5)
    slots = 6
    conv = torch.randn(slots, 3, layer.conv_dim, device=device, dtype=dtype)
    rec = torch.randn(slots, v_heads, head_dim, head_dim, device=device) * 0.1
    counts = torch.zeros(slots, v_heads, dtype=torch.int64, device=device)
    qkv = torch.randn(5, layer.conv_dim, device=device, dtype=dtype)
    z = torch.randn(5, layer.value_dim, device=device, dtype=dtype)
    a, b = (torch.randn(5, v_heads, device=device, dtype=dtype) for _ in range(2))

    def run(slot_ids, rows, out=None):
        pools = (conv.clone(), rec.clone(), counts.clone())
        o = gdn_decode_triton.gdn_decode_step_triton(
            qkv[:rows], z[:rows], a[:rows], b[:rows], pools[0], layer.conv1d.weight, layer.A_log, layer.dt_bias,
            pools[1], torch.tensor(slot_ids, device=device), pools[2], layer.norm.weight, layer.norm.eps, k_heads,
            out=out)
        return o, pools

    alone, (conv_a, rec_a, counts_a) = run([4, 1], 2)
    sentinel = torch.full((5, layer.value_dim), 7.0, device=device, dtype=dtype)
    padded, (conv_p, rec_p, counts_p) = run([4, 1, -1, -1, -1], 5, out=sentinel)
    assert padded.data_ptr() == sentinel.data_ptr()
    torch.testing.assert_close(padded[:2], alone)
    assert (padded[2:] == 7.0).all()
    assert torch.equal(conv_p, conv_a) and torch.equal(rec_p, rec_a) and torch.equal(counts_p, counts_a)
    assert not torch.equal(rec_a[[4, 1]], rec[[4, 1]]) and torch.equal(rec_a[[0, 2, 3, 5]], rec[[0, 2, 3, 5]])


def check_gdn_verify(device: str, dtype: torch.dtype, hidden: int, k_heads: int, v_heads: int, head_dim: int,
                     widths: tuple[int, ...] = (3, 1, 5, 2), block_v: int | None = None,
                     state_dtype: torch.dtype = torch.float32) -> None:
    """The verify kernel (every request's rows from its slot, the states after each row kept)
    and its torch reference against the layer's torch decode step run row after row on CPU copies
    of the pools, one request at a time: each row's output (before the norm) and the states it
    leaves; the pools themselves unchanged."""
    import copy

    from ninfer.engine.layers.gdn_verify import gdn_verify_reference
    from ninfer.engine.layers.gdn_verify_triton import gdn_verify_triton
    from ninfer.engine.layers.gated_delta_net import GatedDeltaNet

    layer = GatedDeltaNet(0, hidden, num_k_heads=k_heads, num_v_heads=v_heads, head_k_dim=head_dim,
                          head_v_dim=head_dim)
    _randomize(layer, 0.5)
    ref_layer = copy.deepcopy(layer)
    layer = layer.to(device)
    slots = 9
    conv = torch.randn(slots, 3, layer.conv_dim, device=device, dtype=dtype)
    rec = (torch.randn(slots, v_heads, head_dim, head_dim, device=device) * 0.1).to(state_dtype)
    slot_ids = torch.tensor([7, 2, 0, 5, 3, 8][: len(widths)], device=device)
    cu = torch.tensor([0, *torch.tensor(widths).cumsum(0).tolist()], device=device)
    rows = int(cu[-1])
    qkv = torch.randn(rows, layer.conv_dim, device=device, dtype=dtype)
    ab = torch.randn(rows, 2 * v_heads, device=device, dtype=dtype)
    a, b = ab[:, :v_heads], ab[:, v_heads:]  # views of one projection's output, as in the layer

    conv_ref, rec_ref = conv.cpu().clone(), rec.cpu().clone()
    want_o = torch.empty(rows, v_heads, head_dim)
    want_conv = torch.empty(rows, *conv.shape[1:], dtype=dtype)
    want_rec = torch.empty(rows, *rec.shape[1:], dtype=state_dtype)
    g, beta = ref_layer._gates(a.cpu(), b.cpu())
    for i, slot in enumerate(slot_ids.tolist()):
        pools = SimpleNamespace(conv=conv_ref[None].clone(), recurrent=rec_ref[None].clone())
        meta = SimpleNamespace(gdn_ordinal={0: 0}, states=pools)
        for r in range(int(cu[i]), int(cu[i + 1])):
            at = torch.tensor([slot])
            want_o[r] = ref_layer._decode(qkv[r : r + 1].cpu(), g[r : r + 1], beta[r : r + 1], at, meta)[0]
            want_conv[r], want_rec[r] = pools.conv[0, slot], pools.recurrent[0, slot]

    for run in (gdn_verify_triton, gdn_verify_reference):
        if run is gdn_verify_triton and block_v is not None:
            run = lambda *args: gdn_verify_triton(*args, block_v=block_v)  # noqa: E731
        conv_out = torch.full((rows + 2, *conv.shape[1:]), float("nan"), device=device, dtype=dtype)
        rec_out = torch.full((rows + 2, *rec.shape[1:]), float("nan"), device=device).to(state_dtype)
        o = run(qkv, a, b, conv, layer.conv1d.weight, layer.A_log, layer.dt_bias, rec, slot_ids, cu,
                conv_out, rec_out, k_heads)
        assert o.shape == (rows, v_heads, head_dim) and o.dtype == dtype
        assert rel_err(o.cpu(), want_o) < 2e-2
        torch.testing.assert_close(conv_out[:rows].cpu(), want_conv)
        # bf16 rows: the conv sums in another order than the torch step's einsum, so a q, k or v
        # value rounds to the neighbouring bf16 now and then, and the state follows it (2-4e-3
        # at 128 x 128 heads, at one position as at five)
        exact = state_dtype == torch.float32 and dtype == torch.float32
        assert rel_err(rec_out[:rows].cpu().float(), want_rec.float()) < (1e-3 if exact else 1e-2)
        assert torch.isnan(conv_out[rows:].float()).all() and torch.isnan(rec_out[rows:].float()).all()
        torch.testing.assert_close(conv.cpu(), conv_ref)  # the slots only read
        torch.testing.assert_close(rec.cpu(), rec_ref)


def check_gdn_short_prompt_rows(device: str, dtype: torch.dtype, hidden: int, k_heads: int, v_heads: int,
                                head_dim: int, widths: tuple[int, ...] = (3, 1, 5, 2)) -> None:
    """Prompt rows of a few tokens through the verify kernel's recurrent form
    (``TritonLinearAttention.short_rows``: each row's final states into its slot) against the
    torch backend's prompt rows on CPU copies of the pools: the outputs before the norm and the
    slots after, the slots of no row untouched."""
    import copy

    from ninfer.engine.layers.backends import TorchLinearAttention, TritonLinearAttention
    from ninfer.engine.layers.gated_delta_net import GatedDeltaNet

    layer = GatedDeltaNet(0, hidden, num_k_heads=k_heads, num_v_heads=v_heads, head_k_dim=head_dim,
                          head_v_dim=head_dim)
    _randomize(layer, 0.5)
    ref_layer = copy.deepcopy(layer).float()
    layer = layer.to(device)
    slots = 9
    conv = torch.randn(slots, 3, layer.conv_dim, device=device, dtype=dtype)
    rec = torch.randn(slots, v_heads, head_dim, head_dim, device=device) * 0.1
    slot_ids = torch.tensor([7, 2, 0, 5, 3, 8][: len(widths)], device=device)
    bounds = [0, *torch.tensor(widths).cumsum(0).tolist()]
    rows = bounds[-1]
    qkv = torch.randn(rows, layer.conv_dim, device=device, dtype=dtype)
    ab = torch.randn(rows, 2 * v_heads, device=device, dtype=dtype)
    a, b = ab[:, :v_heads], ab[:, v_heads:]
    prompt = SimpleNamespace(cu_seqlens_long=torch.tensor(bounds, device=device), max_seqlen=max(widths),
                             cu_seqlens_host=torch.tensor(bounds), slots_host=slot_ids.tolist())

    conv_ref, rec_ref = conv.cpu().float().clone(), rec.cpu().clone()  # (copies: the CPU pools are these)
    meta = SimpleNamespace(gdn_ordinal={0: 0}, num_decode=0, slot_ids=slot_ids.cpu(), prompt=prompt,
                           states=SimpleNamespace(conv=conv_ref[None], recurrent=rec_ref[None]))
    want = TorchLinearAttention().prompt(ref_layer, (qkv.cpu().float(),), a.cpu().float(), b.cpu().float(), meta)
    got = TritonLinearAttention.short_rows(layer, (qkv,), a, b, conv, rec, slot_ids, prompt)
    assert got.shape == (rows, v_heads, head_dim)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert rel_err(got.float().cpu(), want) < tol
    assert rel_err(conv.float().cpu(), conv_ref) < tol and rel_err(rec.cpu(), rec_ref) < max(tol, 1e-3)
    untouched = [s for s in range(slots) if s not in slot_ids.tolist()]
    assert torch.equal(rec.cpu()[untouched], rec_ref[untouched])


def check_gdn_prompt_conv(device: str, dtype: torch.dtype, k_heads: int, v_heads: int, head_dim: int,
                          widths: tuple[int, ...] = (70, 1, 2, 130), split: bool = False,
                          pool_dtype: torch.dtype | None = None) -> None:
    """The prompt rows' conv kernel (each row from its slot's conv state, q and k normalised, the
    slots advanced past the rows) against its torch reference row by row: rows longer than a
    chunk, and shorter than the conv's window (whose slot keeps its older inputs, shifted);
    ``split``: the input as q, k, v views of one wider projection output, as a long run gets them."""
    from ninfer.engine.layers.gdn_prompt import prompt_conv_reference
    from ninfer.engine.layers.gdn_prompt_triton import prompt_conv_triton
    from ninfer.engine.models.base import chunk_pairs

    torch.manual_seed(0)
    key_dim, value_dim, width, slots = k_heads * head_dim, v_heads * head_dim, 4, 9
    c = 2 * key_dim + value_dim
    weight = torch.randn(c, 1, width, device=device, dtype=dtype)
    pool = torch.randn(slots, width - 1, c, device=device, dtype=pool_dtype or dtype)
    slot_ids = torch.tensor([7, 2, 0, 5, 3][: len(widths)], device=device)
    bounds = [0, *torch.tensor(widths).cumsum(0).tolist()]
    cu = torch.tensor(bounds, device=device)
    wide = torch.randn(bounds[-1], c + 40, device=device, dtype=dtype)  # a wider projection's output
    x = wide[:, 8: 8 + c]
    groups = (x[:, :key_dim], x[:, key_dim: 2 * key_dim], x[:, 2 * key_dim:]) if split else (x,)
    chunks = torch.tensor(chunk_pairs(bounds), device=device).view(-1, 2)

    ref_pool = pool.cpu().clone()
    want = prompt_conv_reference(tuple(g.cpu() for g in groups), weight.cpu(), ref_pool, slot_ids.cpu(), cu.cpu(),
                                 k_heads, head_dim)
    got = prompt_conv_triton(groups, weight, pool, slot_ids, cu, chunks, k_heads, head_dim)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for name, g, w in zip("qkv", got, want):
        assert g.shape == w.shape and g.is_contiguous(), name
        assert rel_err(g.float().cpu(), w.float()) < tol, (name, rel_err(g.float().cpu(), w.float()))
    assert torch.equal(pool.cpu(), ref_pool), "the slots' conv states after the rows"


def check_moe_block(monkeypatch, device: str, dtype: torch.dtype, tokens: int, hidden: int, experts: int,
                    top_k: int, inter: int, shared: int, gemv_limit: int | None = None) -> None:
    """Routing, then grouped GEMVs (up to ``moe.DECODE_MAX_ASSIGNMENTS`` assignments, or
    ``gemv_limit``) or the sorted grouped GEMM, the shared expert folded in when sizes match."""
    from ninfer.engine.layers import fused_linear, moe
    from ninfer.engine.layers.moe import SparseMoeBlock

    if gemv_limit is not None:
        monkeypatch.setattr(moe, "DECODE_MAX_ASSIGNMENTS", gemv_limit)

    block = SparseMoeBlock(hidden, experts, top_k, inter, shared, True).to(device=device, dtype=dtype)
    _randomize(block, 0.02 if dtype == torch.bfloat16 else 0.2)
    x = torch.randn(tokens, hidden, device=device, dtype=dtype)
    with monkeypatch.context() as m:
        m.setattr(moe, "on_triton", lambda t: False)
        m.setattr(fused_linear, "on_triton", lambda t: False)  # the shared expert's projections too
        ref = block(x)
        assert block.fuse_projections() == (shared == inter)
        ref_fused = block(x)
    assert torch.equal(ref, ref_fused)  # fusing the router rows changes nothing on the torch path
    assert rel_err(block(x), ref) < 2e-2


def _assert_same_experts(ids: torch.Tensor, ref_ids: torch.Tensor, probs: torch.Tensor, top_k: int,
                         tie: float) -> None:
    """The same top-k experts per token, except where the reference's softmax ``probs`` has a
    near tie (within ``tie``, relative) at the k-th place, which rounding may break either way."""
    got, want = ids[:, :top_k].long().sort(1).values, ref_ids[:, :top_k].long().sort(1).values
    for t in (got != want).any(1).nonzero().flatten().tolist():
        kth = probs[t, want[t]].min()
        extra = probs[t, got[t][~torch.isin(got[t], want[t])]]
        assert (extra >= kth * (1 - tie)).all(), (t, got[t].tolist(), want[t].tolist())
    torch.testing.assert_close(ids[:, top_k:], ref_ids[:, top_k:])  # the shared expert's slot


def check_moe_norm_route(monkeypatch, device: str, dtype: torch.dtype, tokens: int, hidden: int, experts: int,
                         top_k: int, inter: int, shared: int, tiles: dict | None = None) -> None:
    """``SparseMoeBlock.forward_residual``: residual add + RMSNorm + router GEMV + routing in one
    launch (``norm_route_triton``), against the unfused kernels (``add_rms_norm_triton``, router
    GEMV, ``route_triton``, the same experts), computed independently; twice in a row, so a
    counter left non-zero by the first launch shows up in the second. ``tiles`` replaces the
    launch settings' ``moe_norm_route_tiles`` (fewer programs than tokens, ragged token tiles)."""
    from ninfer.engine.layers import moe_triton
    from ninfer.engine.layers.moe import SparseMoeBlock
    from ninfer.engine.layers.norm import RMSNorm
    from ninfer.engine.layers.norm_triton import add_rms_norm_triton

    block = SparseMoeBlock(hidden, experts, top_k, inter, shared, True).to(device=device, dtype=dtype)
    _randomize(block, 0.02 if dtype == torch.bfloat16 else 0.2)
    norm = RMSNorm(hidden, 1e-6, zero_centered=True).to(device=device, dtype=dtype)
    _randomize(norm, 0.3)
    folded = block.fuse_projections()
    assert folded == (shared == inter) and block._route_count is not None
    router = block._router if folded else block.gate.weight
    if tiles:
        from ninfer.engine import launch

        # in force for this test only
        monkeypatch.setattr(launch, "_active", launch.current().changed(moe_norm_route_tiles=((1 << 30, tiles),)))
    calls = []
    fused_entry = moe_triton.norm_route_triton
    monkeypatch.setattr(moe_triton, "norm_route_triton", lambda *a, **k: calls.append(1) or fused_entry(*a, **k))
    for _ in range(2):  # fresh inputs, and a launch after launches on the same counter
        x = torch.randn(tokens, hidden, device=device, dtype=dtype)
        residual = torch.randn(tokens, hidden, device=device, dtype=dtype) * 4
        # the unfused kernels, as the decode path ran them before
        ref_hidden, ref_res = add_rms_norm_triton(x, residual, norm.weight, norm.eps, True)
        ref_logits = torch.nn.functional.linear(ref_hidden, router)
        ref_ids, ref_wts = moe_triton.route_triton(ref_logits, top_k, experts, True, folded)

        got = fused_entry(x, residual, norm.weight, norm.eps, True, router, block._route_count, top_k, experts,
                          True, folded)
        assert not block._route_count.any()  # the last programs put the counters back
        hidden_out, res_out, ids, wts = got
        assert torch.equal(res_out, ref_res) and torch.equal(res_out, x + residual)
        if dtype == torch.float32:
            torch.testing.assert_close(hidden_out, ref_hidden, rtol=1e-5, atol=1e-5)
        else:  # at most one rounding step apart, where the fp32 sums of squares round apart
            assert rel_err(hidden_out, ref_hidden) < 2e-3
        assert ids.shape == ref_ids.shape == wts.shape
        probs = torch.softmax(ref_logits[:, :experts].float(), -1)
        _assert_same_experts(ids, ref_ids, probs, top_k, 1e-5 if dtype == torch.float32 else 2e-2)
        same = (ids.sort(1).values == ref_ids.sort(1).values).all(1)  # tokens routed alike: weights match
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(wts[same].sort(1).values, ref_wts[same].sort(1).values, rtol=tol, atol=tol)
        again = fused_entry(x, residual, norm.weight, norm.eps, True, router, block._route_count, top_k, experts,
                            True, folded)
        assert all(torch.equal(a, b) for a, b in zip(again, got))  # the reset counter: the same routing

    # the whole block: the experts after the fused launch, against the unfused kernels' path
    out, new_res = block.forward_residual(x, residual, norm)
    assert calls == [1]  # forward_residual took the fused launch
    assert torch.equal(new_res, ref_res)
    assert rel_err(out, block(ref_hidden)) < (1e-5 if dtype == torch.float32 else 2e-2)
    assert not block._route_count.any()


def check_prefill_attention(monkeypatch, model, tok, device: str, page_size: int, tol: float,
                            kv_dtype: torch.dtype | None = None) -> None:
    """Steps over the pools mixing prompt chunks and one-token rows of three sequences, then a
    second step each (keys read back from older pages, writes across page boundaries): attention
    through the fused q/k norm + RoPE + K/V write kernel, the split-K decode kernel and the varlen
    prompt kernel gives the logits of the torch path over the same pools (whole model)."""
    from ninfer.engine.cache.manager import CacheManager
    from ninfer.engine.request import Request
    from ninfer.engine.sampling_params import SamplingParams
    from ninfer.engine.step import build_step

    ids = tok.encode("Hello world! How are you today? The quick brown fox jumps over the lazy dog. " * 2)
    prompts = [ids[:20], ids[3:15], ids[5:8]]
    steps = [(11, 7, 1), (9, 1, 1), (0, 4, 1)]  # new tokens per sequence and step (0: not in it)
    dtype = next(model.parameters()).dtype

    def logits(fused: bool) -> torch.Tensor:
        use_backends(model, Backends.for_device(device) if fused else Backends.named("torch"))
        caches = CacheManager(model.config, 96 // page_size, page_size, 3, dtype, device, kv_dtype=kv_dtype)
        reqs = [Request(f"r{i}", p, SamplingParams(), max_total_tokens=64) for i, p in enumerate(prompts)]
        for r in reqs:
            r.cache = caches.open()
        out = []
        for counts in steps:
            plan = [(r, n) for r, n in zip(reqs, counts) if n]
            for r, n in plan:
                assert caches.reserve(r.cache, r.num_computed + n)
            step = build_step(plan, caches, torch.device(device))
            with torch.inference_mode():
                out.append(model.compute_logits(model(step.input_ids, step.batch)))
            for r, n in step.plan:
                r.num_computed += n
        return torch.cat(out).float()

    try:
        assert rel_err(logits(True), logits(False)) < tol
    finally:
        use_backends(model, Backends.for_device(device))  # the model's own, for the tests after


def check_int4_gemv(device: str, dtype: torch.dtype, m: int, n: int, k: int, group: int, with_offset: bool | str,
                    tiles: dict | None, tol: float, kernel: str = "gemv", bits: int = 4, pack_x: bool = False) -> None:
    """The GEMV over ``bits``-bit groups (``kernel`` "gemv", "dot": its form on the tensor
    cores, "split": that form for a few rows with K split over programs) against ``x @ W.T``, or
    the dequantizing kernel ("dequantize") against ``W``, with ``W``
    the group-quantized weight dequantized (in fp32, from the fp16 scales the kernels read);
    ``pack_x`` (split): one row of x prepared first (``quant_gemv_triton.x_pack``).
    ``with_offset`` "symmetric": 4-bit offsets of ``-8 * scale``, which the kernels take as the
    constant zero point 8 (no offsets read)."""
    from ninfer.engine.layers.linear import GroupQuantized
    from ninfer.engine.layers.quant_gemv_triton import (int4_dequantize_triton, int4_gemv_dot_triton,
                                                        int4_gemv_split_triton, int4_gemv_triton, pack_int4)

    symmetric = with_offset == "symmetric"
    assert not (symmetric and bits != 4)
    if bits == 4:
        q = torch.randint(0, 16, (n, k), dtype=torch.uint8)
        held = pack_int4(q)
    else:
        q = torch.randint(-127, 128, (n, k), dtype=torch.int8)
        held = q
    scale = torch.rand(n, k // group) * 0.1 + 0.01
    offset = -8 * scale * (0.5 + torch.rand(n, k // group)) if with_offset is True else None
    s16 = scale.half()
    o16 = None if offset is None else offset.half()
    ref_o = (-8 * s16.float()) if symmetric else None if o16 is None else o16.float()
    ref_w = GroupQuantized(q, s16.float(), ref_o, group, bits, "test").dequantize()
    held, s16, o16 = held.to(device), s16.to(device), None if o16 is None else o16.to(device)
    zero = 8 if symmetric else 0
    if kernel == "dequantize":
        w = torch.empty(n, k + 8, dtype=dtype, device=device)[:, 4:4 + k]  # rows strided
        w = int4_dequantize_triton(held, s16, o16, group, w, zero=zero)
        assert rel_err(w.float(), ref_w.to(device)) < tol
        return
    x = torch.randn(m, k + 6)[:, 3:3 + k].to(device=device, dtype=dtype)  # rows strided
    gemv = {"dot": int4_gemv_dot_triton, "split": int4_gemv_split_triton}.get(kernel, int4_gemv_triton)
    out = gemv(x, held, s16, o16, group, tiles, zero=zero, **({"pack_x": True} if pack_x else {}))
    assert out.shape == (m, n) and out.dtype == dtype
    assert rel_err(out.float(), x.float() @ ref_w.to(device).T) < tol


def symmetric_groups_of_16(w: torch.Tensor):
    """``w`` ``[N, K]`` as GGUF Q6_K holds it: 6-bit integers in symmetric groups of 16 (8-bit held)."""
    from ninfer.engine.layers.linear import GroupQuantized

    n, k = w.shape
    g = w.float().reshape(n, k // 16, 16)
    scale = (g.abs().amax(-1) / 31).clamp_min(1e-8)
    q = (g / scale[..., None]).round().clamp(-32, 31).to(torch.int8).reshape(n, k)
    return GroupQuantized(q.cpu(), scale.cpu(), None, 16, 8, "Q6_K")


def check_moe_quantized(monkeypatch, device: str, dtype: torch.dtype, tokens: int, hidden: int, experts: int,
                        top_k: int, inter: int, bits: int, gemv_limit: int | None = None) -> None:
    """Experts held in ``bits`` (``moe.QuantizedExperts``, packed for the Triton kernels; ``bits``
    6: GGUF Q6_K's symmetric groups of 16): the grouped GEMVs (up to
    ``moe.DECODE_MAX_ASSIGNMENTS`` assignments, or ``gemv_limit``) or the grouped GEMM
    dequantizing tiles in registers, against the torch loop over the same weights dequantized;
    the block's dense shared expert runs on its own."""
    import copy

    from ninfer.engine.layers import fused_linear, moe
    from ninfer.engine.layers.linear import quantize_rtn
    from ninfer.engine.layers.moe import SparseMoeBlock

    if gemv_limit is not None:
        monkeypatch.setattr(moe, "DECODE_MAX_ASSIGNMENTS", gemv_limit)
    ref = SparseMoeBlock(hidden, experts, top_k, inter, inter, True).to(device=device, dtype=dtype)
    _randomize(ref, 0.02 if dtype == torch.bfloat16 else 0.2)
    block = copy.deepcopy(ref)
    for name in ("gate_up_proj", "down_proj"):
        dense = getattr(ref.experts, name)
        flat = dense.detach().reshape(-1, dense.shape[-1])
        q = symmetric_groups_of_16(flat) if bits == 6 else quantize_rtn(flat, bits)
        block.experts.take_quantized(f"experts.{name}", q, torch.device(device), packed=True)
        dense.data.copy_(q.dequantize().view(dense.shape))  # the reference: the held values, dense
    assert block.experts.kernels_take and not block.fuse_projections()
    x = torch.randn(tokens, hidden, device=device, dtype=dtype)
    with monkeypatch.context() as m:
        m.setattr(moe, "on_triton", lambda t: False)
        m.setattr(fused_linear, "on_triton", lambda t: False)
        want = ref(x)
    assert rel_err(block(x), want) < 2e-2
