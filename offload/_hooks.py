"""Hooks the library puts on a user's model, and what a copy of that model makes of them.

``copy.deepcopy(model)`` (an EMA of the weights, a frozen reference model) and ``torch.save(model)`` copy a
module's hooks with it. A plain function or bound method there would drag the engine along (its threads and
locks cannot be copied: "cannot pickle '_thread.lock' object"), or, worse, make the copy call back into the
original engine. Wrapped in :class:`Hook`, a hook copies as a no-op: the copy is a plain model holding the
parameters' current values. Where a copy cannot hold the real values (parameters offloaded to host or NVMe homes,
so the module holds placeholders), or not yet (a step's updates still running beside the next forward), the hook
refuses to be copied and says what to do instead.

Under ``torch.compile`` a hook runs as plain Python, never traced (``torch.compiler.disable``): it moves parameters
and waits on threads and files, which dynamo cannot trace, and a traced copy of its side effects would be replayed
wrongly. The compiled graphs sit between the hooks (a graph break at each module that has some), and autograd's
saved-tensor hooks still see what a compiled graph saves for backward. :func:`unwrap_compiled` is the model the
hooks and every name belong to when the user hands over ``torch.compile(model)``.

Under ``torch.inference_mode()`` a hook runs with inference mode off: the device buffers and placeholders it makes
outlive the block, and an inference tensor could be neither written nor saved for backward after it.

One hook owner per module, with a declared order. Several parts of the library act at each module's forward (the
engine, the update gate, parameter offload, the forward trace), and the order they act in matters (the inputs
reach the device before parameters are fetched; the trace starts once the engine's own checks touched every
parameter). Rather than each registering torch hooks and ordering them by ``prepend`` flags, each takes a
:class:`Slot` on the module with :func:`on_forward`; the module gets ONE forward pre-hook (``prepend=True``,
``with_kwargs=True``) and ONE forward hook (``always_call=True``) from the library, both :class:`Hook`, that run
the slots taken::

    handle = on_forward(module, Slot.FETCH, pre=fetch, post=evictable, refuse=why)
    ...
    handle.remove()  # at the owner's close; the torch hooks go with the module's last slot

* ``pre(module, args, kwargs)``: in slot order, before the forward; it may return ``(args, kwargs)`` to replace
  them (:attr:`Slot.INPUTS`);
* ``always(module, args, output)``: in reverse slot order after the forward, and also after a forward that raised
  an ``Exception`` (torch's ``always_call``: never after a ``BaseException`` such as ``KeyboardInterrupt``, which
  runs no hook; an error raised in one is then a warning, and the others still run);
* ``post(module, args, output)``: after the slot's ``always``, when the forward ended normally only; it may return
  a replacement output;
* ``refuse``: what a copy of the model makes of the slot (:class:`Hook`'s): the module's hooks refuse with the
  first slot that does.

The engine takes :attr:`Slot.HOLD` (``pre``: Ctrl-C held; ``always``: released), :attr:`Slot.CHECK_HELD` (``pre``)
and :attr:`Slot.INPUTS` (``pre``, returning ``(args, kwargs)``) on its root module. A slot is taken once per module.
"""

from __future__ import annotations

import enum
import functools
import sys
import warnings
import weakref
from typing import Any, Callable, NamedTuple

import torch


def unwrap_compiled(model: torch.nn.Module) -> torch.nn.Module:
    """The module ``torch.compile(model)`` wraps (its names carry no ``_orig_mod.`` prefix), else ``model``."""
    dynamo = sys.modules.get("torch._dynamo")  # not imported yet: nothing can have been compiled (no import here)
    return model._orig_mod if dynamo is not None and isinstance(model, dynamo.eval_frame.OptimizedModule) else model


def weakly(method: Callable[..., Any]) -> Callable[..., Any]:
    """``method`` (bound) called through a weak reference to its object, for hooks on tensors: torch keeps those
    in C++, where the garbage collector cannot see a cycle through them, so a strong one would keep an engine
    (dropped unclosed, with its model) alive to the end of the process. Once the object is gone, nothing."""
    ref = weakref.WeakMethod(method)

    def call(*args: Any, **kwargs: Any) -> Any:
        bound = ref()
        return None if bound is None else bound(*args, **kwargs)
    return call


def _nothing(*_: Any, **__: Any) -> None:
    """What a copied hook does."""


def _copied() -> Callable[..., None]:
    """Unpickling a hook gives the no-op (a module-level function pickles by reference)."""
    return _nothing


class Hook:
    """``fn`` as a hook; ``refuse``: the error a copy of the model raises, or a callable giving it at the time of
    the copy (None: the copy drops the hook)."""

    __slots__ = ("fn", "refuse", "_from_public_api")  # the last: torch's mark on public state_dict post-hooks

    def __init__(self, fn: Callable[..., Any], refuse: str | Callable[[], str | None] | None = None) -> None:
        self.fn, self.refuse = fn, refuse
        _hide_from_dynamo()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if torch.is_inference_mode_enabled():  # what a hook makes (device buffers, placeholders) outlives the
            with torch.inference_mode(False):  # block: an inference tensor could not be written or saved after it
                return self.fn(*args, **kwargs)
        return self.fn(*args, **kwargs)

    def _copy(self) -> None:
        why = self.refuse() if callable(self.refuse) else self.refuse
        if why is not None:
            raise ValueError(why)

    def __deepcopy__(self, memo: dict[int, Any]) -> Callable[..., None]:
        self._copy()
        return _nothing

    def __reduce__(self) -> tuple[Any, tuple[()]]:
        self._copy()
        return _copied, ()


@functools.cache
def _hide_from_dynamo() -> None:
    """Makes ``Hook.__call__`` a frame dynamo never enters (see the module docstring), once, when the first hook is
    made: ``torch.compiler.disable`` imports torch._dynamo, a second or more that ``import offload`` alone (the
    CLI's estimate) need not pay. Disabling a callee instead is not enough: dynamo would then compile every hook's
    own frame, an empty graph guarded on its arguments, and recompile it for each kind of hook."""
    Hook.__call__ = torch.compiler.disable(Hook.__call__)  # type: ignore[method-assign]


class Slot(enum.IntEnum):
    """Where an owner acts in a module's forward: ``pre`` parts run in this order, the parts after the forward in
    the reverse one."""

    HOLD = 1  # engine (root): Ctrl-C held from the first pre-hook to the last hook, which runs after an error too
    CHECK_HELD = 2  # engine (root): the model still holds the engine's tensors; before the trace, as it reads every one
    GATE = 3  # update gate: wait for the updates of what the module reads, before anything reads it
    INPUTS = 4  # engine (root): the inputs moved to the device
    STEP = 5  # parameter offload (root): a forward starts; after it, backward's first fetches
    FETCH = 6  # parameter offload: the module's parameters on the device; after it, evictable again
    TRACE = 7  # the forward trace: last, so that no other slot's own work is taken for the model's reads


class _Part(NamedTuple):
    pre: Callable[..., Any] | None
    always: Callable[..., Any] | None
    post: Callable[..., Any] | None
    refuse: str | Callable[[], str | None] | None


class _Slots:
    """One module's slots, and the two torch hooks that run them."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.parts: dict[Slot, _Part] = {}
        self._pre: tuple[Callable[..., Any], ...] = ()
        self._after: tuple[tuple[Callable[..., Any] | None, Callable[..., Any] | None], ...] = ()
        self._handles = (module.register_forward_pre_hook(Hook(self.pre, self.refuse), prepend=True, with_kwargs=True),
                         module.register_forward_hook(Hook(self.after, self.refuse), always_call=True))

    def take(self, slot: Slot, part: _Part) -> None:
        assert slot not in self.parts, f"{slot.name} taken twice on one module"
        self.parts[slot] = part
        self._order()

    def give_back(self, slot: Slot) -> None:
        self.parts.pop(slot, None)
        self._order()
        if not self.parts:
            for h in self._handles:
                h.remove()

    def _order(self) -> None:
        slots = sorted(self.parts)
        self._pre = tuple(self.parts[s].pre for s in slots if self.parts[s].pre is not None)
        self._after = tuple((self.parts[s].always, self.parts[s].post) for s in reversed(slots)
                            if self.parts[s].always is not None or self.parts[s].post is not None)

    def refuse(self) -> str | None:
        for part in self.parts.values():
            why = part.refuse() if callable(part.refuse) else part.refuse
            if why is not None:
                return why
        return None

    def pre(self, module: torch.nn.Module, args: Any, kwargs: Any) -> tuple[Any, Any] | None:
        changed = False
        for fn in self._pre:
            out = fn(module, args, kwargs)
            if out is not None:
                args, kwargs = out
                changed = True
        return (args, kwargs) if changed else None

    def after(self, module: torch.nn.Module, args: Any, output: Any) -> Any:
        parts = self._after
        if _raised_in(module):
            self._always(parts, module, args, output)
            return None
        for i, (always, post) in enumerate(parts):
            try:
                if always is not None:
                    always(module, args, output)
                if post is not None:
                    result = post(module, args, output)
                    if result is not None:
                        output = result
            except Exception:  # as torch does when a hook raises: the always-called ones left still run
                self._always(parts[i + 1 :], module, args, output)
                raise
        return output

    @staticmethod
    def _always(parts: tuple[tuple[Callable[..., Any] | None, Callable[..., Any] | None], ...],
                module: torch.nn.Module, args: Any, output: Any) -> None:
        """The ``always`` parts after an error: each runs, one that raises is a warning (torch's rule)."""
        for always, _ in parts:
            if always is None:
                continue
            try:
                always(module, args, output)
            except Exception as exc:  # noqa: BLE001 - another error is on its way up
                warnings.warn("offload: a module forward hook raised an exception that was silenced as another "
                              f"error was raised in forward: {exc}", stacklevel=2)


class SlotHandle:
    """What :func:`on_forward` returns: ``remove()`` gives the slot back (at the owner's close; idempotent)."""

    __slots__ = ("_slots", "_slot")

    def __init__(self, slots: _Slots, slot: Slot) -> None:
        self._slots: _Slots | None = slots
        self._slot = slot

    def remove(self) -> None:
        if self._slots is not None:
            self._slots.give_back(self._slot)
            self._slots = None


def on_forward(module: torch.nn.Module, slot: Slot, *, pre: Callable[..., Any] | None = None,
               always: Callable[..., Any] | None = None, post: Callable[..., Any] | None = None,
               refuse: str | Callable[[], str | None] | None = None) -> SlotHandle:
    """Takes ``slot`` on ``module``'s forward (see the module docstring for when each part runs)."""
    slots = _slots_of(module)
    if slots is None:
        slots = _Slots(module)
    slots.take(slot, _Part(pre, always, post, refuse))
    return SlotHandle(slots, slot)


def _slots_of(module: torch.nn.Module) -> _Slots | None:
    """The library's slots on ``module``: kept by the pre-hook itself (a copy of the model gets a no-op there, so
    a copy starts with none), never in a table of ours that would keep the module alive."""
    for hook in module._forward_pre_hooks.values():
        if isinstance(hook, Hook) and isinstance(getattr(hook.fn, "__self__", None), _Slots):
            return hook.fn.__self__
    return None


def _raised_in(module: torch.nn.Module) -> bool:
    """Whether torch calls the forward hook of ``module`` after its forward (or a hook) raised: then the exception
    being handled was caught in that very call of ``Module._call_impl`` (the head of its traceback; under
    ``torch.compile``, a resumed piece of it). A forward called while its caller handles an exception of its own
    sees that one, caught elsewhere. The common case, no exception, is one call."""
    exc = sys.exc_info()[1]
    if exc is None:
        return False
    tb = exc.__traceback__
    return tb is not None and "_call_impl" in tb.tb_frame.f_code.co_name and \
        tb.tb_frame.f_locals.get("self") is module
