"""ForwardTrace: the one record of how a model's forward runs, taken over its first forward.

What it records: the parameters each module's forward reads, in the order they were first read, and (noted by
parameter offload as it fetches) the order the forward needed its parameters in. It is read by parameter offload
(the order its prefetch follows; a parameter read outside its owner's forward is fetched as it is read), by the
update gate (the sub-groups each module waits for, and the order the stepper updates them in:
:meth:`sub_group_order`). The gate needs it without parameter offload, so it lives here, beside the hooks.

How: a slot (:attr:`~offload._hooks.Slot.TRACE`, the last of each module's pre-hook slots, so no other slot's own
work is taken for the model's reads) keeps the stack of modules running, and on the root pushes a torch function
mode over the root's forward on the thread that runs the first one (torch keeps a mode stack per thread; forwards on
other threads meanwhile go untraced). The mode sees every parameter handed to a torch function and notes it against
the innermost module running, so a module that reads another module's weight itself (a tied head,
``self.sub.weight`` outside ``self.sub(...)``) is known to. The root's always-called hook pops the mode; when an
interrupt skipped that, the mode is still there and traces the next forward too (a root called inside its own
forward only counts deeper), until :meth:`fix` (the gate's settle, parameter offload's end of backward) pops it.

When: from construction until the end of the first root forward that ended normally and recorded something, then
fixed (:meth:`fix`: the ``on_fixed`` callbacks run). A forward that raised keeps what it read, but the order it
needed parameters in starts over with the next one. Parameter offload calls :meth:`record_again` when a step's order
departed from the trace: the next forward records it again, under the mode. While nothing records, each hook is a
flag test.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack

from ._hooks import Slot, SlotHandle, on_forward

if TYPE_CHECKING:
    from .optim._layout import FlatLayout

# what a torch function is asked of a tensor without reading its values: the placeholder answers as the parameter
_METADATA = frozenset((
    torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel, torch.Tensor.stride, torch.Tensor.__len__,
    torch.Tensor.is_floating_point, torch.Tensor.is_complex, torch.Tensor.element_size, torch.Tensor.data_ptr,
    torch.Tensor.data.__set__,
    *(getattr(torch.Tensor, name).__get__ for name in ("shape", "dtype", "device", "ndim", "requires_grad",
                                                       "is_cuda", "layout", "is_sparse", "grad", "data"))))


class ForwardTrace:
    """The forward trace of ``module`` (see the module docstring); ``refuse``: what a copy of the model makes of its
    hooks (:class:`~offload._hooks.Hook`). ``close()`` removes its hooks and pops its mode."""

    def __init__(self, module: torch.nn.Module, *, refuse: str | None = None) -> None:
        self.recording = True
        self.quiet = 0  # > 0 while the library's own work (a fetch) calls torch functions: none is a read
        self.order: list[int] = []  # what parameter offload noted (note()) as the forward needed it
        self.reads: dict[int, dict[int, None]] = {}  # id(module) -> ids of the parameters its forward read
        self.first_read: dict[int, None] = {}  # ids of the parameters in the order they were first read
        self.on_read: Callable[[torch.nn.Module, torch.nn.Parameter], None] | None = None  # before a values read
        self.on_fixed: list[Callable[[], None]] = []
        self._params = {id(p): p for p in module.parameters()}
        self._modules = {id(m): m for m in module.modules()}
        self._running: list[torch.nn.Module] = []  # the modules whose forward runs, innermost last (mode on only)
        self._mode: _Reads | None = None
        self._pushed: int | None = None  # the thread whose mode stack holds the mode
        self._depth = 0  # the root's forward calls in progress on that thread
        self._again = False  # record again from the next forward (record_again)
        self._handles: list[SlotHandle] = []
        try:
            for mod in module.modules():
                if mod is module:
                    self._handles.append(on_forward(mod, Slot.TRACE, pre=self._start, always=self._stop,
                                                    post=self._done, refuse=refuse))
                else:
                    self._handles.append(on_forward(mod, Slot.TRACE, pre=self._enter, always=self._leave,
                                                    refuse=refuse))
        except BaseException:
            self.close()  # (the slots taken so far: the owner never got this trace to close)
            raise

    # what it recorded --------------------------------------------------------------------------------------------

    def module_of(self, key: int) -> torch.nn.Module:
        """The module ``key`` (an id in :attr:`reads`) names."""
        return self._modules[key]

    def sub_group_order(self, layout: FlatLayout) -> list[int]:
        """``layout``'s sub-groups in the order the forward first read their parameters, then those never read, in
        layout order: the order the stepper updates them in beside the next forward. Layout order alone would not
        do: with decay and no-decay param groups (transformers' Trainer, nanoGPT) the first block's LayerNorm sits
        in the last sub-groups."""
        holding: dict[int, list[int]] = {}  # id(parameter) -> the sub-groups holding parts of it
        for sg in layout.sub_groups:
            for seg in sg.segments:
                holding.setdefault(id(layout.params[seg.param]), []).append(sg.index)
        order: dict[int, None] = {}
        for pid in self.first_read:
            for k in holding.get(pid, ()):
                order.setdefault(k)
        for sg in layout.sub_groups:
            order.setdefault(sg.index)
        return list(order)

    def note(self, key: int) -> None:
        """While recording: the forward needed ``key`` (parameter offload's index of a parameter) now."""
        self.order.append(key)

    # when it records ---------------------------------------------------------------------------------------------

    def record_again(self) -> None:
        """The order departed from the trace: the next forward records it again (under the mode). Until then
        :attr:`order` is empty: nothing to follow."""
        self.order = []
        self._again = True

    def begin_forward(self) -> None:
        """A root forward starts (parameter offload calls it before it fetches anything for it): a trace to record
        again records from here, and a recording one whose last forward raised starts its order over."""
        if self._again:
            self._again, self.recording = False, True
        if self.recording and self._pushed is None:
            self.order.clear()

    def fix(self) -> None:
        """If anything was recorded: ends the recording, pops the mode wherever the forward is, and hands the trace
        to the ``on_fixed`` callbacks."""
        if not self.recording or not (self.order or self.first_read):
            return
        self._pop()
        self.recording = False
        for fn in list(self.on_fixed):
            fn()

    def _start(self, module: torch.nn.Module, *_: Any) -> None:
        """The root's forward starts: an outermost one on a thread with no mode pushes it."""
        if not self.recording:
            return
        if self._pushed is None:
            self._running.clear()
            self._mode = _Reads(self)
            self._mode.__enter__()
            self._pushed = threading.get_ident()
        if self._pushed == threading.get_ident():
            self._depth += 1
            self._running.append(module)

    def _stop(self, *_: Any) -> None:
        """The root's forward ends (also after an error): the outermost one pops the mode."""
        if self._pushed is None or self._pushed != threading.get_ident():
            return
        if self._running:
            self._running.pop()
        self._depth -= 1
        if self._depth <= 0:
            self._pop()

    def _done(self, *_: Any) -> None:
        """The root's forward ended normally (after ``_stop``): the first such forward's record is the trace."""
        if self._pushed is None and self.recording:
            self.fix()

    def _pop(self) -> None:
        """Pops the mode if it is the top of this thread's stack; under a mode of the user's, or on another
        thread's stack, it is left there, inert."""
        mode, self._mode = self._mode, None
        pushed, self._pushed = self._pushed, None
        self._depth = 0
        self._running.clear()
        if mode is None:
            return
        stack = _get_current_function_mode_stack() if pushed == threading.get_ident() else []
        if stack and stack[-1] is mode:
            mode.__exit__(None, None, None)
        else:
            mode.trace = None

    def _enter(self, module: torch.nn.Module, *_: Any) -> None:
        if self._mode is not None and self._pushed == threading.get_ident():
            self._running.append(module)

    def _leave(self, *_: Any) -> None:
        if self._mode is not None and self._running and self._pushed == threading.get_ident():
            self._running.pop()

    def saw(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """A torch function is about to run on ``args``: the parameters among them are read by the innermost module
        running (and, reading values, handed to ``on_read`` first)."""
        if not self._running:
            return
        reader = self._running[-1]
        values = func not in _METADATA
        for t in _tensors((args, kwargs)):
            p = self._params.get(id(t))
            if p is None:
                continue
            self.first_read.setdefault(id(p))
            self.reads.setdefault(id(reader), {})[id(p)] = None
            if values and self.on_read is not None:
                self.on_read(reader, p)

    def close(self) -> None:
        self._pop()
        for h in self._handles:
            h.remove()
        self._handles = []
        self.on_fixed, self.on_read = [], None


class _Reads(TorchFunctionMode):
    """Hands every torch function called while it is active to its trace before it runs (inside the handler the
    mode is off, so what the trace's listeners call passes by)."""

    def __init__(self, trace: ForwardTrace) -> None:
        super().__init__()
        self.trace: ForwardTrace | None = trace  # None: left on a stack it could not be popped from

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        trace = self.trace
        if trace is not None and not trace.quiet:
            trace.saw(func, args, kwargs)
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
