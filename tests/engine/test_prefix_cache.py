"""Prefix checkpoints: a returning conversation goes on from where its last answer ended, with the
tokens it would get without them, for every model family; no minimum length, no page grid;
shared pages copied where a continuation writes; checkpoints dropped when room is needed;
anchors of a long prefill; prompts sent together that share a start; pools exact after."""
from __future__ import annotations

import pytest

from ninfer.engine.engine import LLMEngine
from support.prefix_cases import engine, parts, req, run  # noqa: F401 - parts is a fixture


def conversation(eng: LLMEngine, turns: int = 4) -> list[tuple[list[int], int]]:
    """A conversation whose every prompt is the last one, its answer and a new turn of 5 tokens."""
    ids, out = [5 + i % 80 for i in range(37)], []
    for t in range(turns):
        got, cached = run(eng, [req(f"t{t}", ids)])[f"t{t}"]
        out.append((got, cached))
        ids = ids + got + [9 + t, 10, 11, 12, 13]
    return out


def test_a_returning_conversation_goes_on_from_where_its_last_answer_ended(parts):
    """Each turn resends the last prompt, its answer and a new turn: it goes on from where the
    answer ended (all of it but its last token, which the engine sampled but never ran)."""
    with_cache, without = engine(parts), engine(parts, prefix_cache=False)
    turns, plain = conversation(with_cache), conversation(without)
    assert [got for got, _ in turns] == [got for got, _ in plain]  # token-identical
    lengths = [37]
    for got, _ in turns[:-1]:
        lengths.append(lengths[-1] + len(got) + 5)
    answered = [n + len(got) - 1 for n, (got, _) in zip(lengths, turns)]
    assert [cached for _, cached in turns] == [0] + answered[:-1]
    assert [cached for _, cached in plain] == [0, 0, 0, 0]
    assert with_cache.counters.cached_tokens == sum(answered[:-1])
    assert with_cache.caches.idle() and without.caches.idle()
    with_cache.caches.prefix.clear()
    kv = with_cache.caches.kv
    assert kv is None or kv.num_free == kv.num_pages  # nothing leaked past the checkpoints
    states = with_cache.caches.states
    assert states is None or states.num_free == states.num_slots


def test_a_conversation_whose_answers_are_rewritten_goes_on_from_its_last_prompt(parts):
    """``checkpoint_answer=False`` (the server's choice where the template rewrites answers, as
    Qwen3.5's drops an earlier turn's reasoning): each turn goes on from the whole previous prompt."""
    eng = engine(parts)
    ids, cached = [5 + i % 80 for i in range(37)], []
    for t in range(3):
        got, hit = run(eng, [req(f"t{t}", ids, checkpoint_answer=False)])[f"t{t}"]
        cached.append(hit)
        ids = ids + got + [9 + t, 10, 11]
    assert cached == [0, 37, 37 + 8 + 3]
    assert len(eng.caches.prefix) == 3 and eng.caches.idle()  # one per prompt, none per answer


def test_a_short_prompt_that_extends_another_hits_off_the_page_grid(parts):
    """37 tokens (two pages and 5 of 16), then a 40-token prompt that starts with them."""
    eng = engine(parts)
    first = [5 + i % 80 for i in range(37)]
    run(eng, [req("a", first)])
    got, cached = run(eng, [req("b", first + [7, 8, 9])])["b"]
    assert cached == 37
    alone = run(engine(parts, prefix_cache=False), [req("b", first + [7, 8, 9])])["b"][0]
    assert got == alone
    # a prompt that only shares part of it, or is the checkpoint itself, computes what it must
    assert run(eng, [req("c", first[:30] + [1, 2])])["c"][1] == 0
    assert run(eng, [req("d", first)])["d"][1] == 0  # its last token must run to give logits


def test_continuations_of_one_checkpoint_side_by_side_write_their_own_pages(parts):
    """Three requests continue from the same checkpoint at once: the partly filled page they share
    is copied for each, so none sees another's tokens."""
    eng = engine(parts)
    base = [5 + i % 80 for i in range(37)]
    run(eng, [req("base", base)])
    tails = {f"r{i}": base + [20 + i] * (3 + i) for i in range(3)}
    together = run(eng, [req(name, ids, 10) for name, ids in tails.items()])
    assert all(cached == 37 for _, cached in together.values())
    fresh = engine(parts, prefix_cache=False)
    for name, ids in tails.items():
        assert together[name][0] == run(fresh, [req(name, ids, 10)])[name][0]
    assert eng.caches.idle()


def test_checkpoints_give_way_when_room_is_needed(parts):
    """A pool of 20 pages and at most two checkpoints: old ones are dropped (least recently used
    first) for new checkpoints and for running requests' pages; nothing fails, nothing leaks."""
    small = {"kv_capacity": 320, "max_context": 320, "max_concurrency": 2}
    eng = engine(parts, **small, prefix_checkpoints=2)
    fresh = engine(parts, **small, prefix_cache=False)
    prompts = {f"p{i}": [3 + (7 * i + j) % 90 for j in range(60 + 10 * i)] for i in range(5)}
    for name, ids in prompts.items():
        assert run(eng, [req(name, ids, 20)])[name][0] == run(fresh, [req(name, ids, 20)])[name][0]
        assert len(eng.caches.prefix) <= 2
    newest = prompts["p4"] + [1]
    assert run(eng, [req("again", newest)])["again"][1] == len(prompts["p4"])  # the newest one is kept
    long = [4 + j % 70 for j in range(300)]  # 19 of the 20 pages: every checkpoint must go
    assert run(eng, [req("long", long, 10)])["long"][0] == run(fresh, [req("long", long, 10)])["long"][0]
    assert eng.caches.idle()


def test_a_finished_request_gives_its_state_slot_to_its_answer_checkpoint(parts):
    """Where a request's answer ends its state slot becomes the checkpoint's as it is (nothing
    copied, no slot taken); the table stays within its size (its decode steps moved one to host
    memory ahead of the answer: an engine that launches ahead of the device, as on a GPU), and
    the next turn goes on from the answer with the same tokens."""
    eng, fresh = engine(parts, prefix_checkpoints=2, overlap=True), engine(parts, prefix_cache=False)
    prefix, states = eng.caches.prefix, eng.caches.states
    ids = [5 + i % 80 for i in range(37)]
    slots = []
    for name in ("a", "b"):
        r = req(name, [7 + (3 * i + len(name)) % 60 for i in range(30)])
        eng.add_request(r)
        while eng.has_work:
            if r.cache is not None:
                slots.append(r.cache.slot)
            eng.step()
    first = req("first", ids)
    eng.add_request(first)
    got = []
    while eng.has_work:
        if first.cache is not None:
            slots.append(first.cache.slot)
        got += [t for o in eng.step() for t in o.token_ids or []]
    assert len(prefix) == 2 and prefix.over == 0 and prefix.num_host == 2  # the answer's in the place made
    answer = prefix.longest(ids + got[:-1] + [1])
    assert answer is not None and answer.length == len(ids) + len(got) - 1
    if states is not None:
        assert answer.slot == slots[-1]  # the request's own slot, adopted
    turn = ids + got + [9, 10, 11]
    again = req("again", turn)
    eng.add_request(again)
    outputs = eng.step()  # its first step: launched, then the table trimmed while it runs
    assert len(prefix) <= 2
    assert outputs[0].admitted and outputs[0].cached_tokens == answer.length
    rest = []
    while eng.has_work:
        rest += [t for o in eng.step() for t in o.token_ids or []]
    assert [t for o in outputs for t in o.token_ids or []] + rest == run(fresh, [req("again", turn)])["again"][0]
    eng.idle_work()
    assert eng.caches.idle()


def test_an_idle_engine_keeps_room_for_the_next_burst_of_prompts(parts):
    """Eight checkpoints for two concurrent requests: once idle the engine keeps four places free
    (two per request: where its prompt ends and where its answer does) by moving the least
    recently used to host memory, so the next two requests keep theirs without any checkpoint
    evicted in their steps or left beyond the table; idle again, the table is back."""
    eng = engine(parts, prefix_checkpoints=8, max_concurrency=2)
    prefix = eng.caches.prefix
    for i in range(4):
        run(eng, [req(f"old{i}", [3 + (5 * i + j) % 70 for j in range(20 + i)], 4)])
    assert len(prefix) == 4 and prefix.num_host == 4
    kept = {id(e) for e in prefix.entries}
    new = [req(f"new{i}", [4 + (7 * i + j) % 60 for j in range(25 + i)], 4) for i in range(2)]
    for r in new:
        eng.add_request(r)
    while eng.has_work:
        eng.step()
    assert kept <= {id(e) for e in prefix.entries} and prefix.num_host == 4  # none evicted in the steps
    assert len(prefix) == 8 and prefix.over == 0  # the two prompts' and the two answers', within the table
    while eng.idle_work():
        pass
    assert len(prefix) == 4 and prefix.num_host == 8 and eng.caches.idle()
    again = run(eng, [req("again", new[0].prompt_ids + [1, 2], 4)])["again"]
    assert again[1] == len(new[0].prompt_ids)  # the burst's checkpoints are there to go on from


def test_decode_steps_free_the_table_ahead_of_the_next_burst(parts):
    """An engine that is never idle (a GPU's, launching steps ahead): its decode steps move the
    least recently used checkpoints to host memory, one a step, until four places of the eight
    are free (two per concurrent request), so a burst of new prompts that follows at once keeps
    its checkpoints without any evicted in its steps."""
    eng = engine(parts, prefix_checkpoints=8, max_concurrency=2, overlap=True)
    prefix = eng.caches.prefix

    def busy(requests):  # to the end, no idle work between them
        for r in requests:
            eng.add_request(r)
        while eng.has_work:
            before = (len(prefix), prefix.num_host)
            eng.step()
            moved = prefix.num_host - before[1]
            assert moved <= 1 or len(prefix) <= prefix.max_entries, "more than one moved ahead in a step"

    for i in range(8):  # one token each: one checkpoint (prompt and answer end together), no decode step
        busy([req(f"old{i}", [3 + (5 * i + j) % 70 for j in range(20 + i)], 1)])
    assert len(prefix) == 8 and prefix.num_host == 0
    busy([req("long", [5 + (3 * j) % 50 for j in range(30)], 12)])  # its decode steps free four places
    assert len(prefix) == 5 and prefix.num_host == 5 and prefix.over == 0  # then its answer came in
    kept = {id(e) for e in prefix.entries}
    evicted = prefix.num_host
    busy([req(f"new{i}", [4 + (7 * i + j) % 60 for j in range(25 + i)], 1) for i in range(2)])
    assert kept <= {id(e) for e in prefix.entries} and prefix.num_host == evicted  # none evicted in the burst


def test_conversations_taking_turns_return_to_device_checkpoints(parts):
    """Four conversations taking turns two at a time on a GPU's engine (steps launched ahead,
    decode steps freeing table places ahead of the next burst): the eight places hold four once
    freed, and each turn leaves two checkpoints, where its prompt ended and where its answer did.
    The prompt's is covered by the answer's, so it goes first: every returning turn goes on from
    where its last answer ended, on the device, with the tokens it gets without the cache."""
    eng = engine(parts, prefix_checkpoints=8, max_concurrency=2, overlap=True)
    fresh = engine(parts, prefix_cache=False)
    prefix = eng.caches.prefix
    convs = {f"c{i}": [3 + (11 * i + 5 * j) % 70 for j in range(24 + 3 * i)] for i in range(4)}
    for turn in range(3):
        for pair in (("c0", "c1"), ("c2", "c3")):
            before = prefix.hits_gpu
            reqs = [req(f"{c}t{turn}", convs[c], 6, checkpoints=[len(convs[c])]) for c in pair]
            got = run(eng, reqs)
            for c, r in zip(pair, reqs):
                ids, cached = got[r.request_id]
                assert ids == run(fresh, [req("plain", convs[c], 6)])["plain"][0]
                if turn:  # all but the new turn's 3 ids and the answer's last token (sampled, never run)
                    assert cached == len(convs[c]) - 4, f"{c} turn {turn} found {cached} tokens cached"
                convs[c] = convs[c] + ids + [9 + turn, 10, 11]
            assert prefix.hits_gpu - before == (2 if turn else 0)
    assert prefix.hits_host == 0


def test_a_checkpoint_can_be_put_where_the_turn_ends(parts):
    """``checkpoints``: the server puts one before the generation prompt; a request resent with
    the turn after it goes on from there, and a position outside the prompt is refused."""
    eng = engine(parts)
    turn = [5 + i % 80 for i in range(40)]
    run(eng, [req("a", turn + [1, 2, 3], checkpoints=[len(turn)])])
    assert run(eng, [req("b", turn + [4, 4, 4, 4])])["b"][1] == len(turn)
    with pytest.raises(ValueError, match="checkpoint position 50 is outside the prompt's 43 tokens"):
        eng.add_request(req("c", turn + [1, 2, 3], checkpoints=[10, 50]))


def test_a_long_prompt_cancelled_part_way_resumes_from_its_last_anchor(parts):
    """``progress_anchor=48``: a 300-token prompt keeps its newest anchor as it goes (its chunks
    of 64 cut at each); cancelled after 200 tokens or more and sent again, it goes on from its last
    anchor (only the rest is computed again), with the tokens it gets without any cache;
    finished, it keeps no anchor."""
    eng = engine(parts, progress_anchor=48)
    prompt = [3 + (5 * i) % 97 for i in range(300)]
    eng.add_request(req("a", prompt, 6))
    while not eng.running or eng.running[0].num_computed < 200:
        eng.step()
    anchor = eng.running[0].num_computed // 48 * 48
    assert [e.length for e in eng.caches.prefix.entries] == [anchor]  # the newest anchor only
    assert eng.abort("a").finished
    computed = eng.counters.prefill_tokens
    got, cached = run(eng, [req("b", prompt, 6)])["b"]
    assert cached == anchor and got == run(engine(parts, prefix_cache=False), [req("b", prompt, 6)])["b"][0]
    assert eng.counters.prefill_tokens == computed + 300 - anchor
    assert sorted(e.length for e in eng.caches.prefix.entries) == [300, 305]  # prompt and answer ends
    assert eng.caches.idle()


def test_a_cancelled_turn_leaves_the_checkpoint_it_went_on_from(parts):
    eng = engine(parts)
    base = [5 + i % 80 for i in range(37)]
    run(eng, [req("a", base)])
    eng.add_request(req("b", base + [1, 2, 3], 50))
    for _ in range(4):
        eng.step()
    assert eng.abort("b").finished
    got, cached = run(eng, [req("c", base + [1, 2, 3])])["c"]
    assert cached == 37 and got == run(engine(parts, prefix_cache=False), [req("c", base + [1, 2, 3])])["c"][0]
    assert eng.caches.idle()


def test_ids_that_share_a_key_replace_the_older_checkpoint_without_leaking(parts, monkeypatch):
    """Every key the same (as if two prefixes' hashes collided): the ids tell them apart, the
    newer checkpoint takes the key, and the older one's pages and slot go back."""
    from ninfer.engine.cache import prefix

    monkeypatch.setattr(prefix, "key_of", lambda *args: 0)
    eng = engine(parts)
    a, b = [5 + i % 80 for i in range(37)], [6 + i % 70 for i in range(50)]
    run(eng, [req("a", a, checkpoint_answer=False)])
    run(eng, [req("b", b, checkpoint_answer=False)])
    assert [e.tokens for e in eng.caches.prefix.entries] == [b] and eng.caches.idle()
    assert run(eng, [req("a2", a + [1])])["a2"][1] == 0  # its checkpoint is gone, not mistaken for b's
    eng.caches.prefix.clear()
    assert eng.caches.kv.num_free == eng.caches.kv.num_pages


def test_requests_sent_together_with_one_long_prefix_compute_it_once(parts):
    """Two prompts that share their first 300 tokens, sent together: the second waits for the
    first to compute them, goes on from the checkpoint taken there and computes only its own
    tail; both get the tokens they get without any cache (the time it saves:
    tests/engine/test_shared_prefix.py)."""
    base = [3 + (11 * i) % 89 for i in range(300)]
    prompts = {"a": base + [1, 2, 3], "b": base + [4, 5, 6, 7]}
    results = {}
    for cached in (False, True):
        eng = engine(parts, prefix_cache=cached)
        results[cached] = run(eng, [req(name, ids, 4) for name, ids in prompts.items()])
        results[cached]["computed"] = eng.counters.prefill_tokens
        assert eng.caches.idle()
    assert results[True]["b"][1] == 300 and results[False]["b"][1] == 0
    assert [results[True][n][0] for n in prompts] == [results[False][n][0] for n in prompts]
    assert results[True]["computed"] == 303 + 4 and results[False]["computed"] == 303 + 304
    # a prompt that shares less than SHARED_PREFIX_MIN tokens does not wait
    short = {"c": base[:200] + [1, 2, 3], "d": base[:200] + [4, 5]}
    assert all(c == 0 for _, c in run(engine(parts), [req(n, ids, 2) for n, ids in short.items()]).values())


def test_the_default_keeps_four_checkpoints_per_concurrent_request_as_memory_allows(monkeypatch, tmp_path):
    from ninfer.engine import memory
    from ninfer.engine.engine_config import EngineConfig
    from ninfer.engine.loader import load_checkpoint
    from support.tiny import save_tiny_qwen3_5

    model = load_checkpoint(save_tiny_qwen3_5(tmp_path / "ckpt")).config

    def config(**kw):
        return EngineConfig(**{"kv_capacity": 8192, **kw})

    slot = memory._slot_bytes(model, config())
    assert slot > 0
    monkeypatch.setattr(memory, "free_memory_bytes", lambda device, cap=None: 1 << 34)
    assert memory.prefix_checkpoints(model, config(max_concurrency=12)) == 48
    assert memory.prefix_checkpoints(model, config(max_concurrency=2)) == 16  # at least 16
    assert memory.prefix_checkpoints(model, config(max_concurrency=12, prefix_checkpoints=5)) == 5
    assert memory.prefix_checkpoints(model, config(max_concurrency=12, prefix_cache=False)) == 0
    # their state slots take at most a quarter of free memory: 48 do not fit in 30 slots' worth
    monkeypatch.setattr(memory, "free_memory_bytes", lambda device, cap=None: 4 * 30 * slot)
    assert memory.prefix_checkpoints(model, config(max_concurrency=12)) == 24


def test_a_pool_sized_by_default_keeps_a_finished_prompt_on_the_device_while_the_next_one_runs(parts):
    """With the pool sized from free memory (no ``kv_capacity``), one lane and a prompt of nearly
    ``max_context``: the next user's prompt of the same length finds room beside the first one's
    checkpoint, so nothing goes to host memory on its time, and the first user's next turn is served
    from the device."""
    eng = engine(parts, max_concurrency=1, kv_capacity=None, max_context=480)
    first, second = [5 + i % 80 for i in range(400)], [7 + i % 70 for i in range(400)]
    (got, _), = run(eng, [req("a", first, max_total_tokens=480)]).values()
    assert run(eng, [req("b", second, max_total_tokens=480)])["b"][1] == 0
    assert eng.caches.host_checkpoint_bytes == 0  # the first prompt's pages stayed where they were
    back = req("a2", first + got + [9, 10, 11], max_total_tokens=480)
    assert run(eng, [back])["a2"][1] == 400 + len(got) - 1
    assert back.reuse["tier"] == "gpu"
