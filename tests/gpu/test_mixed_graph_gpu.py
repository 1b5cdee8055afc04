"""Steps with prompt rows replayed from CUDA graphs in pieces (``cuda_graph_mixed.py``) on the
GPU: the tokens are those of the same steps run eagerly, for the dense and MoE hybrids (the MoE
block's kernels inside the pieces) and Llama, with and without decode launched ahead."""
from __future__ import annotations

import pytest
import torch

from ninfer.engine.loader import load_checkpoint, load_model
from support.overlap import drive
from support.tiny import save_tiny_llama, save_tiny_qwen3_5

pytestmark = pytest.mark.gpu
BUILDERS = {"llama": save_tiny_llama, "qwen3_5": save_tiny_qwen3_5,
            "qwen3_5_moe": lambda p: save_tiny_qwen3_5(p, moe=True)}
# prompts of 6 to 42 tokens in 32-token chunks, two arriving while the others decode
SPECS = {0: {"max_tokens": 24}, 1: {"max_tokens": 10}, 2: {"max_tokens": 16}, 3: {"max_tokens": 8},
         4: {"max_tokens": 12}}
ARRIVALS = {3: (0, 2), 4: (1, 5)}


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "ahead"])
@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_steps_with_prompt_rows_in_captured_pieces_give_the_eager_tokens(name, overlap, tmp_path_factory,
                                                                         monkeypatch, set_launch):
    from ninfer.engine import cuda_graph_mixed

    ckpt = load_checkpoint(BUILDERS[name](tmp_path_factory.mktemp(name) / "ckpt"))
    parts = (load_model(ckpt, "cuda", torch.float32), ckpt.tokenizer)
    runs: list[int] = []
    run = cuda_graph_mixed.MixedGraphs.run
    monkeypatch.setattr(cuda_graph_mixed.MixedGraphs, "run",
                        lambda self, ids, batch: runs.append(ids.shape[0]) or run(self, ids, batch))

    def serve(tokens: int):
        set_launch(mixed_graph_tokens=tokens, gdn_graph_tokens=0)  # every token mixer's core eager
        engines = []
        seen, _ = drive(parts, overlap, SPECS, arrivals=dict(ARRIVALS), device="cuda", engine_out=engines)
        mixed = engines[0].runner.mixed_graphs
        # (buckets up to the one that holds a whole step: the 32-token budget's)
        assert (sorted(t for _, t in mixed.captured) if mixed else []) == [b for b in (16, 32) if b <= tokens]
        return seen

    eager = serve(0)
    assert not runs
    graphed = serve(64)
    assert graphed == eager
    assert len(runs) >= 3 and any(n % 16 for n in runs)


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "ahead"])
@pytest.mark.parametrize("name", ["qwen3_5", "qwen3_5_moe"])
def test_steps_with_the_gdn_cores_inside_the_pieces_give_the_eager_tokens(name, overlap, tmp_path_factory,
                                                                          monkeypatch, set_launch):
    """``gdn_graph_tokens``: a step of one prompt row (kind ONE) or a few (FEW) after decode rows
    replays pieces that hold its Gated DeltaNet cores too (the rows read from ``GraphRows`` on
    the device, the decode kernel skipping the tokens past the real decode rows, fla-core's
    chunks past a row's end and rows of no tokens doing nothing): the tokens of the same steps
    run eagerly through the chunked rule."""
    from ninfer.engine import cuda_graph_mixed

    ckpt = load_checkpoint(BUILDERS[name](tmp_path_factory.mktemp(name) / "ckpt"))
    parts = (load_model(ckpt, "cuda", torch.float32), ckpt.tokenizer)
    kinds: list[str] = []
    run = cuda_graph_mixed.MixedGraphs.run
    monkeypatch.setattr(cuda_graph_mixed.MixedGraphs, "run", lambda self, ids, batch:
                        kinds.append(self._key(batch, ids.shape[0])[0]) or run(self, ids, batch))

    def serve(tokens: int):
        # every prompt row through the chunked rule, as the captured cores run it
        set_launch(mixed_graph_tokens=tokens, gdn_graph_tokens=tokens, gdn_graph_rows=4,
                   gdn_recurrent_prompt_tokens=0)
        engines = []
        seen, _ = drive(parts, overlap, SPECS, arrivals=dict(ARRIVALS), device="cuda", engine_out=engines)
        mixed = engines[0].runner.mixed_graphs
        rows = {k: sorted(t for kk, t in mixed.captured if kk == k) for k in ("one", "few")} if mixed else {}
        assert rows == ({"one": [16, 32], "few": [16, 32]} if tokens else {})
        return seen

    eager = serve(0)
    graphed = serve(64)
    assert graphed == eager
    assert kinds.count(cuda_graph_mixed.ONE) >= 3 and cuda_graph_mixed.FEW in kinds


def test_mtp_steps_in_captured_pieces_give_the_eager_tokens(tmp_path_factory, set_launch):
    """``--spec mtp`` takes no whole-step graph (the head reads every step's hidden states): its
    prompt steps and the steps that verify the head's drafts run in pieces, with the tokens of
    the same engine run eagerly."""
    from support.mtp_weights import add_mtp_weights

    ckpt = load_checkpoint(add_mtp_weights(save_tiny_qwen3_5(tmp_path_factory.mktemp("mtp") / "ckpt")))
    parts = (load_model(ckpt, "cuda", torch.float32, mtp=True), ckpt.tokenizer)

    def serve(tokens: int):
        set_launch(mixed_graph_tokens=tokens)
        engines = []
        seen, _ = drive(parts, False, SPECS, arrivals=dict(ARRIVALS), device="cuda", spec="mtp", draft_tokens=3,
                        engine_out=engines)
        mixed = engines[0].runner.mixed_graphs
        assert (mixed is not None and {k for k, _ in mixed.captured} == {"prompt", "rows"}) == bool(tokens)
        assert engines[0].counters.spec_rounds > 0
        return seen

    assert serve(64) == serve(0)


def test_memory_the_allocator_caches_for_nobody_counts_as_free():
    """What a load leaves cached (temporaries freed after the fused projections were made) is
    memory the caches and the pieces may plan with."""
    from ninfer.engine.memory import DEVICE_FRACTION, free_memory_bytes

    device = torch.device("cuda")
    before = free_memory_bytes(device)
    temp = torch.empty(1 << 30, dtype=torch.uint8, device=device)  # 1 GiB, then freed: cached by torch
    del temp
    assert torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device) >= 1 << 30  # cached
    after = free_memory_bytes(device)
    assert after >= before - DEVICE_FRACTION * (64 << 20)  # within the noise of other allocations, not 1 GiB short


def test_the_pieces_smaller_buckets_reuse_the_largests_memory(tmp_path_factory):
    """Buckets captured largest first into one pool on one stream: the smaller ones take the
    largest's freed intermediates, so the pool holds about what the largest needs, not their sum
    (a stream per bucket grew the 9B's pool to 1,046 MiB, three times what the plan counted)."""
    from ninfer.engine.cuda_graph_mixed import MixedGraphs

    ckpt = load_checkpoint(save_tiny_qwen3_5(tmp_path_factory.mktemp("pool") / "ckpt"))
    model = load_model(ckpt, "cuda", torch.float32)

    def pool_bytes(graphs: MixedGraphs) -> int:
        return sum(seg["total_size"] for seg in torch.cuda.memory._snapshot()["segments"]
                   if tuple(seg.get("segment_pool_id") or ()) == tuple(graphs.pool))

    largest = MixedGraphs(model, torch.device("cuda"), 1024)
    largest.buckets = largest.buckets[-1:]
    largest.capture()
    every = MixedGraphs(model, torch.device("cuda"), 1024)
    every.capture()
    assert len(every.captured) == len(every.buckets) > 5
    assert pool_bytes(every) <= 1.25 * pool_bytes(largest)
