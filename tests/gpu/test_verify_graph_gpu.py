"""Verify steps of speculative decoding replayed from CUDA graphs (``cuda_graph_verify.py``) on the
GPU: the tokens are those of the same steps run eagerly."""
from __future__ import annotations

import pytest
import torch

from ninfer.engine.loader import load_checkpoint, load_model
from support.overlap import drive
from support.spec_drafts import AnswerDrafter, CutDrafter, use_drafter
from support.tiny import save_tiny_llama, save_tiny_qwen3_5

pytestmark = pytest.mark.gpu
BUILDERS = {"llama": save_tiny_llama, "qwen3_5": save_tiny_qwen3_5,
            "qwen3_5_moe": lambda p: save_tiny_qwen3_5(p, moe=True)}


@pytest.mark.parametrize("drafter", [AnswerDrafter, CutDrafter], ids=["full", "cut"])  # cut: rows of any width
@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_graph_replayed_verify_steps_give_the_eager_tokens(name, drafter, tmp_path_factory, monkeypatch,
                                                          set_launch):
    from ninfer.engine import cuda_graph_verify

    ckpt = load_checkpoint(BUILDERS[name](tmp_path_factory.mktemp(name) / "ckpt"))
    parts = (load_model(ckpt, "cuda", torch.float32), ckpt.tokenizer)
    specs = {0: {"max_tokens": 40}, 1: {"max_tokens": 12}, 2: {"max_tokens": 20}}
    arrivals = {2: (0, 3)}
    plain, _ = drive(parts, False, specs, arrivals=dict(arrivals), device="cuda")
    answers = {name: seen["tokens"] for name, seen in plain.items()}
    replays = []
    run = cuda_graph_verify.CudaGraphVerifier.run
    monkeypatch.setattr(cuda_graph_verify.CudaGraphVerifier, "run",
                        lambda self, plan: replays.append(len(plan)) or run(self, plan))

    def spec(in_graph: bool):
        set_launch(verify_in_graph=in_graph)
        engines = []
        seen, _ = drive(parts, False, specs, arrivals=dict(arrivals), device="cuda", spec="ngram", draft_tokens=3,
                        engine_out=engines,
                        prepare=lambda e: use_drafter(e, drafter(answers, 3, spoil=drafter is AnswerDrafter)))
        assert (engines[0].runner.verify_graphs is not None) == in_graph
        assert engines[0].counters.spec_accepted_tokens > 0  # the answers' drafts: most are taken
        return seen

    eager = spec(False)
    assert not replays
    graphed = spec(True)
    # each request's rows as the eager step runs them (the graph's padded to the full width, and
    # padding requests): the same tokens; those without drafts are not compared, as a projection
    # of more rows may take another kernel there
    assert graphed == eager
    assert {1, 2, 3} <= set(replays)
