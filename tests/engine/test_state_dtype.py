"""``--state-dtype``: the Gated DeltaNet recurrent state held in bf16 or fp16 in its slots (fp32 by
default). The setting is validated and reaches the engine from the server's flag, the slots and
the memory plan count the smaller state, and a tiny Qwen3.5's greedy outputs stay with the fp32
state's (the layers update the state in fp32 and round it once per step where they store it), also
through prefix checkpoints and the host tier, which copy the slots as they are."""
from __future__ import annotations

import pytest
import torch

from ninfer.engine.cache.manager import state_shapes
from ninfer.engine.cache.state_pool import StateSlotPool
from ninfer.engine.engine_config import EngineConfig
from support.prefix_cases import engine, greedy_with_top5, req, run
from support.tiny import save_tiny_qwen3_5


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    from ninfer.engine.loader import load_checkpoint, load_model

    ckpt = load_checkpoint(save_tiny_qwen3_5(tmp_path_factory.mktemp("qwen3_5") / "ckpt"))
    return load_model(ckpt, "cpu", torch.float32), ckpt.tokenizer


def test_the_setting_is_checked_and_reaches_the_engine():
    from ninfer.server.bootstrap import engine_config
    from ninfer.server.cli import build_parser

    assert EngineConfig().state_storage_dtype == torch.float32
    assert EngineConfig(state_dtype="bf16").state_storage_dtype == torch.bfloat16
    with pytest.raises(ValueError, match="state_dtype must be one of fp32, bf16, fp16, got 'fp8'"):
        EngineConfig(state_dtype="fp8")
    args = build_parser().parse_args(["--model", "m", "--state-dtype", "fp16"])
    assert engine_config(args, 512, "cpu", torch.float32).state_storage_dtype == torch.float16
    assert build_parser().parse_args(["--model", "m"]).state_dtype == "fp32"


def test_slots_and_the_memory_plan_count_the_smaller_state(parts):
    from ninfer.engine import memory

    model, _ = parts
    cfg = model.config
    conv, rec = state_shapes(cfg)
    n_gdn = sum(t == "linear_attention" for t in cfg.layer_types)
    full = memory._slot_bytes(cfg, EngineConfig())
    half = memory._slot_bytes(cfg, EngineConfig(state_dtype="bf16"))
    assert full - half == n_gdn * rec[0] * rec[1] * rec[2] * 2
    assert half == StateSlotPool.bytes_per_slot(n_gdn, conv, rec, torch.float32, torch.float16)
    eng = engine(parts, state_dtype="bf16")
    assert eng.caches.states.recurrent.dtype == torch.bfloat16
    assert eng.caches.states.conv.dtype == torch.float32  # the conv state stays in the compute dtype



# Measured (tiny random Qwen3.5, fp32 compute, 24 tokens): the same 24 tokens with either state
# dtype; largest top-5 log-probability difference 0.043 (bf16) / 0.0069 (fp16: 3 more mantissa
# bits); the bounds leave about 3x.
BOUNDS = {"bf16": 0.13, "fp16": 0.02}


@pytest.mark.parametrize("state_dtype", ["bf16", "fp16"])
def test_greedy_outputs_stay_with_the_fp32_state(parts, state_dtype):
    ref_toks, ref_tops = greedy_with_top5(parts, state_dtype="fp32")
    toks, tops = greedy_with_top5(parts, state_dtype=state_dtype)
    assert toks == ref_toks
    diff = max(abs(ref_tops[i][t] - tops[i][t]) for i in range(len(toks)) for t in ref_tops[i] if t in tops[i])
    print(f"state {state_dtype}: top-5 log-probabilities within {diff:.5f}")
    assert 0 < diff < BOUNDS[state_dtype], diff


def test_prefix_checkpoints_and_the_host_tier_carry_the_smaller_state(parts):
    """Two conversations taking turns with one device checkpoint and host memory for the rest:
    every hit gives the tokens a bf16 state gives without any cache."""
    def turns(eng):
        ids = {"a": [5 + i % 80 for i in range(37)], "b": [7 + (3 * i) % 61 for i in range(45)]}
        out = []
        for t in range(2):
            for name in ("a", "b"):
                got, cached = run(eng, [req(f"{name}{t}", ids[name])])[f"{name}{t}"]
                out.append((got, cached))
                ids[name] = ids[name] + got + [9 + t, 10, 11]
        return out

    cached_eng = engine(parts, state_dtype="bf16", prefix_checkpoints=1, host_cache_mib=64)
    with_cache, plain = turns(cached_eng), turns(engine(parts, state_dtype="bf16", prefix_cache=False))
    assert [got for got, _ in with_cache] == [got for got, _ in plain]
    assert all(cached > 0 for _, cached in with_cache[2:])
    assert cached_eng.caches.prefix.hits_host >= 2
