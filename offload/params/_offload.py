"""ParameterOffload: low-precision parameters live on HOST or NVME; only a bounded window is on the device.

Each managed parameter has a home (a view of the flat host buffer the optimizer writes new parameters into, or a
swap key per parameter on NVMe; stage 3 on several ranks: this rank's piece, on the host or on NVMe, held by
:class:`offload.dist.ParamShards`) and a device state, explicit in :class:`ParamState`:

    RELEASED --fetch--> FETCHING --(copy/read done)--> AVAILABLE --release (no user left)--> RELEASED
    AVAILABLE --(gradient done, an update follows)--> LANDING --(the update wrote every part)--> AVAILABLE
                                                      LANDING --(a fetch, no room, no update)--> RELEASED

While RELEASED, ``p.data`` is one NaN element expanded to the parameter's shape (the shape stays true for
autograd, which lays out a gradient to match it, and a use that bypassed the hooks shows as NaN rather than as
plausible numbers); while AVAILABLE it is a device buffer counted on the DEVICE tier.
Parameters with at most ``stage3_param_persistence_threshold`` elements stay AVAILABLE (persistent).

When parameters are needed:

* forward: a pre-hook on each module fetches its own parameters (waiting only for those not already prefetched)
  and a post-hook marks them evictable: they stay on the device, least recently used first out, until a fetch
  needs the room. Backward runs the layers in reverse, so the last layers of forward are still there when backward
  starts (DeepSpeed's reuse distance, bounded here by the window rather than by a count). So a parameter is on the
  device while its owning module runs. A module that reads another module's parameter itself (``self.sub.weight``
  outside ``self.sub(...)``: ``nn.MultiheadAttention`` reads ``out_proj.weight``, a tied head goes through
  ``F.linear``, a loss in the forward reads the embedding) needs no declaration: while the forward trace records
  (the first forward, and any after one whose order departed from the trace), the model's forward runs under a
  torch function mode (:class:`_ReadsOutside`) that sees every parameter handed to a torch function; one no running
  module has fetched is fetched there, before the function runs, and declared for the innermost module running
  (:meth:`register_external`, DeepSpeed's explicit rule, which still works), so later forwards fetch it in that
  module's pre-hook, along the trace, and run without the mode. ``nn.MultiheadAttention`` modules are declared so
  from the start (their forward always reads ``out_proj``). A read outside any forward, or one a later forward
  makes on a path none recorded, still sees the NaN placeholder: the last line of defence;
* backward: the model's forward runs under a saved-tensors hook that saves a *reference* (parameter, view
  geometry) instead of a parameter's device tensor, so backward fetches it again on demand at unpack time; a
  trainable parameter is released once its gradient has been accumulated (its last use in this backward), a frozen
  one is evictable as soon as it is unpacked (no gradient tells its last use).

Copies to the device go through the engine's :class:`~offload.memory.CopyStreams`: with CUDA, a host home is copied
on the host-to-device stream and the compute stream waits for that copy on the GPU only when it uses the parameter;
an NVMe home is read into a piece of a fixed pinned :class:`~offload.memory.StagingArena` and copied on by the
fetch thread, which does not wait for that copy (the arena does, before it lends the piece's room again). A
device buffer handed to a new fetch is written only after the compute stream has passed the point where
its previous parameter was released. On the CPU the same calls copy on the fetch thread.

Landing: with NVMe homes, the first parameters of the forward trace (as many as the first prefetch would start)
are the last whose gradients backward finishes, and the optimizer updates them last. Instead of writing them to
NVMe and reading them straight back for the next forward, a parameter among them keeps its device buffer when its
gradient is done (LANDING, still counted in the window) and the optimizer thread, as it writes each updated part
home, also copies it into that buffer (:meth:`write_home_part`; a host-to-device copy with CUDA). ``updated`` makes
those whose every part landed AVAILABLE; any other leaves the window, as does a landing that a fetch needs the room
of, or that no update completed (a skipped step). The next forward then starts without waiting for the disk.

Prefetch: the first step records the order parameters are fetched in (forward and backward separately); later
steps, at each fetch, start the fetches of the next parameters in that order as long as the live parameters stay
within ``stage3_max_live_parameters`` and the fetches in flight within ``stage3_prefetch_bucket_size``; in forward
it may evict the oldest evictable parameters for room, in backward only room that finished gradients freed (every
leftover of forward is needed before anything further along the trace). A step whose order departs from the trace
stays correct (fetches wait), drops the trace and records a new one.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import functools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from nvme_swapper import PAGE, AioConfig, SwapEngine, aligned_tensor, swap_file_bytes

from .._cleanup import close_after_failure, run_all
from .._device import free_device_memory
from .._hooks import Hook
from .._worker import bind_thread
from ..memory import (DONE, AllOf, BudgetExceeded, Copy, CopyStreams, StagingArena, Tier, TieredStore,
                      default_host_budget, fmt_bytes, start_all, wait_all)

log = logging.getLogger("offload")

_NO_COPY = ("copy.deepcopy or torch.save of a model whose parameters are offloaded (offload_param) would copy the "
            "placeholders the modules hold between uses, not the weights: write them with "
            "engine.save_safetensors(dir) or take engine.consolidated_state_dict(), and load that into a model of "
            "your own (or copy the model before offload.initialize)")


class ParamState(Enum):
    RELEASED = "released"
    FETCHING = "fetching"
    AVAILABLE = "available"
    LANDING = "landing"  # not usable: its device buffer waits for the optimizer's new values (see "Landing")


@dataclass(eq=False)
class _Landing:
    """The parts of a LANDING parameter the optimizer has yet to copy in, and the copies it made (CUDA)."""

    left: set[int]  # starts of the parts not landed yet
    copies: list[Any] = field(default_factory=list)


@dataclass(eq=False)
class _Param:
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


@dataclass
class _Trace:
    """The order parameters were fetched in, by phase; ``pos`` is how far this step has followed it."""

    order: list[int] = field(default_factory=list)
    recording: bool = True
    pos: int = 0


def check_window(sizes: list[int], persistence_threshold: int, max_live: int, dtype: torch.dtype,
                 budget: int | None) -> None:
    """The window (``max_live`` elements) plus the persistent parameters must fit the device ``budget``, and the
    largest parameter the window: checked before anything moves (the engine calls it before the parameters go to
    their homes, so a config that cannot fit leaves the model as it was), not mid-step."""
    size = torch.empty((), dtype=dtype).element_size()
    persistent = sum(n for n in sizes if n <= persistence_threshold) * size
    largest = max((n for n in sizes if n > persistence_threshold), default=0)
    if largest > max_live:
        raise ValueError(f"zero_optimization.stage3_max_live_parameters ({max_live}) is smaller than the "
                         f"largest parameter ({largest} elements); raise it to at least {largest}")
    if budget is not None and max_live * size + persistent > budget:
        least = largest * size + persistent  # the smallest window (the largest parameter) beside the persistent
        if budget >= least:
            fix = (f"lower zero_optimization.stage3_max_live_parameters to at most {(budget - persistent) // size} "
                   f"or raise offload.device_memory_budget to at least {max_live * size + persistent} B")
        elif largest * size <= budget:  # only fewer persistent parameters make room for the largest one
            fix = (f"lower zero_optimization.stage3_param_persistence_threshold (fewer of the {persistent} B of "
                   f"persistent parameters kept on the device) or raise offload.device_memory_budget to at least "
                   f"{least} B")
        else:  # the largest parameter alone does not fit: only a larger budget helps
            fix = (f"raise offload.device_memory_budget to at least {least} B: the largest parameter ({largest} "
                   "elements) is on the device whole while its module runs"
                   + (f", beside {persistent} B of persistent parameters" if persistent else ""))
        raise BudgetExceeded(Tier.DEVICE, f"the parameter window (stage3_max_live_parameters {max_live} "
                             f"x {size} B) plus {persistent} B of persistent parameters",
                             max_live * size + persistent, 0, budget, fix)


class ParameterOffload:
    """Owns the device copies of the model's parameters, the hooks that fetch and release them, the prefetch
    traces, and (NVMe home) its own swap engine. ``close()`` removes the hooks and puts every parameter back on
    the device as a plain tensor. The caller checks the window with :func:`check_window` before it moves any
    parameter to a home."""

    def __init__(self, module: torch.nn.Module, params: list[torch.nn.Parameter], homes: list[torch.Tensor | None],
                 store: TieredStore, copies: CopyStreams, dtype: torch.dtype, *, persistence_threshold: int,
                 max_live: int, bucket: int, nvme_path: str | None = None, aio: AioConfig | None = None,
                 shards: Any = None, scratch: torch.Tensor | None = None,
                 parts: list[list[tuple[int, int]]] | None = None, land: bool = False, staging: int = 0,
                 before_home: Callable[[int], None] | None = None,
                 written_together: list[list[tuple[int, int]]] | None = None, writes: int = 1) -> None:
        """``shards`` (a :class:`offload.dist.ParamShards`, several ranks): the homes of the parameters it covers
        are pieces on each rank; fetching one is an all-gather (collective: every rank fetches in the same
        order, which the same model, trace and window make true). ``scratch``: a host buffer of the caller's,
        idle during construction, that NVMe homes are written through (else one is allocated for it).
        ``parts``: per parameter, the (start, numel) ranges its NVMe home is kept in, one key each (the
        optimizer's sub-group segments, so an update writes its own keys); parameters without (frozen ones) are
        cut in ranges of at most ``scratch``'s size. ``land``: updates are written by the optimizer thread during
        the step that follows each backward (not delayed), so the next forward's first parameters may land (see
        "Landing"). ``staging``: elements of a pinned arena NVMe reads land in before the fetch thread copies
        them to the device (CUDA); 0: they are read straight into the device buffer (the CPU device tier).
        ``before_home(i)``: called before parameter ``i`` is read for its home (the engine fills the optimizer's
        masters from it then, so each parameter's memory goes once it is homed, not after every master is
        filled). ``written_together``: the (parameter, part start) keys one update writes at once (a sub-group's
        segments), at most ``writes`` updates at a time: the swap file's spare room for their rewrites."""
        self.module, self.store, self.copies, self.dtype = module, store, copies, dtype
        self.shards = shards
        self.device = store.device
        self.max_live, self.bucket = max_live, bucket
        self.live_numel = 0  # non-persistent parameters AVAILABLE or FETCHING
        self.in_flight_numel = 0
        # released device buffers by size, reused by fetches, each with the compute-stream point it was released at
        self._cache: dict[int, list[tuple[torch.Tensor, Any]]] = {}
        self._arena: StagingArena | None = None  # pinned memory NVMe reads land in (CUDA)
        self._evictable: collections.OrderedDict[int, _Param] = collections.OrderedDict()  # unused, oldest first
        self.cached_numel = 0  # live + cached stays within max_live: the device window's bound
        self.counters = {"resident": 0, "in_flight": 0, "waited": 0, "fetches": 0, "released": 0,
                         "trace_invalidations": 0, "landed": 0, "refetched": 0, "read_outside": 0}
        self._may_land = land
        self._to_land: set[int] = set()  # chosen at the start of a backward an update follows
        self._landing: dict[int, _Landing] = {}  # shared with the optimizer thread, under _landing_lock
        self._landing_lock = threading.Lock()
        self._mark = dict(self.counters)  # counters at the end of the last optimizer step
        self.last_step: dict[str, float] = {}
        self._swap: SwapEngine | None = None
        self._copier = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="offload-fetch",
                                                             initializer=bind_thread, initargs=(self.device,))
        self._hooks: list[Any] = []
        self._running: list[torch.nn.Module] = []  # the modules whose forward is running, innermost last
        self._tracing_reads = False  # the model's forward runs under _ReadsOutside
        self._busy = 0  # fetches running: their own torch calls are not the model's reads
        self.params: list[_Param] = []
        self._by_param: dict[int, _Param] = {}
        self._by_storage: dict[int, _Param] = {}
        self._traces = {"forward": _Trace(), "backward": _Trace()}
        self._phase = "forward"
        self._frozen_in_backward: set[int] = set()
        self._nvme_bytes = 0
        self._home_writes: dict[int, int] = {}  # parameter -> its part writes in flight at once (else 1)
        self._private: list[torch.Tensor] = []  # host copies this object allocated (and frees at close)
        self._parts = parts or []
        try:
            # NVMe keys of this object's own: the pieces of sharded parameters (frozen ones too) are ParamShards'
            homed = [i for i, p in enumerate(params) if p.numel() > persistence_threshold
                     and not (shards is not None and shards.covers(i))]
            chunk = scratch.numel() if scratch is not None else max((p.numel() for p in params), default=1)
            self._parts = [self._parts[i] if i < len(self._parts) and self._parts[i] else
                           [(s, min(chunk, p.numel() - s)) for s in range(0, p.numel(), max(chunk, 1))]
                           for i, p in enumerate(params)]
            if nvme_path is not None and (homed or shards is None):
                root = Path(nvme_path)
                size = torch.empty((), dtype=dtype).element_size()
                # every part's key (its page-rounded extent, and the file's header page), plus the spare extents its
                # rewrites go to beside the bytes they replace: those of the updates in flight at once, and one at a
                # time for the rest (frozen parts: loads)
                parts_of = {(i, s): n * size for i in homed for s, n in self._parts[i]}
                groups = [[parts_of.pop(key) for key in group if key in parts_of] for group in written_together or []]
                self._home_writes = {i: writes for group in written_together or [] for i, _ in group}
                nvme_bytes = swap_file_bytes(groups, writes, parts_of.values())
                store.claim_nvme(root, nvme_bytes, f"parameters homed on {root}", f"free disk space at {root}")
                self._nvme_bytes = nvme_bytes
                self._swap = SwapEngine(root, aio or AioConfig(), file_io=store.file_io)
                # written now, as the optimizer's: each length's spare extents come from this room, never from
                # splitting another length's (the file would then outgrow the claim)
                self._swap.reserve(nvme_bytes - PAGE)
                if staging:
                    self._arena = StagingArena(store, staging, dtype, "the pinned staging of parameters read from "
                                               "NVMe", "raise offload.host_memory_budget or lower "
                                               "zero_optimization.stage3_prefetch_bucket_size")
            self._build(params, homes, persistence_threshold, scratch, before_home)
            self._install()
        except BaseException as exc:
            close_after_failure(self.close, exc)
            raise

    def _build(self, params: list[torch.nn.Parameter], homes: list[torch.Tensor | None],
               persistence_threshold: int, scratch: torch.Tensor | None,
               before_home: Callable[[int], None] | None) -> None:
        """Records every parameter, writes NVMe homes (through one host buffer, freed after) and puts persistent
        parameters on the device. A parameter is recorded once its home holds its value, so ``close`` after a
        failure here hands back exactly the parameters that moved."""
        writing = owned = None
        if self._swap is not None:
            largest = max((n for i, p in enumerate(params) if p.numel() > persistence_threshold
                           and not (self.shards is not None and self.shards.covers(i))
                           for _, n in self._parts[i]), default=0)
            if scratch is not None and scratch.numel() >= largest and scratch.dtype == self.dtype:
                writing = scratch
            else:
                writing = owned = self.store.allocate(Tier.HOST, largest, self.dtype, "the buffer parameters are "
                                                      "written to NVMe through at initialize",
                                                      "raise offload.host_memory_budget")
        # frozen parameters, and persistent ones with NVMe homes, keep a private host copy: one block, taken
        # before anything moves, so a host budget it does not fit fails with the model as it was
        private = [i for i, (p, home) in enumerate(zip(params, homes)) if home is None
                   and not (self.shards is not None and self.shards.covers(i))
                   and (self._swap is None or p.numel() <= persistence_threshold)]
        copies: dict[int, torch.Tensor] = {}
        if private:
            sizes = [params[i].numel() for i in private]
            block = self.store.allocate(Tier.HOST, sum(sizes), self.dtype, f"the host copies of {len(private)} "
                                        "frozen or persistent parameters", "raise offload.host_memory_budget")
            self._private.append(block)
            copies = dict(zip(private, block.split(sizes)))
        try:
            for i, (p, home) in enumerate(zip(params, homes)):
                if before_home is not None:
                    before_home(i)
                persistent = p.numel() <= persistence_threshold
                rec = _Param(i, p, p.shape, p.numel(), home, persistent, parts=tuple(self._parts[i]),
                             trains=p.requires_grad)
                rec.sharded = self.shards is not None and self.shards.covers(i)
                if rec.sharded:
                    pass  # the engine filled this rank's piece; every rank starts from the same full values
                elif self._swap is not None and not persistent:
                    flat = p.detach().reshape(-1)
                    for start, n in rec.parts:
                        writing[:n].copy_(flat[start : start + n])
                        self._swap.write(self._key(rec, start), writing[:n]).wait()
                    rec.home = None
                elif home is None:  # frozen, or persistent with NVMe homes: its private host copy
                    rec.home = copies[i]
                    rec.home.copy_(p.detach().reshape(-1))
                self.params.append(rec)
                self._by_param[id(p)] = rec
                if persistent:
                    self._materialize(rec)
                    source = rec.home if rec.home is not None and not rec.sharded else p.detach().reshape(-1)
                    self._upload_now(rec, source)
                    rec.state = ParamState.AVAILABLE
                p.data = self._placeholder(rec) if not persistent else rec.device.view(rec.shape)
        finally:
            if owned is not None:
                self.store.free(Tier.HOST, owned)

    @staticmethod
    def _key(rec: _Param, start: int) -> str:
        return f"param/{rec.index}/{start}"

    def _read_parts(self, rec: _Param, dst: torch.Tensor) -> AllOf:
        """Starts reading every part of ``rec``'s NVMe home into its range of ``dst`` (flat, the parameter's
        size)."""
        assert self._swap is not None
        return start_all(functools.partial(self._swap.read, self._key(rec, start), dst[start : start + n])
                         for start, n in rec.parts)

    # hooks ------------------------------------------------------------------------------------------------------

    def _install(self) -> None:
        # before any module's own pre-hook (the root's included): a new forward starts the traces from the top
        self._hooks.append(self.module.register_forward_pre_hook(Hook(lambda *_: self.begin_step(), _NO_COPY),
                                                                 prepend=True))
        self._uses: dict[int, list[_Param]] = {}
        for mod in self.module.modules():
            own = [self._by_param[id(p)] for p in mod.parameters(recurse=False) if id(p) in self._by_param]
            if own:
                self._hook_module(mod, own)
            # the modules running, innermost last: whom a read outside its owner's forward is declared for
            self._hooks.append(mod.register_forward_pre_hook(Hook(functools.partial(self._enter, mod), _NO_COPY)))
            self._hooks.append(mod.register_forward_hook(Hook(self._leave, _NO_COPY), always_call=True))
        for mod in self.module.modules():
            if isinstance(mod, torch.nn.MultiheadAttention):  # its forward reads out_proj's parameters itself
                for p in mod.out_proj.parameters():
                    if id(p) in self._by_param:
                        self.register_external(mod, p)
        self._hooks.append(self.module.register_forward_hook(Hook(lambda *_: self._forward_done(), _NO_COPY)))
        original = self.module.forward

        @functools.wraps(original)
        def forward(*args: Any, **kwargs: Any) -> Any:
            with self.saved_tensors(), self._reads_outside():
                return original(*args, **kwargs)

        self.module.forward = forward
        self._original_forward = original

    def _hook_module(self, mod: torch.nn.Module, own: list[_Param]) -> None:
        self._uses[id(mod)] = own
        self._hooks.append(mod.register_forward_pre_hook(Hook(functools.partial(self._pre_forward, own), _NO_COPY)))
        self._hooks.append(mod.register_forward_hook(Hook(functools.partial(self._post_forward, own), _NO_COPY)))

    def register_external(self, module: torch.nn.Module, param: torch.nn.Parameter) -> None:
        """Makes ``param`` available while ``module`` runs, though another module owns it."""
        rec = self._by_param.get(id(param))
        if rec is None:
            raise ValueError("register_external: the tensor is not a parameter of the model")
        if id(module) in self._uses:
            if rec not in self._uses[id(module)]:
                self._uses[id(module)].append(rec)
        else:
            self._hook_module(module, [rec])

    def _enter(self, mod: torch.nn.Module, *_: Any) -> None:
        if self._tracing_reads:  # (kept only while the mode can ask for it)
            self._running.append(mod)

    def _leave(self, *_: Any) -> None:
        if self._tracing_reads and self._running:
            self._running.pop()

    def _reads_outside(self) -> Any:
        """The mode that fetches parameters read outside their modules' forwards (see the module docstring), while
        the forward trace records; else nothing."""
        if self._traces["forward"].recording and not self._tracing_reads:
            return _ReadsOutside(self)
        return contextlib.nullcontext()

    def _fetch_read(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """A torch function is about to read ``args``: each managed parameter among them that no running module
        has fetched is fetched now and declared for the innermost module running, which counts as its user until
        that module's forward ends (its post-hook, now covering it, releases it as its own)."""
        for t in _tensor_args(args, kwargs):
            rec = self._by_param.get(id(t))
            if rec is None or rec.users or rec.persistent or rec.held:
                continue
            reader = self._running[-1] if self._running else self.module
            self.register_external(reader, rec.param)
            self.counters["read_outside"] += 1
            self.fetch(rec)
            rec.users += 1
            log.debug("offload: %s's forward reads a parameter of another module (%s): fetched with it from now on",
                      type(reader).__name__, tuple(rec.shape))

    def _pre_forward(self, own: list[_Param], module: torch.nn.Module, args: Any) -> None:
        for rec in own:
            self.fetch(rec)
            rec.users += 1

    def _post_forward(self, own: list[_Param], module: torch.nn.Module, args: Any, output: Any) -> None:
        recomputing = self._phase == "backward"  # activation checkpointing re-runs forward inside backward,
        for rec in own:  # saving the parameters themselves: keep them until their gradient is in (grad_done)
            rec.users -= 1
            if rec.users == 0 and not recomputing and not rec.persistent and not rec.held:
                self._evictable[rec.index] = rec  # kept while the window has room: backward may want it soon
                self._evictable.move_to_end(rec.index)

    def _forward_done(self) -> None:
        """The root module returned: with autograd recording, backward comes next, so start its first fetches."""
        if torch.is_grad_enabled():
            self._phase = "backward"
            self._traces["backward"].pos = 0
            self._prefetch()

    def _pack(self, t: torch.Tensor) -> Any:
        if t.device != self.device or not t.is_floating_point():
            return t
        rec = self._by_storage.get(t.untyped_storage().data_ptr())
        if rec is None:
            return t
        return (rec, t.storage_offset(), tuple(t.shape), tuple(t.stride()))

    def _unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        rec, offset, shape, stride = packed
        self._phase = "backward"
        self.fetch(rec)
        # A frozen parameter: no gradient says when backward is done with it, so it is evictable at once, least
        # recently used first (a later use fetches it again), and its buffer is never handed to another fetch
        # (autograd may still read it). Kept until backward ended, a frozen base filled the device beyond the window.
        if not rec.param.requires_grad:
            self._frozen_in_backward.add(rec.index)
            if not rec.persistent and not rec.held:
                self._evictable[rec.index] = rec
                self._evictable.move_to_end(rec.index)
        assert rec.device is not None
        return rec.device.as_strided(shape, stride, offset)

    # fetch and release ------------------------------------------------------------------------------------------

    def fetch(self, rec: _Param) -> None:
        """Makes ``rec`` AVAILABLE on the device (waiting if needed), then prefetches along the trace. A piece's
        use in a forward that trains goes into the ranks' trace (``Comm.trace``): a persistent one is gathered by
        no collective. Uses that make no gradient (a no_grad forward, a gathered() block's) may differ by rank."""
        self._busy += 1  # (its own torch calls are no reads for _ReadsOutside)
        try:
            if rec.sharded and not rec.held and torch.is_grad_enabled():
                self.shards.comm.note("use", rec.index)
            self._follow_trace(rec)
            self.counters["fetches"] += 1
            self.counters[self._ready(rec)] += 1
            self._prefetch()
        finally:
            self._busy -= 1

    def _ready(self, rec: _Param) -> str:
        """Makes ``rec`` AVAILABLE, waiting if needed; says how it was found: resident, in_flight or waited."""
        self._evictable.pop(rec.index, None)  # in use again
        if rec.state is ParamState.LANDING:  # needed before the update it waits for: read the home instead
            self._cancel_landing(rec)
        if rec.state is ParamState.AVAILABLE:
            if rec.stale:
                self._refresh(rec)
            return "resident"
        if rec.state is ParamState.FETCHING:
            try:
                self._finish(rec)
            except OSError:  # a prefetch started while the disk was failing (a step that failed before this
                if rec.sharded:  # one, retried): read the home once more, and raise if that fails. Not a piece:
                    raise  # its gather is a collective, and this rank alone would issue it again
                self.counters["refetched"] += 1
                self._demand(rec)
            return "in_flight"
        self._demand(rec)
        return "waited"

    def finish_fetches(self) -> None:
        """Waits for every fetch in flight (in index order, the same on every rank): before a checkpoint reads the
        homes, so that no prefetch's read or gather runs beside it."""
        for rec in self.params:
            if rec.state is ParamState.FETCHING:
                self._finish(rec)

    def hold(self, params: list[torch.nn.Parameter]) -> list[_Param]:
        """Makes ``params`` AVAILABLE and keeps them so until :meth:`unhold`, for code that uses them outside their
        modules' forwards; not part of the traces (a window full of held parameters fetches beyond itself, within
        the device budget). A collective for sharded ones: every rank holds the same parameters in the same order."""
        recs: list[_Param] = []
        try:
            for p in params:
                rec = self._by_param[id(p)]
                rec.held += 1
                recs.append(rec)
                self._ready(rec)
        except BudgetExceeded as exc:  # the window's advice cannot help: these are held at once, whatever it is
            self.unhold(recs)
            size = torch.empty((), dtype=self.dtype).element_size()
            total = sum(self._by_param[id(p)].numel for p in params) * size
            raise BudgetExceeded(exc.tier, f"holding the {len(params)} parameter(s) asked for at once "
                                 f"({fmt_bytes(total)}, engine.gathered())", exc.need, exc.current, exc.budget,
                                 "gather fewer at a time (one module's, or the parameters the code reads), or "
                                 "raise offload.device_memory_budget") from exc
        except BaseException:
            self.unhold(recs)
            raise
        return recs

    def unhold(self, recs: list[_Param]) -> None:
        """Undoes :meth:`hold`: a parameter no one holds any more is evictable again, and the window is brought back
        within its bound, least recently used first."""
        for rec in recs:
            rec.held -= 1
            if rec.held == 0 and rec.users == 0 and not rec.persistent and rec.state is ParamState.AVAILABLE:
                self._evictable[rec.index] = rec
                self._evictable.move_to_end(rec.index)
        self._evict(0)

    def saved_tensors(self) -> Any:
        """A context in which what autograd saves of a parameter is a reference, fetched again by backward (the
        model's forward runs in it; so does :meth:`Engine.gathered`'s block)."""
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _demand(self, rec: _Param) -> None:
        """RELEASED -> AVAILABLE, waiting."""
        self._make_room(rec.numel, keep=rec)
        self._start(rec)
        self._finish(rec)

    def release(self, rec: _Param, reuse: bool = True) -> None:
        """Back to RELEASED. ``reuse=False`` when autograd may still hold the device tensor (unpacked for a
        backward node that has not run yet): its buffer is dropped, not handed to the next fetch. A LANDING
        parameter gives up its landing."""
        self._evictable.pop(rec.index, None)
        if rec.state is ParamState.LANDING:
            self._cancel_landing(rec)
            return
        if rec.persistent or rec.users > 0 or rec.held or rec.state is ParamState.RELEASED:
            return
        if rec.state is ParamState.FETCHING:
            self._finish(rec)
        self._by_storage.pop(rec.device.untyped_storage().data_ptr(), None)
        if reuse:  # fetches of same-shaped parameters reuse it, once the compute stream is past this point
            self._cache.setdefault(rec.numel, []).append((rec.device, self.copies.mark()))
            self.cached_numel += rec.numel
        else:
            self.store.free(Tier.DEVICE, rec.device)
        self._released(rec)

    def _released(self, rec: _Param) -> None:
        """The end of every way back to RELEASED, once the buffer is cached or freed."""
        placeholder = self._placeholder(rec)  # first: the record changes in the few steps after it
        self.live_numel -= rec.numel
        rec.device = rec.after = None
        rec.param.data = placeholder
        rec.state = ParamState.RELEASED
        self.counters["released"] += 1

    def _available(self, rec: _Param) -> None:
        """The end of every way to AVAILABLE (a fetch waited for, a landing completed)."""
        rec.state, rec.stale = ParamState.AVAILABLE, False
        rec.param.data = rec.device.view(rec.shape)

    # landing ---------------------------------------------------------------------------------------------------

    def _landing_head(self) -> set[int]:
        """The parameters the first prefetch after an update would start (the head of the forward trace, within
        the prefetch bucket and the window) whose homes are this object's NVMe keys."""
        order = self._traces["forward"].order
        limit, total, chosen = min(self.bucket, self.max_live), 0, set()
        for idx in dict.fromkeys(order):
            rec = self.params[idx]
            if rec.persistent:
                continue
            if total and total + rec.numel > limit:
                break
            total += rec.numel
            if rec.home is None and not rec.sharded:
                chosen.add(idx)
        return chosen

    def _begin_landing(self, rec: _Param) -> None:
        """AVAILABLE -> LANDING: the buffer stays in the window for the optimizer to copy the new values into,
        once the compute stream has passed this point (its last read of the old ones). Not evictable: only a fetch
        that finds no other room takes it back (``_make_room``)."""
        self._evictable.pop(rec.index, None)
        self._by_storage.pop(rec.device.untyped_storage().data_ptr(), None)
        rec.after = self.copies.mark()
        rec.param.data = self._placeholder(rec)
        rec.state = ParamState.LANDING
        with self._landing_lock:
            self._landing[rec.index] = _Landing({start for start, _ in rec.parts})

    def _complete_landing(self, rec: _Param) -> bool:
        """LANDING -> AVAILABLE if every part landed (the compute stream waits for the copies), else released."""
        with self._landing_lock:
            land = self._landing.get(rec.index)
            if land is None or land.left:
                land = None
            else:
                del self._landing[rec.index]
        if land is None:
            self._cancel_landing(rec)
            return False
        for copy in land.copies:
            self.copies.use(copy)
        rec.after = None
        self._available(rec)
        self._by_storage[rec.device.untyped_storage().data_ptr()] = rec
        self.counters["landed"] += 1
        return True

    def _cancel_landing(self, rec: _Param) -> None:
        """LANDING -> RELEASED: the optimizer copies nothing more in; the buffer goes back to the cache once the
        copies it made have run."""
        with self._landing_lock:
            land = self._landing.pop(rec.index, None)
        for copy in land.copies if land is not None else ():
            copy.wait()
        self._cache.setdefault(rec.numel, []).append((rec.device, rec.after))
        self.cached_numel += rec.numel
        self._released(rec)

    def _placeholder(self, rec: _Param) -> torch.Tensor:
        # one element of no dimension: it expands to any shape, a 0-d parameter's (CLIP's logit_scale) included
        return torch.full((), float("nan"), dtype=self.dtype, device=self.device).expand(rec.shape)

    def _materialize(self, rec: _Param) -> None:
        """A device buffer for ``rec``: a cached one of its size (no allocation, no page faults), else a new one
        after dropping cached buffers until the window has room."""
        cached = self._cache.get(rec.numel)
        if cached and not rec.persistent:
            rec.device, rec.after = cached.pop(0)  # the oldest: the compute stream is likeliest past its mark
            self.cached_numel -= rec.numel
        else:
            rec.after = None
            if not rec.persistent:
                self._trim(self.max_live - self.live_numel - rec.numel)
            with self.copies.copy_stream():  # filled by a copy on that stream, used on the compute stream
                rec.device = self.store.allocate(Tier.DEVICE, rec.numel, self.dtype, f"parameter {rec.index} on the "
                                                 "device", "raise offload.device_memory_budget or lower "
                                                 "zero_optimization.stage3_max_live_parameters",
                                                 prefault=False)  # the fetch writes it whole
        self._by_storage[rec.device.untyped_storage().data_ptr()] = rec

    def _trim(self, keep: int) -> None:
        """Frees cached device buffers until at most ``keep`` elements stay cached."""
        for numel in sorted(self._cache, reverse=True):
            bufs = self._cache[numel]
            while bufs and self.cached_numel > max(keep, 0):
                self.store.free(Tier.DEVICE, bufs.pop()[0])
                self.cached_numel -= numel

    def _start(self, rec: _Param, *, wait_for_room: bool = True) -> bool:
        """RELEASED -> FETCHING: a device buffer, and the copy or read that fills it started. False, with nothing
        changed, when NVMe staging has no room and ``wait_for_room`` is off (a prefetch stops there); a demand
        waits for the fetch thread to give staging back. A failure to start leaves the parameter RELEASED."""
        staging = None
        if self._arena is not None and rec.home is None and not rec.sharded:
            staging = self._arena.take(rec.numel, block=wait_for_room)
            if staging is None:
                return False
        try:
            self._materialize(rec)
        except BaseException:
            if staging is not None:
                self._arena.give(staging)  # type: ignore[union-attr]
            raise
        self.in_flight_numel += rec.numel
        if not rec.persistent:
            self.live_numel += rec.numel
        try:
            if rec.sharded:
                rec.pending = self.shards.fetch(rec.index, rec.device)
            elif staging is not None:  # read into pinned staging, copied on by the fetch thread
                reads = self._read_parts(rec, staging)
                try:
                    rec.pending = self._copier.submit(self._copy_staged, reads, staging, rec.device, rec.after)
                except BaseException:
                    with contextlib.suppress(Exception):  # the staging goes back below: no read may be left on it
                        reads.wait()
                    raise
            elif rec.home is None:  # the device tier is host memory: read straight into the buffer
                rec.pending = self._read_parts(rec, rec.device)
            elif self.copies.cuda:
                rec.pending = self.copies.to_device(rec.device, rec.home, after=rec.after)
            else:  # a memcpy: on the fetch thread, beside compute
                rec.pending = self._copier.submit(self.copies.to_device, rec.device, rec.home, after=None)
        except BaseException:
            if staging is not None:
                self._arena.give(staging)  # type: ignore[union-attr]
            self.in_flight_numel -= rec.numel
            self._fetch_failed(rec)
            raise
        rec.after = None
        rec.state = ParamState.FETCHING
        if rec.home is None and not rec.sharded:
            self.store.count(Tier.NVME, Tier.HOST, rec.numel * rec.param.element_size())
        return True

    def _copy_staged(self, handle: Any, staging: torch.Tensor, dst: torch.Tensor, after: Any) -> Copy:
        """On the fetch thread: once an NVMe read has landed in ``staging``, copy it to the device buffer. Neither
        this thread nor the one that waits for the fetch waits for the copy: the compute stream does (``use``),
        and the arena before it lends the staging again."""
        copy = None
        try:
            handle.wait()
            copy = self.copies.to_device(dst, staging, after=after, src_tier=Tier.HOST)
            return copy
        finally:
            self._arena.give(staging, busy=copy)  # type: ignore[union-attr]

    def _upload_now(self, rec: _Param, value: torch.Tensor) -> None:
        """Writes ``value`` (host, or already on the device) into ``rec``'s device buffer, ready for the calling
        thread's stream."""
        if value.device.type != "cpu" or not self.copies.cuda:
            rec.device.copy_(value.reshape(-1))
            self.copies.hold(rec.device)  # allocated on the copy stream, written here on the calling one
        else:
            copy = self.copies.to_device(rec.device, value.reshape(-1), after=self.copies.mark())
            self.copies.use(copy, rec.device)
            copy.wait()  # value may be a staging buffer, reused when this returns

    def _finish(self, rec: _Param) -> None:
        pending, rec.pending = rec.pending, None
        self.in_flight_numel -= rec.numel
        t = time.perf_counter()
        try:
            if isinstance(pending, concurrent.futures.Future):
                pending = pending.result()
            if isinstance(pending, Copy):
                self.copies.use(pending)  # on the GPU: the compute stream waits for the copy, the CPU does not
            else:
                pending.wait()
            self.copies.hold(rec.device)  # allocated on the copy stream, read on the compute stream
        except Exception:
            self._fetch_failed(rec)
            raise
        except BaseException:  # the wait was cut short (a second Ctrl-C), not the fetch: it stays in flight
            rec.pending = pending
            self.in_flight_numel += rec.numel
            raise
        finally:
            self.store.stall_seconds += time.perf_counter() - t
        self._available(rec)

    def _fetch_failed(self, rec: _Param) -> None:
        """FETCHING -> RELEASED after a read or copy that failed (every part of it settled: ``AllOf``, the copy
        thread's future). The home is untouched, so the next fetch starts over; the half-filled buffer is freed,
        never cached for another parameter."""
        self._by_storage.pop(rec.device.untyped_storage().data_ptr(), None)
        self.copies.synchronize()  # a copy stream's work on the buffer ends before the allocator may reuse it
        self.store.free(Tier.DEVICE, rec.device)
        if not rec.persistent:
            self.live_numel -= rec.numel
        rec.device = rec.after = None
        rec.param.data = self._placeholder(rec)
        rec.state = ParamState.RELEASED

    def _refresh(self, rec: _Param) -> None:
        """A persistent parameter after an optimizer step: copy its new value from the home."""
        if rec.sharded:
            self.shards.fetch(rec.index, rec.device).wait()  # gathered straight into the device buffer
        elif rec.home is not None:
            self.copies.use(self.copies.to_device(rec.device, rec.home, after=self.copies.mark()), rec.device)
        rec.stale = False

    def _evict(self, numel: int) -> bool:
        """Releases evictable parameters, least recently used first, until ``numel`` more fit the window."""
        while self.live_numel + numel > self.max_live and self._evictable:
            rec = next(iter(self._evictable.values()))
            self.release(rec, reuse=rec.index not in self._frozen_in_backward)
        return self.live_numel + numel <= self.max_live

    def _make_room(self, numel: int, keep: _Param) -> None:
        """Before a demand fetch: evict unused parameters, then prefetched ones nobody uses yet."""
        if self._evict(numel):
            return
        for rec in self.params:
            if rec is not keep and rec.users == 0 and not rec.held and not rec.persistent \
                    and rec.state is not ParamState.RELEASED and rec.index not in self._frozen_in_backward:
                self.release(rec, reuse=self._phase == "forward")
                if self.live_numel + numel <= self.max_live:
                    return

    # traces -----------------------------------------------------------------------------------------------------

    def _follow_trace(self, rec: _Param) -> None:
        trace = self._traces[self._phase]
        if trace.recording:
            trace.order.append(rec.index)
            return
        if trace.pos < len(trace.order) and trace.order[trace.pos] == rec.index:
            trace.pos += 1
            return
        if rec.state is ParamState.AVAILABLE and rec.users > 0:
            return  # already in use (a module entered again, a tied weight): not a step of the order
        self.counters["trace_invalidations"] += 1  # the order changed: stay correct, record it again
        trace.order, trace.recording, trace.pos = [rec.index], True, 0

    def _prefetch(self) -> None:
        trace = self._traces[self._phase]
        if trace.recording:
            return
        in_flight = self.in_flight_numel
        for idx in trace.order[trace.pos :]:
            rec = self.params[idx]
            if rec.state is not ParamState.RELEASED:
                continue
            if in_flight and in_flight + rec.numel > self.bucket:
                break
            if self._arena is not None and rec.home is None and not rec.sharded and not self._arena.fits(rec.numel):
                break  # no staging room until earlier reads are copied on: evict nothing for it
            # forward may evict (the oldest are needed last, in backward); in backward every evictable parameter
            # is left from forward and needed before anything further along the trace: only freed room is used
            room = self._evict(rec.numel) if self._phase == "forward" else \
                self.live_numel + rec.numel <= self.max_live
            if not room:
                break
            try:
                if not self._start(rec, wait_for_room=False):
                    break
            except BudgetExceeded:
                break
            in_flight += rec.numel

    # step boundaries --------------------------------------------------------------------------------------------

    def _reset_users(self) -> None:
        """No module is running at a phase boundary. Counts can be left over when a forward did not finish its
        modules: an exception, or activation checkpointing stopping a recomputation early once it has what it
        needs (the remaining post-hooks never run)."""
        for rec in self.params:
            rec.users = 0

    def begin_step(self) -> None:
        """Before a forward: traces restart from the top; a recorded forward (eval, no backward) stops recording.
        A landing no update completed (a skipped step) ends here."""
        self._reset_users()
        self._running.clear()  # (a forward that raised left its modules there)
        self._to_land = set()
        self._frozen_in_backward.clear()  # a backward this object did not run (another engine's) ends here too
        for rec in self.params:
            if rec.state is ParamState.LANDING:
                self._cancel_landing(rec)
        self._phase = "forward"
        for trace in self._traces.values():
            trace.pos = 0
        forward = self._traces["forward"]
        if forward.recording and forward.order:
            forward.recording = False

    def begin_backward(self, step_follows: bool) -> None:
        """Before backward: with an update to follow, choose the parameters that will land (see "Landing")."""
        self._to_land = self._landing_head() if self._may_land and step_follows and self._swap is not None else set()

    def end_backward(self, step_follows: bool) -> None:
        """After backward: release what backward fetched (landings stay, for the update) and close the recording
        of both traces. Unless an optimizer step comes first (it would make copies fetched now stale), start the
        next forward's fetches."""
        self._reset_users()
        self._to_land = set()
        for rec in self.params:
            if rec.state is not ParamState.LANDING or not step_follows:
                self.release(rec)
        self._frozen_in_backward.clear()
        for trace in self._traces.values():
            if trace.order:
                trace.recording = False
            trace.pos = 0
        self._phase = "forward"
        if not step_follows:
            self._prefetch()

    def grad_done(self, param: torch.nn.Parameter) -> None:
        """A trainable parameter's gradient is accumulated: backward will not use it again."""
        rec = self._by_param.get(id(param))
        if rec is None or rec.users > 0 or rec.held:  # held: stays as it is until the block ends
            return
        if rec.index in self._to_land and rec.state is ParamState.AVAILABLE:
            self._begin_landing(rec)
        else:
            self.release(rec)

    def updated(self) -> None:
        """The optimizer has written new parameters to every home: landed parameters are AVAILABLE, persistent ones
        copied again, other device copies released; start the next forward's fetches."""
        landed = {rec.index for rec in self.params if rec.state is ParamState.LANDING and self._complete_landing(rec)}
        self.last_step = self._rates({k: v - self._mark[k] for k, v in self.counters.items()})
        self._mark = dict(self.counters)
        self._reset_users()
        for rec in self.params:
            if rec.index in landed or (rec.persistent and not rec.trains):  # a frozen one's value is unchanged
                continue
            if rec.persistent:  # now, not at its next fetch: read between steps (a callback, the model after
                self._refresh(rec)  # train()) it holds the new value; sharded, a collective in index order
            elif rec.state is not ParamState.RELEASED:
                self.release(rec)  # fetched before the update: holds the old values
        self._phase = "forward"
        self._traces["forward"].pos = 0
        self._prefetch()

    def write_home(self, index: int, value: torch.Tensor) -> None:
        """Stores a parameter's new low-precision value (a host tensor) in its home, and in the device copy it may
        have (a prefetched one too). On the training thread, between steps: ``write_parameter`` and the loads of
        checkpoints and state dicts."""
        rec = self.params[index]
        if rec.state is ParamState.FETCHING:  # its copy may still be reading the home about to be overwritten
            self._finish(rec)
            self.copies.synchronize()
        if rec.state is ParamState.LANDING:
            self._cancel_landing(rec)
        if rec.sharded:
            self.shards.write(index, value)
            if rec.state is ParamState.AVAILABLE:  # the full value is here: no gather (a collective) needed
                self._upload_now(rec, value)
        elif rec.home is not None:
            rec.home.copy_(value.reshape(-1))
            if rec.state is ParamState.AVAILABLE:
                self._refresh(rec)
        else:
            flat = value.reshape(-1)
            window = self._home_writes.get(index, 1)  # the rewrites in flight the swap file's claim has room for
            handles: list[Any] = []
            for start, n in rec.parts:
                if len(handles) == window:
                    handles.pop(0).wait()
                handles.append(self.write_home_part(index, start, flat[start : start + n]))
            wait_all(handles)
            if rec.state is ParamState.AVAILABLE:
                self._upload_now(rec, flat)

    def write_home_part(self, index: int, start: int, value: torch.Tensor) -> Any:
        """Starts storing elements ``start``.. of a parameter's new value in its home: one of the parts of an NVMe
        home (the optimizer thread writes each sub-group's segment as soon as it is updated), or a range of a host
        copy; a LANDING parameter's device buffer gets it too. Returns the handle of the write (and copy):
        ``value`` must stay untouched until it has been waited on."""
        rec = self.params[index]
        if rec.home is not None:  # persistent: a host copy, uploaded at the next refresh
            rec.home[start : start + value.numel()].copy_(value)
            rec.stale = True
            return DONE
        assert self._swap is not None and (start, value.numel()) in rec.parts
        write = self._swap.write(self._key(rec, start), value)
        self.store.count(Tier.HOST, Tier.NVME, value.numel() * value.element_size())  # (as its reads are)
        with self._landing_lock:  # held while copying: a cancel on the training thread waits for this copy
            land = self._landing.get(index)
            if land is None or start not in land.left:
                return write
            copy = self.copies.to_device(rec.device[start : start + value.numel()], value, after=rec.after)
            land.left.discard(start)
            if copy is not DONE:
                land.copies.append(copy)
        return write if copy is DONE else AllOf([write, copy])

    def read_home(self, index: int) -> torch.Tensor:
        """A parameter's current value from its home, as a new host tensor in its shape."""
        rec = self.params[index]
        if rec.sharded:
            return self.shards.read(index)
        if rec.home is not None:
            return rec.home.view(rec.shape).clone()
        staged = aligned_tensor(rec.numel, self.dtype, pin_memory=False)
        self._read_parts(rec, staged).wait()
        return staged.view(rec.shape)

    def index_of(self, param: torch.nn.Parameter) -> int:
        return self._by_param[id(param)].index

    @staticmethod
    def _rates(c: dict[str, Any]) -> dict[str, Any]:
        c = dict(c)
        c["hit_rate"] = (c["resident"] + c["in_flight"]) / c["fetches"] if c["fetches"] else 0.0
        return c

    def stats(self) -> dict[str, Any]:
        """Fetches that found their parameter resident, in flight or had to wait (since the start or the last
        reset, and in the last optimizer step), releases, trace invalidations; ``nvme``: the swap engine of the
        parameters' NVMe homes (bytes read and written, ...), None when they live on the host; ``pieces_nvme``:
        likewise for this rank's pieces (stage 3 on several ranks with NVMe homes), else None."""
        return {**self._rates(self.counters), "last_step": self.last_step,
                "nvme": self._swap.stats() if self._swap is not None else None,
                "pieces_nvme": self.shards.swap_stats() if self.shards is not None else None}

    def reset_counters(self) -> None:
        for k in self.counters:
            self.counters[k] = 0
        self._mark = dict(self.counters)

    def close(self) -> None:
        """Removes the hooks and hands the model back whole, as plain tensors holding each parameter's current
        value. Safe on a half-built object (a failure in ``__init__``): only the parameters recorded are touched."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        if getattr(self, "_original_forward", None) is not None:
            self.module.__dict__.pop("forward", None)  # the instance attribute; the class's forward shows through
            self._original_forward = None  # (popped again, harmlessly, by a close an interrupt cut short here)
        self._copier.shutdown(wait=True)  # fetches in flight land first
        run_all([self._hand_back, self._free])  # the swap file goes even if the GPU failed the hand-back

    def _hand_back(self) -> None:
        """Every parameter back as a plain tensor holding its current value: on the device where the whole model
        fits its budget beside what else is there; else in host memory, a host home handed over as it is and the
        rest (NVMe homes, pieces, device copies) read into memory this machine has free now, every rank agreeing;
        else left NaN placeholders, and close raises saying so once all is freed. A model offloaded because the
        device cannot hold it would otherwise run the device, or the host, out of memory as its engine closes."""
        self.copies.synchronize()  # fetches' copies land first: homes and staging are freed after
        self._trim(0)  # the cached buffers are ours to drop
        size = torch.empty((), dtype=self.dtype).element_size()
        need = sum(rec.numel for rec in self.params) * size
        held = sum(rec.device.numel() for rec in self.params if rec.device is not None) * size
        device = self.store.accounts[Tier.DEVICE]
        fits = device.budget is None or device.current - held + need <= device.budget
        card = free_device_memory(self.device)  # the CUDA driver's count: the context, other processes, torch's
        if card is not None:  # cache (returned first) are in no budget; a piece's gather takes two buffers more
            fits = fits and need - held + 2 * max((rec.numel * size for rec in self.params), default=0) <= card
        new = sum(rec.numel for rec in self.params if rec.home is None or rec.sharded) * size
        room = new <= default_host_budget()
        if self.shards is not None:  # the reads below are collectives: every rank takes the same way
            fits, room = (bool(v) for v in self.shards.comm.min_ints([int(fits), int(room)]))
        where: str | None = "device" if fits else "host" if room else None
        if where != "device":  # (on the CPU the device tier is RAM too: the host is no worse a place, said quietly)
            log.log(logging.INFO if where == "host" and self.device.type == "cpu" else logging.WARNING,
                    "offload: the model's offloaded parameters (%s) do not fit the device (budget %s, %s) "
                    "beside what it holds%s: %s", fmt_bytes(need), fmt_bytes(device.budget or 0),
                    "the driver's free memory " + fmt_bytes(card) if card is not None else "no driver count",
                    " on some rank" if self.shards is not None else "",
                    "they are handed back in host memory (move the model when it fits)" if room else
                    f"nor does this machine's free memory hold the {fmt_bytes(new)} read back; they stay NaN "
                    "placeholders")
        uploaded: list[torch.nn.Parameter] = []  # moved to the host too if the card runs out part way
        for rec in self.params:
            if rec.state is ParamState.LANDING:
                self._cancel_landing(rec)
            if rec.state is ParamState.FETCHING:
                try:
                    self._finish(rec)
                except Exception:  # noqa: BLE001 - a prefetch nobody waited for: its home is read again just below,
                    pass  # and that read raises if the fault is still there
            if where is None:
                rec.param.data = self._placeholder(rec)
            elif where == "host" and rec.home is not None and not rec.sharded:
                rec.param.data = rec.home.view(rec.shape)  # the home itself: the newest value, no copy
            else:
                # a piece of a parameter is read (a collective) on every rank alike, whatever each holds
                fresh = rec.state is ParamState.RELEASED or rec.stale or rec.sharded
                value = self.read_home(rec.index) if fresh else rec.device.view(rec.shape)
                if where == "device":
                    try:
                        value = self.copies.upload(value) if fresh else value.clone()
                        uploaded.append(rec.param)
                    except torch.OutOfMemoryError:  # the card had less than it said: the whole model goes to the
                        where = "host"  # host, in one place for the next forward
                        log.warning("offload: the device ran out of memory handing the model back at parameter %d; "
                                    "the model is handed back in host memory", rec.index)
                        for p in uploaded:
                            p.data = p.data.to("cpu")
                        uploaded.clear()
                if where == "host" and not fresh:
                    value = value.to("cpu", copy=True)
                rec.param.data = value
            if rec.device is not None:
                self.store.free(Tier.DEVICE, rec.device)
                rec.device = None
            rec.state = ParamState.RELEASED
        if where is None:
            raise RuntimeError(
                f"close(): the model's parameters ({fmt_bytes(need)}) fit neither the device budget nor this "
                "machine's free memory, so they were not handed back (the model holds NaN placeholders; everything "
                "else was freed). Save the weights before close (engine.save_safetensors or save_checkpoint) and "
                "load them where they fit, or into a model built inside offload.init")

    def _free(self) -> None:
        """Device cache, staging, the swap engine (its files), NVMe claims and private host copies."""
        self._trim(0)
        if self._arena is not None:
            self._arena.close()
            self._arena = None
        if self._swap is not None:
            self._swap.close()
            self._swap = None
        if self._nvme_bytes:
            self.store.accounts[Tier.NVME].release(self._nvme_bytes)
            self._nvme_bytes = 0
        for t in self._private:
            self.store.free(Tier.HOST, t)
        self._private = []


# what a torch function is asked of a tensor without reading its values: the placeholder answers as the parameter
_METADATA = frozenset((
    torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel, torch.Tensor.stride, torch.Tensor.__len__,
    torch.Tensor.is_floating_point, torch.Tensor.is_complex, torch.Tensor.element_size, torch.Tensor.data_ptr,
    torch.Tensor.data.__set__,
    *(getattr(torch.Tensor, name).__get__ for name in ("shape", "dtype", "device", "ndim", "requires_grad",
                                                       "is_cuda", "layout", "is_sparse", "grad", "data"))))


class _ReadsOutside(TorchFunctionMode):
    """Over the model's forward while the trace records: hands the tensors of every torch function that reads
    values to :meth:`ParameterOffload._fetch_read` before it runs (inside the handler the mode is off, so the fetch's
    own torch calls pass by); the offload's own work (its hooks, fetches, releases) passes through untouched."""

    def __init__(self, offload: ParameterOffload) -> None:
        super().__init__()
        self._offload = offload

    def __enter__(self) -> "_ReadsOutside":
        self._offload._tracing_reads = True
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        self._offload._tracing_reads = False
        super().__exit__(*exc)

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if func not in _METADATA and not self._offload._busy:
            self._offload._fetch_read(args, kwargs)
        return func(*args, **kwargs)


def _tensor_args(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The tensors among a call's arguments, and in its lists and tuples (``torch.cat([...])``, an RNN's flat
    weights), one level deep."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            for v in value:
                if isinstance(v, torch.Tensor):
                    yield v
