"""A CUDA graph's stand-in on a CPU: the operations run while it is captured are recorded, and a
replay runs them again over the very tensors they ran on, results written into the tensors the
capture made.

So what a captured graph would get wrong, this gets wrong too: a value read on the host during
the capture is baked in (and reading one is refused, as a capture refuses it), a tensor made
during the capture is the same tensor at every replay, and only what the recorded operations
read can change between replays. Tensors made by the capture are kept alive by the recording
(a CUDA graph's pool keeps their memory).
"""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

_FRESH = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"}


class _Recording(TorchDispatchMode):
    def __init__(self, ops: list) -> None:
        super().__init__()
        self.ops = ops

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name in ("_local_scalar_dense", "item"):
            raise RuntimeError(f"{func}: a device value read on the host while a graph is captured")
        out = func(*args, **kwargs)
        if name not in _FRESH:
            self.ops.append((func, args, kwargs, out))
        return out


def _storages(args, kwargs) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}


class RecordedGraph:
    """``capture_begin`` / ``capture_end`` / ``replay``, as ``torch.cuda.CUDAGraph``."""

    def __init__(self) -> None:
        self.ops: list = []
        self._mode: _Recording | None = None
        self.replays = 0

    def capture_begin(self, pool=None) -> None:
        self._mode = _Recording(self.ops)
        self._mode.__enter__()

    def capture_end(self) -> None:
        self._mode.__exit__(None, None, None)
        self._mode = None

    def replay(self) -> None:
        self.replays += 1
        for func, args, kwargs, out in self.ops:
            again = func(*args, **kwargs)
            inputs = _storages(args, kwargs)  # an output on an input's storage (a view, an op in place) is there already
            for dst, src in zip(tree_flatten(out)[0], tree_flatten(again)[0]):
                if isinstance(dst, torch.Tensor) and dst.untyped_storage().data_ptr() not in inputs:
                    dst.copy_(src)
