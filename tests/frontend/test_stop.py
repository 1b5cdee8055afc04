"""Stop strings over streamed text."""
from __future__ import annotations

from itertools import combinations

import pytest

from ninfer.engine.frontend.stop import StopMatcher


def run(stops: list[str], chunks: list[str]) -> tuple[str, str | None, list[str]]:
    """Feed ``chunks``; return (all emitted text, matched stop, the emitted pieces)."""
    matcher = StopMatcher(stops)
    pieces, matched = [], None
    for chunk in chunks:
        piece, found = matcher.push(chunk)
        pieces.append(piece)
        if found is not None:
            matched = found
            break
    pieces.append(matcher.flush())
    return "".join(pieces), matched, pieces


def splits(text: str, max_cuts: int = 2) -> list[list[str]]:
    """Every way to cut ``text`` into up to ``max_cuts + 1`` chunks."""
    out = []
    for k in range(max_cuts + 1):
        for cuts in combinations(range(1, len(text)), k):
            bounds = (0, *cuts, len(text))
            out.append([text[a:b] for a, b in zip(bounds, bounds[1:])])
    return out


@pytest.mark.parametrize("chunks", splits("Hello END world"))
def test_stop_split_anywhere(chunks: list[str]) -> None:
    text, matched, _ = run(["END"], chunks)
    assert (text, matched) == ("Hello ", "END")


@pytest.mark.parametrize("chunks", splits("ab<|im_end|>cd", max_cuts=1))
def test_special_looking_stop_split_anywhere(chunks: list[str]) -> None:
    assert run(["<|im_end|>"], chunks)[:2] == ("ab", "<|im_end|>")


@pytest.mark.parametrize("chunks", splits("xxabcyy"))
def test_stop_that_is_a_prefix_of_another_wins(chunks: list[str]) -> None:
    # "ab" completes before "abc" could, whatever the chunking
    assert run(["abc", "ab"], chunks)[:2] == ("xx", "ab")


@pytest.mark.parametrize("chunks", splits("xxabcyy"))
def test_first_completed_stop_wins(chunks: list[str]) -> None:
    assert run(["abc", "b"], chunks)[:2] == ("xxa", "b")
    assert run(["abc", "bc"], chunks)[:2] == ("xx", "abc")  # same end: the longer one


def test_nothing_after_the_stop() -> None:
    matcher = StopMatcher(["STOP"])
    assert matcher.push("one ST") == ("one ", None)
    assert matcher.push("OP two") == ("", "STOP")
    assert matcher.stopped and matcher.matched == "STOP"
    assert matcher.push("three") == ("", None)
    assert matcher.flush() == ""


def test_held_text_is_released_when_it_stops_matching() -> None:
    matcher = StopMatcher(["</answer>"])
    assert matcher.push("a </ans") == ("a ", None)
    assert matcher.push("wer") == ("", None)
    assert matcher.push("s!") == ("</answers!", None)
    assert matcher.push("</") == ("", None)
    assert matcher.flush() == "</"


def test_overlapping_partial_match() -> None:
    # "aab" inside "aaab": the first "a" can be released once it cannot start the stop
    assert run(["aab"], ["a", "a", "a", "b", "c"])[:2] == ("a", "aab")


def test_no_stops_passes_everything() -> None:
    matcher = StopMatcher([])
    assert matcher.push("anything") == ("anything", None)
    assert matcher.flush() == ""


def test_unicode_stop() -> None:
    assert run(["。"], ["你好", "。再见"])[:2] == ("你好", "。")


def test_empty_stop_rejected() -> None:
    with pytest.raises(ValueError):
        StopMatcher(["ok", ""])
    with pytest.raises(TypeError):
        StopMatcher("END")  # type: ignore[arg-type]
