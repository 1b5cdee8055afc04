"""Host memory for state moved off the device: extents of slabs that are kept and reused, within
the budget; copies of pages and state slots that come back exactly, in parts no larger than a slab."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from ninfer.engine.cache.host import ALIGN, HostArena, HostTier
from ninfer.engine.cache.kv_pool import PagedKVPool
from ninfer.engine.cache.state_pool import StateSlotPool

MIB = 1 << 20


def test_extents_come_from_kept_slabs_first_fit_and_merge_when_given_back():
    arena = HostArena(budget=4 * MIB, pinned=False, slab_bytes=MIB)
    a, b, c = arena.take(100), arena.take(ALIGN + 1), arena.take(3000)
    assert (a.size, b.size, c.size) == (ALIGN, 2 * ALIGN, ALIGN)
    assert (a.slab, a.offset, b.offset, c.offset) == (0, 0, ALIGN, 3 * ALIGN)
    assert arena.allocated == MIB and arena.used == 4 * ALIGN
    arena.give(a)
    arena.give(b)  # merges with a's room: one run of three blocks at the start
    d = arena.take(3 * ALIGN)
    assert (d.slab, d.offset) == (0, 0)
    arena.give(c)
    arena.give(d)
    assert arena.used == 0 and arena.allocated == MIB  # kept for the next copies
    whole = arena.take(MIB)
    assert (whole.slab, whole.offset) == (0, 0)  # everything merged back into one free run
    big = arena.take(2 * MIB + 1)  # larger than a slab: a slab of its own
    assert big.slab == 1 and arena.allocated == MIB + 2 * MIB + ALIGN
    assert arena.take(MIB) is None  # the budget holds no other slab of a MiB
    last = arena.take(MIB - 2 * ALIGN)  # but the last of it, sized to fit
    assert last is not None and arena.allocated <= arena.budget


def test_with_room_kept_ahead_slabs_are_taken_while_idle_never_by_a_copy_but_the_first():
    """Pinning stalls every CUDA call of the process: with ``ahead`` set, slabs come from
    ``grow`` (the engine calls it while idle), up to ``ahead`` bytes free; ``take`` makes only the
    first one."""
    arena = HostArena(budget=8 * MIB, pinned=False, slab_bytes=MIB, ahead=3 * MIB)
    first = arena.take(MIB // 2)
    assert first is not None and arena.allocated == MIB  # nothing to serve from: the first slab
    assert arena.take(MIB) is None  # no free room: nothing pinned in the middle of serving
    grown = 0
    while arena.grow():
        grown += 1
    assert grown == 3 and arena.allocated - arena.used >= 3 * MIB
    while arena.take(MIB) is not None or arena.grow():  # serving and idle times, until the budget is full
        assert arena.allocated <= 8 * MIB
    assert arena.allocated == 8 * MIB and arena.used >= 7 * MIB
    assert not arena.grow()
    assert not HostArena(budget=8 * MIB, pinned=False, slab_bytes=MIB).grow()  # none kept ahead: none grown


def _pools(pages: int = 16, slots: int = 3):
    g = torch.Generator().manual_seed(0)
    kv = PagedKVPool(2, pages, 64, 2, 32, torch.bfloat16, "cpu")  # 16 KiB of keys a page
    kv.keys.copy_(torch.randn(kv.keys.shape, generator=g))
    kv.values.copy_(torch.randn(kv.values.shape, generator=g))
    states = StateSlotPool(3, slots, (3, 20), (2, 4, 4), torch.bfloat16, "cpu")
    states.conv.copy_(torch.randn(states.conv.shape, generator=g))
    states.recurrent.copy_(torch.randn(states.recurrent.shape, generator=g))
    return kv, states


def test_a_copy_larger_than_a_slab_goes_in_parts_and_comes_back_exactly():
    kv, states = _pools()
    page = 2 * kv.keys[:, 0].numel() * 2
    tier = HostTier(kv, states, budget=MIB, device=torch.device("cpu"), slab_bytes=3 * page)
    assert tier.part_pages == 3
    src = [9, 2, 4, 11, 0, 7, 5]
    copy = tier.take(len(src), state=True)
    assert [(p.start, p.count) for p in copy.kv] == [(0, 3), (3, 3), (6, 1)]
    assert copy.kv_bytes == 7 * page and copy.state_bytes == tier.slot_bytes
    assert copy.nbytes == tier.nbytes(7, True) == tier.arena.used
    tier.to_host(copy, src, slot=1)
    dst = [1, 3, 6, 8, 10, 12, 13]
    tier.to_device(copy, dst, slot=2)
    assert torch.equal(kv.keys[:, dst], kv.keys[:, src]) and torch.equal(kv.values[:, dst], kv.values[:, src])
    assert torch.equal(states.conv[:, 2], states.conv[:, 1])
    assert torch.equal(states.recurrent[:, 2], states.recurrent[:, 1])
    tier.give(copy)
    tier.give(copy)  # a second time changes nothing
    assert tier.arena.used == 0 and copy.nbytes == 0


def test_a_copy_the_budget_cannot_hold_takes_nothing():
    kv, states = _pools()
    tier = HostTier(kv, states, budget=8 * ALIGN, device=torch.device("cpu"), slab_bytes=8 * ALIGN)
    assert tier.take(16, state=True) is None
    assert tier.arena.used == 0  # the parts that fitted were given back
    small = tier.take(1, state=False)
    assert small is not None and small.conv is None and small.state_bytes == 0


@pytest.mark.parametrize("state", [True, False])
def test_the_bytes_a_copy_takes_are_known_before_it_is_taken(state):
    kv, states = _pools()
    tier = HostTier(kv, states, budget=MIB, device=torch.device("cpu"), slab_bytes=5 * ALIGN)
    for pages in (1, 3, 7):
        copy = tier.take(pages, state)
        assert copy.nbytes == tier.nbytes(pages, state)
        tier.give(copy)


class _SlowPins(HostArena):
    """Slabs that take ``PIN_S`` each, as pinning one does on a GPU (156 ms for 256 MiB)."""

    PIN_S = 0.4

    def _add(self, nbytes: int, taken: int = 0) -> int:
        time.sleep(self.PIN_S)
        return super()._add(nbytes, taken)


def test_a_request_sent_as_the_last_one_ends_never_waits_for_a_slab_being_pinned(tmp_path, monkeypatch):
    """The engine pins host memory only once it has been idle for ``IDLE_PIN_AFTER_S``: a
    conversation's next turn, sent as the last answer ends, is admitted at once, not after a slab
    (every CUDA call of the process waits while one is pinned); once the engine is quiet the room
    kept ahead is pinned."""
    from ninfer.engine.engine import LLMEngine
    from ninfer.engine.engine_config import EngineConfig
    from ninfer.engine.loader import load_checkpoint, load_model
    from ninfer.engine.loop import EngineLoop
    from ninfer.engine.request import Request
    from ninfer.engine.sampling_params import SamplingParams
    from support.tiny import save_tiny_llama

    monkeypatch.setattr(LLMEngine, "IDLE_PIN_AFTER_S", 0.5)
    ckpt = load_checkpoint(save_tiny_llama(tmp_path / "ckpt"))
    eng = LLMEngine(load_model(ckpt, "cpu", torch.float32), ckpt.tokenizer,
                    EngineConfig(max_context=256, max_concurrency=1, kv_capacity=512, host_cache_mib=64))
    eng.caches.host.arena = arena = _SlowPins(64 * MIB, pinned=False, slab_bytes=MIB, ahead=3 * MIB)
    loop = EngineLoop(eng)
    loop.start()
    try:
        admitted_after = []
        for turn in range(3):
            done = threading.Event()
            sent = time.monotonic()

            def sink(out, sent=sent, done=done):
                if out.admitted:
                    admitted_after.append(time.monotonic() - sent)
                if out.finished:
                    done.set()

            loop.submit(Request(f"turn{turn}", [5 + turn] * 40, SamplingParams(temperature=0.0, max_tokens=4),
                                max_total_tokens=256), sink)
            assert done.wait(30)
        assert max(admitted_after) < _SlowPins.PIN_S / 2  # no turn found a slab being pinned
        assert arena.allocated == 0
        deadline = time.monotonic() + 10
        while arena.allocated < 3 * MIB and time.monotonic() < deadline:  # quiet: the room kept ahead comes
            time.sleep(0.05)
        assert arena.allocated == 3 * MIB
    finally:
        loop.stop()
