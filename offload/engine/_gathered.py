"""``engine.gathered(params)``: parameters whole on the device for a block of the user's code (DeepSpeed's
``zero.GatheredParameters``), and the changes the block makes to them kept.

With parameter offload a parameter is a NaN placeholder outside the forwards of its module, so code that uses one
elsewhere (a loss that multiplies by the output embedding itself, a generation loop, an initialisation after
``initialize``) needs it fetched and kept. :class:`Gathered` owns one block's worth of that:

* on entry, the parameters are held on the device (:meth:`~offload.params.ParameterOffload.hold`: never released
  or evicted until the block ends; a collective with several ranks in stage 3), and the block runs under the same
  saved-tensor hooks as the model's forward, so what autograd saves of them is a reference that backward fetches
  again, inside the block or after it;
* each parameter's bits get a fingerprint (the swap engine's C checksum on the host, a position-weighted sum on a
  GPU: one read of it), taken again at the end once the engine's own writes are in (updates run by a backward in
  the block, a delayed update). A parameter whose fingerprint or tensor changed is a candidate
  (``p.data.normal_()`` leaves no trace in torch's version counters, so they cannot tell); a candidate that differs
  from its master rounded to the training dtype was edited by the block (the engine's own writes, a load or an
  update, leave it equal), as is a frozen one (it has no master). Edits become fp32 masters and homes through
  ``engine.load_state_dict``, where DeepSpeed keeps the low-precision value of its ``modifier_rank`` but not the
  master. With several ranks: candidates are agreed over ranks, rank 0's edits reach every rank, and an edit on
  another rank alone is undone there.

Without parameter offload the parameters are always on the device; the fingerprints still find the changes, which
would otherwise last only until the next step rewrote them from the unchanged masters.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from nvme_swapper import tensor_checksum

from .._state import WriteRefused
from ..params import ParamState
from ..persist import keys_by_tensor

if TYPE_CHECKING:
    from ._engine import Engine

_CHUNK = 1 << 22  # elements per fingerprint kernel on a GPU: bounds its int64 temporaries (32 MiB each)
_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def fingerprints(tensors: list[torch.Tensor]) -> list[int]:
    """Per tensor, a number that changes with any edit of its bits short of a collision. Host tensors: the swap
    engine's block checksum (C, 10-30 GB/s); device tensors: the sum of each element's bits times its position (so
    a permutation shows too), wrapping at 2^64, computed on the device and read back once for all of them."""
    out: list[int | None] = [tensor_checksum(t.detach().contiguous()) if t.device.type == "cpu" else None
                             for t in tensors]
    on_device = [_weighted_sum(t) for t, v in zip(tensors, out) if v is None]
    sums = iter(torch.stack(on_device).tolist() if on_device else [])
    return [next(sums) if v is None else v for v in out]


def _weighted_sum(t: torch.Tensor) -> torch.Tensor:
    bits = t.detach().reshape(-1).view(_BITS[t.element_size()])
    total = torch.zeros((), dtype=torch.int64, device=t.device)
    weights = torch.arange(1, min(_CHUNK, bits.numel()) + 1, dtype=torch.int64, device=t.device)
    for start in range(0, bits.numel(), _CHUNK):
        chunk = bits[start : start + _CHUNK].to(torch.int64)
        total += (chunk * weights[: chunk.numel()]).sum() + start * chunk.sum()
    return total


class Gathered:
    """One ``engine.gathered()`` block: :meth:`enter` before it, :meth:`exit` after it (also after an exception in
    it: what the block changed until then is kept, as in a plain model)."""

    def __init__(self, engine: "Engine", params: list[torch.nn.Parameter]) -> None:
        self.engine, self.params = engine, params
        self._held: list[Any] = []
        self._hooks: Any = None
        self._tensors: list[torch.Tensor] = []  # each parameter's tensor at entry, and where its bits were
        self._ptrs: list[int] = []
        self._marks: list[int] = []

    def enter(self) -> None:
        offload = self.engine.weights.params
        if offload is not None:
            self._held = offload.hold(self.params)
            self._hooks = offload.saved_tensors()
            self._hooks.__enter__()
        try:
            self._tensors = [p.data for p in self.params]
            self._ptrs = [p.data_ptr() for p in self.params]
            self._marks = fingerprints(self.params)
        except BaseException:
            self._release()
            raise

    def exit(self) -> None:
        try:
            assert all(rec.state is ParamState.AVAILABLE for rec in self._held), "a held parameter left the device"
            self._keep_changes()
        finally:
            self._release()

    def _release(self) -> None:
        if self._hooks is not None:
            self._hooks.__exit__(None, None, None)
            self._hooks = None
        offload = self.engine.weights.params
        if offload is not None:
            offload.unhold(self._held)
        self._held = []

    def _keep_changes(self) -> None:
        """A parameter whose bits moved is a candidate; the engine's own writes in the block (a load, the updates a
        backward runs) leave it equal to its master rounded to the training dtype, so only one that differs from
        that was edited. Candidates are agreed over ranks (the masters are read collectively), edits are rank 0's."""
        engine = self.engine
        engine.parameters_current()  # the engine's own writes are all in before the bits are compared
        values: list[torch.Tensor] = [p.detach() for p in self.params]  # what each parameter holds at the end
        misfit = ""
        for i, (p, t, ptr) in enumerate(zip(self.params, self._tensors, self._ptrs)):
            if p.data_ptr() == ptr:
                continue
            if p.shape == t.shape:  # `p.data = ...` in the block: its values go into the engine's own tensor
                values[i] = p.data.detach().to(t.device, t.dtype)
            else:
                misfit = misfit or (f"engine.gathered: parameter {self._names()[id(p)]!r} was given a tensor of shape "
                                    f"{tuple(p.shape)} in the block, not its {tuple(t.shape)}; shapes are fixed at "
                                    "initialize (the tensor it had is kept)")
                values[i] = t.detach()
            p.data = t
        moved = [int(a != b) for a, b in zip(fingerprints(values), self._marks)]
        if engine.world_size > 1 and moved:
            moved = self._agree(moved, all_ranks=True)
        names = self._names()
        candidates = [i for i, m in enumerate(moved) if m]
        masters = engine.consolidated_state_dict([names[id(self.params[i])] for i in candidates]) if candidates else {}
        # a frozen candidate counts as edited: it has no master to tell (the engine writes one in a block only by
        # a load, whose value writing it again keeps)
        trains = {id(p) for p in engine.layout.params}
        here = [int(id(self.params[i]) not in trains
                    or not torch.equal(values[i].cpu(), masters[names[id(self.params[i])]].to(values[i].dtype)))
                for i in candidates]
        edited = self._agree(here, all_ranks=False) if engine.world_size > 1 and here else here
        kept = {}
        for i, e, mine in zip(candidates, edited, here):
            p, name = self.params[i], names[id(self.params[i])]
            if e:
                value = values[i].contiguous()
                engine.comm.broadcast(value, 0)
                kept[name] = value
            elif mine:  # edited on this rank but not on rank 0: back to the master here
                engine.write_parameter(p, masters[name])
        if kept:
            try:
                engine.load_state_dict(kept, strict=False)
            except WriteRefused:  # refused before any write (the window's updates have started): the device
                for i, e in zip(candidates, edited):  # copies of trained parameters get back what those computed
                    if e and id(self.params[i]) in trains:
                        engine.write_parameter(self.params[i], masters[names[id(self.params[i])]])
                raise
        if misfit:
            raise ValueError(misfit)

    def _agree(self, flags: list[int], *, all_ranks: bool) -> list[int]:
        """``flags`` made the same on every rank: set where any rank set it, or as rank 0 set it."""
        comm = self.engine.comm
        if not all_ranks:
            return comm.rank0s(flags)
        t = torch.tensor(flags, dtype=torch.int64, device=comm.pg.device)
        comm.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        return t.tolist()

    def _names(self) -> dict[int, str]:
        """Each parameter's first state_dict key: what consolidated_state_dict and load_state_dict take."""
        return {i: keys[0] for i, keys in keys_by_tensor(self.engine.module).items()}
