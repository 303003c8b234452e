"""What an engine reports about itself: bytes per memory tier (``memory_report``), and the counters of its
transfers, updates, gradients, collectives and start (``stats``)."""

from __future__ import annotations

from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from nvme_swapper import pinned_bytes

if TYPE_CHECKING:
    from .._precision import LossScaler
    from ..dist import Comm, ReduceBuckets, StartSync
    from ..memory import HeapTrim, TieredStore
    from ..optim._layout import FlatLayout
    from ..optim.offloaded import OffloadedAdam
    from ._gate import UpdateGate
    from ._grads import GradientStream
    from ._step import StepController
    from ..params._weights import Weights


class Reports:
    """The :class:`~offload.engine.Engine`'s reports. Owns no state: reads the store, the layout, the optimizer,
    the gradient stream, the weights, the update gate, the reduce buckets, the heap trims, the collectives, the
    start's sync and the step controller's counters."""

    store: "TieredStore"
    layout: "FlatLayout"
    optimizer: "OffloadedAdam"
    grads: "GradientStream"
    weights: "Weights"
    scaler: "LossScaler"
    comm: "Comm"
    start_sync: "StartSync | None"
    global_steps: int
    micro_steps: int
    _gate: "UpdateGate | None"
    _reduce: "ReduceBuckets | None"
    _heap: "HeapTrim | None"
    _steps: "StepController"

    @property
    def last_step_comm(self) -> dict[str, int]:
        """The collective bytes of the last optimizer step (its micro-batches' reduce-scatters included)."""
        return self._steps.last_step_comm

    def memory_report(self) -> dict[str, dict[str, int | None]]:
        """This rank's bytes per tier: current, peak and budget (None: unlimited), and of them the optimizer
        state (``optimizer_state``: this rank's share; ``optimizer_state_all_ranks``: the whole model's, padding
        included). With N ranks each holds 1/N of the state, gradients and (stage 3) parameters. ``host`` also
        says how many bytes are page-locked for CUDA (``pinned``: exactly what was asked, rounded to pages)."""
        report = self.store.memory_report()
        mine = sum(12 * sg.numel for sg in self.layout.sub_groups)
        total = 12 * sum(self.layout.group_numel)
        for tier, r in report.items():
            on_tier = tier == self.optimizer.placement.value
            r["optimizer_state"] = mine if on_tier else 0
            r["optimizer_state_all_ranks"] = total if on_tier else 0
        report["host"]["pinned"] = pinned_bytes()
        return report

    def stats(self) -> dict[str, Any]:
        """Counters: bytes moved per tier pair, time stalled on I/O, time in Adam and the share hidden in backward."""
        opt = self.optimizer
        return {
            "steps": self.global_steps,
            "micro_steps": self.micro_steps,
            "skipped_steps": self.scaler.skipped,
            "loss_scale": self.scaler.scale,
            "bytes_moved": dict(self.store.moved),
            "stall_seconds": self.store.stall_seconds,
            "adam_seconds": opt.adam_seconds,
            "adam_seconds_overlapped": opt.adam_seconds_overlapped,
            "overlap_fraction": opt.adam_seconds_overlapped / opt.adam_seconds if opt.adam_seconds else 0.0,
            "sub_groups_overlapped": opt.sub_groups_overlapped,
            # plan.overlap_forward: steps whose updates finished beside the next forward, and the time readers
            # (forward hooks, backward, checkpoints) waited for them
            "update_beside_forward": self._gate.stats() if self._gate is not None else None,
            "gradient_copies": dict(self.grads.sends),
            "gradient_buffers": opt.grads.stats(),
            "nvme": self.store.swap_stats(),
            "params": self.weights.stats(),
            "reduce": self._reduce.stats() if self._reduce is not None else None,  # stages 1-2 on several ranks
            "heap_trims": self._heap.stats() if self._heap is not None else None,  # CPU device only
            # collectives (none with one rank): totals since initialize, and the last optimizer step's (the
            # reduce-scatters of its micro-batches included); payload: the ZeRO paper's measure, wire: ring sends
            "comm": {**self.comm.stats(), "last_step": dict(self.last_step_comm)},
            # parameters and buffers compared across ranks at initialize, and those copied from rank 0
            "start_sync": asdict(self.start_sync) if self.start_sync is not None else None,
        }
