"""``bench.gguf_kept_bytes``: each K-quant's bytes a weight as the methods hold it, and a shape's
mix kept against dense."""
from __future__ import annotations

from gguf import GGMLQuantizationType as Q

from bench.gguf_kept_bytes import held_per_weight, main


def test_bytes_a_weight_as_held():
    # GPU: packed nibbles or int8, fp16 scales (and offsets); CPU: int4 parts, bf16 scale/zero per 32
    assert held_per_weight(Q.Q4_K) == (0.5 + 2 * 2 / 32, 0.5 + 4 / 32)
    assert held_per_weight(Q.Q5_K) == (1 + 2 * 2 / 32, 2 * (0.5 + 4 / 32))
    assert held_per_weight(Q.Q6_K) == (1 + 2 / 16, 4 * (0.5 + 4 / 32))


def test_prints_the_mix(capsys):
    assert main(["--shape", "qwen3.5-0.8b"]) == 0
    out = capsys.readouterr().out
    assert "Q4_K_M-like mix" in out and "| GPU (dense bf16) |" in out and "| CPU (dense fp32, head fp16) |" in out
