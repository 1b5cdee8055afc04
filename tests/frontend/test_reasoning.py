"""Reasoning vs answer text, whatever the chunking."""
from __future__ import annotations

import pytest

from ninfer.engine.frontend.reasoning import ReasoningParser, prompt_opens_reasoning, split_reasoning

CASES = [
    # (starts_in_reasoning, output, reasoning, content)
    (True, "The user asks.\nSo 4.\n</think>\n\nThe answer is 4.", "The user asks.\nSo 4.", "The answer is 4."),
    (True, "x\n\n</think>\n\nA", "x\n", "A"),
    (True, "</think>\n\nOnly an answer", "", "Only an answer"),
    (True, "still thinking when cut <", "still thinking when cut <", ""),
    (True, "a</think>b</think>c", "a", "b</think>c"),
    (False, "Plain answer with </think> inside", "", "Plain answer with </think> inside"),
    (False, "\n<think>\nhidden\n</think>\n\nshown", "hidden", "shown"),
    (False, "<thi", "", "<thi"),
    (False, "  text", "", "  text"),
]


@pytest.mark.parametrize("starts, text, reasoning, content", CASES)
def test_split_is_the_same_at_every_cut(starts, text, reasoning, content):
    whole = split_reasoning(text, starts)
    assert (whole.reasoning, whole.content) == (reasoning, content)
    for cut in range(1, len(text)):
        p = ReasoningParser(starts)
        parts = [p.push(text[:cut]), p.push(text[cut:]), p.finish()]
        assert "".join(d.reasoning for d in parts) == reasoning, cut
        assert "".join(d.content for d in parts) == content, cut
    p = ReasoningParser(starts)
    parts = [p.push(ch) for ch in text] + [p.finish()]
    assert ("".join(d.reasoning for d in parts), "".join(d.content for d in parts)) == (reasoning, content)


def test_reasoning_streams_before_the_close():
    p = ReasoningParser(True)
    assert p.push("Thinking hard").reasoning == "Thinking hard"
    assert p.in_reasoning
    d = p.push(" now\n</think>\n\nDone")
    assert (d.reasoning, d.content) == (" now", "Done") and not p.in_reasoning


def test_prompt_opens_reasoning():
    assert prompt_opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n")
