"""Update sinks: the one way the optimizer hands a sub-group's new low-precision parameters to where they live.

The optimizer's update of sub-group ``sg`` writes the new values into the buffer its sink lends (:meth:`take`:
the destination itself where the CPU Adam kernel can write it in its own pass, else a host staging buffer), or
with the state on the device lands them there (:meth:`land`), then hands them over (:meth:`put`); the sink does
the rest. :class:`~offload.params._weights.Weights` picks one sink per engine, by where the parameters live:

* :class:`FlatSink`: flat buffers the update writes in place: the device's own on the CPU device tier, the delayed
  update's host copies, the host homes of parameter offload, this rank's owned range of stage 3's host pieces;
* :class:`UploadSink`: the device's flats on CUDA, reached through pinned staging on the host-to-device stream,
  behind the point where the compute stream stops reading them;
* :class:`HomeSink`: parameter offload's NVMe homes (:meth:`ParameterOffload.write_home_part` per segment, which
  also copies a landing parameter's part to its device buffer);
* :class:`PieceSink`: this rank's stage-3 pieces on NVMe (:meth:`ParamShards.write_updated`).

The staged sinks reuse a buffer once what last read it (a copy, the writes) is done, so the next updates run while
the writes wait their turn on the disk. A sink runs on the optimizer's thread (``take``, ``land``, ``put``); the
training thread waits for its writes (``wait``) and closes it once the optimizer is idle.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

import torch

from ..memory import Copy, CopyStreams, StagingRing, TieredStore, start_all
from ..optim._layout import FlatLayout, SubGroup

if TYPE_CHECKING:
    from ._offload import ParameterOffload
    from ._shards import ParamShards

_FIX_STAGING = ("lower zero_optimization.sub_group_size, offload the optimizer to nvme, or raise "
                "offload.host_memory_budget")


class UpdateSink(ABC):
    """Where a sub-group's new values go; by default nothing is handed over (values written in place)."""

    @abstractmethod
    def take(self, sg: SubGroup) -> torch.Tensor:
        """The ``sg.numel`` elements the update writes sub-group ``sg``'s new values into."""

    def land(self, out: torch.Tensor, master: torch.Tensor) -> None:
        """State on the device: its new fp32 masters into ``out`` (from :meth:`take`), on the calling stream."""
        out.copy_(master)

    def put(self, sg: SubGroup, values: torch.Tensor, after: Any) -> Copy | None:
        """``values`` (from :meth:`take`) hold sub-group ``sg``'s new parameters: sends them on. ``after``: the
        point of the compute stream after which the device no longer reads them. Returns the copy that takes them
        to the device, if one does."""
        return None

    @property
    def scratch(self) -> torch.Tensor | None:
        """A host staging buffer idle until the first update (parameter offload writes the initial NVMe homes
        through it); None when the sink stages nothing for NVMe."""
        return None

    def wait(self) -> None:
        """Waits for the writes handed over so far (re-raising the first error)."""

    def close(self) -> None:
        """Frees the staging (waiting for what still reads it)."""


class FlatSink(UpdateSink):
    """Flat buffers, one per param group, that the update writes in place. ``owned_only``: each covers only this
    rank's range of its group (stage 3's host pieces)."""

    def __init__(self, flats: list[torch.Tensor], layout: FlatLayout, *, owned_only: bool = False) -> None:
        self._flats = flats
        self._base = [layout.owned[g][0] if owned_only else 0 for g in range(len(flats))]

    def take(self, sg: SubGroup) -> torch.Tensor:
        base = self._base[sg.group]
        return self._flats[sg.group][sg.start - base : sg.end - base]


class _Staged(UpdateSink):
    """The update writes into one of ``count`` host staging buffers, reused in turn once what read it is done."""

    def __init__(self, store: TieredStore, count: int, layout: FlatLayout, dtype: torch.dtype, what: str) -> None:
        self._ring = StagingRing(store, count, layout.max_sub_group_numel, dtype, what, _FIX_STAGING)
        self._slot = -1  # the buffer taken for the update in progress (one at a time: the optimizer's thread)

    def take(self, sg: SubGroup) -> torch.Tensor:
        self._slot, staged = self._ring.take()
        return staged[: sg.numel]

    def close(self) -> None:
        self._ring.close()


class UploadSink(_Staged):
    """The device's flats (CUDA): each update's values go through pinned staging on the host-to-device stream. The
    compute stream waits for those copies where it uses them (``CopyStreams.use_uploads``, the update gate)."""

    def __init__(self, flats: list[torch.Tensor], store: TieredStore, copies: CopyStreams,
                 layout: FlatLayout) -> None:
        super().__init__(store, 2, layout, flats[0].dtype, "pinned staging of updated parameters for the device")
        self._flats, self._copies = flats, copies

    def put(self, sg: SubGroup, values: torch.Tensor, after: Any) -> Copy | None:
        upload = self._copies.to_device(self._flats[sg.group][sg.start : sg.end], values, after=after)
        self._ring.used(self._slot, upload)
        return upload


class _Written(_Staged):
    """New values written to NVMe from host staging: a buffer is reused once its writes are done."""

    def __init__(self, store: TieredStore, copies: CopyStreams, layout: FlatLayout, dtype: torch.dtype,
                 count: int) -> None:
        super().__init__(store, count, layout, dtype, "staging of updated parameters for NVMe")
        self._copies = copies

    @property
    def scratch(self) -> torch.Tensor | None:
        return self._ring.buffers[0]

    def land(self, out: torch.Tensor, master: torch.Tensor) -> None:
        self._copies.to_host(out, master.to(out.dtype)).wait()

    def put(self, sg: SubGroup, values: torch.Tensor, after: Any) -> Copy | None:
        self._ring.used(self._slot, self._write(sg, values))
        return None

    @abstractmethod
    def _write(self, sg: SubGroup, values: torch.Tensor) -> Any:
        """Starts writing ``values`` home; returns the handle that completes the writes."""

    def wait(self) -> None:
        self._ring.wait_all()


class HomeSink(_Written):
    """Parameter offload's NVMe homes: each segment of a sub-group to its key. ``homes`` is set once the
    :class:`ParameterOffload` is built (it writes the initial homes through :attr:`scratch`)."""

    def __init__(self, store: TieredStore, copies: CopyStreams, layout: FlatLayout, dtype: torch.dtype,
                 count: int) -> None:
        super().__init__(store, copies, layout, dtype, count)
        self.homes: ParameterOffload | None = None

    def _write(self, sg: SubGroup, values: torch.Tensor) -> Any:
        assert self.homes is not None
        return start_all(functools.partial(self.homes.write_home_part, seg.param, seg.param_start,
                                           values[seg.flat_start - sg.start : seg.flat_start - sg.start + seg.numel])
                         for seg in sg.segments)


class PieceSink(_Written):
    """This rank's stage-3 pieces on NVMe: the sub-group's parts of them, each to its key."""

    def __init__(self, shards: ParamShards, store: TieredStore, copies: CopyStreams, layout: FlatLayout,
                 dtype: torch.dtype, count: int) -> None:
        super().__init__(store, copies, layout, dtype, count)
        self._shards = shards

    def _write(self, sg: SubGroup, values: torch.Tensor) -> Any:
        return self._shards.write_updated(sg, values)
