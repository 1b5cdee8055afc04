"""Host memory for state moved off the device, and the copies between them.

Prefix checkpoints evicted from the device (``prefix.py``) and paused requests' snapshots
(``manager.py``) share one budget of host memory. It is taken in slabs and kept for reuse
(``HostArena``): pinned on CUDA, where pinning is slow and the driver serializes it, so it happens
once per slab, never per copy. A copy is one extent of a slab, viewed as the tensors it holds.

On CUDA every copy between the tiers runs on one side stream (``HostTier``): a copy to host is
queued behind the work queued so far and records an event, which says when the device pages and
slot it read may be written again; a copy to the device makes the current stream wait for it
on the GPU. The host never waits for either. Because every read and write of host extents is on
that one stream, an extent given back may be taken by the next copy at once: the stream orders
them. On a CPU the copies are done when the call returns.
"""
from __future__ import annotations

import bisect
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from .kv_pool import PagedKVPool
from .kv_quant import raw_bytes
from .state_pool import StateSlotPool

ALIGN = 4096  # extents and the regions inside them start at multiples of this
# host memory is taken in slabs of this size, or of one slot's states where that is larger: a
# slab pinned while the engine is idle holds every CUDA call of the process for as long as the
# driver takes to pin it (about 0.6 ms a MiB on an H200), so slabs are kept small
SLAB_BYTES = 64 << 20
AHEAD_BYTES = 2 << 30  # free room pinned ahead of need (within the budget): at start, then while the engine is idle


def _round(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass(eq=False)
class Extent:
    slab: int
    offset: int
    size: int
    data: torch.Tensor  # uint8 [size], a view of the slab


class HostArena:
    """Extents of host memory within ``budget`` bytes, from slabs that are kept (first fit; freed
    extents merge with their free neighbours). Pinned slabs (CUDA) take a while to allocate, and
    while the driver pins one no other CUDA call of the process goes on (measured on an H200:
    256 MiB in 156 ms, kernel launches on another thread held the whole time; hence small slabs), so with ``ahead``
    set (CUDA) they are not taken in the middle of serving: ``grow`` adds one at a time, up to
    ``ahead`` bytes free (the engine grows them all at start, then one whenever it has been idle
    for ``LLMEngine.IDLE_PIN_AFTER_S``), and ``take`` makes a slab itself only for the first one.
    Without it (CPU: plain memory) a slab is taken whenever a copy needs one."""

    def __init__(self, budget: int, pinned: bool, slab_bytes: int = SLAB_BYTES, ahead: int = 0) -> None:
        self.budget = budget
        self.pinned = pinned
        self.slab_bytes = max(ALIGN, min(_round(slab_bytes), budget // ALIGN * ALIGN))
        self.ahead = min(ahead, budget)
        self._slabs: list[torch.Tensor] = []
        self._free: list[list[tuple[int, int]]] = []  # per slab: its free (offset, size), by offset
        self.allocated = 0  # bytes in slabs
        self.used = 0  # bytes in extents taken

    @staticmethod
    def size_of(nbytes: int) -> int:
        """The bytes an extent for ``nbytes`` takes."""
        return _round(max(nbytes, 1))

    def take(self, nbytes: int) -> Extent | None:
        """An extent of at least ``nbytes``: from a slab's free room, else (without ``ahead``, or
        the first slab) from a new slab while the budget allows; None where neither has room."""
        size = self.size_of(nbytes)
        for s, free in enumerate(self._free):
            for i, (off, n) in enumerate(free):
                if n >= size:
                    if n == size:
                        free.pop(i)
                    else:
                        free[i] = (off + size, n - size)
                    return self._extent(s, off, size)
        if self.ahead and self._slabs:
            return None
        slab = max(self.slab_bytes, size)
        if self.allocated + slab > self.budget:
            slab = size  # the budget's last room: no more than this needs
            if self.allocated + slab > self.budget:
                return None
        return self._extent(self._add(slab, size), 0, size)

    def _add(self, nbytes: int, taken: int = 0) -> int:
        """A new slab of ``nbytes`` (its first ``taken`` bytes in use); its index."""
        self._slabs.append(torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pinned))
        self._free.append([(taken, nbytes - taken)] if nbytes > taken else [])
        self.allocated += nbytes
        return len(self._slabs) - 1

    def _extent(self, slab: int, offset: int, size: int) -> Extent:
        self.used += size
        return Extent(slab, offset, size, self._slabs[slab][offset : offset + size])

    def give(self, ext: Extent) -> None:
        """Return ``ext`` to its slab's free room (merged with free neighbours)."""
        free = self._free[ext.slab]
        i = bisect.bisect(free, (ext.offset, 0))
        off, n = ext.offset, ext.size
        if i < len(free) and free[i][0] == off + n:  # the free run after it
            n += free.pop(i)[1]
        if i > 0 and free[i - 1][0] + free[i - 1][1] == off:  # the one before
            off, n = free[i - 1][0], free[i - 1][1] + n
            free[i - 1] = (off, n)
        else:
            free.insert(i, (off, n))
        self.used -= ext.size

    def grow(self) -> bool:
        """Add one slab where fewer than ``ahead`` bytes are free and the budget has room for it
        (the engine calls this while it has no work); whether it did."""
        if self.allocated - self.used >= self.ahead or self.allocated + self.slab_bytes > self.budget:
            return False
        self._add(self.slab_bytes)
        return True


@dataclass(eq=False)
class KVPart:
    """Pages ``start`` to ``start + count`` of a copy: their keys and values (and, quantized, their
    scales), in one extent, a region each."""

    start: int
    count: int
    extent: Extent
    tensors: list[torch.Tensor]  # like PagedKVPool.tensors: [L_attn, count, P, Hkv, D] keys, values, ...

    @property
    def keys(self) -> torch.Tensor:
        return self.tensors[0]

    @property
    def values(self) -> torch.Tensor:
        return self.tensors[1]


@dataclass(eq=False)
class HostCopy:
    """A sequence's state in host memory: the KV rows of its pages (in parts of at most a slab)
    and its GDN states (an extent of their own)."""

    kv: list[KVPart]
    state: Extent | None
    conv: torch.Tensor | None  # [L_gdn, W-1, C]
    recurrent: torch.Tensor | None  # [L_gdn, Hv, K, V]
    num_pages: int
    kv_bytes: int  # the data it holds (its extents may be a little larger)
    state_bytes: int
    event: torch.cuda.Event | None = None  # recorded after the copy from the device (CUDA only)
    released: bool = False

    @property
    def extents(self) -> list[Extent]:
        return [p.extent for p in self.kv] + ([self.state] if self.state is not None else [])

    @property
    def nbytes(self) -> int:
        """The host memory it takes."""
        return 0 if self.released else sum(e.size for e in self.extents)


class HostTier:
    """The host budget's arena and the copies of pages and state slots to and from it."""

    def __init__(self, kv: PagedKVPool | None, states: StateSlotPool | None, budget: int,
                 device: torch.device, slab_bytes: int = SLAB_BYTES) -> None:
        self.kv = kv
        self.states = states
        self.device = device
        cuda = device.type == "cuda"
        # bytes of one page in each of the pool's tensors (keys, values and, quantized, their scales)
        self.tensor_page_bytes = [] if kv is None else [t[:, 0].numel() * t.element_size() for t in kv.tensors]
        self.page_bytes = sum(self.tensor_page_bytes)
        self.conv_bytes = 0 if states is None else states.conv[:, 0].numel() * states.conv.element_size()
        self.recurrent_bytes = 0 if states is None else \
            states.recurrent[:, 0].numel() * states.recurrent.element_size()
        self.slot_bytes = self.conv_bytes + self.recurrent_bytes
        # a slab holds at least one slot's states (their extent is never split)
        slab_bytes = max(slab_bytes, _round(self.conv_bytes) + self.recurrent_bytes)
        self.arena = HostArena(budget, pinned=cuda, slab_bytes=slab_bytes, ahead=AHEAD_BYTES if cuda else 0)
        # pages per KV part: as many as one slab holds (at least one)
        self.part_pages = max(1, self.arena.slab_bytes // max(self._kv_size(1), 1))
        self._stream: torch.cuda.Stream | None = None

    def _kv_size(self, pages: int) -> int:
        return sum(_round(pages * b) for b in self.tensor_page_bytes)

    def _parts(self, pages: int) -> list[tuple[int, int]]:
        return [(s, min(self.part_pages, pages - s)) for s in range(0, pages, self.part_pages)]

    def nbytes(self, pages: int, state: bool) -> int:
        """Host memory a copy of ``pages`` KV pages (and a slot's states) takes."""
        kv = sum(self.arena.size_of(self._kv_size(n)) for _, n in self._parts(pages)) if self.kv is not None else 0
        st = self.arena.size_of(_round(self.conv_bytes) + self.recurrent_bytes) if state and self.states else 0
        return kv + st

    def take(self, pages: int, state: bool) -> HostCopy | None:
        """Host memory for a copy of ``pages`` KV pages (and a slot's states), as the views it is
        copied into; None (nothing taken) where the arena has no room for it."""
        state = state and self.states is not None
        parts = self._parts(pages) if self.kv is not None else []
        sizes = [self._kv_size(n) for _, n in parts] + ([_round(self.conv_bytes) + self.recurrent_bytes] if state else [])
        taken: list[Extent] = []
        for n in sizes:
            ext = self.arena.take(n)
            if ext is None:
                for e in taken:
                    self.arena.give(e)
                return None
            taken.append(ext)
        kv = []
        for (start, count), ext in zip(parts, taken):
            views, at = [], 0
            for t, b in zip(self.kv.tensors, self.tensor_page_bytes):
                views.append(ext.data[at : at + count * b].view(t.dtype).view(t.shape[0], count, *t.shape[2:]))
                at += _round(count * b)
            kv.append(KVPart(start, count, ext, views))
        st = conv = recurrent = None
        if state:
            st, at = taken[-1], _round(self.conv_bytes)
            conv = st.data[: self.conv_bytes].view(self.states.conv.dtype).view(
                self.states.conv.shape[0], *self.states.conv.shape[2:])
            recurrent = st.data[at : at + self.recurrent_bytes].view(self.states.recurrent.dtype).view(
                self.states.recurrent.shape[0], *self.states.recurrent.shape[2:])
        return HostCopy(kv, st, conv, recurrent, pages, pages * self.page_bytes, self.slot_bytes if state else 0)

    def give(self, copy: HostCopy | None) -> None:
        """Give ``copy``'s host memory back (a copy still queued on the side stream is ordered
        before any later one that takes it)."""
        if copy is not None and not copy.released:
            for ext in copy.extents:
                self.arena.give(ext)
            copy.released = True

    # ------------------------------------------------------------------ copies
    def _side(self) -> tuple[torch.cuda.Stream | None, object]:
        """The side stream (CUDA; None on a CPU), made to wait for the work queued so far, and a
        context that runs on it."""
        if self.device.type != "cuda":
            return None, nullcontext()
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        return self._stream, torch.cuda.stream(self._stream)

    def _index(self, pages: list[int]) -> torch.Tensor:
        """``pages`` as a device index, sent without the host waiting (pinned on CUDA)."""
        idx = torch.tensor(pages, dtype=torch.long)
        if self.device.type != "cuda":
            return idx
        return idx.pin_memory().to(self.device, non_blocking=True)

    def to_host(self, copy: HostCopy, pages: list[int], slot: int | None) -> HostCopy:
        """Copy ``pages``' KV rows and ``slot``'s states into ``copy`` (from ``take``): on CUDA
        queued on the side stream (``event`` says when it is done), on a CPU done."""
        stream, on_side = self._side()
        async_ = stream is not None
        with on_side:
            if copy.kv:
                idx = self._index(pages)
                for part in copy.kv:
                    sub = idx[part.start : part.start + part.count]
                    for view, t in zip(part.tensors, self.kv.tensors):
                        view.copy_(t.index_select(1, sub), non_blocking=async_)
            if copy.conv is not None and slot is not None:
                copy.conv.copy_(self.states.conv[:, slot], non_blocking=async_)
                copy.recurrent.copy_(self.states.recurrent[:, slot], non_blocking=async_)
        if async_:
            copy.event = torch.cuda.Event()
            copy.event.record(stream)
        return copy

    def to_device(self, copy: HostCopy, pages: list[int], slot: int | None) -> None:
        """``copy``'s tensors into ``pages`` and ``slot``: on CUDA on the side stream (behind its
        own copy to host, if that is still in flight), the current stream waiting for them on
        the GPU before anything that reads them."""
        stream, on_side = self._side()
        async_ = stream is not None
        with on_side:
            if copy.kv:
                idx = self._index(pages)
                for part in copy.kv:
                    sub = idx[part.start : part.start + part.count]
                    for view, t in zip(part.tensors, self.kv.tensors):
                        raw_bytes(t).index_copy_(1, sub, raw_bytes(view.to(self.device, non_blocking=async_)))
            if slot is not None and copy.conv is not None:
                self.states.conv[:, slot] = copy.conv.to(self.device, non_blocking=async_)
                self.states.recurrent[:, slot] = copy.recurrent.to(self.device, non_blocking=async_)
        if async_:
            done = torch.cuda.Event()
            done.record(stream)
            torch.cuda.current_stream(self.device).wait_event(done)

    def wait_on_device(self, event: torch.cuda.Event | None) -> None:
        """Make the current stream wait (on the GPU, not the host) for ``event``: what it queues
        next may overwrite what that copy read."""
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)
