"""Prompt tokens beside decoding rows: capped so that the streams' gap stays within a few decode
steps, widened where a burst of new prompts waits, and never a change in anyone's tokens."""
from __future__ import annotations

import pytest
import torch

from ninfer.engine.engine import LLMEngine
from ninfer.engine.engine_config import EngineConfig
from ninfer.engine.loader import load_checkpoint, load_model
from ninfer.engine.pace import StepPace
from ninfer.engine.request import Request
from ninfer.engine.sampling_params import SamplingParams
from support.tiny import save_tiny_qwen3_5

MS = 1e-3


def learned(decode_ms: float = 6.0, prompt: int = 512, mixed_ms: float = 31.0) -> StepPace:
    pace = StepPace(3.0, floor=64, most=2048)
    for _ in range(8):
        pace.observe(8, 0, decode_ms * MS)
    pace.observe(8, prompt, mixed_ms * MS)
    return pace


def test_the_cap_keeps_a_step_beside_decoders_within_the_gap():
    pace = learned()  # 8 decoders at 6 ms; 512 prompt tokens beside them made a 31 ms step
    cap = pace.prompt_tokens(decoding=8, waiting=1)
    per_token = 25.0 * MS / 512
    assert 200 <= cap <= 256  # 2 decode steps' time (12 ms) of prompt tokens
    assert 6.0 * MS + cap * per_token <= 3 * 6.0 * MS  # the step with them: within 3 decode steps
    assert pace.prompt_tokens(decoding=0, waiting=1) == 2048  # nobody decodes: the whole budget


def test_a_burst_of_new_prompts_widens_the_bound():
    pace = learned()
    one = pace.prompt_tokens(decoding=8, waiting=1)
    assert pace.prompt_tokens(decoding=8, waiting=8) == one  # as many wait as stream
    assert pace.prompt_tokens(decoding=8, waiting=40) > 4 * one  # five times as many wait
    assert pace.prompt_tokens(decoding=8, waiting=400) == 2048  # never past the token budget


def test_a_fixed_cost_is_told_apart_from_the_cost_per_token():
    """Steps of two sizes: 8 decoders at 6 ms, prompt tokens adding 4 ms plus 0.02 ms each."""
    pace = learned(mixed_ms=6 + 4 + 0.02 * 512)
    pace.observe(8, 128, (6 + 4 + 0.02 * 128) * MS)
    fixed, per_token = pace.cost()
    assert fixed == pytest.approx(4 * MS) and per_token == pytest.approx(0.02 * MS)
    assert pace.prompt_tokens(decoding=8, waiting=1) == pytest.approx(400, abs=1)  # (12 ms - 4 ms) / 0.02 ms


def test_no_cap_where_the_fixed_cost_alone_passes_the_gap():
    """A step with prompt rows costs 20 ms whatever its size beside 6 ms decode steps (a host-bound
    step): no chunk keeps 3 decode steps' time, and cutting the prompt would only repeat those
    20 ms in more steps, so the whole budget goes."""
    pace = learned(mixed_ms=6 + 20 + 0.02 * 512)
    pace.observe(8, 128, (6 + 20 + 0.02 * 128) * MS)
    assert pace.cost()[0] == pytest.approx(20 * MS)
    assert pace.prompt_tokens(decoding=8, waiting=1) == 2048
    slow = learned(decode_ms=1.0, mixed_ms=60.0)  # one size only: all of it per token, past the floor
    assert slow.prompt_tokens(decoding=64, waiting=1) == 2048


class FixedPace(StepPace):
    """What a GPU would have measured: decode steps of 6 ms, 0.25 ms per prompt token (a cap of 48)."""

    def __init__(self, most: int) -> None:
        super().__init__(3.0, floor=16, most=most)
        self.decode_s = 6 * MS
        self.caps: list[int] = []

    def cost(self) -> tuple[float, float]:
        return 0.0, 0.25 * MS

    def observe(self, decode_rows: int, prompt_tokens: int, seconds: float) -> None:
        pass

    def prompt_tokens(self, decoding: int, waiting: int) -> int:
        cap = super().prompt_tokens(decoding, waiting)
        self.caps.append(cap)
        return cap


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    ckpt = load_checkpoint(save_tiny_qwen3_5(tmp_path_factory.mktemp("pace") / "ckpt"))
    return load_model(ckpt, "cpu", torch.float32), ckpt.tokenizer


def engine(parts, **kw) -> LLMEngine:
    model, tok = parts
    cfg = {"max_context": 256, "prefill_chunk": 128, "max_concurrency": 8, "kv_capacity": 4096, "page_size": 8,
           **kw}
    return LLMEngine(model, tok, EngineConfig(**cfg))


def run(eng: LLMEngine, pace: StepPace | None) -> tuple[dict[str, list[int]], list[tuple[int, int]]]:
    """Four streams decoding, then a 150-token prompt beside them: each one's tokens, and each
    step's (decode rows, prompt tokens)."""
    eng.pace = eng.scheduler.pace = pace
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    streams = [Request(f"s{i}", torch.randint(3, 200, (5 + i,), generator=g).tolist(), params, max_total_tokens=256)
               for i in range(4)]
    late = Request("late", torch.randint(3, 200, (150,), generator=g).tolist(), params, max_total_tokens=256)
    for r in streams:
        eng.add_request(r)
    eng.step()
    eng.step()
    eng.add_request(late)
    steps = []
    while eng.has_work:
        decoding = sum(r.num_computed >= len(r.prompt_ids) for r in streams if not r.is_finished)
        before = late.num_computed
        eng.step()
        steps.append((decoding, late.num_computed - before))
    return {r.request_id: list(r.output_ids) for r in streams + [late]}, steps


def test_a_long_prompt_beside_streams_goes_in_capped_chunks_with_the_same_tokens(parts):
    eng = engine(parts)
    assert eng.pace is None  # the token budget alone, unless asked
    alone, steps = run(eng, None)
    assert steps[0][1] == 124  # the first chunk: the step's budget (128) less the 4 decode rows
    paced = FixedPace(eng.config.step_tokens)
    beside, steps = run(engine(parts), paced)
    chunks = [n for _, n in steps if n]
    assert beside == alone  # every request's greedy tokens unchanged
    assert sum(chunks) >= 149 and max(chunks) == 48  # 2 decode steps' time of 0.25 ms tokens
    assert paced.caps and set(paced.caps) == {48}


def test_an_engine_asked_to_pace_learns_from_its_own_steps(parts):
    eng = engine(parts, decode_gap=3.0)
    assert eng.pace is not None and eng.scheduler.pace is eng.pace
    run(eng, eng.pace)
    assert eng.pace.decode_s > 0 and eng.pace.cost()[1] > 0  # learned from the engine's own steps
    with pytest.raises(ValueError, match="decode_gap must be 0 \\(none\\) or >= 1.5"):
        EngineConfig(decode_gap=1.2)
