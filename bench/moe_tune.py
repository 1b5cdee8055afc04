"""Tile sizes of the MoE decode GEMVs, timed at a model's shape.

    python -m bench.moe_tune --shape qwen3.5-35b-a3b [--tokens 1,8] [--kernels gate_up,down]

Random bf16 experts at the shape's size (all of them) and ``--routes`` random routings, so the
timed calls read expert weights from HBM rather than L2, as in a real step; each tile choice of
``moe_gate_up_triton`` and ``moe_down_triton`` is checked against the current default's output
and timed in a CUDA graph (GPU time, no Python launch cost).
Prints one table per kernel and token count: microseconds per call and the bandwidth of the
expert rows it reads.
"""
from __future__ import annotations

import argparse
import itertools

import torch

from ninfer.engine import launch
from ninfer.engine.layers import moe_triton as mt

from .gpu_env import sweep_tiles
from .shapes import shape_config


def candidates(block_ns, block_ks, warps, **fixed):
    return [{"BLOCK_N": n, "BLOCK_K": k, "num_warps": w, **fixed}
            for n, k, w in itertools.product(block_ns, block_ks, warps)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.moe_tune")
    p.add_argument("--shape", default="qwen3.5-35b-a3b")
    p.add_argument("--tokens", default="1,8")
    p.add_argument("--routes", type=int, default=16, help="routings per timed graph (experts beyond L2)")
    p.add_argument("--kernels", default="gate_up,down", help="which GEMVs to sweep")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU")
    cfg = shape_config(args.shape)
    e, hid, inter, k = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts_per_tok
    dt, dev = torch.bfloat16, "cuda"
    gate_up = torch.randn(e, 2 * inter, hid, dtype=dt, device=dev) * 0.02
    down = torch.randn(e, hid, inter, dtype=dt, device=dev) * 0.02
    shared_gu = torch.randn(2 * inter, hid, dtype=dt, device=dev) * 0.02
    shared_d = torch.randn(hid, inter, dtype=dt, device=dev) * 0.02
    print(f"{args.shape}: {e} experts, hidden {hid}, moe intermediate {inter}, top-{k} + shared")
    routes, kernels = args.routes, set(args.kernels.split(","))
    if not kernels <= {"gate_up", "down"}:
        p.error(f"--kernels: unknown {sorted(kernels - {'gate_up', 'down'})}")
    for n in (int(t) for t in args.tokens.split(",")):
        routed = [mt.route_triton(torch.randn(n, e + 1, device=dev), k, e, True, True) for _ in range(routes)]
        x = torch.randn(n, hid, dtype=dt, device=dev)
        h = torch.randn(n * (k + 1), inter, dtype=dt, device=dev)
        distinct = sum(ids.unique().numel() for ids, _ in routed) / routes
        if "gate_up" in kernels:
            for line in sweep_tiles(f"gate_up, {n} token(s), {distinct:.1f} distinct experts",
                              lambda t, r: mt.moe_gate_up_triton(x, gate_up, shared_gu, routed[r][0], t),
                              launch.current().moe_gate_up_tiles, candidates([1, 2, 4, 8, 16], [512, 1024, 2048], [2, 4, 8]),
                              distinct * 2 * inter * hid * 2, routes):
                print(line, flush=True)
        if "down" in kernels:
            for line in sweep_tiles(f"down, {n} token(s), {distinct:.1f} distinct experts",
                              lambda t, r: mt.moe_down_triton(h, down, shared_d, *routed[r], t), mt.down_tiles(n),
                              candidates([1, 2, 4, 8, 16, 32], [128, 256, 512], [2, 4, 8], ALL_SLOTS=False)
                              + candidates([1, 2, 4, 8], [128, 256, 512], [1, 2, 4, 8], ALL_SLOTS=True),
                              distinct * hid * inter * 2, routes):
                print(line, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
