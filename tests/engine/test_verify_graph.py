"""Verify steps through the captured-graph verifier (``cuda_graph_verify.py``) on a CPU: each
graph is stood in for by the step's forward run again over the verifier's static inputs at every
replay, so the inputs it writes (token ids, positions, KV write rows, slots, lengths, per-request
block tables widened to rows, the verify kernel's row bounds) and the commit of the states from the
shared verify buffers are checked against steps without it. Greedy outputs with drafts from the
answers (a token spoiled at a moving place, so every accepted length is seen; or cut to lengths
that move, rows without a draft among them) are those without drafts; the steps that carry
prompt rows run eagerly beside them."""
from __future__ import annotations

import pytest
import torch

from ninfer.engine.cuda_graph_verify import CudaGraphVerifier
from ninfer.engine.loader import load_checkpoint, load_model
from support.overlap import drive
from support.spec_drafts import AnswerDrafter, CutDrafter, use_drafter
from support.tiny import save_tiny_qwen3_5


class _Replay:
    """A captured graph's stand-in: ``replay`` runs the bucket's forward into the same logits."""

    def __init__(self, verifier: CudaGraphVerifier, b: int, replays: list[int]) -> None:
        self.verifier, self.b, self.replays = verifier, b, replays
        self.logits = verifier._forward(b).clone()

    def replay(self) -> None:
        self.replays.append(self.b)
        with torch.inference_mode():
            self.logits.copy_(self.verifier._forward(self.b))


def install(engine, width: int, replays: list[int]) -> None:
    runner = engine.runner
    buckets = [1, 2, 4, engine.config.max_concurrency]
    verifier = CudaGraphVerifier(runner.model, runner.caches, buckets, width, engine.config.max_context,
                                 runner.device, runner.vocab, runner.verify_buffers(buckets[-1] * width))
    with torch.inference_mode():
        for b in buckets:
            stand_in = _Replay(verifier, b, replays)
            verifier.graphs[b] = (stand_in, stand_in.logits)
    runner.verify_graphs = verifier


@pytest.fixture(scope="module", params=[False, True], ids=["dense", "moe"])
def parts(request, tmp_path_factory):
    ckpt = load_checkpoint(save_tiny_qwen3_5(tmp_path_factory.mktemp("ckpt") / "ckpt", moe=request.param))
    return load_model(ckpt, "cpu", torch.float32), ckpt.tokenizer


@pytest.mark.parametrize("drafter", [AnswerDrafter, CutDrafter], ids=["full", "cut"])
def test_verify_steps_from_the_static_inputs_give_the_tokens_of_one_token_steps(parts, drafter):
    specs = {0: {"max_tokens": 40}, 1: {"max_tokens": 12}, 2: {"max_tokens": 20}}
    arrivals = {2: (0, 3)}  # its prompt arrives while the others verify: an eager step between
    plain, _ = drive(parts, False, specs, arrivals=dict(arrivals))
    answers = {name: seen["tokens"] for name, seen in plain.items()}
    replays: list[int] = []
    engines = []

    def prepare(engine):
        use_drafter(engine, drafter(answers, 3, spoil=drafter is AnswerDrafter))
        install(engine, 4, replays)

    fast, _ = drive(parts, False, specs, arrivals=dict(arrivals), spec="ngram", draft_tokens=3,
                    engine_out=engines, prepare=prepare)
    assert fast == plain
    c = engines[0].counters
    assert 0 < c.spec_accepted_tokens <= c.spec_draft_tokens
    assert {1, 2, 4} <= set(replays)  # one, two and three requests (bucket 4: a padding request)
    if drafter is CutDrafter:  # most steps of cut drafts run from the graphs, not only those of full ones
        assert len(replays) > c.spec_rounds / 2
