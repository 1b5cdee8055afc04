"""Bytes a GGUF K-quant mix takes held by the engine: each type's bytes a weight as the linear
methods hold it (read from the modules' buffers), and a model's projections and LM head in a
Q4_K_M-like mix, kept quantized against dense.

    python -m bench.gguf_kept_bytes [--shape qwen3.5-27b] [--base Q4_K]

The mix: Q6_K for the LM head, ``attn_v`` and ``ffn_down`` in the first half of the layers,
``--base`` (Q4_K: Q4_K_M-like, Q5_K: Q5_K_M-like) for the other projections (the GDN's too). On
the GPU every projection and the head are held by ``TritonGroupMethod`` (dense: bf16); on the CPU
the projections by ``Int4CpuMethod`` and the head in fp16 (``Fp16CpuMethod``, ``layers/embedding.py``;
dense: fp32). Runs on the CPU; nothing is timed.
"""
from __future__ import annotations

import argparse

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q

from ninfer.engine.layers.linear import Int4CpuMethod, TritonGroupMethod
from ninfer.engine.loader.gguf_quant import _SUPER_BLOCK_READERS

from .shapes import shape_config

ROWS, COLS = 64, 1024  # the matrix each type's bytes a weight are read from


def held_per_weight(qtype: Q) -> tuple[float, float]:
    """(GPU, CPU) bytes a weight of a ``qtype`` matrix as the methods hold it."""
    block, nbytes = GGML_QUANT_SIZES[qtype]
    raw = np.random.default_rng(0).integers(0, 256, (ROWS * COLS // block, nbytes), dtype=np.uint8)
    scales = slice(208, 210) if qtype == Q.Q6_K else slice(0, 4)  # finite fp16 d (and dmin)
    raw[:, scales] = np.full((len(raw), (scales.stop - scales.start) // 2), 0.01, np.float16).view(np.uint8)
    w = _SUPER_BLOCK_READERS[qtype](raw.reshape(ROWS, -1), ROWS, COLS)

    def size(m: torch.nn.Module) -> float:
        return sum(b.numel() * b.element_size() for b in m.buffers() if b is not None) / (ROWS * COLS)

    return size(TritonGroupMethod.from_groups(w, torch.device("cpu"))), size(Int4CpuMethod.from_groups(w))


def matrices(cfg, base: Q) -> list[tuple[str, int, Q]]:
    """``(name, weights, type)`` of the model's projections and LM head in the mix."""
    hid, layers = cfg.hidden_size, cfg.num_hidden_layers
    out = [("lm_head", cfg.vocab_size * hid, Q.Q6_K)]
    for i, kind in enumerate(cfg.layer_types):
        if kind == "linear_attention":
            kd = cfg.linear_num_key_heads * cfg.linear_key_head_dim
            vd = cfg.linear_num_value_heads * cfg.linear_value_head_dim
            out += [("gdn in_proj_qkv", (2 * kd + vd) * hid, base), ("gdn in_proj_z", vd * hid, base),
                    ("gdn in_proj_b/a", 2 * cfg.linear_num_value_heads * hid, base), ("gdn out_proj", hid * vd, base)]
        else:
            q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
            out += [("attn q (gated)", 2 * q * hid, base), ("attn k", kv * hid, base), ("attn v", kv * hid, Q.Q6_K),
                    ("attn o", hid * q, base)]
        inter = cfg.intermediate_size
        out += [("mlp gate/up", 2 * inter * hid, base),
                ("mlp down", hid * inter, Q.Q6_K if i < (layers + 1) // 2 else base)]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gguf_kept_bytes")
    p.add_argument("--shape", default="qwen3.5-27b")
    p.add_argument("--base", default="Q4_K", choices=["Q4_K", "Q5_K"])
    args = p.parse_args(argv)
    base = Q[args.base]
    per = {t: held_per_weight(t) for t in (Q.Q4_K, Q.Q5_K, Q.Q6_K)}
    print("| type | file bytes/weight | GPU held | CPU held |\n|---|---|---|---|")
    for t, (gpu, cpu) in per.items():
        block, nbytes = GGML_QUANT_SIZES[t]
        print(f"| {t.name} | {nbytes / block:.4f} | {gpu:.4f} | {cpu:.4f} |")
    mats = matrices(shape_config(args.shape), base)
    weights = {t: sum(n for _, n, q in mats if q == t) for t in per}
    head = next(n for name, n, _ in mats if name == "lm_head")
    gib = 2**30
    file = sum(n * GGML_QUANT_SIZES[t][1] / GGML_QUANT_SIZES[t][0] for t, n in weights.items())
    gpu_kept = sum(n * per[t][0] for t, n in weights.items())
    # before Q5_K / Q6_K were kept: those dequantized at load
    gpu_before = sum(n * (per[t][0] if t == Q.Q4_K else 2) for t, n in weights.items())
    cpu_kept = sum(n * per[t][1] for t, n in weights.items()) - head * per[Q.Q6_K][1] + head * 2
    cpu_before = sum(n * (per[t][1] if t == Q.Q4_K else 4) for t, n in weights.items())
    total = sum(weights.values())
    print(f"\n{args.shape}, {base.name}_M-like mix: {total / 1e9:.2f} G weights in projections and LM head, "
          f"{weights[Q.Q6_K] / 1e9:.2f} G of them Q6_K; in the file {file / gib:.2f} GiB")
    print("| held | kept quantized | Q5_K / Q6_K dense (before) | all dense |\n|---|---|---|---|")
    print(f"| GPU (dense bf16) | {gpu_kept / gib:.2f} GiB | {gpu_before / gib:.2f} GiB | {2 * total / gib:.2f} GiB |")
    print(f"| CPU (dense fp32, head fp16) | {cpu_kept / gib:.2f} GiB | {cpu_before / gib:.2f} GiB | "
          f"{4 * total / gib:.2f} GiB |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
