"""Copying checkpoint tensors into a model's parameters, with the checks every model wants."""
from __future__ import annotations

from typing import Callable, Iterable

import torch
from torch import nn

from ..layers.linear import GroupQuantized


def load_parameters(
    module: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    skip: Callable[[str], bool] | None = None,
) -> None:
    """Copy each ``(name, tensor)`` into the parameter of that name, converting dtype and device.

    Raises ``ValueError`` for a name the model does not have, a shape mismatch (naming the tensor),
    a tensor given twice, and at the end for parameters that were never given. Names for which
    ``skip(name)`` is true are ignored (e.g. ``lm_head.weight`` in a tied checkpoint). Parameters
    shared between modules count once, under their first name.

    A ``GroupQuantized`` tensor goes to its module's ``take_quantized`` (``layers/linear.py``),
    which keeps it quantized in place of the dense parameter; a module without one (a norm, a
    router) refuses it by name. A parameter still on ``meta`` (``build_model(lazy=True)``) takes
    its storage on ``module.load_device`` as its tensor arrives.
    """
    params = dict(module.named_parameters())
    device = getattr(module, "load_device", None)
    loaded: set[str] = set()
    with torch.no_grad():
        for name, tensor in weights:
            if skip is not None and skip(name):
                continue
            param = params.get(name)
            if param is None:
                raise ValueError(
                    f"checkpoint tensor {name!r} has no matching parameter in {type(module).__name__}"
                )
            if name in loaded:
                raise ValueError(f"checkpoint tensor {name!r} given twice")
            if isinstance(tensor, GroupQuantized):
                _place_quantized(module, name, tensor, param.device if device is None else device)
                loaded.add(name)
                continue
            if tuple(tensor.shape) != tuple(param.shape):
                raise ValueError(
                    f"shape mismatch for {name!r}: checkpoint {tuple(tensor.shape)}, "
                    f"model {tuple(param.shape)}"
                )
            if param.is_meta and device is not None:
                param = materialize(module, param, device)
            param.copy_(tensor)
            loaded.add(name)
    missing = sorted(set(params) - loaded)
    if missing:
        shown = ", ".join(missing[:8]) + (f", ... ({len(missing)} in all)" if len(missing) > 8 else "")
        raise ValueError(f"checkpoint is missing parameters: {shown}")


def materialize(module: nn.Module, param: nn.Parameter, device: torch.device | None) -> nn.Parameter:
    """``param`` (on ``meta``) given uninitialised storage on ``device``, in every submodule of
    ``module`` that holds it."""
    if device is None:
        raise ValueError("a parameter on the meta device and no load_device to place it on")
    new = nn.Parameter(torch.empty(param.shape, dtype=param.dtype, device=device), requires_grad=False)
    for _, sub in module.named_modules(remove_duplicate=False):
        for key, p in sub._parameters.items():
            if p is param:
                sub._parameters[key] = new
    return new


def _place_quantized(module: nn.Module, name: str, tensor: GroupQuantized, device: torch.device) -> None:
    owner_name, _, attr = name.rpartition(".")
    owner = module.get_submodule(owner_name)
    take = getattr(owner, "take_quantized", None)
    if take is None or attr not in getattr(owner, "QUANTIZED", ("weight",)):
        raise ValueError(f"checkpoint tensor {name!r} is {tensor.kind}-quantized, and "
                         f"{type(owner).__name__} takes only dense weights")
    take(name, tensor, device)
