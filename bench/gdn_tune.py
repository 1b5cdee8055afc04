"""Value columns per program of the fused GDN decode step, timed at a model's shape.

    python -m bench.gdn_tune --shape qwen3.5-35b-a3b [--batches 1,8] [--verify 4]

Random projections and state pools at the shape's GDN layer size, one pool per timed call (so the
fp32 states come from HBM, as each layer's do in a step). For each ``block_v`` the step is checked
against the current default's output on the same pool, then timed in a CUDA graph (GPU time, no
Python launch cost) with counters of its own, since one pool's launches must all use one
``block_v``. Prints a table per batch size: microseconds per call and the state bandwidth. With
``--verify K`` the GDN verify kernel (``gdn_verify_triton``: rows of ``K`` positions per request,
the state after each written out) too, per value columns and warps, beside the decode step: its
output checked against the default tiles', its time, the states' bandwidth (read once, written
``K`` times) and its time over the decode step's at the default ``block_v``.
"""
from __future__ import annotations

import argparse

import torch

from ninfer.engine.layers import gdn_decode_triton as gd

from .gpu_env import graph_time_us
from .shapes import shape_config


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gdn_tune")
    p.add_argument("--shape", default="qwen3.5-35b-a3b")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--pools", type=int, default=32, help="state pools per timed graph (beyond L2)")
    p.add_argument("--verify", type=int, default=0, metavar="K", help="also the verify kernel, rows of K")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU")
    cfg = shape_config(args.shape)
    hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv, width = cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim
    conv_dim = 2 * hk * dk + hv * dv
    dt, dev = torch.bfloat16, "cuda"
    conv_w = torch.randn(conv_dim, 1, width, dtype=dt, device=dev) * 0.5
    a_log, dt_bias = torch.randn(hv, device=dev), torch.randn(hv, device=dev)
    norm_w = torch.randn(dv, device=dev) * 0.3 + 1
    print(f"{args.shape} on {torch.cuda.get_device_name()}: {hk} key / {hv} value heads of {dk} x {dv}, "
          f"default block_v {gd.BLOCK_V}")
    for b in (int(x) for x in args.batches.split(",")):
        qkv = torch.randn(b, conv_dim, dtype=dt, device=dev)
        z = torch.randn(b, hv * dv, dtype=dt, device=dev)
        a, bb = torch.randn(b, hv, dtype=dt, device=dev), torch.randn(b, hv, dtype=dt, device=dev)
        slots = torch.arange(b, device=dev)
        convs = [torch.randn(b, width - 1, conv_dim, dtype=dt, device=dev) for _ in range(args.pools)]
        states = [torch.randn(b, hv, dk, dv, device=dev) * 0.1 for _ in range(args.pools)]
        state_bytes = 2 * b * hv * dk * dv * 4  # read + written

        def step(block_v, pool, counts, conv=None, state=None):
            return gd.gdn_decode_step_triton(qkv, z, a, bb, convs[pool] if conv is None else conv, conv_w, a_log,
                                             dt_bias, states[pool] if state is None else state, slots, counts,
                                             norm_w, 1e-6, hk, block_v)

        def fresh_counts():
            return torch.zeros(b, hk, dtype=torch.int64, device=dev)

        conv0, state0 = convs[0].clone(), states[0].clone()  # the timed calls update the pools in place
        ref = step(gd.BLOCK_V, 0, fresh_counts(), conv0.clone(), state0.clone())
        print(f"\nbatch {b}\n| block_v | programs | us per call | state GB/s | output |\n|---|---|---|---|---|")
        decode_us = None
        for block_v in sorted({v for v in (8, 16, 32, 64, 128) if v <= dv}):
            out = step(block_v, 0, fresh_counts(), conv0.clone(), state0.clone())
            ok = torch.allclose(out.float(), ref.float(), rtol=2e-2, atol=2e-2)
            counts = fresh_counts()
            us = graph_time_us(lambda i: step(block_v, i, counts), args.pools)
            mark = " (default)" if block_v == gd.BLOCK_V else ""
            decode_us = us if block_v == gd.BLOCK_V else decode_us
            print(f"| {block_v}{mark} | {b * hv * dv // block_v} | {us:.1f} | {state_bytes / us / 1e3:.0f} | "
                  f"{'ok' if ok else 'MISMATCH'} |", flush=True)
        if args.verify > 1:
            _verify_table(args.verify, b, qkv.shape[1], hk, hv, dk, dv, width, conv_w, a_log, dt_bias, convs, states,
                          args.pools, decode_us)
    return 0


def _verify_table(k: int, b: int, conv_dim: int, hk: int, hv: int, dk: int, dv: int, width: int, conv_w, a_log,
                  dt_bias, convs, states, pools: int, decode_us: float | None) -> None:
    """The verify kernel for ``b`` requests of ``k`` rows over the same pools, per tiles."""
    from ninfer.engine import launch
    from ninfer.engine.layers.gdn_verify_triton import gdn_verify_triton

    dt, dev, rows = torch.bfloat16, "cuda", b * k
    qkv = torch.randn(rows, conv_dim, dtype=dt, device=dev)
    a, bb = torch.randn(rows, hv, dtype=dt, device=dev), torch.randn(rows, hv, dtype=dt, device=dev)
    slots = torch.arange(b, device=dev)
    cu = torch.arange(b + 1, device=dev) * k
    conv_out = torch.empty(rows, width - 1, conv_dim, dtype=dt, device=dev)
    state_out = torch.empty(rows, hv, dk, dv, device=dev)
    state_bytes = (b + rows) * hv * dk * dv * 4  # each request's state read, each row's written
    default = launch.current().gdn_verify_tiles

    def verify(pool: int, tiles: dict):
        launch.use(launch.current().changed(gdn_verify_tiles=tiles))
        try:
            return gdn_verify_triton(qkv, a, bb, convs[pool], conv_w, a_log, dt_bias, states[pool], slots, cu,
                                     conv_out, state_out, hk)
        finally:
            launch.use(launch.current().changed(gdn_verify_tiles=default))

    ref = verify(0, default).clone()
    print(f"\nverify, batch {b}, rows of {k}\n| block_v x warps | programs | us per call | state GB/s | "
          f"x decode step | output |\n|---|---|---|---|---|---|")
    for block_v in sorted({v for v in (16, 32, 64) if v <= dv}):
        for warps in (4, 8):
            tiles = {"BLOCK_V": block_v, "num_warps": warps}
            ok = torch.allclose(verify(0, tiles).float(), ref.float(), rtol=2e-2, atol=2e-2)
            us = graph_time_us(lambda i: verify(i, tiles), pools)
            mark = " (default)" if tiles == default else ""
            ratio = f"{us / decode_us:.2f}" if decode_us else "-"
            print(f"| {block_v} x {warps}{mark} | {b * hv * dv // block_v} | {us:.1f} | {state_bytes / us / 1e3:.0f} | "
                  f"{ratio} | {'ok' if ok else 'MISMATCH'} |", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
