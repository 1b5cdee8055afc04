"""Overlapped decode: the next decode step is launched from the device-side tokens before the
host reads this step's. What users get must not change: the same tokens, text, finish reasons
and freed caches as stepping one at a time, through finishing, stop tokens and strings, aborts,
late arrivals, forced thinking-close tokens, seeded sampling and penalties (which turn the
overlap off while they run)."""
from __future__ import annotations

import pytest

from ninfer.engine.sampling_params import ThinkingControl
from support.decode_paths import load_parts
from support.overlap import CLOSE, check_scenario, drive, scenario


@pytest.fixture(scope="module", params=["llama", "qwen3_5"])
def parts(request, tmp_path_factory):
    return load_parts(request.param, tmp_path_factory)


def test_overlap_keeps_every_output(parts):
    specs, kw = scenario(parts)
    plain, none_ahead = drive(parts, False, specs, **kw)
    overlapped, ahead = drive(parts, True, specs, **kw)
    assert none_ahead == 0 and ahead >= 5
    assert overlapped == plain
    check_scenario(plain, specs)


@pytest.mark.parametrize("sampled", [False, True])
def test_forced_close_tokens_under_overlap(parts, sampled):
    """No token is sampled ahead where the budget may force the close tokens: greedy and seeded
    sampling give what they give without overlap (the seeded generator draws no extra token)."""
    control = ThinkingControl(end_id=2, budget=6, close_ids=CLOSE)
    how = {"temperature": 1.5, "seed": 3} if sampled else {}
    specs = {0: {"max_tokens": 16}, 3: {"max_tokens": 14, "thinking": control, **how}}
    plain, _ = drive(parts, False, specs)
    overlapped, ahead = drive(parts, True, specs)
    assert ahead > 5
    assert overlapped == plain
    assert plain["r3"]["tokens"][6:10] == list(CLOSE) and len(plain["r3"]["tokens"]) == 14


def test_penalties_turn_the_overlap_off_and_keep_outputs(parts):
    specs = {0: {"max_tokens": 14}, 1: {"max_tokens": 14, "repetition_penalty": 1.5},
             2: {"max_tokens": 24, "frequency_penalty": 0.7}}
    plain, _ = drive(parts, False, specs)
    overlapped, ahead = drive(parts, True, specs)
    assert overlapped == plain
    assert ahead == 0  # a penalised request runs in every step until r2's end
    alone, ahead_alone = drive(parts, True, {0: {"max_tokens": 14}})
    assert alone["r0"] == plain["r0"] and ahead_alone > 5
