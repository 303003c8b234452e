"""ZeRO partitioning of gradients and parameters across ranks, for the engine.

The :class:`~offload.optim._layout.FlatLayout` built with world size N gives each rank an equal contiguous range of
every param group's flat buffer; the rank's optimizer state (and host gradient buffer) covers that range only.
:class:`GradPartition` gets every rank's gradients summed into its owner's host buffer and the updated parameters
back to everyone:

* world size 1: the engine's hooks write gradients straight into the host buffer (the owned range is everything)
  and nothing is communicated. Same code, no copies.
* stages 1-2 (and 0): gradients are summed onto their owners in buckets while backward runs
  (:class:`~._buckets.ReduceBuckets`), and micro-batches accumulate in the owner's host buffer (Psi per
  micro-batch); no rank holds a full-size gradient.
* after the optimizer step, every rank's updated range of the device parameters is all-gathered (Psi).
* stage 3 (the layout's ``per_param``): each parameter is cut into N equal pieces; rank r's home holds piece r of
  every parameter (:class:`offload.params._shards.ParamShards`, with the rest of where a parameter lives; the
  NVMe bytes of its pieces are :func:`piece_nvme_bytes`, which the plan sizes the NVME tier with). A fetch
  all-gathers the pieces, and each gradient is reduce-scattered in its hook straight into the owner's host buffer
  (:meth:`GradPartition.reduce_param`): Psi in forward, Psi again in backward for what the window did not keep,
  Psi of gradients.

Gradients are summed, not averaged: the engine divides by N in the CPU Adam kernel's gradient divisor (with the
loss scale and the clipping coefficient), and all-reduces the squared norm for clipping and fp16 overflow checks.
"""

from __future__ import annotations

import torch

from nvme_swapper import swap_file_bytes

from ..optim._layout import FlatLayout
from ._comm import Comm


def piece_nvme_bytes(layout: FlatLayout, frozen: FlatLayout | None, size: int, writes: int) -> int:
    """The NVMe bytes of one rank's pieces: a key per part (page-rounded), the swap file's header, and the spare
    extents rewrites go to: a sub-group's parts rewritten together, ``writes`` sub-groups at once; frozen parts
    one at a time (loads)."""
    updated = [[seg.numel * size for seg in sg.segments] for sg in layout.sub_groups]
    fixed = [seg.numel * size for sg in (frozen.sub_groups if frozen is not None else ()) for seg in sg.segments]
    return swap_file_bytes(updated, writes, fixed)


class GradPartition:
    """The gradient and parameter collectives that are not bucketed: stage 3's reduce-scatter of each parameter's
    gradient, and the all-gather of updated parameters after a step (stages 1-2). Stages 1-2 reduce gradients
    in :class:`~._buckets.ReduceBuckets`."""

    def __init__(self, comm: Comm, layout: FlatLayout) -> None:
        self.comm, self.layout = comm, layout

    def reduce_param(self, i: int, grad: torch.Tensor) -> torch.Tensor:
        """Stage 3: parameter ``i``'s gradient summed over ranks, this rank's piece of it (a new tensor)."""
        piece = self.layout.piece[i]
        padded = torch.zeros(piece * self.comm.world_size, dtype=grad.dtype, device=grad.device)
        padded[: grad.numel()].copy_(grad)
        out = torch.empty(piece, dtype=grad.dtype, device=grad.device)
        self.comm.reduce_scatter(out, padded, key=i)
        return out

    def gather_params(self, flats: list[torch.Tensor]) -> None:
        """Every rank's updated range of the flat parameters, to every rank (in place)."""
        if self.comm.world_size == 1:
            return
        for g, flat in enumerate(flats):
            lo, hi = self.layout.owned[g]
            self.comm.all_gather(flat, flat[lo:hi])
