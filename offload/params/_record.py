"""One managed parameter's record: its state on the device, explicit in :class:`ParamState`, which every part of
parameter offload reads and only the device window (``_window.py``) moves::

    RELEASED --fetch--> FETCHING --(copy/read done)--> AVAILABLE --release (no user left)--> RELEASED
    AVAILABLE --(gradient done, an update follows)--> LANDING --(the update wrote every part)--> AVAILABLE
                                                      LANDING --(a fetch, no room, no update)--> RELEASED

While RELEASED, ``p.data`` is one NaN element expanded to the parameter's shape (the shape stays true for
autograd, which lays out a gradient to match it, and a use that bypassed the hooks shows as NaN rather than as
plausible numbers); while AVAILABLE it is a device buffer counted on the DEVICE tier.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch


class ParamState(Enum):
    RELEASED = "released"
    FETCHING = "fetching"
    AVAILABLE = "available"
    LANDING = "landing"  # not usable: its device buffer waits for the optimizer's new values (_landing.py)


@dataclass(eq=False)
class ParamRecord:
    index: int  # position in ParameterOffload.params
    param: torch.nn.Parameter
    shape: torch.Size
    numel: int
    home: torch.Tensor | None  # HOST home: a view of the optimizer's flat host buffer (or a private host copy)
    persistent: bool
    state: ParamState = ParamState.RELEASED
    device: torch.Tensor | None = None
    after: Any = None  # a reused device buffer: the compute-stream point after which it may be overwritten
    pending: Any = None  # the fetch in flight (a Copy, a SwapHandle, a gather or a Future), cleared when waited
    users: int = 0  # modules currently running with it (a module may be entered again before it exits)
    parts: tuple[tuple[int, int], ...] = ()  # NVMe home: (start, numel) of each key, covering the parameter
    stale: bool = False  # AVAILABLE, but the home holds a newer value (copied again at the next fetch)
    sharded: bool = False  # stage 3 on several ranks: the home is this rank's piece; a fetch all-gathers
    trains: bool = True  # requires_grad at construction: only these take the optimizer's updates
    held: int = 0  # hold() calls not yet undone: kept on the device, never released, outside the traces
