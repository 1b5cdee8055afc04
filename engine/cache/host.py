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
from .state_pool import StateSlotPool

ALIGN = 4096  # extents and the regions inside them start at multiples of this
SLAB_BYTES = 256 << 20  # host memory is taken in slabs of this size (larger for a larger copy)


def _round(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass(eq=False)
class Extent:
    slab: int
    offset: int
    size: int
    data: torch.Tensor  # uint8 [size], a view of the slab


class HostArena:
    """Extents of host memory within ``budget`` bytes, from slabs taken as they are needed and
    kept (first fit; freed extents merge with their free neighbours)."""

    def __init__(self, budget: int, pinned: bool, slab_bytes: int = SLAB_BYTES) -> None:
        self.budget = budget
        self.pinned = pinned
        self.slab_bytes = max(ALIGN, min(_round(slab_bytes), budget // ALIGN * ALIGN))
        self._slabs: list[torch.Tensor] = []
        self._free: list[list[tuple[int, int]]] = []  # per slab: its free (offset, size), by offset
        self.allocated = 0  # bytes in slabs
        self.used = 0  # bytes in extents taken

    @staticmethod
    def size_of(nbytes: int) -> int:
        """The bytes an extent for ``nbytes`` takes."""
        return _round(max(nbytes, 1))

    def take(self, nbytes: int) -> Extent | None:
        """An extent of at least ``nbytes``: from a slab's free room, else from a new slab while
        the budget allows; None where neither has room."""
        size = self.size_of(nbytes)
        for s, free in enumerate(self._free):
            for i, (off, n) in enumerate(free):
                if n >= size:
                    if n == size:
                        free.pop(i)
                    else:
                        free[i] = (off + size, n - size)
                    return self._extent(s, off, size)
        slab = max(self.slab_bytes, size)
        if self.allocated + slab > self.budget:
            slab = size  # the budget's last room: no more than this copy needs
            if self.allocated + slab > self.budget:
                return None
        self._slabs.append(torch.empty(slab, dtype=torch.uint8, pin_memory=self.pinned))
        self._free.append([(size, slab - size)] if slab > size else [])
        self.allocated += slab
        return self._extent(len(self._slabs) - 1, 0, size)

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


@dataclass(eq=False)
class HostCopy:
    """A sequence's state in host memory: the KV rows of its pages, its GDN states, in one extent."""

    extent: Extent | None  # None once given back
    keys: torch.Tensor | None  # [L_attn, pages, P, Hkv, D]
    values: torch.Tensor | None
    conv: torch.Tensor | None  # [L_gdn, W-1, C]
    recurrent: torch.Tensor | None  # [L_gdn, Hv, K, V]
    kv_bytes: int  # the data it holds (its extent may be a little larger)
    state_bytes: int
    event: torch.cuda.Event | None = None  # recorded after the copy from the device (CUDA only)

    @property
    def nbytes(self) -> int:
        """The host memory it takes."""
        return 0 if self.extent is None else self.extent.size

    @property
    def num_pages(self) -> int:
        return 0 if self.keys is None else self.keys.shape[1]


class HostTier:
    """The host budget's arena and the copies of pages and state slots to and from it."""

    def __init__(self, kv: PagedKVPool | None, states: StateSlotPool | None, budget: int,
                 device: torch.device) -> None:
        self.kv = kv
        self.states = states
        self.device = device
        self.arena = HostArena(budget, pinned=device.type == "cuda")
        self.page_bytes = 0 if kv is None else 2 * kv.keys[:, 0].numel() * kv.keys.element_size()
        self.slot_bytes = 0 if states is None else \
            states.conv[:, 0].numel() * states.conv.element_size() + \
            states.recurrent[:, 0].numel() * states.recurrent.element_size()
        self._stream: torch.cuda.Stream | None = None

    @property
    def budget(self) -> int:
        return self.arena.budget

    def nbytes(self, pages: int, state: bool) -> int:
        """Host memory a copy of ``pages`` KV pages (and a slot's states) takes."""
        return self.arena.size_of(sum(_round(n) for n in self._regions(pages, state)))

    def _regions(self, pages: int, state: bool) -> list[int]:
        half = pages * self.page_bytes // 2
        conv = rec = 0
        if state and self.states is not None:
            conv = self.states.conv[:, 0].numel() * self.states.conv.element_size()
            rec = self.states.recurrent[:, 0].numel() * self.states.recurrent.element_size()
        return [half, half, conv, rec]

    def take(self, pages: int, state: bool) -> Extent | None:
        return self.arena.take(self.nbytes(pages, state))

    def give(self, copy: HostCopy | None) -> None:
        """Give ``copy``'s host memory back (a copy still queued on the side stream is ordered
        before any later one that takes it)."""
        if copy is not None and copy.extent is not None:
            self.arena.give(copy.extent)
            copy.extent = None

    def _views(self, ext: Extent, pages: int, state: bool) -> list[torch.Tensor | None]:
        out, offset = [], 0
        shapes = [(self.kv, "keys"), (self.kv, "values"), (self.states, "conv"), (self.states, "recurrent")]
        for (pool, name), n in zip(shapes, self._regions(pages, state)):
            if pool is None or (name in ("conv", "recurrent") and not state):
                out.append(None)
                continue
            src = getattr(pool, name)
            shape = (src.shape[0], pages, *src.shape[2:]) if pool is self.kv else (src.shape[0], *src.shape[2:])
            out.append(ext.data[offset : offset + n].view(src.dtype).view(shape))
            offset += _round(n)
        return out

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

    def to_host(self, ext: Extent, pages: list[int], slot: int | None) -> HostCopy:
        """Copy ``pages``' KV rows and ``slot``'s states into extent ``ext`` (from ``take``): on
        CUDA queued on the side stream (``event`` says when it is done), on a CPU done."""
        stream, on_side = self._side()
        keys, values, conv, recurrent = self._views(ext, len(pages), slot is not None)
        with on_side:
            if keys is not None and pages:
                idx = self._index(pages)
                keys.copy_(self.kv.keys.index_select(1, idx), non_blocking=stream is not None)
                values.copy_(self.kv.values.index_select(1, idx), non_blocking=stream is not None)
            if conv is not None:
                conv.copy_(self.states.conv[:, slot], non_blocking=stream is not None)
                recurrent.copy_(self.states.recurrent[:, slot], non_blocking=stream is not None)
        copy = HostCopy(ext, keys, values, conv, recurrent, len(pages) * self.page_bytes,
                        0 if conv is None else self.slot_bytes)
        if stream is not None:
            copy.event = torch.cuda.Event()
            copy.event.record(stream)
        return copy

    def to_device(self, copy: HostCopy, pages: list[int], slot: int | None) -> None:
        """``copy``'s tensors into ``pages`` and ``slot``: on CUDA on the side stream (behind its
        own copy to host, if that is still in flight), the current stream waiting for them on
        the GPU before anything that reads them."""
        stream, on_side = self._side()
        with on_side:
            if copy.keys is not None and pages:
                idx = self._index(pages)
                self.kv.keys.index_copy_(1, idx, copy.keys.to(self.device, non_blocking=stream is not None))
                self.kv.values.index_copy_(1, idx, copy.values.to(self.device, non_blocking=stream is not None))
            if slot is not None and copy.conv is not None:
                self.states.conv[:, slot] = copy.conv.to(self.device, non_blocking=stream is not None)
                self.states.recurrent[:, slot] = copy.recurrent.to(self.device, non_blocking=stream is not None)
        if stream is not None:
            done = torch.cuda.Event()
            done.record(stream)
            torch.cuda.current_stream(self.device).wait_event(done)

    def wait_on_device(self, event: torch.cuda.Event | None) -> None:
        """Make the current stream wait (on the GPU, not the host) for ``event``: what it queues
        next may overwrite what that copy read."""
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)
