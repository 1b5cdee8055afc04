"""The Triton GEMV (``gemv_triton``) against cuBLAS (``F.linear``) at a model's decode projections.

    python -m bench.gemv_tune --shape qwen3.5-27b [--rows 1,8] [--norm]

For each distinct decode projection ``[M, K] @ [N, K]^T`` of the shape (GDN fused input projection
and out_proj, attention fused qkv and o_proj, the dense MLP's fused gate/up and down, the LM head),
random bf16 weights in enough copies that one timed CUDA graph streams >= ``--graph-mb`` MB (so
reads come from HBM, not the 50 MB L2); cuBLAS and each tile choice of the GEMV are timed inside
the graph (GPU time, no Python launch cost) and checked against cuBLAS's output. Prints one table
per shape, then ``gemv_shape_tiles`` entries for the measured shapes in the form of the tuned
config files (``engine/tuned/*.json``, ``--tuned-config``): tiles where the GEMV won, null where
cuBLAS did.

``--norm``: the projections that follow a pre-norm (GDN input projection, attention qkv, dense
MLP gate/up) as ``norm_linear`` runs them: the GEMV with the add + RMSNorm in front
(``norm_gemv_triton``) per tile choice, against the add + norm launch followed by the projection as
``decode_linear`` runs it now; prints ``norm_gemv_shape_tiles`` entries where the one launch won.

``--int4``: the same projections with 4-bit weights in groups of 128 (scales and offsets fp16) as
``int4_gemv_triton`` runs them per tile choice (prompt rows: ``int4_dequantize_triton`` then
cuBLAS), its tensor-core form (``int4_gemv_dot_triton``, best tiles), the split-K form
(``int4_gemv_split_triton``; ``--forms`` picks the forms swept) and torch's tinygemm, against bf16
cuBLAS on the dense weight; TB/s counts the packed
bytes, the scales and the offsets.
"""
from __future__ import annotations

import argparse
import itertools
import json
import math

import torch
import torch.nn.functional as F

from ninfer.engine.layers import gemv_triton as gt
from ninfer.engine.layers.fused_linear import decode_linear, gemv_tiles
from ninfer.engine.layers.norm_triton import add_rms_norm_triton
from ninfer.engine.layers.quant_gemv_triton import (SPLIT_MAX_ROWS, int4_dequantize_triton, int4_gemv_dot_triton,
                                                    int4_gemv_split_triton, int4_gemv_triton)

from .gpu_env import graph_time_us
from .shapes import shape_config

# (BLOCK_K, num_warps) pairs whose warps all split K (gemv_triton caps num_warps otherwise)
_K_WARPS = [(256, 1), (512, 1), (512, 2), (1024, 2), (1024, 4), (2048, 4), (2048, 8)]


# projections whose input is the pre-norm block's normalised residual stream
NORMED = ("gdn in_proj (qkv|z|b|a)", "attn qkv", "mlp gate_up")


def projections(cfg) -> list[tuple[str, int, int]]:
    """``(name, N, K)`` of each distinct decode projection of the model."""
    hid = cfg.hidden_size
    out = []
    if "linear_attention" in cfg.layer_types:
        key_dim = cfg.linear_num_key_heads * cfg.linear_key_head_dim
        value_dim = cfg.linear_num_value_heads * cfg.linear_value_head_dim
        conv_dim = 2 * key_dim + value_dim
        out.append(("gdn in_proj (qkv|z|b|a)", conv_dim + value_dim + 2 * cfg.linear_num_value_heads, hid))
        out.append(("gdn out_proj", hid, value_dim))
    if "full_attention" in cfg.layer_types:
        gated = cfg.family in ("qwen3_5", "qwen3_5_moe", "qwen3_next")
        q_out = cfg.num_attention_heads * cfg.head_dim * (2 if gated else 1)
        out.append(("attn qkv", q_out + 2 * cfg.num_key_value_heads * cfg.head_dim, hid))
        out.append(("attn o_proj", hid, cfg.num_attention_heads * cfg.head_dim))
    if not cfg.is_moe:
        out.append(("mlp gate_up", 2 * cfg.intermediate_size, hid))
        out.append(("mlp down", hid, cfg.intermediate_size))
    out.append(("lm_head", cfg.vocab_size, hid))
    names: dict[tuple[int, int], list[str]] = {}
    for name, n, k in out:
        names.setdefault((n, k), []).append(name)
    return [(" = ".join(v), n, k) for (n, k), v in names.items()]


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def candidates(block_ns=(1, 2, 4, 8)) -> list[dict]:
    return [{"BLOCK_N": n, "BLOCK_K": k, "num_warps": w} for n, (k, w) in itertools.product(block_ns, _K_WARPS)]


def _sweep(m: int, k: int, ref: torch.Tensor, run, copies: int, options: list[dict]) -> tuple:
    """``(best (tiles, us) or None, failures)`` of ``run(tiles, copy)`` over the tile options."""
    best, bad, seen = None, [], set()
    for tiles in options:
        eff = gt.gemv_config(m, k, tiles)
        key = (eff["BLOCK_N"], eff["BLOCK_K"], eff["num_warps"])
        if key in seen:  # the same launch after clipping BLOCK_K to K / capping the warps
            continue
        seen.add(key)
        try:
            ok = _rel_err(run(tiles, 0), ref) < 1e-2
            us = graph_time_us(lambda c: run(tiles, c), copies)
        except Exception as exc:  # noqa: BLE001 - a tile that does not compile is skipped, not a stop
            bad.append(f"{tiles}: {type(exc).__name__}")
            continue
        if not ok:
            bad.append(f"{tiles}: MISMATCH")
        elif best is None or us < best[1]:
            best = (tiles, us)
    return best, bad


def tune(n: int, k: int, rows: list[int], graph_mb: float, dev: str = "cuda",
         dt: torch.dtype = torch.bfloat16, norm: bool = False) -> list[dict]:
    nbytes = n * k * torch.finfo(dt).bits // 8
    copies = max(1, math.ceil(graph_mb * 1e6 / nbytes))
    weights = [torch.randn(n, k, dtype=dt, device=dev) * 0.02 for _ in range(copies)]
    results = []
    for m in rows:
        x = torch.randn(m, k, dtype=dt, device=dev)
        if norm:
            results.append(_tune_norm(x, weights))
            continue
        ref = F.linear(x, weights[0])
        cublas = graph_time_us(lambda c: F.linear(x, weights[c]), copies)
        best, bad = _sweep(m, k, ref, lambda tiles, c: gt.gemv_triton(x, weights[c], None, tiles), copies,
                           candidates())
        rule = gemv_tiles(m, n, k)
        rule_us = graph_time_us(lambda c: gt.gemv_triton(x, weights[c], None, rule), copies) if rule else None
        results.append({"m": m, "n": n, "k": k, "mb": nbytes / 1e6, "cublas_us": cublas, "best": best,
                        "rule": rule, "rule_us": rule_us, "bad": bad})
    weights.clear()  # free this shape's copies before the next shape's
    torch.cuda.empty_cache()
    return results


def _tune_norm(x: torch.Tensor, weights: list[torch.Tensor]) -> dict:
    """``norm_gemv_triton`` per tile choice against add + RMSNorm then ``decode_linear``."""
    m, k = x.shape
    n, copies = weights[0].shape[0], len(weights)
    residual = torch.randn_like(x) * 4
    nw = torch.randn(k, dtype=x.dtype, device=x.device) * 0.3

    def unfused(c: int) -> torch.Tensor:
        hidden, _ = add_rms_norm_triton(x, residual, nw, 1e-6, True)
        return decode_linear(hidden, weights[c])

    ref = unfused(0)
    now = graph_time_us(unfused, copies)
    best, bad = _sweep(m, k, ref, lambda tiles, c: gt.norm_gemv_triton(x, residual, nw, 1e-6, True, weights[c],
                                                                       tiles)[0],
                       copies, candidates((2, 4, 8, 16)))  # the input rows are re-read per program: taller tiles
    return {"m": m, "n": n, "k": k, "mb": n * k * x.element_size() / 1e6, "cublas_us": now, "best": best,
            "rule": None, "rule_us": None, "bad": bad}


_INT4_TILES = [{"BLOCK_N": n, "BLOCK_K": k, "num_warps": w}
               for n, k, w in itertools.product((2, 4, 8, 16, 32), (64, 128), (1, 2, 4, 8))]


_DOT_TILES = [{"BLOCK_N": n, "BLOCK_K": k, "num_warps": w}
              for n, k, w in itertools.product((16, 32, 64, 128), (64, 128), (2, 4, 8))]
_SPLIT_TILES = [{"BLOCK_N": n, "BLOCK_K": k, "num_warps": w, "SPLIT": sp}
                for n, k, w, sp in itertools.product((32, 64, 128), (64, 128), (4, 8), (None, 1, 2, 4, 8))]


def tinygemm_pack(q0: torch.Tensor, s0: torch.Tensor, o0: torch.Tensor, inner_k_tiles: int = 8):
    """torch's int4 CUDA matmul (``_weight_int4pack_mm``, tinygemm) operands for ``pack_int4``
    bytes: the values repacked even column high, the scales and zeros ``[K / G, N, 2]`` bf16 with
    ``w = (q - 8) * scale + zero``."""
    q = torch.stack([q0 & 15, q0 >> 4], -1).view(q0.shape[0], -1)
    packed = torch.ops.aten._convert_weight_to_int4pack((q[:, 0::2] << 4 | q[:, 1::2]).contiguous(), inner_k_tiles)
    sz = torch.stack([s0, o0 + 8 * s0], -1).transpose(0, 1).contiguous().to(torch.bfloat16)
    return packed, sz


def _sweep_tiles(gemv, tile_list: list[dict], label: str, x: torch.Tensor, packs: list, group: int, copies: int,
                 ref: torch.Tensor, bad: list[str]) -> tuple[dict, float] | None:
    """``gemv`` at each tile choice: the fastest ``(tiles, us)`` of those that compile and match
    ``ref``; the others noted in ``bad`` under ``label``."""
    best = None
    for tiles in tile_list:
        try:
            out = gemv(x, *packs[0], group, tiles)
            us = graph_time_us(lambda c: gemv(x, *packs[c], group, tiles), copies)
        except Exception as exc:  # noqa: BLE001 - a tile that does not compile is skipped
            bad.append(f"{label}{tiles}: {type(exc).__name__}")
            continue
        if _rel_err(out, ref) > 2e-2:
            bad.append(f"{label}{tiles}: MISMATCH")
        elif best is None or us < best[1]:
            best = (tiles, us)
    return best


INT4_FORMS = ("split", "dot", "gemv")


def tune_int4(n: int, k: int, rows: list[int], graph_mb: float, group: int = 128,
              forms: tuple[str, ...] = INT4_FORMS) -> list[dict]:
    """``int4_gemv_triton`` per tile choice (decode rows), the weight dequantized then cuBLAS (prompt
rows) and torch's tinygemm, against bf16 cuBLAS, at
    ``[M, K] @ [N, K]^T``."""
    nbytes = n * k // 2 + 2 * (n * k // group) * 2
    copies = max(1, math.ceil(graph_mb * 1e6 / nbytes))
    packs = [(torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device="cuda"),
              torch.rand(n, k // group, dtype=torch.float16, device="cuda") * 0.01,
              torch.randn(n, k // group, dtype=torch.float16, device="cuda") * 0.01) for _ in range(copies)]
    dense_copies = max(1, math.ceil(graph_mb * 1e6 / (2 * n * k)))
    dense = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02 for _ in range(dense_copies)]
    q0, s0, o0 = packs[0]
    lo, hi = (q0 & 15).float(), (q0 >> 4).float()
    cols = torch.stack([lo, hi], -1).view(n, k)
    w0 = (cols.view(n, k // group, group) * s0.float()[..., None] + o0.float()[..., None]).view(n, k)
    tiny = [tinygemm_pack(*p) for p in packs]
    results = []
    for m in rows:
        x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
        ref = x.float() @ w0.T
        cublas = graph_time_us(lambda c: F.linear(x, dense[c]), dense_copies)
        best, bad = None, []
        tiny_err = _rel_err(torch.ops.aten._weight_int4pack_mm(x, tiny[0][0], group, tiny[0][1]), ref)
        tiny_us = graph_time_us(lambda c: torch.ops.aten._weight_int4pack_mm(x, tiny[c][0], group, tiny[c][1]), copies)
        bad.append(f"tinygemm {tiny_us:.1f} us ({nbytes / 1e6 / tiny_us:.2f} TB/s), rel err {tiny_err:.4f}")
        if m > 16:  # prompt rows: the weight dequantized into a buffer, then cuBLAS
            scratch = torch.empty(n, k, dtype=torch.bfloat16, device="cuda")

            def dequantized(c: int) -> torch.Tensor:
                return F.linear(x, int4_dequantize_triton(*packs[c], group, scratch))

            err = _rel_err(dequantized(0), ref)
            us = graph_time_us(dequantized, copies)
            bad.append(f"dequantize + cuBLAS {us:.1f} us ({cublas / us:.2f}x bf16), rel err {err:.4f}")
            del scratch

        def best_and_default(gemv, tile_list: list[dict], label: str, name: str) -> None:
            """``gemv``'s best tiles and its default ones, noted in ``bad`` under ``name``."""
            best_tiles = _sweep_tiles(gemv, tile_list, label, x, packs, group, copies, ref, bad)
            default_us = graph_time_us(lambda c: gemv(x, *packs[c], group), copies)
            if best_tiles is not None:
                tiles, us = best_tiles
                bad.append(f"{name} best {tiles} {us:.1f} us ({nbytes / 1e6 / us:.2f} TB/s, {cublas / us:.2f}x "
                           f"bf16); default tiles {default_us:.1f} us ({nbytes / 1e6 / default_us:.2f} TB/s)")

        if m <= SPLIT_MAX_ROWS and "split" in forms:  # the split-K form for decode and verify rows
            best_and_default(int4_gemv_split_triton, _SPLIT_TILES, "split ", "split-K GEMV")
        if m <= 16 and "dot" in forms:  # the GEMV's tensor-core form (int4_gemv_dot_triton), its best tiles
            dot = _sweep_tiles(int4_gemv_dot_triton, _DOT_TILES, "dot ", x, packs, group, copies, ref, bad)
            if dot is not None:
                bad.append(f"tensor-core GEMV {_tile_name(dot[0])} {dot[1]:.1f} us ({nbytes / 1e6 / dot[1]:.2f} TB/s, "
                           f"{cublas / dot[1]:.2f}x bf16)")
        if m <= 16 and "gemv" in forms:
            best = _sweep_tiles(int4_gemv_triton, _INT4_TILES, "", x, packs, group, copies, ref, bad)
        results.append({"m": m, "n": n, "k": k, "mb": nbytes / 1e6, "cublas_us": cublas, "best": best,
                        "rule": {}, "rule_us": tiny_us, "bad": bad, "cublas_mb": 2 * n * k / 1e6})
    packs.clear()
    dense.clear()
    tiny.clear()
    torch.cuda.empty_cache()
    return results


def _tile_name(t: dict) -> str:
    name = f"{t['BLOCK_N']}x{t['BLOCK_K']}/{t['num_warps']}w"
    if "BLOCK_M" in t:
        name = f"{t['BLOCK_M']}x" + name + f" split {t['SPLIT_K']} stages {t['num_stages']}"
    return name


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gemv_tune")
    p.add_argument("--shape", default="qwen3.5-27b")
    p.add_argument("--rows", default="1,8", help="input rows M (decode batch sizes)")
    p.add_argument("--graph-mb", type=float, default=256.0, help="weight MB streamed per timed graph (> L2)")
    p.add_argument("--norm", action="store_true", help="the pre-norm projections with the add + norm in front")
    p.add_argument("--int4", action="store_true", help="4-bit weights (int4_gemv_triton) against bf16 cuBLAS")
    p.add_argument("--forms", default=",".join(INT4_FORMS),
                   help="--int4: the GEMV forms swept (split, dot, gemv), beside tinygemm")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU")
    cfg = shape_config(args.shape)
    rows = [int(r) for r in args.rows.split(",")]
    forms = tuple(f for f in args.forms.split(",") if f)
    if any(f not in INT4_FORMS for f in forms):
        p.error(f"--forms: each of {', '.join(INT4_FORMS)}")
    print(f"{args.shape} on {torch.cuda.get_device_name()}: bf16, GPU time per call inside CUDA graphs; "
          "TB/s = weight bytes / time; tiles = BLOCK_N x BLOCK_K / num_warps; "
          "'rule us' = the tiles decode_linear runs now (fused_linear.gemv_tiles)"
          + ("; --int4: MB and TB/s count the 4-bit weight; 'rule us' = torch's tinygemm (_weight_int4pack_mm)" if args.int4 else "")
          + ("; --norm: the 'cuBLAS' columns are add + RMSNorm then the projection as decode_linear runs it"
             if args.norm else ""))
    lines = ["| projection | N | K | M | MB | cuBLAS us | cuBLAS TB/s | best Triton tiles | us | TB/s | speedup "
             "| rule us |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    table = {}
    for name, n, k in projections(cfg):
        if args.norm and not any(part in NORMED for part in name.split(" = ")):
            continue
        runs = tune_int4(n, k, rows, args.graph_mb, forms=forms) if args.int4 else \
            tune(n, k, rows, args.graph_mb, norm=args.norm)
        for r in runs:
            mb, cu = r["mb"], r["cublas_us"]
            rule = "-" if args.norm else "cuBLAS" if r["rule"] is None else f"{r['rule_us']:.1f}"
            if args.int4:  # TB/s over the packed bytes; the speedup is against bf16 cuBLAS
                rule = f"{r['rule_us']:.1f}"
            for b in r["bad"]:
                print(f"  {name} M={r['m']}: {b}")
            if r["best"] is None:
                lines.append(f"| {name} | {n} | {k} | {r['m']} | {mb:.1f} | {cu:.1f} | {r.get('cublas_mb', mb) / cu:.2f} | none | | | "
                             f"| {rule} |")
                table[(r["m"], n, k)] = None
                continue
            tiles, us = r["best"]
            lines.append(f"| {name} | {n} | {k} | {r['m']} | {mb:.1f} | {cu:.1f} | {r.get('cublas_mb', mb) / cu:.2f} | "
                         f"{_tile_name(tiles)} | {us:.1f} | {mb / us:.2f} | "
                         f"{cu / us:.2f} | {rule} |")
            table[(r["m"], n, k)] = tiles if us < cu else None
            print(lines[-1], flush=True)
    print("\n" + "\n".join(lines))
    name = "norm_gemv_shape_tiles" if args.norm else "gemv_shape_tiles"
    entries = {",".join(map(str, key)): tiles for key, tiles in table.items() if tiles is not None or not args.norm}
    print(f"\n# {name} entries for a tuned config file (engine/tuned/*.json, --tuned-config):")
    print(json.dumps({name: entries}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
