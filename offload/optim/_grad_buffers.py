"""GradientBuffers: the host memory that gradients land in until the CPU Adam has read them.

It comes in one of two shapes, chosen by the plan:

* **whole**: one buffer per param group over this rank's range, so every gradient of a step is held at once. This
  is needed when the update cannot start before backward ends: clipping and fp16 read the global norm first,
  micro-batches accumulate, and several ranks reduce first. The delayed update keeps two sets, so backward t+1
  fills one while update t reads the other.
* **slots** (``slots > 0``): the optimizer updates each sub-group during backward as soon as its gradients are
  final (``plan.overlap`` with one micro-batch). A sub-group's gradients then need memory only from their first
  arrival until its update has run. A few sub-group-sized slots replace the whole buffer. The whole buffer is
  2 B/param of bf16, so 140 GB of host RAM for a 70B model; the slots are a few sub-groups.

  A sub-group takes a slot when its first gradient arrives (:meth:`of`), and gets it back when the job of its
  update has run (:meth:`queued` records that job). When no slot is free, the training thread waits for the
  oldest queued update (the stepper runs jobs in order, so that one finishes first). If no update is queued, the
  pool grows by one slot: this happens when sub-groups fill out of order, and it cannot deadlock. A wait re-raises
  an error of the stepper. A fresh slot has zeros wherever the sub-group's layout has padding, because nothing
  writes those elements and Adam must read zeros there.

Every method runs on the training thread. The stepper only reads the tensor :meth:`for_update` handed to its job.
"""

from __future__ import annotations

from typing import Any

import torch

from ..memory import Tier, TieredStore
from ._layout import FlatLayout

_FIX = {Tier.HOST: "lower zero_optimization.sub_group_size, offload the optimizer to nvme, or raise "
               "offload.host_memory_budget",
        Tier.DEVICE: "offload the optimizer (zero_optimization.offload_optimizer.device \"cpu\" or \"nvme\"), use "
                     "more ranks, or raise offload.device_memory_budget"}


class GradientBuffers:
    """Owns the host (``tier``: HOST, or DEVICE when the optimizer is not offloaded) gradient buffers of one
    engine: ``sets`` whole sets, or a pool that starts with ``slots`` slots."""

    def __init__(self, layout: FlatLayout, store: TieredStore, tier: Tier, dtype: torch.dtype, *, sets: int = 1,
                 slots: int = 0) -> None:
        self.layout, self.store, self.tier, self.dtype = layout, store, tier, dtype
        self._sets: list[list[torch.Tensor]] = []
        self._index = 0
        self._free: list[torch.Tensor] = []  # slots no sub-group holds
        self._held: dict[int, torch.Tensor] = {}  # sub-group -> its slot, from its first gradient to its update
        self._jobs: dict[int, Any] = {}  # sub-group -> the queued job of its update (frees the slot once run)
        self.counters = {"held_peak": 0, "waits": 0, "grown": 0}  # slots held at once; waits for one; pool growth
        self._gaps = [sg.padding() for sg in layout.sub_groups] if slots else []
        try:
            if slots:
                for _ in range(slots):
                    self._free.append(self._new_slot())
            else:
                for _ in range(sets):
                    self._sets.append([store.allocate(tier, layout.owned_numel(g), dtype,
                                                      f"{dtype} gradients of param group {g}", _FIX[tier], stagger=1)
                                       for g in range(len(layout.group_numel))])
        except BaseException:
            self.close()
            raise

    def _new_slot(self) -> torch.Tensor:
        return self.store.allocate(self.tier, self.layout.max_sub_group_numel, self.dtype,
                                   f"a {self.dtype} gradient slot of one sub-group", _FIX[self.tier],
                                   stagger=1)

    @property
    def whole(self) -> list[torch.Tensor] | None:
        """The current set, one buffer per param group (this rank's range): what the hooks fill and the gradient
        norm reads. None with slots."""
        return self._sets[self._index] if self._sets else None

    def swap(self) -> None:
        """Delayed update: from now on the hooks fill the other set."""
        self._index = (self._index + 1) % len(self._sets)

    # where sub-group k's gradients go ---------------------------------------------------------------------------

    def of(self, k: int) -> torch.Tensor:
        """Sub-group ``k``'s gradients (element 0 is the sub-group's first): its range of the current set, or its
        slot, taken now if it holds none (which may wait for a queued update to finish)."""
        sg = self.layout.sub_groups[k]
        if self._sets:
            lo = sg.start - self.layout.owned[sg.group][0]
            return self._sets[self._index][sg.group][lo : lo + sg.numel]
        slot = self._held.get(k)
        if slot is None:
            slot = self._take()
            for lo, hi in self._gaps[k]:
                slot[lo:hi].zero_()
            self._held[k] = slot
            self.counters["held_peak"] = max(self.counters["held_peak"], len(self._held))
        return slot[: sg.numel]

    def for_update(self, k: int) -> torch.Tensor:
        """What sub-group ``k``'s update reads, fixed when it is queued: a slot never written (no gradient came in
        this step) is zeros."""
        if self._sets or k in self._held:
            return self.of(k)
        return self.of(k).zero_()

    def queued(self, k: int, job: Any) -> None:
        """The stepper's ``job`` updates sub-group ``k``: its slot is free once ``job`` has run."""
        if not self._sets:
            self._jobs[k] = job

    def _take(self) -> torch.Tensor:
        self.reclaim()
        if not self._free and self._jobs:
            self.counters["waits"] += 1
            oldest = next(iter(self._jobs))
            self._jobs[oldest].wait()  # re-raises an error of the stepper
            self.reclaim()
        if not self._free:  # no update queued can free one: sub-groups filling out of order
            self.counters["grown"] += 1
            self._free.append(self._new_slot())
        return self._free.pop()

    def reclaim(self) -> None:
        """Every slot whose update has run goes back to the pool."""
        for k in [k for k, job in self._jobs.items() if job.done()]:
            del self._jobs[k]
            self._free.append(self._held.pop(k))

    def drop(self) -> None:
        """Every slot back to the pool, whatever it held (a window abandoned; the stepper is idle)."""
        self._free += self._held.values()
        self._held, self._jobs = {}, {}

    def stats(self) -> dict[str, Any]:
        """The shape and, with slots, how the pool was used: the most held at once, waits for a queued update to
        free one, slots added beyond the first ``slots``."""
        if self._sets:
            return {"shape": "whole", "sets": len(self._sets)}
        return {"shape": "slots", "slots": len(self._free) + len(self._held), **self.counters}

    def close(self) -> None:
        """Frees every buffer; the stepper must be idle (nothing reads them any more)."""
        for t in [t for s in self._sets for t in s] + self._free + list(self._held.values()):
            self.store.free(self.tier, t)
        self._sets, self._free, self._held, self._jobs = [], [], {}, {}
