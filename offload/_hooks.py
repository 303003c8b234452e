"""Hooks the library puts on a user's model, and what a copy of that model makes of them.

``copy.deepcopy(model)`` (an EMA of the weights, a frozen reference model) and ``torch.save(model)`` copy a
module's hooks with it. A plain function or bound method there would drag the engine along (its threads and
locks cannot be copied: "cannot pickle '_thread.lock' object"), or, worse, make the copy call back into the
original engine. Wrapped in :class:`Hook`, a hook copies as a no-op: the copy is a plain model holding the
parameters' current values. Where a copy cannot hold the real values (parameters offloaded to host or NVMe homes,
so the module holds placeholders), or not yet (a step's updates still running beside the next forward), the hook
refuses to be copied and says what to do instead.
"""

from __future__ import annotations

from typing import Any, Callable


def _nothing(*_: Any, **__: Any) -> None:
    """What a copied hook does."""


def _copied() -> Callable[..., None]:
    """Unpickling a hook gives the no-op (a module-level function pickles by reference)."""
    return _nothing


class Hook:
    """``fn`` as a hook; ``refuse``: the error a copy of the model raises, or a callable giving it at the time of
    the copy (None: the copy drops the hook)."""

    __slots__ = ("fn", "refuse")

    def __init__(self, fn: Callable[..., Any], refuse: str | Callable[[], str | None] | None = None) -> None:
        self.fn, self.refuse = fn, refuse

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
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
