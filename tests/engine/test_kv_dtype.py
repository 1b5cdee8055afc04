"""``--kv-dtype``: KV pages in one byte per element (fp8 e4m3, int8) with a scale per (token, KV
head), or two elements per byte (4bit): keys with a step and minimum per page and channel,
values with a scale per group of 32 along the head dim. The setting is validated, the pool and
the memory plan count the smaller pages and their scales, quantization round-trips within a step
of its grid (4-bit keys written a row at a time as well), greedy outputs
of a tiny Llama and a tiny Qwen3.5 stay with the fp32 cache's, and prefix checkpoints (on the
device and in host memory) give the tokens the same kv dtype gives without them."""
from __future__ import annotations

import pytest
import torch

from ninfer.engine.cache.kv_pool import PagedKVPool
from ninfer.engine.cache.kv_quant import (QMAX, ExactKeys, dequantize, dequantize_keys4, quantize, quantize_keys4,
                                          rotation, unpack4, write_keys4)
from ninfer.engine.cache.manager import kv_bytes_per_token
from ninfer.engine.engine_config import EngineConfig
from support.prefix_cases import engine, greedy_with_top5, req, run
from support.tiny import save_tiny_llama, save_tiny_qwen3_5

ONE_BYTE = [("int8", torch.int8), ("fp8", torch.float8_e4m3fn)]


def test_the_setting_is_checked():
    assert EngineConfig().kv_storage_dtype == torch.float32
    assert EngineConfig(kv_dtype="bf16").kv_storage_dtype == torch.bfloat16
    assert EngineConfig(kv_dtype="fp8", dtype=torch.bfloat16).kv_storage_dtype == torch.float8_e4m3fn
    assert EngineConfig(kv_dtype="4bit", dtype=torch.bfloat16).kv_storage_dtype == torch.uint8  # packed pairs
    with pytest.raises(ValueError, match="kv_dtype must be one of auto, bf16, fp8, int8, 4bit, got 'fp16'"):
        EngineConfig(kv_dtype="fp16")


def test_4bit_needs_a_head_dim_its_groups_divide(parts):
    from dataclasses import replace

    model, _ = parts
    EngineConfig(kv_dtype="4bit").check_for_model(model.config)
    odd = replace(model.config, head_dim=48)
    EngineConfig(kv_dtype="int8").check_for_model(odd)
    with pytest.raises(ValueError, match="kv_dtype '4bit' needs a head_dim .* multiple of 32 .* this model's is 48"):
        EngineConfig(kv_dtype="4bit").check_for_model(odd)


def test_4bit_quantize_packs_two_codes_a_byte_with_a_scale_per_group():
    """16 levels at the midpoints of 15 equal cells over ``[-amax, amax]`` of each group of 32:
    code ``c`` stands for ``(c - 7.5) * amax / 7.5``."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, 3, 64, generator=g) * torch.logspace(-3, 2, 16)[:, None, None]
    x[:, :, 40] *= 30.0  # an outlier in the second group: the first keeps its own step
    x[5, 2] = 0.0
    q, scale = quantize(x, torch.uint8)
    assert q.dtype == torch.uint8 and q.shape == (16, 3, 32) and scale.shape == (16, 3, 2)
    codes = unpack4(q)
    assert codes.min() == 0 and codes.max() == 15  # every level used, the ends at +-amax
    assert torch.equal(codes[..., 1], q[..., 0] >> 4)  # element 1 in byte 0's high nibble
    back = dequantize(q, scale, torch.float32)
    groups = x.reshape(16, 3, 2, 32)
    amax = groups.abs().amax(-1, keepdim=True)
    err = ((back.reshape(16, 3, 2, 32) - groups).abs() / amax.clamp_min(1e-20)).max().item()
    assert err <= 0.5 / 7.5 + 2 ** -10, err  # half a step of amax / 7.5 within each group (the fp16 scale's rounding)
    assert scale.dtype == torch.float16 and torch.allclose(scale.float(), amax[..., 0] / 7.5, rtol=2 ** -10, atol=0)  # rounded up
    assert back[5, 2].abs().max() == 0  # an all-zero row: a scale of 0


@pytest.mark.parametrize("name, dtype", ONE_BYTE)
def test_quantize_round_trips_within_its_grid(name, dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, 32, generator=g) * torch.logspace(-3, 2, 64)[:, None, None]  # rows of very different size
    x[3, 1] = 0.0  # an all-zero row stays zero
    q, scale = quantize(x, dtype)
    assert q.dtype == dtype and scale.shape == (64, 4) and scale.dtype == torch.float32
    back = dequantize(q, scale, torch.float32)
    amax = x.abs().amax(-1, keepdim=True)
    err = ((back - x).abs() / amax.clamp_min(1e-30)).max().item()
    # int8: half a step of amax/127; e4m3: 3 mantissa bits, half an ulp is 1/16 of the value
    assert err <= (0.5 / 127 + 1e-6 if dtype == torch.int8 else 1 / 16 + 1e-6), err
    assert torch.equal(back[3, 1], torch.zeros(32))
    assert q.float().abs().max().item() <= QMAX[dtype]  # saturated at the grid's end


def test_the_keys_rotation_keeps_scores_and_spreads_outlier_channels():
    h = rotation(64, torch.device("cpu"), torch.float32)
    assert torch.allclose(h @ h.T, torch.eye(64), atol=1e-6) and rotation(48, "cpu", torch.float32) is None
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(8, 64, generator=g), torch.randn(8, 64, generator=g)
    q[:, 3] *= 20.0  # an outlier channel that queries and keys share (RoPE's low frequencies do)
    k[:, 3] *= 20.0
    assert torch.allclose((q @ h) @ (k @ h).T, q @ k.T, rtol=1e-4, atol=1e-2)
    assert (k @ h).abs().amax(-1).mean() < 0.5 * k.abs().amax(-1).mean()  # spread over the head
    # what it buys is measured on a trained model: the embedded SmolLM2's perplexity with e4m3
    # keys (tests/loader/test_smollm2_kv_dtype.py; +1.64% without it, +0.30% with it)


@pytest.mark.parametrize("name, dtype", ONE_BYTE)
def test_pool_and_plan_count_one_byte_elements_and_their_scales(name, dtype):
    pool = PagedKVPool(3, 5, 16, 2, 64, dtype, "cpu")
    assert pool.keys.dtype == dtype and pool.k_scales.shape == (3, 5, 16, 2)
    per_page = PagedKVPool.bytes_per_page(3, 16, 2, 64, dtype)
    assert pool.page_bytes == per_page == 2 * 3 * 16 * 2 * (64 + 4)
    assert per_page < PagedKVPool.bytes_per_page(3, 16, 2, 64, torch.bfloat16) * 0.6
    pool.k_scales[:, 1] = 2.0
    pool.copy_page(1, 4)  # a page's copy copies its scales
    assert torch.equal(pool.k_scales[:, 4], pool.k_scales[:, 1])


def test_pool_and_plan_count_4bit_pages_and_their_key_ranges_and_value_scales():
    pool = PagedKVPool(3, 5, 16, 2, 64, torch.uint8, "cpu")
    assert pool.keys.shape == pool.values.shape == (3, 5, 16, 2, 32)
    assert pool.k_scales.shape == (3, 5, 2, 2, 64) and pool.k_scales.dtype == torch.float16  # step, minimum
    assert pool.v_scales.shape == (3, 5, 16, 2, 2) and pool.v_scales.dtype == torch.float16
    per_page = PagedKVPool.bytes_per_page(3, 16, 2, 64, torch.uint8)
    assert pool.page_bytes == per_page == 3 * 2 * (16 * (32 + 32 + 2 * 2) + 2 * 64 * 2)
    assert per_page * 256 == PagedKVPool.bytes_per_page(3, 16, 2, 64, torch.bfloat16) * 84  # 84 bytes a token and head
    assert kv_bytes_per_token(type("C", (), {"layer_types": ["full_attention"] * 3, "num_key_value_heads": 2,
                                             "head_dim": 64})(), torch.uint8) == per_page // 16
    pool.v_scales[:, 2] = 3.0
    pool.k_scales[:, 2] = 0.5
    pool.values[:, 2] = 0x5A
    pool.copy_page(2, 0)
    assert torch.equal(pool.v_scales[:, 0], pool.v_scales[:, 2]) and torch.equal(pool.values[:, 0], pool.values[:, 2])
    assert torch.equal(pool.k_scales[:, 0], pool.k_scales[:, 2])


def test_4bit_keys_written_a_row_at_a_time_keep_a_range_per_page_and_channel(monkeypatch):
    """Rows written one by one (decode), in runs crossing pages (prompt chunks, runs split between
    requantizations) or all at once: each page's rows dequantize within a step of their page's
    range per channel; written at once they are ``quantize_keys4`` of the page; a row inside the
    range leaves the earlier rows' codes as they were."""
    from ninfer.engine.cache import kv_quant

    g = torch.Generator().manual_seed(1)
    n_pages, page, hkv, d = 4, 8, 2, 64
    x = torch.randn(2 * page, hkv, d, generator=g) * torch.logspace(-1, 1, d) + torch.linspace(-20, 20, d)
    index = torch.cat([torch.arange(page) + 3 * page, torch.arange(page) + page])  # pages 3 then 1
    at_once = (torch.zeros(n_pages, page, hkv, d // 2, dtype=torch.uint8), torch.zeros(n_pages, 2, hkv, d).half())
    write_keys4(*at_once, index, x)
    codes, ranges = quantize_keys4(torch.stack([x[page:], x[:page]], 0))
    assert torch.equal(at_once[0][[1, 3]], codes) and torch.equal(at_once[1][[1, 3]], ranges)
    monkeypatch.setattr(kv_quant, "KEYS_PER_WRITE", 5)
    for runs in ([1] * 2 * page, [3, 7, 6]):
        pages = torch.full((n_pages, page, hkv, d // 2), 0xFF, dtype=torch.uint8)
        stats = torch.zeros(n_pages, 2, hkv, d).half()
        start = 0
        for n in runs:
            write_keys4(pages, stats, index[start : start + n], x[start : start + n])
            start += n
        back = dequantize_keys4(pages, stats, torch.float32)[[3, 1]].flatten(0, 1)
        step = stats[[3, 1], 0].float().repeat_interleave(page, 0)
        err = (back - x).abs() / step  # in steps of the final range
        assert err.max() < 1.5 and (err <= 0.5 + 1e-3).float().mean() > 0.9, err  # rounded again as the range grew
    pages, stats = torch.zeros(n_pages, page, hkv, d // 2, dtype=torch.uint8), torch.zeros(n_pages, 2, hkv, d).half()
    write_keys4(pages, stats, index[: page - 1], x[: page - 1])
    before = pages.clone(), stats.clone()
    back = dequantize_keys4(pages, stats, torch.float32)[3]
    write_keys4(pages, stats, index[page - 1 : page], (back[:1] + back[1:2]) / 2)  # inside the range
    assert torch.equal(pages[3, :-1], before[0][3, :-1]) and torch.equal(stats, before[1])


def test_4bit_keys_written_a_row_at_a_time_from_their_exact_rows_end_as_a_whole_page_write(monkeypatch):
    """With a write slot holding the exact keys of the page being filled, pages written a row at
    a time, or in runs crossing pages and split between requantizations, end with the codes and
    ranges of the pages written whole; two sequences write side by side in one call. Without the
    exact rows (no slot, or a slot cleared since) the earlier rows are the page's, rounded again."""
    from ninfer.engine.cache import kv_quant

    g = torch.Generator().manual_seed(2)
    n_pages, page, hkv, d, slots = 6, 8, 2, 64, 3
    x = torch.randn(4 * page, hkv, d, generator=g) * torch.logspace(-1, 1, d) + torch.linspace(-20, 20, d)
    x[5] *= 4.0  # a row that widens its page's range after the first ones
    seq = {0: (torch.cat([torch.arange(page) + 3 * page, torch.arange(page) + page]), x[: 2 * page]),  # pages 3, 1
           2: (torch.cat([torch.arange(page) + 0 * page, torch.arange(page) + 4 * page]), x[2 * page :])}  # 0, 4
    whole_codes, whole_ranges = quantize_keys4(x.view(4, page, hkv, d))
    written = {3: 0, 1: 1, 0: 2, 4: 3}  # page: its rows in ``x``

    def fresh():
        exact = (torch.zeros(slots + 1, page, hkv, d), torch.full((slots + 1, page), -1, dtype=torch.long))
        return (torch.full((n_pages, page, hkv, d // 2), 0xFF, dtype=torch.uint8),
                torch.zeros(n_pages, 2, hkv, d).half(), exact)

    def same_as_whole(pages, stats):
        return all(torch.equal(pages[pg], whole_codes[i]) and torch.equal(stats[pg], whole_ranges[i])
                   for pg, i in written.items())

    monkeypatch.setattr(kv_quant, "KEYS_PER_WRITE", 5)
    for runs in ([1] * 2 * page, [3, 7, 6], [2 * page]):
        pages, stats, (rows, at) = fresh()
        start = 0
        for n in runs:  # the two sequences' runs in one call, as a step lays them out
            index = torch.cat([seq[s][0][start : start + n] for s in seq])
            k = torch.cat([seq[s][1][start : start + n] for s in seq])
            slot = torch.tensor([s for s in seq for _ in range(n)])
            write_keys4(pages, stats, index, k, ExactKeys(rows, at, slot))
            start += n
        assert same_as_whole(pages, stats), runs
        assert torch.equal(at[0], seq[0][0][page:]) and torch.equal(rows[2], seq[2][1][page:])  # the last pages

    for cleared in (False, True):  # rows without a slot (the unread last one), a slot forgotten midway
        pages, stats, (rows, at) = fresh()
        for i in range(page):
            slot = torch.tensor([0 if cleared else slots])
            if cleared and i == page // 2:
                at[0] = -1
            write_keys4(pages, stats, seq[0][0][i : i + 1], seq[0][1][i : i + 1], ExactKeys(rows, at, slot))
        assert not torch.equal(stats[3], whole_ranges[0]) or not torch.equal(pages[3], whole_codes[0])
        if not cleared:
            assert torch.equal(at[:slots], torch.full((slots, page), -1))  # nothing kept outside the unread slot
    pages, stats, _ = fresh()  # today's write, from the dequantized rows, differs too
    for i in range(page):
        write_keys4(pages, stats, seq[0][0][i : i + 1], seq[0][1][i : i + 1])
    assert not torch.equal(pages[3], whole_codes[0])


def test_memory_plan_fits_more_tokens_with_one_byte_pages(parts, monkeypatch):
    from ninfer.engine import memory

    model, _ = parts
    cfg = model.config
    per = {kv: kv_bytes_per_token(cfg, EngineConfig(kv_dtype=kv).kv_storage_dtype)
           for kv in ("auto", "bf16", "int8", "4bit")}
    assert per["int8"] == kv_bytes_per_token(cfg, torch.float8_e4m3fn)
    d = cfg.head_dim
    assert per["int8"] * 4 * d == per["auto"] * (d + 4)  # fp32 elements against a byte and a share of a scale
    monkeypatch.setattr(memory, "free_memory_bytes", lambda device, cap=None: 1 << 30)
    # half a byte, the values' groups' fp16 scales and the keys' fp16 ranges over a page of 16
    assert per["4bit"] * 4 * d == per["auto"] * (d // 2 + d // min(32, d) + d // 8)
    tokens = {kv: memory._kv_tokens(cfg, EngineConfig(max_context=1 << 28, max_concurrency=2, kv_dtype=kv), 0)
              for kv in ("auto", "int8", "4bit")}
    assert tokens["int8"] > 3 * tokens["auto"]  # the same free memory holds ~3.8x the tokens
    assert tokens["4bit"] > 1.5 * tokens["int8"]


BUILDERS = {"llama": save_tiny_llama, "qwen3_5": save_tiny_qwen3_5}


@pytest.fixture(scope="module", params=sorted(BUILDERS))
def parts(request, tmp_path_factory):
    from ninfer.engine.loader import load_checkpoint, load_model

    ckpt = load_checkpoint(BUILDERS[request.param](tmp_path_factory.mktemp(request.param) / "ckpt"))
    return load_model(ckpt, "cpu", torch.float32), ckpt.tokenizer



# Measured (tiny random Llama / Qwen3.5, fp32 compute, 24 tokens, keys rotated): the same 24
# tokens for both kv dtypes; largest top-5 log-probability difference over them 0.011 / 0.003
# (int8) and 0.058 / 0.038 (fp8; bf16 pages for scale: 0.009 / 0.002). The bounds leave about 3x
# room; e4m3's half-ulp (1/16 of a value) is ~16x int8's worst case (1/254 of the row's amax), so
# fp8's bound is the wider. 4bit (half a step is 1/15 of a group's amax): the first 3 / 24 tokens
# the same (then a near tie goes the other way); top-5 log-probabilities within 0.142 / 0.043.
BOUNDS = {"int8": (16, 0.04), "fp8": (12, 0.2), "4bit": (2, 0.4)}


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8", "4bit"])
def test_greedy_outputs_stay_with_the_fp32_cache(parts, kv_dtype):
    ref_toks, ref_tops = greedy_with_top5(parts, kv_dtype="auto")
    toks, tops = greedy_with_top5(parts, kv_dtype=kv_dtype)
    same = next((i for i, (a, b) in enumerate(zip(ref_toks, toks)) if a != b), len(toks))
    first, bound = BOUNDS[kv_dtype]
    assert same >= first, (ref_toks, toks)
    diff = max(abs(ref_tops[i][t] - tops[i][t]) for i in range(same) for t in ref_tops[i] if t in tops[i])
    print(f"{kv_dtype}: first {same} tokens the same, top-5 log-probabilities within {diff:.4f}")
    assert 0 < diff < bound, diff


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8", "4bit"])
def test_prefix_checkpoints_and_the_host_tier_give_the_tokens_of_no_cache(parts, kv_dtype):
    """A conversation over two turns with one device checkpoint and host memory for the rest, two
    conversations taking turns: every hit (device or host) gives the tokens the same kv dtype
    gives without any cache, so the checkpoints' copies carry their pages' scales."""
    def turns(eng):
        ids = {"a": [5 + i % 80 for i in range(37)], "b": [7 + (3 * i) % 61 for i in range(45)]}
        out = []
        for t in range(2):
            for name in ("a", "b"):
                got, cached = run(eng, [req(f"{name}{t}", ids[name])])[f"{name}{t}"]
                out.append((got, cached))
                ids[name] = ids[name] + got + [9 + t, 10, 11]
        return out

    cached_eng = engine(parts, kv_dtype=kv_dtype, prefix_checkpoints=1, host_cache_mib=64)
    with_cache, plain = turns(cached_eng), turns(engine(parts, kv_dtype=kv_dtype, prefix_cache=False))
    if kv_dtype == "4bit":
        # a page's key ranges are requantized from its dequantized rows when a later write lands in
        # a page brought back without its exact rows: keys round a second time, and a random
        # model's greedy tokens may part at a near-tie; the first turns (no hit) and the start of
        # every later one agree
        assert [got for got, _ in with_cache[:2]] == [got for got, _ in plain[:2]]
        assert all(a[:4] == b[:4] for (a, _), (b, _) in zip(with_cache, plain))
    else:
        assert [got for got, _ in with_cache] == [got for got, _ in plain]
    assert all(cached > 0 for _, cached in with_cache[2:])
    assert cached_eng.caches.prefix.hits_host >= 2
    assert cached_eng.caches.host.page_bytes == cached_eng.caches.kv.page_bytes


def test_the_server_flag_reaches_the_engine(capsys):
    from ninfer.server.bootstrap import engine_config
    from ninfer.server.cli import build_parser

    args = build_parser().parse_args(["--model", "m", "--kv-dtype", "int8"])
    assert engine_config(args, 512, "cpu", torch.float32).kv_storage_dtype == torch.int8
    assert build_parser().parse_args(["--model", "m"]).kv_dtype == "auto"
    args = build_parser().parse_args(["--model", "m", "--kv-dtype", "4bit"])
    assert engine_config(args, 512, "cpu", torch.float32).kv_storage_dtype == torch.uint8
    for bad, why in (("int4", "must be one of auto, bf16, fp8, int8, 4bit"),
                     ("fp16", "must be one of auto, bf16, fp8, int8, 4bit")):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["--model", "m", "--kv-dtype", bad])
        assert why in capsys.readouterr().err


@torch.no_grad()
def test_4bit_key_pages_decoded_a_token_a_step_end_as_written_by_a_prompt(parts):
    """Two sequences decoded side by side a token a step (each a write slot) leave the first
    attention layer's full key pages (keys the KV cache does not change) with the codes and ranges
    their tokens written as one prompt give; a pool without write slots rounds the early rows again."""
    from ninfer.engine.cache.manager import CacheManager
    from ninfer.engine.request import Request
    from ninfer.engine.sampling_params import SamplingParams
    from ninfer.engine.step import build_step

    model, _ = parts
    page, n = 8, 3 * 8 + 5
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, model.config.vocab_size, (n,), generator=g).tolist() for _ in range(2)]

    def keys_after(chunk: int, write_slots: int | None = None):
        caches = CacheManager(model.config, 16, page, 2, torch.float32, "cpu", kv_dtype=torch.uint8,
                              write_slots=write_slots)
        reqs = [Request(str(i), p, SamplingParams(), max_total_tokens=n + 1) for i, p in enumerate(prompts)]
        for r in reqs:
            r.cache = caches.open()
        for at in range(0, n, chunk):
            step = min(chunk, n - at)
            for r in reqs:
                assert caches.reserve(r.cache, at + step)
            run_step = build_step([(r, step) for r in reqs], caches, torch.device("cpu"))
            model(run_step.input_ids, run_step.batch)
            for r in reqs:
                r.num_computed += step
        full = [p for r in reqs for p in r.cache.pages[: n // page]]
        keys, ranges = caches.kv.layer(0)[0], caches.kv.layer(0)[2]
        return keys[full], ranges[full]

    whole = keys_after(n)
    stepped = keys_after(1)
    assert torch.equal(stepped[0], whole[0]) and torch.equal(stepped[1], whole[1])
    rounded = keys_after(1, write_slots=0)
    assert not (torch.equal(rounded[0], whole[0]) and torch.equal(rounded[1], whole[1]))


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8", "4bit"])
def test_speculated_steps_over_one_byte_pages_give_the_tokens_of_one_token_steps(kv_dtype, tmp_path_factory):
    """``--spec ngram`` verify rows read and write one-byte pages as decode rows do: a rejected
    draft's K/V and scales are overwritten, and the tokens are those of one-token steps."""
    from support.decode_paths import load_parts
    from support.overlap import drive

    llama = load_parts("llama", tmp_path_factory)
    specs = {3: {"max_tokens": 80}}
    engines = []
    plain, _ = drive(llama, False, specs, kv_dtype=kv_dtype)
    fast, _ = drive(llama, False, specs, spec="ngram", engine_out=engines, kv_dtype=kv_dtype)
    assert engines[0].caches.kv.k_scales is not None  # one-byte pages
    assert engines[0].counters.spec_accepted_tokens > 0
    if kv_dtype == "4bit":
        # a 4-bit key page's ranges take in every row written to it, the step's drafts too: a
        # verify row attends to its page's keys rounded over a range one-token steps may not have
        # yet, and a random model's greedy tokens may part at a near-tie
        (a,), (b,) = fast.values(), plain.values()
        same = next((i for i, (x, y) in enumerate(zip(a["tokens"], b["tokens"])) if x != y), len(a["tokens"]))
        assert same >= 16, same
    else:
        assert fast == plain


def _unpacked(pages: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """4-bit value pages dequantized element by element here, not through ``kv_quant``: byte ``i``'s
    low nibble is element ``2i``, its high one ``2i + 1``, each ``code - 7.5`` times its group's scale."""
    lo, hi = (pages & 15).float() - 7.5, (pages >> 4).float() - 7.5
    codes = torch.empty(*pages.shape[:-1], 2 * pages.shape[-1])
    codes[..., 0::2], codes[..., 1::2] = lo, hi
    group = codes.shape[-1] // scales.shape[-1]
    return codes * scales.repeat_interleave(group, dim=-1)


def _unpacked_keys(pages: torch.Tensor, ranges: torch.Tensor) -> torch.Tensor:
    """4-bit key pages dequantized here: code times its page's channel's step plus its minimum."""
    codes = torch.empty(*pages.shape[:-1], 2 * pages.shape[-1])
    codes[..., 0::2], codes[..., 1::2] = (pages & 15).float(), (pages >> 4).float()
    return codes * ranges[:, 0, None].float() + ranges[:, 1, None].float()


def test_the_torch_attention_over_4bit_pages_attends_to_their_dequantized_rows():
    """The CPU path's decode (``paged_decode_attention``) and prompt (``prefill_attention``)
    attention over 4-bit pages give plain attention over the pages' rows dequantized here."""
    from ninfer.engine.layers.attention import causal_attention
    from ninfer.engine.layers.paged_attention import paged_decode_attention
    from ninfer.engine.layers.prefill_attention import prefill_attention

    g = torch.Generator().manual_seed(3)
    pages, page, hkv, h, d = 12, 8, 2, 6, 64
    k, ks = quantize_keys4(torch.randn(pages, page, hkv, d, generator=g) * 3 + 5)
    v, vs = quantize(torch.randn(pages, page, hkv, d, generator=g) * 3, torch.uint8)
    keys, values = _unpacked_keys(k, ks), _unpacked(v, vs)
    tables = torch.stack([torch.randperm(pages, generator=g)[:5] for _ in range(2)]).int()
    lens = torch.tensor([13, 37], dtype=torch.int32)
    q = torch.randn(2, h, d, generator=g)
    out = paged_decode_attention(q, k, v, tables, lens, d**-0.5, None, ks, vs)
    for b in range(2):
        rows = tables[b].long()
        kb, vb = keys[rows].flatten(0, 1)[: lens[b]], values[rows].flatten(0, 1)[: lens[b]]
        ref = causal_attention(q[b : b + 1], kb, vb, d**-0.5)
        assert torch.allclose(out[b : b + 1], ref, atol=1e-5), (out[b] - ref[0]).abs().max()
    # prompt rows: 5 and 2 new tokens at the end of the same contexts
    qp = torch.randn(7, h, d, generator=g)
    cu = torch.tensor([0, 5, 7], dtype=torch.int32)
    out = prefill_attention(qp, k, v, tables, cu, lens, 5, d**-0.5, None, ks, vs)
    for b, (s, e) in enumerate(((0, 5), (5, 7))):
        rows = tables[b].long()
        kb, vb = keys[rows].flatten(0, 1)[: lens[b]], values[rows].flatten(0, 1)[: lens[b]]
        assert torch.allclose(out[s:e], causal_attention(qp[s:e], kb, vb, d**-0.5), atol=1e-5)
