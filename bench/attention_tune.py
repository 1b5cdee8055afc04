"""Launch choices of the paged decode attention (split phase + merge), timed at a model's shape.

    python -m bench.attention_tune --shape qwen3.5-35b-a3b [--batches 1,8] [--context 4096]

Random K/V page pools at the shape's attention size with every sequence ``--context`` tokens
long, one pool per timed call (so K/V come from HBM, as each layer's do in a step). Each choice of
``paged_decode_attention_triton``'s ``tiles`` (how many split programs per SM, at most how many
splits, tokens per step, warps and stages of the split phase, head-dim columns per merge program)
is checked against the current default's output and timed in a CUDA graph (GPU time, no Python
launch cost). Prints one table per batch size, fastest first: microseconds per call and the K/V
bandwidth (``{}`` is the default).
"""
from __future__ import annotations

import argparse
import itertools

import torch

from ninfer.engine.layers.paged_attention_triton import paged_decode_attention_triton

from .gpu_env import sweep_tiles
from .shapes import shape_config

PAGE = 16


def candidates(head_dim: int) -> list[dict]:
    blocks = [16, 32] if head_dim >= 256 else [32, 64]
    return [{"PROGRAMS_PER_SM": pps, "MAX_SPLITS": ms, "BLOCK_N": bn, "num_warps": w, "num_stages": st,
             "REDUCE_BLOCK_D": rd}
            for pps, ms, bn, w, st, rd in itertools.product([1, 2, 4], [32, 64, 128], blocks, [4, 8], [2, 3],
                                                            [32, 64])]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.attention_tune")
    p.add_argument("--shape", default="qwen3.5-35b-a3b")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--pools", type=int, default=8, help="K/V pools per timed graph (beyond L2)")
    p.add_argument("--top", type=int, default=12, help="rows printed per table")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU")
    cfg = shape_config(args.shape)
    h, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    gated = cfg.family in ("qwen3_5", "qwen3_5_moe", "qwen3_next")
    dt, dev = torch.bfloat16, "cuda"
    print(f"{args.shape} on {torch.cuda.get_device_name()}: {h} query / {hkv} KV heads of {d}, "
          f"context {args.context}, pages of {PAGE}")
    for b in (int(x) for x in args.batches.split(",")):
        pages_per_seq = -(-args.context // PAGE)
        pools = [(torch.randn(b * pages_per_seq, PAGE, hkv, d, dtype=dt, device=dev),
                  torch.randn(b * pages_per_seq, PAGE, hkv, d, dtype=dt, device=dev)) for _ in range(args.pools)]
        tables = torch.randperm(b * pages_per_seq, device=dev).view(b, pages_per_seq).int()
        lens = torch.full((b,), args.context, dtype=torch.int32, device=dev)
        q = torch.randn(b, h, d, dtype=dt, device=dev)
        gate = torch.randn(b, h, 2 * d, dtype=dt, device=dev)[:, :, d:] if gated else None
        kv_bytes = 2 * b * args.context * hkv * d * 2

        def attend(tiles, pool):
            k, v = pools[pool]
            return paged_decode_attention_triton(q, k, v, tables, lens, d**-0.5, gate, tiles)

        for line in sweep_tiles(f"batch {b}", attend, {}, candidates(d), kv_bytes, args.pools, args.top):
            print(line, flush=True)
        pools.clear()
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
