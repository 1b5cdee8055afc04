"""Prompt attention over the paged KV pool at a model's attention shape: TFLOP/s by cached prefix.

    python -m bench.prefill_attention --shape qwen3.5-27b [--heads H,HKV,D] [--chunk 4096]
        [--prefixes 0,16384,131072] [--rows 1] [--page 16] [--sweep] [--no-torch] [--json PATH]

Each of ``--rows`` rows has ``prefix`` cached tokens and a ``--chunk``-token prompt chunk in a
random bf16 page pool with shuffled pages. Times ``prefill_attention_triton`` (one call for all
rows) against what the per-sequence path does today (each row's pages gathered, then torch SDPA
with a bottom-right causal mask), median GPU time of 20 calls. FLOPs count what causal
attention needs: ``4 * H * D`` per (query, visible key). ``--sweep`` also times each tile choice
at every prefix, fastest first.
"""
from __future__ import annotations

import argparse
import itertools
import json

import torch

from ninfer.engine.layers.backends import TritonAttention
from ninfer.engine import launch
from ninfer.engine.layers.prefill_attention_triton import prefill_attention_triton

from .gpu_env import _time_ms, measure_ceilings
from .shapes import shape_config


def make_rows(rows: int, prefix: int, chunk: int, h: int, hkv: int, d: int, page: int, gated: bool):
    ctx = prefix + chunk
    per_row = -(-ctx // page)
    dev, dt = "cuda", torch.bfloat16
    k = torch.randn(rows * per_row, page, hkv, d, dtype=dt, device=dev)
    v = torch.randn_like(k)
    tables = torch.randperm(rows * per_row, device=dev).view(rows, per_row).int()
    raw = torch.randn(rows * chunk, h, 2 * d, dtype=dt, device=dev)
    q, gate = raw[:, :, :d].contiguous(), raw[:, :, d:] if gated else None
    cu = torch.arange(0, rows * chunk + 1, chunk, dtype=torch.int32, device=dev)
    lens = torch.full((rows,), ctx, dtype=torch.int32, device=dev)
    return q, k, v, tables, cu, lens, gate


def torch_path(q, k, v, tables, cu, lens, scale, page):
    """The per-sequence path: each row's pages gathered into contiguous K/V, then SDPA."""
    parts = []
    for r, ctx in enumerate(lens.tolist()):
        idx = tables[r, : -(-ctx // page)].long()
        parts.append(TritonAttention().attend(q[cu[r]: cu[r + 1]], k[idx].flatten(0, 1)[:ctx], v[idx].flatten(0, 1)[:ctx], scale))
    return torch.cat(parts)


def candidates(d: int) -> list[dict]:
    ms, ns = ([64, 128], [32, 64]) if d >= 256 else ([64, 128], [32, 64, 128])
    return [{"BLOCK_M": m, "BLOCK_N": n, "num_warps": w, "num_stages": s}
            for m, n, w, s in itertools.product(ms, ns, [4, 8], [1, 2, 3])]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.prefill_attention")
    p.add_argument("--shape", default="qwen3.5-27b")
    p.add_argument("--heads", help="H,HKV,D instead of the shape's attention (e.g. 32,8,128)")
    p.add_argument("--chunk", type=int, default=4096)
    p.add_argument("--prefixes", default="0,16384,131072")
    p.add_argument("--rows", type=int, default=1)
    p.add_argument("--page", type=int, default=16)
    p.add_argument("--sweep", action="store_true", help="also time every tile choice")
    p.add_argument("--no-torch", action="store_true", help="skip the gather + SDPA column")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU")
    cfg = shape_config(args.shape)
    h, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    if args.heads:
        h, hkv, d = (int(x) for x in args.heads.split(","))
    gated = cfg.family in ("qwen3_5", "qwen3_5_moe", "qwen3_next")
    scale = d**-0.5
    ceil = measure_ceilings()
    print(f"{args.shape} on {ceil['gpu']}: {h} query / {hkv} KV heads of {d}, gated {gated}, {args.rows} row(s) "
          f"of a {args.chunk}-token chunk, pages of {args.page}, tiles {launch.current().prefill_attention_tiles.get(d)}; bf16 matmul "
          f"{ceil['matmul_tflops']:.0f} TFLOP/s")
    print("\n| prefix | kernel ms | TFLOP/s | % of matmul | gather + SDPA ms | TFLOP/s | speedup | max abs diff |")
    print("|---|---|---|---|---|---|---|---|")
    results = {"shape": args.shape, "chunk": args.chunk, "rows": args.rows, "page": args.page, **ceil, "runs": []}
    sweeps = {}
    for prefix in (int(x) for x in args.prefixes.split(",")):
        case = make_rows(args.rows, prefix, args.chunk, h, hkv, d, args.page, gated)
        q, k, v, tables, cu, lens, gate = case
        flops = 4 * h * d * args.rows * (args.chunk * prefix + args.chunk * (args.chunk + 1) // 2)

        def kernel(tiles=None):
            return prefill_attention_triton(q, k, v, tables, cu, lens, args.chunk, scale, gate, tiles)

        out = kernel()
        ms = _time_ms(kernel)
        row = {"prefix": prefix, "kernel_ms": ms, "kernel_tflops": flops / ms / 1e9}
        share = 100 * row["kernel_tflops"] / ceil["matmul_tflops"]
        line = f"| {prefix} | {ms:.3f} | {row['kernel_tflops']:.0f} | {share:.0f}% |"
        if args.no_torch:
            line += " | | | |"
        else:
            def reference():
                o = torch_path(q, k, v, tables, cu, lens, scale, args.page)
                return o if gate is None else o * torch.sigmoid(gate)

            ref = reference()
            ref_ms = _time_ms(reference)
            diff = (out.float() - ref.float()).abs().max().item()
            row.update(torch_ms=ref_ms, torch_tflops=flops / ref_ms / 1e9, max_abs_diff=diff)
            line += f" {ref_ms:.3f} | {row['torch_tflops']:.0f} | {ref_ms / ms:.2f}x | {diff:.3g} |"
            del ref
        print(line, flush=True)
        results["runs"].append(row)
        if args.sweep:
            timed = []
            for tiles in candidates(d):
                try:
                    ok = torch.allclose(kernel(tiles).float(), out.float(), atol=2e-2, rtol=2e-2)
                    t_ms = _time_ms(lambda: kernel(tiles), 5)
                except Exception as exc:  # noqa: BLE001 - a tile that does not compile is a row, not a stop
                    timed.append((float("inf"), f"| {tiles} | failed: {type(exc).__name__} | |"))
                    continue
                timed.append((t_ms, f"| {tiles} | {t_ms:.3f} | {flops / t_ms / 1e9:.0f} |{'' if ok else ' MISMATCH'}"))
            timed.sort(key=lambda x: x[0])
            sweeps[prefix] = [r for _, r in timed]
        del case, q, k, v, out
        torch.cuda.empty_cache()
    for prefix, lines in sweeps.items():
        print(f"\nprefix {prefix}\n| tiles | ms | TFLOP/s |\n|---|---|---|")
        print("\n".join(lines))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
