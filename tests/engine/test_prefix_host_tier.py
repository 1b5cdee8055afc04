"""Prefix checkpoints in host memory: checkpoints evicted from the device move to the host budget,
a request that goes on from one gets it back, with the tokens it would get without any cache,
for every model family; the budget is shared with paused requests' snapshots, which come first;
pools and host bytes exact after."""
from __future__ import annotations

from ninfer.engine.engine import LLMEngine
from ninfer.engine.snapshot import take_snapshot
from support.prefix_cases import engine, parts, req, run  # noqa: F401 - parts is a fixture


def taking_turns(eng: LLMEngine, rounds: int = 3) -> list[tuple[list[int], list[int], int]]:
    """Two conversations taking turns, each prompt that conversation's last one, its answer and a
    new turn of 5 tokens: (prompt, output, cached tokens) of each turn, in order."""
    ids = {"a": [5 + i % 80 for i in range(37)], "b": [7 + (3 * i) % 61 for i in range(45)]}
    out = []
    for t in range(rounds):
        for name in ("a", "b"):
            got, cached = run(eng, [req(f"{name}{t}", ids[name])])[f"{name}{t}"]
            out.append((ids[name], got, cached))
            ids[name] = ids[name] + got + [9 + t, 10, 11, 12, 13]
    return out


def answered(turns: list[tuple[list[int], list[int], int]]) -> list[int]:
    """The cached tokens each turn can have: none for a conversation's first, else its previous
    prompt and answer but the answer's last token (sampled, never run: the engine keeps a
    checkpoint where each answer ends)."""
    return [0, 0] + [len(prompt) + len(got) - 1 for prompt, got, _ in turns[:-2]]


def assert_all_given_back(eng: LLMEngine) -> None:
    caches = eng.caches
    assert caches.idle()
    caches.prefix.clear()
    assert caches.kv is None or caches.kv.num_free == caches.kv.num_pages
    assert caches.states is None or caches.states.num_free == caches.states.num_slots
    assert caches.prefix.num_host == 0 and caches.host_checkpoint_bytes == 0
    assert caches.prefix.host_kv_bytes == caches.prefix.host_state_bytes == 0


def test_two_conversations_taking_turns_go_on_from_host_memory(parts):
    """One checkpoint fits on the device: each conversation's answer is evicted by the other's
    turn and moves to host memory; every later turn goes on from there, promoted back, with the
    tokens it gets without any cache."""
    eng = engine(parts, prefix_checkpoints=1, host_cache_mib=64)
    turns = taking_turns(eng)
    plain = taking_turns(engine(parts, prefix_cache=False))
    assert [got for _, got, _ in turns] == [got for _, got, _ in plain]  # token-identical
    assert [cached for _, _, cached in turns] == answered(turns)
    assert [cached for _, _, cached in plain] == [0] * 6
    assert eng.counters.cached_tokens == sum(answered(turns))
    prefix = eng.caches.prefix
    assert prefix.hits_host == 4 and prefix.hits_gpu == 0  # every hit came from the host tier
    assert len(prefix) == 1 and prefix.num_host >= 2
    g = take_snapshot(eng).gauges
    assert (g.prefix_checkpoints, g.prefix_host_checkpoints) == (1, prefix.num_host)
    assert (g.prefix_hits_gpu, g.prefix_hits_host) == (0, 4)
    # every checkpoint in host memory, and every one promoted from there, moved there first; none dropped
    assert (g.prefix_evicted_host, g.prefix_evicted_dropped, g.prefix_copy_waits) == (prefix.evicted_host, 0, 0)
    assert prefix.evicted_host >= prefix.num_host + prefix.hits_host
    pages = sum(-(-e.length // eng.caches.page_size) for e in prefix.host_entries)  # those covering each
    assert g.prefix_host_kv_bytes == pages * prefix.page_bytes > 0  # the data they hold
    assert g.prefix_host_state_bytes == prefix.num_host * prefix.slot_bytes
    # the host memory they take: an extent each, the data rounded up to whole 4 KiB
    assert eng.caches.host_checkpoint_bytes == sum(prefix.host_cost(e.length) for e in prefix.host_entries)
    assert 0 <= eng.caches.host_checkpoint_bytes - g.prefix_host_kv_bytes - g.prefix_host_state_bytes \
        < prefix.num_host * 4 * 4096
    assert g.host_cache_bytes_used == 0  # the snapshots' share: none
    assert_all_given_back(eng)


def test_without_a_host_budget_evicted_checkpoints_are_dropped(parts):
    """``host_cache_mib=0``: no host tier; a checkpoint evicted from the device is gone, and each
    turn computes its whole prompt again."""
    eng = engine(parts, prefix_checkpoints=1, host_cache_mib=0)
    turns = taking_turns(eng)
    assert [got for _, got, _ in turns] == [got for _, got, _ in taking_turns(engine(parts, prefix_cache=False))]
    assert [cached for _, _, cached in turns] == [0] * 6
    prefix = eng.caches.prefix
    assert prefix.num_host == 0 and eng.caches.host_checkpoint_bytes == 0 and prefix.hits_host == 0
    assert len(prefix) == 1
    assert prefix.evicted_host == 0 and prefix.evicted_dropped >= 5  # each turn's answer dropped for the next
    assert_all_given_back(eng)


def test_the_host_tier_keeps_the_most_recent_checkpoints_its_budget_holds(parts):
    """A host budget of exactly three checkpoints of 40 and 43 tokens (three pages each): the
    oldest go as newer ones come; a prompt that extends a kept one goes on from it, one whose
    checkpoints went computes it all."""
    eng = engine(parts, prefix_checkpoints=1)
    prefix = eng.caches.prefix
    eng.caches.host_cache_bytes = 3 * prefix.host_cost(40)
    assert prefix.host_cost(40) == prefix.host_cost(43) > 3 * prefix.page_bytes + prefix.slot_bytes
    prompts = [[3 + (7 * i + j) % 90 for j in range(40)] for i in range(4)]
    answers = []
    for i, ids in enumerate(prompts):
        answers.append(run(eng, [req(f"p{i}", ids, 4)])[f"p{i}"][0])
        assert eng.caches.host_checkpoint_bytes <= eng.caches.host_cache_bytes
    assert prefix.num_host == 3 and eng.caches.host_checkpoint_bytes == eng.caches.host_cache_bytes
    fresh = engine(parts, prefix_cache=False)
    later = prompts[2] + answers[2] + [1, 2]
    got, cached = run(eng, [req("again2", later, 4)])["again2"]
    assert cached == 43 and prefix.hits_host == 1  # the answer's end, from the host tier
    assert got == run(fresh, [req("again2", later, 4)])["again2"][0]
    earlier = prompts[1] + answers[1] + [1, 2]
    got, cached = run(eng, [req("again1", earlier, 4)])["again1"]
    assert cached == 0 and got == run(fresh, [req("again1", earlier, 4)])["again1"][0]
    assert eng.caches.host_checkpoint_bytes <= eng.caches.host_cache_bytes
    assert_all_given_back(eng)


def test_a_paused_request_takes_the_room_of_host_checkpoints(parts):
    """A host budget that host checkpoints fill, then three requests a pool of 20 pages cannot
    hold at once: the paused ones are snapshotted (host checkpoints dropped for the room), none
    replayed, with the tokens they get alone; the budget is never overrun."""
    small = {"kv_capacity": 320, "max_context": 320, "max_concurrency": 3}
    eng = engine(parts, **small, prefix_checkpoints=1, host_cache_mib=64)
    caches = eng.caches
    for i in range(5):  # ten checkpoints, nine of them moved to the host
        run(eng, [req(f"fill{i}", [4 + (11 * i + j) % 83 for j in range(60)])])
    assert caches.prefix.num_host == 9
    caches.host_cache_bytes = caches.host_checkpoint_bytes  # full of checkpoints
    full = caches.prefix.num_host

    def within_budget():
        assert caches.host_bytes_used + caches.host_checkpoint_bytes <= caches.host_cache_bytes

    prompts = {f"r{i}": [6 + (5 * i + j) % 77 for j in range(50 + 5 * i)] for i in range(3)}
    together = run(eng, [req(name, ids, 100) for name, ids in prompts.items()], within_budget)
    stats = eng.scheduler.stats
    assert stats.preempted_snapshot > 0 and stats.preempted_replay == 0
    assert stats.restored == stats.preempted_snapshot
    assert caches.prefix.num_host < full
    alone = engine(parts, prefix_cache=False)
    for name, ids in prompts.items():
        assert together[name][0] == run(alone, [req(name, ids, 100)])[name][0]
    assert caches.host_bytes_used == 0
    assert_all_given_back(eng)
