"""Progress bars (tqdm) for long work of the command line and the benches: on stderr when it is a terminal, off
otherwise, so logs and CI output stay plain lines."""

from __future__ import annotations

import sys
from typing import Iterable, TypeVar

from tqdm import tqdm

T = TypeVar("T")


def interactive() -> bool:
    return sys.stderr.isatty()


def bar(total: float | None = None, desc: str = "", unit: str = "it", *, unit_scale: bool = False) -> tqdm:
    """A bar to ``update()`` by hand; disabled (every call a no-op) when stderr is not a terminal."""
    return tqdm(total=total, desc=desc, unit=unit, unit_scale=unit_scale, file=sys.stderr, leave=False,
                dynamic_ncols=True, disable=not interactive())


def progress(items: Iterable[T], desc: str, total: int | None = None) -> Iterable[T]:
    """``items``, with a bar while they are consumed (in a terminal)."""
    if not interactive():
        return items
    return tqdm(items, desc=desc, total=total, file=sys.stderr, leave=False, dynamic_ncols=True)
