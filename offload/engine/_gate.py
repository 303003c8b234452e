"""UpdateGate: the next forward starts while the optimizer step before it is still updating parameters.

Without it ``engine.step()`` returns once every sub-group is updated and its new parameters are on the device, so
a step costs forward + backward + whatever part of Adam backward did not hide. With it (``Plan.overlap_forward``:
one rank, optimizer state on HOST, parameters on the device) ``step()`` returns as soon as the updates are queued,
and a forward pre-hook on each module with trainable parameters of its own holds that module until the sub-groups
it needs are updated; with CUDA the compute stream then also waits, on the GPU, for the copies that bring them.
Once backward has ended the stepper takes the queued sub-groups in the order forward needs them, so forward runs
beside the rest of Adam and a step costs about max(compute, Adam, copies) instead of their sum.

What forward reads, and in what order, is the model's :class:`~offload._trace.ForwardTrace` (the first forward,
before any step, so nothing waits in it), which this object owns: a module that reads another module's weight itself
(a tied head, ``self.sub.weight`` outside ``self.sub(...)``) waits for that weight too. Sub-groups are ranked in the
order they were first read (:meth:`ForwardTrace.sub_group_order`): the order the stepper updates them in once
backward has ended. A module waits for every sub-group ranked up to the highest it reads, not only for those: a read
the trace missed of a parameter read before (a later forward taking another path) stays right. A module whose later
forwards read a parameter of another module that the first forward never read declares it with
``engine.register_external_parameter``. The order is fixed as that forward ends; the forwards after it (a generation
loop's too) run without the trace's mode. The wait is the module's :attr:`~offload._hooks.Slot.GATE` slot.

Everything else that reads or writes parameters or optimizer state settles the gate first (:meth:`settle`: the
whole step finished): the engine's backward, checkpoints, state dicts and parameter reads and writes, and
``state_dict()`` of any module with parameters (a pre-hook). Code that reads ``module.weight`` directly between
``step()`` and the next forward calls ``engine.finish_step()`` first. An error of an update raises in the hook or
the settle that waited for it, and ``on_error`` (the engine's) marks the step failed.
"""

from __future__ import annotations

import collections
import time
from typing import Any, Callable

import torch

from .._hooks import Hook, Slot, SlotHandle, on_forward
from .._trace import ForwardTrace
from ..memory import CopyStreams
from ..optim._layout import FlatLayout
from ..optim.offloaded import OffloadedAdam


class UpdateGate:
    """Owns the GATE slots and state-dict pre-hooks that hold readers of the parameters until the step in flight
    has updated them, and the forward trace that says what each module reads; ``close()`` removes them."""

    def __init__(self, module: torch.nn.Module, layout: FlatLayout, optimizer: OffloadedAdam, copies: CopyStreams,
                 on_error: Callable[[BaseException], None]) -> None:
        self._optimizer, self._copies, self._on_error = optimizer, copies, on_error
        self._layout = layout
        self._of: dict[int, set[int]] = {}  # id(parameter) -> the sub-groups holding parts of it
        for sg in layout.sub_groups:
            for seg in sg.segments:
                self._of.setdefault(id(layout.params[seg.param]), set()).add(sg.index)
        self._reads: dict[int, set[int]] = {}  # id(module) -> the sub-groups its forward reads
        self._rank = list(range(len(layout.sub_groups)))  # sub-group -> its place in the order forward needs them
        self._hooks: list[Any] = []
        self._slots: list[SlotHandle] = []
        self._waiting: collections.deque[tuple[int, int]] = collections.deque()  # (rank, sub-group), ascending
        self._jobs: dict[int, Any] = {}
        self.wait_seconds = 0.0  # time readers were held by updates still running
        self.steps = 0  # steps whose updates ran beside the next forward
        self.trace = ForwardTrace(module)
        try:
            self.trace.on_fixed.append(self._rank_by_trace)
            for mod in module.modules():
                own = list(mod.parameters(recurse=False))
                for p in own:
                    self._read(mod, p)
                if own:
                    self._hooks.append(mod.register_state_dict_pre_hook(Hook(lambda *_: self.settle(),
                                                                             self._in_flight)))
        except BaseException:
            self.close()
            raise

    def _read(self, mod: torch.nn.Module, param: torch.nn.Parameter) -> None:
        if id(param) in self._of:  # else frozen
            self._read_sub_groups(mod, self._of[id(param)])

    def _read_sub_groups(self, mod: torch.nn.Module, sub_groups: set[int]) -> None:
        if id(mod) not in self._reads:
            self._reads[id(mod)] = set()
            self._slots.append(on_forward(mod, Slot.GATE, pre=self._before_forward))
        self._reads[id(mod)] |= sub_groups

    def register_external(self, module: torch.nn.Module, param: torch.nn.Parameter) -> None:
        """``module``'s forward reads ``param``, which another module owns: it waits for that one's update too."""
        self._read(module, param)

    def _rank_by_trace(self) -> None:
        """The trace is fixed: ranks the sub-groups in its order, gives that to the stepper, and makes each module
        whose forward read other modules' parameters wait for them too."""
        for rank, k in enumerate(self.trace.sub_group_order(self._layout)):
            self._rank[k] = rank
        for key, pids in self.trace.reads.items():
            sub_groups = set().union(*(self._of.get(pid, ()) for pid in pids))
            if sub_groups:
                self._read_sub_groups(self.trace.module_of(key), sub_groups)
        self._optimizer.update_order(self._rank)
        self.trace.close()  # the order is the first forward's: its slots would run at every forward for nothing

    # waiting ----------------------------------------------------------------------------------------------------

    @property
    def armed(self) -> bool:
        return bool(self._jobs)

    def _in_flight(self) -> str | None:
        """Why a copy of the model (``copy.deepcopy``, ``torch.save``) must not be taken now, if so: it would copy
        parameters the step is still updating, and torch copies them before any hook could wait."""
        if self._jobs:
            return ("copy.deepcopy or torch.save of the model while the last step's updates still run beside the "
                    "next forward (offload_optimizer.overlap_forward) would copy parameters half updated: call "
                    "engine.finish_step() first")
        return None

    def arm(self) -> None:
        """Called by ``step()`` once every update of the step is queued: readers wait from now on."""
        self._jobs = self._optimizer.pending()
        self._waiting = collections.deque(sorted((self._rank[k], k) for k in self._jobs))
        self.steps += 1

    def _before_forward(self, module: torch.nn.Module, *_: Any) -> None:
        waiting = self._waiting
        if not waiting:
            return
        need = max(self._rank[k] for k in self._reads[id(module)])
        while waiting and waiting[0][0] <= need:
            self._pass(waiting.popleft()[1])

    def _pass(self, k: int) -> None:
        """Sub-group ``k``'s update has run, and the calling thread's stream sees its new parameters."""
        job = self._jobs[k]
        t = time.perf_counter()
        try:
            job.wait()  # a job that already ran may have failed: this raises its error
        except BaseException as exc:
            self._fail(exc)
            raise
        finally:
            self.wait_seconds += time.perf_counter() - t
        self._copies.use(self._optimizer.upload_of(k))

    def settle(self) -> None:
        """Waits for the whole step in flight (raising its error, after ``on_error``) and disarms. Fixes the
        order forward needs sub-groups in if no forward of the root has ended normally yet but one ran."""
        self.trace.fix()  # a forward has run since initialize, and its trace is not ranked yet
        if not self._jobs:
            return
        self._waiting.clear()
        self._jobs = {}
        t = time.perf_counter()
        try:
            self._optimizer.finish()
        except BaseException as exc:
            self._on_error(exc)
            raise
        finally:
            self.wait_seconds += time.perf_counter() - t
        self._copies.use_uploads()

    def _fail(self, exc: BaseException) -> None:
        self._waiting.clear()
        self._jobs = {}
        self._on_error(exc)

    def stats(self) -> dict[str, Any]:
        return {"steps": self.steps, "wait_seconds": self.wait_seconds}

    def close(self) -> None:
        self.trace.close()
        for h in (*self._slots, *self._hooks):
            h.remove()
        self._slots, self._hooks = [], []

