"""The host stage of a captured decode step: what each row of the graph's inputs holds as the
batch grows, shrinks and changes members, with block-table rows rewritten only when needed."""
from __future__ import annotations

from types import SimpleNamespace

from ninfer.engine.cuda_graphs import _Stage

PAGE = 4
PAD = (9, 9 * PAGE, 7, 5)  # padding page, its first row, padding slot, the KV write slot no write reads


def request(prompt: int, pages: list[int], slot: int, computed: int | None = None, kv_slot: int | None = None):
    """A decoding request whose cache holds ``prompt`` tokens; its next token is ``100 + prompt``."""
    req = SimpleNamespace(cache=SimpleNamespace(pages=pages, slot=slot, kv_slot=kv_slot),
                          num_computed=prompt if computed is None else computed, num_tokens=prompt + 1)
    req.token_at = lambda i: 100 + i
    return req


def rows(stage: _Stage, n: int):
    lens, tables = stage.narrow[: stage.n], stage.tables
    return [(stage.wide[:, i].tolist(), int(lens[i]), tables[i].tolist()) for i in range(n)]


def test_stage_rows_follow_the_batch():
    stage = _Stage(3, 4, PAD)
    a, b = request(5, [2, 3], 0, kv_slot=3), request(2, [4], 1)
    stage.fill([a, b], PAGE)
    assert rows(stage, 3) == [
        ([105, 5, 3 * PAGE + 1, 0, 3], 6, [2, 3, 9, 9]),
        ([102, 2, 4 * PAGE + 2, 1, 5], 3, [4, 9, 9, 9]),  # no KV write slot
        ([0, 0, 9 * PAGE, 7, 5], 1, [9, 9, 9, 9]),  # padding row
    ]
    # a grows into a new page; b leaves, so its row becomes padding again
    a.num_computed, a.num_tokens = 8, 9
    a.cache.pages = [2, 3, 6]
    stage.fill([a], PAGE)
    assert rows(stage, 2) == [([108, 8, 6 * PAGE, 0, 3], 9, [2, 3, 6, 9]), ([0, 0, 9 * PAGE, 7, 5], 1, [9, 9, 9, 9])]


def test_table_rows_are_rewritten_only_when_pages_change(monkeypatch):
    stage = _Stage(2, 4, PAD)
    a = request(5, [2, 3], 0)
    stage.fill([a], PAGE)
    writes = []
    real = stage._write_table

    def counting(i, start, cache):
        writes.append(cache.pages[start:])
        real(i, start, cache)

    monkeypatch.setattr(stage, "_write_table", counting)
    a.num_computed, a.num_tokens = 6, 7  # same pages
    stage.fill([a], PAGE)
    assert writes == []
    b = request(1, [5], 1)  # a different sequence in row 0, same number of pages as nothing
    stage.fill([b], PAGE)
    assert writes == [[5]] and rows(stage, 1)[0][2] == [5, 9, 9, 9]
    b.num_computed, b.num_tokens = 4, 5
    b.cache.pages = [5, 8]  # b takes a page: only that page is written, the rest of the row stays
    stage.fill([b], PAGE)
    assert writes == [[5], [8]] and rows(stage, 1)[0][2] == [5, 8, 9, 9]
    c = request(1, [1], 1)  # a shorter sequence in the same row: the longer one's pages are padded over
    stage.fill([c], PAGE)
    assert rows(stage, 1)[0][2] == [1, 9, 9, 9]


def test_a_token_not_yet_read_is_left_for_the_device():
    """Launched ahead, the next input is still on the device: the stage holds a placeholder."""
    stage = _Stage(1, 2, PAD)
    ahead = request(5, [2, 3], 0, computed=6)
    ahead.num_tokens = 6  # the token at position 6 has not been read back
    stage.fill([ahead], PAGE)
    assert rows(stage, 1)[0][0] == [0, 6, 3 * PAGE + 2, 0, 5]


def test_picture_spares_the_copy_only_while_the_device_holds_the_inputs():
    """With the inputs advanced inside the graph, a greedy step that follows sends nothing while
    its staged rows equal what the device holds; a new page, a new member or a fresh picture after
    a different stage sends."""
    from ninfer.engine.cuda_graphs import _layout, _Picture

    n, max_pages = 2, 4
    picture = _Picture(n, max_pages, PAGE)
    start, end = 8 * n, _layout(n, max_pages)[0] + (n + 1 * max_pages) * 4  # no ids row, bucket 1
    stage = _Stage(n, max_pages, PAD)
    a = request(5, [2, 3], 0)
    stage.fill([a], PAGE)
    assert not picture.holds(stage, start, end)
    picture.sent(stage, start, end)
    picture.replayed(1)  # position 5 -> 6, still in page 3

    def step(req):
        req.num_computed += 1
        req.num_tokens += 1
        stage.fill([req], PAGE)

    step(a)
    assert picture.holds(stage, start, end)
    picture.replayed(1)
    step(a)  # position 7, the last row of page 3
    assert picture.holds(stage, start, end)
    picture.replayed(1)
    a.cache.pages = [2, 3, 6]  # position 8 takes a new page: its table row changes
    step(a)
    assert not picture.holds(stage, start, end)
    picture.sent(stage, start, end)
    picture.replayed(1)
    step(a)
    assert picture.holds(stage, start, end)
    picture.replayed(1)
    b = request(9, [4, 5, 7], 1)  # another sequence in row 0
    stage.fill([b], PAGE)
    assert not picture.holds(stage, start, end)
