"""Whole models on the GPU: bf16 logits against the CPU fp32 reference, and greedy batch invariance
with CUDA-graph decoding."""
from __future__ import annotations

import pytest
import torch

from ninfer.engine.engine import LLMEngine
from ninfer.engine.engine_config import EngineConfig
from ninfer.engine.loader import load_checkpoint, load_model
from ninfer.engine.models.base import ForwardBatch
from ninfer.engine.request import Request
from ninfer.engine.sampling_params import SamplingParams
from support.tiny import save_tiny_llama, save_tiny_qwen3_5

pytestmark = pytest.mark.gpu
BUILDERS = {"llama": save_tiny_llama, "qwen3_5": save_tiny_qwen3_5,
            "qwen3_5_moe": lambda p: save_tiny_qwen3_5(p, moe=True)}


@pytest.fixture(scope="module", params=sorted(BUILDERS))
def ckpt(request, tmp_path_factory):
    return load_checkpoint(BUILDERS[request.param](tmp_path_factory.mktemp(request.param) / "ckpt"))


def prompt_logits(model, ids: list[int], device: str) -> torch.Tensor:
    cache = model.new_cache()
    with torch.inference_mode():
        hidden = model(torch.tensor(ids, device=device), ForwardBatch.single(len(ids), cache, device))
        return model.compute_logits(hidden).float().cpu()


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out - ref).norm() / ref.norm()).item()


def test_gpu_logits_match_cpu_reference(ckpt):
    """fp32 on the GPU equals the CPU reference up to the kernels' tf32 dots; bf16 on the GPU is
    as close to the fp32 reference as bf16 itself allows (the CPU path in bf16 is the yardstick)."""
    ids = ckpt.tokenizer.encode("Hello world! How are you today? The quick brown fox jumps over the lazy dog. " * 3)
    ref = prompt_logits(load_model(ckpt, "cpu", torch.float32), ids, "cpu")
    gpu32 = prompt_logits(load_model(ckpt, "cuda", torch.float32), ids, "cuda")
    assert rel(gpu32, ref) < 3e-2, rel(gpu32, ref)  # fla and Triton dots run in tf32
    cpu16 = prompt_logits(load_model(ckpt, "cpu", torch.bfloat16), ids, "cpu")
    gpu16 = prompt_logits(load_model(ckpt, "cuda", torch.bfloat16), ids, "cuda")
    assert rel(gpu16, ref) < max(3e-2, 2 * rel(cpu16, ref)), (rel(gpu16, ref), rel(cpu16, ref))
    assert (gpu32.argmax(-1) == ref.argmax(-1)).float().mean().item() > 0.95


def _greedy(model, tok, which: tuple[int, ...] = (0, 1, 2), dtype: torch.dtype = torch.float32) -> dict[int, list[int]]:
    """Greedy tokens of prompts ``which`` (of eight of different lengths) decoded together in
    CUDA graphs."""
    ids = tok.encode("Hello world! How are you today? The quick brown fox jumps over the lazy dog. " * 4)
    engine = LLMEngine(model, tok, EngineConfig(max_context=160, max_concurrency=8, prefill_chunk=64,
                                                kv_capacity=2048, page_size=16, device="cuda", dtype=dtype))
    assert engine.runner.graphs is not None
    reqs = {i: Request(f"r{i}", ids[i : i + 6 + 9 * i], SamplingParams(temperature=0.0, max_tokens=24,
                                                                        ignore_eos=True), max_total_tokens=160)
            for i in which}
    for r in reqs.values():
        engine.add_request(r)
    while engine.has_work:
        engine.step()
    assert engine.caches.idle()
    return {i: r.output_ids for i, r in reqs.items()}


def test_greedy_batch_invariance_with_cuda_graphs(ckpt, monkeypatch):
    """Eight requests decoded together in CUDA graphs give each one's tokens alone. For the MoE
    model the grouped-GEMV limit is lowered so batches of 3+ tokens take the sorted grouped GEMM,
    which must then be graph-capturable (no host sync)."""
    from ninfer.engine.layers import moe

    monkeypatch.setattr(moe, "DECODE_MAX_ASSIGNMENTS", 4)
    model = load_model(ckpt, "cuda", torch.float32)
    together = _greedy(model, ckpt.tokenizer, tuple(range(8)))
    alone = {}
    for i in range(8):
        alone.update(_greedy(model, ckpt.tokenizer, (i,)))
    assert together == alone


def test_inputs_advanced_in_the_graph_give_the_same_tokens(ckpt, monkeypatch, set_launch):
    """With the launch setting ``advance_in_graph`` the greedy steps that follow one another send no
    inputs unless a sequence takes a new page, and every request gets the tokens it gets without."""
    from ninfer.engine import cuda_graphs

    model = load_model(ckpt, "cuda", torch.float32)
    set_launch(advance_in_graph=False)
    plain = _greedy(model, ckpt.tokenizer, tuple(range(8)))
    set_launch(advance_in_graph=True)
    sends = []
    send = cuda_graphs.CudaGraphDecoder._send
    monkeypatch.setattr(cuda_graphs.CudaGraphDecoder, "_send", lambda *a, **k: sends.append(send(*a, **k)) or sends[-1])
    assert _greedy(model, ckpt.tokenizer, tuple(range(8))) == plain
    assert sends.count(False) >= 5 and sends.count(True) >= 5  # steps without a copy, and pages taken


@pytest.mark.parametrize("advance", [False, True])  # the launch setting advance_in_graph
@pytest.mark.parametrize("name", ["llama", "qwen3_5"])
def test_overlapped_graph_decode_keeps_every_output(name, advance, tmp_path_factory, monkeypatch, set_launch):
    """The overlap scenario on the GPU: graph replays launched from device-side tokens (pinned
    staging, bucket padding rows that come and go; ``advance``: positions, lengths and write rows
    advanced inside the graph, steps that send no inputs) give what eager decode without overlap
    gives."""
    from support.overlap import check_scenario, drive, scenario

    from ninfer.engine import cuda_graphs

    ckpt = load_checkpoint(BUILDERS[name](tmp_path_factory.mktemp(name) / "ckpt"))
    parts = (load_model(ckpt, "cuda", torch.float32), ckpt.tokenizer)
    specs, kw = scenario(parts, device="cuda", cuda_graphs=False)
    plain, _ = drive(parts, False, specs, **kw)
    set_launch(advance_in_graph=advance)
    sends = []
    send = cuda_graphs.CudaGraphDecoder._send
    monkeypatch.setattr(cuda_graphs.CudaGraphDecoder, "_send", lambda *a, **k: sends.append(send(*a, **k)) or sends[-1])
    overlapped, ahead = drive(parts, True, specs, **{**kw, "cuda_graphs": True})
    assert ahead >= 5
    assert overlapped == plain
    check_scenario(plain, specs)
    assert all(sends) if not advance else sends  # without the advance every step sends its inputs


@pytest.mark.parametrize("name", ["llama", "qwen3_5"])
def test_fused_prefill_attention_matches_torch_path(name, tmp_path_factory, monkeypatch):
    from support.kernel_cases import check_prefill_attention

    ckpt = load_checkpoint(BUILDERS[name](tmp_path_factory.mktemp(name) / "ckpt"))
    check_prefill_attention(monkeypatch, load_model(ckpt, "cuda", torch.float32), ckpt.tokenizer, "cuda",
                            page_size=16, tol=2e-2)  # the Triton kernel's dots in tf32


class _EveryShape(dict):
    """A tile table with an entry for every shape."""

    def get(self, key, default=None):
        return {"BLOCK_N": 4, "BLOCK_K": 256, "num_warps": 2}


def test_norm_in_projection_decodes_as_unfused(ckpt, monkeypatch, set_launch):
    """Decode with every pre-norm add + RMSNorm inside the next projection's GEMV (``norm_linear``,
    the attention / GDN input projections) gives the greedy tokens of the separate norm launch."""
    from ninfer.engine.layers import gemv_triton

    model = load_model(ckpt, "cuda", torch.float32)
    unfused = _greedy(model, ckpt.tokenizer)
    set_launch(norm_gemv_shape_tiles=_EveryShape())
    launch, calls = gemv_triton.norm_gemv_triton, []

    def counted(*args, **kwargs):
        calls.append(1)
        return launch(*args, **kwargs)

    monkeypatch.setattr(gemv_triton, "norm_gemv_triton", counted)
    assert _greedy(model, ckpt.tokenizer) == unfused
    assert calls  # the fused launch ran


@pytest.mark.parametrize("mode", ["first", "late"])  # release first, release after the wait
def test_programmatic_dependent_launch_decodes_as_without(ckpt, mode, set_launch):
    """The decode kernels launched with programmatic dependent launch, each waiting for the one
    before, give the greedy tokens of plain launches."""
    from ninfer.engine.layers import pdl

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs Hopper or newer")
    model = load_model(ckpt, "cuda", torch.float32)
    set_launch(pdl="off")
    plain = _greedy(model, ckpt.tokenizer)
    set_launch(pdl=mode)
    assert pdl.pdl_options(torch.empty(1, device="cuda"))["PDL"] == {"first": 1, "late": 2}[mode]
    assert _greedy(model, ckpt.tokenizer) == plain
