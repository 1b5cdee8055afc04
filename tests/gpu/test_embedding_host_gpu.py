"""``--embedding-host``: the token embedding's table in pinned host memory, its rows read in place
by the GPU (``layers/embedding_triton.py``), inside the captured decode graphs too."""
from __future__ import annotations

import pytest
import torch

from ninfer.engine.engine import LLMEngine
from ninfer.engine.engine_config import EngineConfig
from ninfer.engine.loader import load_checkpoint, load_model
from ninfer.engine.request import Request
from ninfer.engine.sampling_params import SamplingParams
from support.tiny import save_tiny_qwen3_5

pytestmark = pytest.mark.gpu


def test_host_table_rows_equal_a_device_lookup():
    from ninfer.engine.layers.embedding_triton import host_embedding_triton

    table = torch.randn(5000, 1000, dtype=torch.bfloat16).pin_memory()
    ids = torch.tensor([[0, 4999, 17], [17, 3, 2500]], device="cuda")
    got = host_embedding_triton(table, ids)
    assert got.device.type == "cuda" and got.shape == (2, 3, 1000)
    assert torch.equal(got, torch.nn.functional.embedding(ids, table.cuda()))


def _greedy(model, tok) -> list[list[int]]:
    engine = LLMEngine(model, tok, EngineConfig(max_context=160, max_concurrency=4, prefill_chunk=64,
                                                kv_capacity=1024, page_size=16, device="cuda",
                                                dtype=torch.bfloat16))
    assert engine.runner.graphs is not None
    ids = tok.encode("The quick brown fox jumps over the lazy dog. " * 4)
    reqs = [Request(f"r{i}", ids[i : i + 10 + 7 * i], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
                    max_total_tokens=160) for i in range(3)]
    for r in reqs:
        engine.add_request(r)
    while engine.has_work:
        engine.step()
    return [r.output_ids for r in reqs]


def test_a_host_embedding_decodes_as_the_device_table(tmp_path):
    """The untied tiny Qwen3.5 with its table on the host: the table is pinned host memory, the
    device holds none of it, and three requests decoded in CUDA graphs get the tokens of the
    table on the device."""
    ckpt = load_checkpoint(save_tiny_qwen3_5(tmp_path / "q"))
    assert not ckpt.config.tie_word_embeddings
    on_device = load_model(ckpt, "cuda", torch.bfloat16)
    on_host = load_model(ckpt, "cuda", torch.bfloat16, embedding_host=True)
    table = on_host.model.embed_tokens.weight
    assert table.device.type == "cpu" and table.is_pinned()
    assert torch.equal(table, on_device.model.embed_tokens.weight.cpu())
    assert _greedy(on_host, ckpt.tokenizer) == _greedy(on_device, ckpt.tokenizer)
