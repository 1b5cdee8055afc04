"""Fixed slots for the Gated DeltaNet layers' state, allocated once at startup.

Slot ``s`` of GDN layer ordinal ``g``: ``conv[g, s]`` ``[kernel - 1, conv_dim]`` (raw pre-conv qkv
of the last tokens) and ``recurrent[g, s]`` ``[Hv, K, V]`` in ``state_dtype`` (``--state-dtype``:
fp32 by default; bf16 / fp16 halve it, the layers update it in fp32 and round it once per step
where they store it). A running hybrid sequence
holds exactly one slot; a slot is zeroed when handed out.

``journal`` (a list, or None): where the changes made outside a forward (a slot zeroed, a slot
copied) are noted, for the tensor-parallel ranks to make the same in their own slots (``tp_steps.py``).
"""
from __future__ import annotations

import torch


class OutOfSlotsError(RuntimeError):
    pass


class StateSlotPool:
    def __init__(self, num_gdn_layers: int, num_slots: int, conv_shape: tuple[int, int],
                 recurrent_shape: tuple[int, int, int], dtype: torch.dtype, device: torch.device | str,
                 state_dtype: torch.dtype = torch.float32) -> None:
        self.num_slots = num_slots
        self.num_gdn_layers = num_gdn_layers
        self.conv = torch.zeros((num_gdn_layers, num_slots, *conv_shape), dtype=dtype, device=device)
        self.recurrent = torch.zeros((num_gdn_layers, num_slots, *recurrent_shape), dtype=state_dtype,
                                     device=device)
        # per slot and value head: arrivals of the fused GDN decode step's programs, by which the
        # last reader of a key head's conv state knows it may shift it (gdn_decode_triton.py)
        self.step_counts = torch.zeros((num_slots, recurrent_shape[0]), dtype=torch.int64, device=device)
        self._free: list[int] = list(range(num_slots - 1, -1, -1))
        self.journal: list[tuple] | None = None

    @staticmethod
    def bytes_per_slot(num_gdn_layers: int, conv_shape: tuple[int, int], recurrent_shape: tuple[int, int, int],
                       dtype: torch.dtype, state_dtype: torch.dtype = torch.float32) -> int:
        conv = conv_shape[0] * conv_shape[1] * torch.empty((), dtype=dtype).element_size()
        rec = recurrent_shape[0] * recurrent_shape[1] * recurrent_shape[2] * \
            torch.empty((), dtype=state_dtype).element_size()
        return num_gdn_layers * (conv + rec)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_slots - len(self._free)

    def acquire(self, clear: bool = True) -> int:
        """A free slot, zeroed (``clear``; without it the caller overwrites it whole)."""
        if not self._free:
            raise OutOfSlotsError("no free state slot")
        slot = self._free.pop()
        if clear:
            self.clear(slot)
        return slot

    def clear(self, slot: int) -> None:
        """Zero slot ``slot``'s states."""
        self.conv[:, slot].zero_()
        self.recurrent[:, slot].zero_()
        if self.journal is not None:
            self.journal.append(("clear", slot))

    def release(self, slot: int) -> None:
        self._free.append(slot)

    def copy(self, src: int, dst: int) -> None:
        """Slot ``dst`` takes slot ``src``'s conv and recurrent state (queued on the device)."""
        self.conv[:, dst] = self.conv[:, src]
        self.recurrent[:, dst] = self.recurrent[:, src]
        if self.journal is not None:
            self.journal.append(("copy_slot", src, dst))
