"""Hooks the library puts on a user's model, and what a copy of that model makes of them.

``copy.deepcopy(model)`` (an EMA of the weights, a frozen reference model) and ``torch.save(model)`` copy a
module's hooks with it. A plain function or bound method there would drag the engine along (its threads and
locks cannot be copied: "cannot pickle '_thread.lock' object"), or, worse, make the copy call back into the
original engine. Wrapped in :class:`Hook`, a hook copies as a no-op: the copy is a plain model holding the
parameters' current values. Where a copy cannot hold the real values (parameters offloaded to host or NVMe homes,
so the module holds placeholders), the hook refuses to be copied and says what to use instead.
"""

from __future__ import annotations

from typing import Any, Callable


def _nothing(*_: Any, **__: Any) -> None:
    """What a copied hook does."""


def _copied() -> Callable[..., None]:
    """Unpickling a hook gives the no-op (a module-level function pickles by reference)."""
    return _nothing


class Hook:
    """``fn`` as a hook; ``refuse``: the error a copy of the model raises (None: the copy drops the hook)."""

    __slots__ = ("fn", "refuse")

    def __init__(self, fn: Callable[..., Any], refuse: str | None = None) -> None:
        self.fn, self.refuse = fn, refuse

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def _copy(self) -> None:
        if self.refuse is not None:
            raise ValueError(self.refuse)

    def __deepcopy__(self, memo: dict[int, Any]) -> Callable[..., None]:
        self._copy()
        return _nothing

    def __reduce__(self) -> tuple[Any, tuple[()]]:
        self._copy()
        return _copied, ()
