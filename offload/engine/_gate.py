"""UpdateGate: the next forward starts while the optimizer step before it is still updating parameters.

Without it ``engine.step()`` returns once every sub-group is updated and its new parameters are on the device, so
a step costs forward + backward + whatever part of Adam backward did not hide. With it (``Plan.overlap_forward``:
one rank, optimizer state on HOST, parameters on the device) ``step()`` returns as soon as the updates are queued,
and a forward pre-hook on each module with trainable parameters of its own holds that module until the sub-groups
it needs are updated; with CUDA the compute stream then also waits, on the GPU, for the copies that bring them.
Once backward has ended the stepper takes the queued sub-groups in the order forward needs them, so forward runs
beside the rest of Adam and a step costs about max(compute, Adam, copies) instead of their sum.

What forward reads, and in what order, is traced in the first forward (before any step, so nothing waits in it):
the root's forward runs under a torch function mode (pushed by the root's first pre-hook, popped by its
always-called forward hook, or by the next one after an interrupt that skipped it) that sees every parameter handed
to a torch function and notes it against the innermost module running, so a module that reads another module's
weight itself (a tied head, ``self.sub.weight`` outside ``self.sub(...)``) waits for that weight too. Sub-groups
are ranked in the order they were first read (those never read follow, in layout order): the order the stepper
updates them in once backward has ended. Layout order alone would not do: with decay and no-decay param groups
(transformers' Trainer, nanoGPT) the first block's LayerNorm sits in the last sub-groups. A module waits for every
sub-group ranked up to the highest it reads, not only for those: a read the trace missed of a parameter read before
(a later forward taking another path) stays right. A module whose later forwards read a parameter of another module
that the first forward never read declares it with ``engine.register_external_parameter``. The order is fixed as
that forward ends; the forwards after it (a generation loop's too) run without the mode.

Everything else that reads or writes parameters or optimizer state settles the gate first (:meth:`settle`: the
whole step finished): the engine's backward, checkpoints, state dicts and parameter reads and writes, and
``state_dict()`` of any module with parameters (a pre-hook). Code that reads ``module.weight`` directly between
``step()`` and the next forward calls ``engine.finish_step()`` first. An error of an update raises in the hook or
the settle that waited for it, and ``on_error`` (the engine's) marks the step failed.
"""

from __future__ import annotations

import collections
import functools
import threading
import time
from typing import Any, Callable, Iterator

import torch
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack

from .._hooks import Hook
from ..memory import CopyStreams
from ..optim._layout import FlatLayout
from ..optim.offloaded import OffloadedAdam


class UpdateGate:
    """Owns the forward pre-hooks and state-dict pre-hooks that hold readers of the parameters until the step in
    flight has updated them, and the trace of the order forward needs sub-groups in; ``close()`` removes them."""

    def __init__(self, module: torch.nn.Module, layout: FlatLayout, optimizer: OffloadedAdam, copies: CopyStreams,
                 on_error: Callable[[BaseException], None]) -> None:
        self._optimizer, self._copies, self._on_error = optimizer, copies, on_error
        self._count = len(layout.sub_groups)
        self._of: dict[int, set[int]] = {}  # id(parameter) -> the sub-groups holding parts of it
        for sg in layout.sub_groups:
            for seg in sg.segments:
                self._of.setdefault(id(layout.params[seg.param]), set()).add(sg.index)
        self._reads: dict[int, set[int]] = {}  # id(module) -> the sub-groups its forward reads
        self._modules = {id(m): m for m in module.modules()}
        self._rank = list(range(self._count))  # sub-group -> its place in the order forward needs them
        self._hooks: list[Any] = []
        self._tracing: list[Any] = []  # the trace's hooks, removed once ranked
        self._running: list[int] = []  # id(module) of the modules inside whose forward the trace is
        self._pushed: int | None = None  # the thread whose mode stack holds the trace's mode
        self._depth = 0  # the root's forward calls in progress on that thread
        self._first_read: dict[int, None] = {}  # sub-groups in the order the traced forward first read them
        self._traced: set[tuple[int, int]] = set()  # (id(module), sub-group) reads the trace found
        self._mode = _ReadTrace(self._saw)
        self._waiting: collections.deque[tuple[int, int]] = collections.deque()  # (rank, sub-group), ascending
        self._jobs: dict[int, Any] = {}
        self.wait_seconds = 0.0  # time readers were held by updates still running
        self.steps = 0  # steps whose updates ran beside the next forward
        for mod in module.modules():
            own = list(mod.parameters(recurse=False))
            for p in own:
                self._read(mod, p)
            if own:
                self._hooks.append(mod.register_state_dict_pre_hook(Hook(lambda *_: self.settle(), self._in_flight)))
            self._tracing.append(mod.register_forward_pre_hook(Hook(functools.partial(self._enter, id(mod))),
                                                               prepend=True))
            self._tracing.append(mod.register_forward_hook(Hook(self._leave), always_call=True))
        self._tracing.append(module.register_forward_pre_hook(Hook(self._start_trace), prepend=True))
        self._tracing.append(module.register_forward_hook(Hook(self._stop_trace), always_call=True))
        self._tracing.append(module.register_forward_hook(Hook(self._traced_forward_done)))  # not after an error

    def _read(self, mod: torch.nn.Module, param: torch.nn.Parameter) -> None:
        if id(param) in self._of:  # else frozen
            self._read_sub_groups(mod, self._of[id(param)])

    def _read_sub_groups(self, mod: torch.nn.Module, sub_groups: set[int]) -> None:
        if id(mod) not in self._reads:
            self._reads[id(mod)] = set()
            self._modules[id(mod)] = mod
            self._hooks.append(mod.register_forward_pre_hook(Hook(functools.partial(self._before_forward, id(mod))),
                                                             prepend=True))  # before pre-hooks that read them
        self._reads[id(mod)] |= sub_groups

    def register_external(self, module: torch.nn.Module, param: torch.nn.Parameter) -> None:
        """``module``'s forward reads ``param``, which another module owns: it waits for that one's update too."""
        self._read(module, param)

    # the trace (the first forward) ------------------------------------------------------------------------------

    def _start_trace(self, *_: Any) -> None:
        """The root's forward starts: on the thread that runs the first one, under the mode (torch keeps a mode
        stack per thread; forwards on other threads meanwhile go untraced). A root called inside its own forward
        only counts deeper; after an interrupted forward the mode is still there and traces this one too."""
        if self._pushed is None:
            self._running.clear()
            self._mode.__enter__()
            self._pushed = threading.get_ident()
        if self._pushed == threading.get_ident():
            self._depth += 1

    def _stop_trace(self, *_: Any, force: bool = False) -> None:
        """The root's forward ends (an always-called hook): the outermost one pops the mode, if it is still the
        top of the stack; under a mode of the user's it is left there, inert. Never raises."""
        if self._pushed != threading.get_ident():
            if force and self._pushed is not None:  # another thread's stack: leave it there, inert
                self._mode.saw = None
                self._pushed = None
            return
        self._depth -= 1
        if self._depth > 0 and not force:
            return
        self._depth, self._pushed = 0, None
        self._running.clear()
        stack = _get_current_function_mode_stack()
        if stack and stack[-1] is self._mode:
            self._mode.__exit__(None, None, None)
        else:
            self._mode.saw = None

    def _traced_forward_done(self, *_: Any) -> None:
        """The root's forward ended normally (after ``_stop_trace``): the outermost first one's trace is the
        order (later forwards, a generation loop's included, run without the mode)."""
        if self._pushed is None and self._first_read:
            self._rank_by_trace()

    def _enter(self, key: int, *_: Any) -> None:
        self._running.append(key)

    def _leave(self, *_: Any) -> None:
        if self._running:
            self._running.pop()

    def _saw(self, values: Any) -> None:
        """A torch function was handed ``values``: the trainable parameters among them are read by the innermost
        module running."""
        if not self._running:
            return
        for t in _tensors(values):
            for k in self._of.get(id(t), ()):
                self._first_read.setdefault(k)
                self._traced.add((self._running[-1], k))

    def _rank_by_trace(self) -> None:
        """Fixes the order forward needs sub-groups in (the first forward's trace), gives it to the stepper, and
        makes each module whose forward read other modules' parameters wait for them too."""
        self._stop_tracing()
        rank: dict[int, int] = {}
        for k in (*self._first_read, *range(self._count)):
            rank.setdefault(k, len(rank))
        self._rank = [rank[k] for k in range(self._count)]
        for key, k in self._traced:
            self._read_sub_groups(self._modules[key], {k})
        self._first_read, self._traced = {}, set()  # empty from now on: the trace's hooks are gone
        self._optimizer.update_order(self._rank)

    def _stop_tracing(self) -> None:
        for h in self._tracing:
            h.remove()
        self._tracing = []
        self._stop_trace(force=True)

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

    def _before_forward(self, key: int, module: torch.nn.Module, args: Any) -> None:
        waiting = self._waiting
        if not waiting:
            return
        need = max(self._rank[k] for k in self._reads[key])
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
        if self._first_read:  # a forward has run since initialize, and its trace is not ranked yet
            self._rank_by_trace()
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
        self._stop_tracing()
        for h in self._hooks:
            h.remove()
        self._hooks = []


class _ReadTrace(TorchFunctionMode):
    """Hands the arguments of every torch function called while it is active to ``saw``."""

    def __init__(self, saw: Callable[[Any], None]) -> None:
        super().__init__()
        self.saw: Callable[[Any], None] | None = saw  # None: left on a stack it could not be popped from

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if self.saw is not None:
            self.saw((args, kwargs))
        return func(*args, **kwargs)


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)
