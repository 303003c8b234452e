"""Hooks the library puts on a user's model, and what a copy of that model makes of them.

``copy.deepcopy(model)`` (an EMA of the weights, a frozen reference model) and ``torch.save(model)`` copy a
module's hooks with it. A plain function or bound method there would drag the engine along (its threads and
locks cannot be copied: "cannot pickle '_thread.lock' object"), or, worse, make the copy call back into the
original engine. Wrapped in :class:`Hook`, a hook copies as a no-op: the copy is a plain model holding the
parameters' current values. Where a copy cannot hold the real values (parameters offloaded to host or NVMe homes,
so the module holds placeholders), or not yet (a step's updates still running beside the next forward), the hook
refuses to be copied and says what to do instead.

Under ``torch.compile`` a hook runs as plain Python, never traced (``torch.compiler.disable``): it moves parameters
and waits on threads and files, which dynamo cannot trace, and a traced copy of its side effects would be replayed
wrongly. The compiled graphs sit between the hooks (a graph break at each module that has some), and autograd's
saved-tensor hooks still see what a compiled graph saves for backward. :func:`unwrap_compiled` is the model the
hooks and every name belong to when the user hands over ``torch.compile(model)``.

Under ``torch.inference_mode()`` a hook runs with inference mode off: the device buffers and placeholders it makes
outlive the block, and an inference tensor could be neither written nor saved for backward after it.
"""

from __future__ import annotations

import functools
import sys
import weakref
from typing import Any, Callable

import torch


def unwrap_compiled(model: torch.nn.Module) -> torch.nn.Module:
    """The module ``torch.compile(model)`` wraps (its names carry no ``_orig_mod.`` prefix), else ``model``."""
    dynamo = sys.modules.get("torch._dynamo")  # not imported yet: nothing can have been compiled (no import here)
    return model._orig_mod if dynamo is not None and isinstance(model, dynamo.eval_frame.OptimizedModule) else model


def weakly(method: Callable[..., Any]) -> Callable[..., Any]:
    """``method`` (bound) called through a weak reference to its object, for hooks on tensors: torch keeps those
    in C++, where the garbage collector cannot see a cycle through them, so a strong one would keep an engine
    (dropped unclosed, with its model) alive to the end of the process. Once the object is gone, nothing."""
    ref = weakref.WeakMethod(method)

    def call(*args: Any, **kwargs: Any) -> Any:
        bound = ref()
        return None if bound is None else bound(*args, **kwargs)
    return call


def _nothing(*_: Any, **__: Any) -> None:
    """What a copied hook does."""


def _copied() -> Callable[..., None]:
    """Unpickling a hook gives the no-op (a module-level function pickles by reference)."""
    return _nothing


class Hook:
    """``fn`` as a hook; ``refuse``: the error a copy of the model raises, or a callable giving it at the time of
    the copy (None: the copy drops the hook)."""

    __slots__ = ("fn", "refuse", "_from_public_api")  # the last: torch's mark on public state_dict post-hooks

    def __init__(self, fn: Callable[..., Any], refuse: str | Callable[[], str | None] | None = None) -> None:
        self.fn, self.refuse = fn, refuse
        _hide_from_dynamo()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if torch.is_inference_mode_enabled():  # what a hook makes (device buffers, placeholders) outlives the
            with torch.inference_mode(False):  # block: an inference tensor could not be written or saved after it
                return self.fn(*args, **kwargs)
        return self.fn(*args, **kwargs)

    def _copy(self) -> None:
        why = self.refuse() if callable(self.refuse) else self.refuse
        if why is not None:
            raise ValueError(why)

    def __deepcopy__(self, memo: dict[int, Any]) -> Callable[..., None]:
        self._copy()
        return _nothing

    def __reduce__(self) -> tuple[Any, tuple[()]]:
        self._copy()
        return _copied, ()


@functools.cache
def _hide_from_dynamo() -> None:
    """Makes ``Hook.__call__`` a frame dynamo never enters (see the module docstring), once, when the first hook is
    made: ``torch.compiler.disable`` imports torch._dynamo, a second or more that ``import offload`` alone (the
    CLI's estimate) need not pay. Disabling a callee instead is not enough: dynamo would then compile every hook's
    own frame, an empty graph guarded on its arguments, and recompile it for each kind of hook."""
    Hook.__call__ = torch.compiler.disable(Hook.__call__)  # type: ignore[method-assign]
