"""The one place a forward's inputs are moved to the engine's device: the root module's forward pre-hook
(:class:`MoveInputs`), so a batch built on the CPU works unchanged on a GPU.

Tensors in args and kwargs move, nested in lists, tuples, named tuples and mappings (transformers'
``BatchEncoding`` too), asynchronously from pinned memory; with DeepSpeed's ``fp16.auto_cast`` floating ones are
cast to fp16 on the device.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch


def to_device(value: Any, device: torch.device, cast: torch.dtype | None = None) -> Any:
    """``value`` with every tensor in it (through lists, tuples, named tuples and mappings) on ``device``, floating
    ones in ``cast`` if given (DeepSpeed's ``fp16.auto_cast``)."""
    if isinstance(value, torch.Tensor):
        dtype = cast if cast is not None and value.is_floating_point() else value.dtype
        if value.device == device and value.dtype == dtype:
            return value
        # moved first, then cast there: a cast in the same call would convert on the host into pageable memory
        return value.to(device, non_blocking=device.type == "cuda" and value.is_pinned()).to(dtype)
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(to_device(v, device, cast) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(to_device(v, device, cast) for v in value)
    if isinstance(value, Mapping):  # dicts, and UserDicts such as transformers' BatchEncoding
        moved = {k: to_device(v, device, cast) for k, v in value.items()}
        try:
            return type(value)(moved)
        except TypeError:  # a mapping that cannot be built from a dict
            return moved
    return value


class MoveInputs:
    """The root module's forward pre-hook (``with_kwargs``): owns where inputs go and the cast, nothing of the
    engine's, so the hook keeps no engine alive."""

    __slots__ = ("device", "cast")

    def __init__(self, device: torch.device, cast: torch.dtype | None) -> None:
        self.device, self.cast = device, cast

    def __call__(self, module: torch.nn.Module, args: tuple[Any, ...],
                 kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        return to_device(args, self.device, self.cast), to_device(kwargs, self.device, self.cast)
