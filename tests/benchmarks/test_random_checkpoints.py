"""The random checkpoints the GPU benchmarks serve: a 4-bit one written tensor by tensor as
gptqmodel saves it (the 27B's in 15 GB of disk where bf16 takes 54) has the names and shapes
of the bf16 one transformers saves, and loads held quantized."""
from __future__ import annotations

import json

import torch
from safetensors import safe_open

from bench.shapes import GPTQ_MODULES, random_checkpoint, random_gptq_checkpoint
from ninfer.engine.layers.linear import Int4CpuMethod, Linear
from ninfer.engine.loader import load_checkpoint, load_model
from ninfer.engine.models.base import ForwardBatch

SHAPE = {
    "model_type": "qwen3_5_text", "vocab_size": 512, "hidden_size": 256, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "intermediate_size": 512,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 64,
    "linear_value_head_dim": 64, "full_attention_interval": 4,
}


def tensors(path) -> dict[str, tuple[int, ...]]:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), "pt") as fh:
            out.update({k: tuple(fh.get_slice(k).get_shape()) for k in fh.keys()})
    return out


def test_gptq_random_checkpoint_has_the_bf16_names_and_loads_held_quantized(tmp_path, monkeypatch):
    import bench.shapes

    monkeypatch.setattr(bench.shapes, "SHARD_BYTES", 1 << 20)  # several shards and an index, as the 27B's
    dense = tensors(random_checkpoint(SHAPE, tmp_path / "bf16"))
    path = random_gptq_checkpoint(SHAPE, tmp_path / "gptq")
    held = tensors(path)
    assert len(list(path.glob("*.safetensors"))) > 1
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(index) == set(held)
    quantized = {n.removesuffix(".weight") for n in dense if n.rsplit(".", 2)[-2] in GPTQ_MODULES}
    assert len(quantized) == 3 * 4 + 3 * 3 + 4  # the MLPs', the GDN layers' three, the attention's four
    want = {n: s for n, s in dense.items() if n.removesuffix(".weight") not in quantized}
    for module in quantized:
        out, cols = dense[f"{module}.weight"]
        want.update({f"{module}.qweight": (cols // 8, out), f"{module}.qzeros": (cols // 128, out // 8),
                     f"{module}.scales": (cols // 128, out), f"{module}.g_idx": (cols,)})
    assert held == want
    assert random_gptq_checkpoint(SHAPE, tmp_path / "gptq") == path  # found again, not rewritten

    model = load_model(load_checkpoint(path), "cpu", torch.float32)
    linears = {n: m for n, m in model.named_modules() if isinstance(m, Linear)}
    assert {n for n, m in linears.items() if isinstance(m.method, Int4CpuMethod)} == \
        {n for n in linears if n.rsplit(".", 1)[-1] in GPTQ_MODULES}
    ids = list(range(3, 40))
    with torch.no_grad():
        logits = model.compute_logits(model(torch.tensor(ids), ForwardBatch.single(len(ids), model.new_cache())))
    assert torch.isfinite(logits).all() and logits.std() > 0
