"""ParameterOffload: low-precision parameters live on HOST or NVME; only a bounded window is on the device.

It coordinates parts that each own one thing and its lifetime:

* :class:`~._homes.Homes` (``_homes.py``): where each parameter lives off the device (a view of the flat host buffer
  the optimizer writes new parameters into, NVMe keys in its own swap file, or, stage 3 on several ranks, this
  rank's piece held by :class:`~._shards.ParamShards`), and every read and write of it;
* :class:`~._window.DeviceWindow` (``_window.py``): the device buffers of at most ``stage3_max_live_parameters``
  elements, the least-recently-used order they are evicted in, and each parameter's state
  (:class:`~._record.ParamState`, ``_record.py``), persistent ones (at most ``stage3_param_persistence_threshold``
  elements) kept AVAILABLE;
* :class:`~offload._trace.ForwardTrace` (``offload/_trace.py``): THE forward trace, and :class:`~._prefetch.Prefetcher`
  (``_prefetch.py``), which follows it (and backward's own order) to start fetches ahead;
* :class:`~._landing.Landings` (``_landing.py``): the next forward's first parameters taking their new values from
  the optimizer thread as it writes them home, instead of being read back.

This object holds the records and the hooks: the :attr:`~offload._hooks.Slot.STEP` slot on the root (a forward
starts; after it, backward's first fetches), a :attr:`~offload._hooks.Slot.FETCH` slot on each module with
parameters, and the root's ``forward`` replaced by one that runs under the saved-tensors hooks (a context, so that
even an interrupt that skips every hook leaves none behind). It moves the parameters at the step's boundaries the
engine tells it of (:meth:`begin_backward`, :meth:`grad_done`, :meth:`end_backward`, :meth:`updated`).

When parameters are needed:

* forward: a module's FETCH slot fetches its own parameters (waiting only for those not already prefetched) and,
  once its forward ends, marks them evictable: they stay on the device, least recently used first out, until a fetch
  needs the room. Backward runs the layers in reverse, so the last layers of forward are still there when backward
  starts (DeepSpeed's reuse distance, bounded here by the window rather than by a count). A module that reads
  another module's parameter itself (``self.sub.weight`` outside ``self.sub(...)``: ``nn.MultiheadAttention`` reads
  ``out_proj.weight``, a tied head goes through ``F.linear``, a loss in the forward reads the embedding) needs no
  declaration: while the forward trace records, it hands each parameter read to a torch function to
  :meth:`_fetch_read` first; one no running module has fetched is fetched there, and declared for the innermost
  module running (:meth:`register_external`, DeepSpeed's explicit rule, which still works), so later forwards fetch
  it in that module's FETCH slot, along the trace. ``nn.MultiheadAttention`` modules are declared so from the start.
  A read outside any forward, or one a later forward makes on a path none recorded, still sees the NaN placeholder:
  the last line of defence;
* backward: the model's forward runs under a saved-tensors hook that saves a *reference* (parameter, view
  geometry) instead of a parameter's device tensor, so backward fetches it again on demand at unpack time; a
  trainable parameter is released once its gradient has been accumulated (its last use in this backward), a frozen
  one is evictable as soon as it is unpacked (no gradient tells its last use).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable
from typing import Any

import torch

from nvme_swapper import AioConfig

from .._cleanup import close_after_failure, run_all
from .._device import free_device_memory
from .._hooks import Slot, SlotHandle, on_forward
from .._trace import ForwardTrace
from ..memory import AllOf, BudgetExceeded, CopyStreams, Tier, TieredStore, default_host_budget, fmt_bytes
from ._homes import Homes
from ._landing import Landings
from ._prefetch import Prefetcher
from ._record import ParamRecord, ParamState
from ._window import DeviceWindow

log = logging.getLogger("offload")

_NO_COPY = ("copy.deepcopy or torch.save of a model whose parameters are offloaded (offload_param) would copy the "
            "placeholders the modules hold between uses, not the weights: write them with "
            "engine.save_safetensors(dir) or take engine.consolidated_state_dict(), and load that into a model of "
            "your own (or copy the model before offload.initialize)")


class ParameterOffload:
    """Owns the parameters' records, their hooks and the parts above. ``close()`` removes the hooks and puts every
    parameter back on the device as a plain tensor. The caller checks the window with
    :func:`~._window.check_window` before it moves any parameter to a home."""

    def __init__(self, module: torch.nn.Module, params: list[torch.nn.Parameter], homes: list[torch.Tensor | None],
                 store: TieredStore, copies: CopyStreams, dtype: torch.dtype, *, persistence_threshold: int,
                 max_live: int, bucket: int, nvme_path: str | None = None, aio: AioConfig | None = None,
                 shards: Any = None, scratch: torch.Tensor | None = None,
                 parts: list[list[tuple[int, int]]] | None = None, land: bool = False, staging: int = 0,
                 before_home: Callable[[int], None] | None = None,
                 written_together: list[list[tuple[int, int]]] | None = None, writes: int = 1) -> None:
        """``shards`` (a :class:`ParamShards`, several ranks): the homes of the parameters it covers are pieces
        on each rank; fetching one is an all-gather (collective: every rank fetches in the same order, which the
        same model, trace and window make true). ``scratch``: a host buffer of the caller's, idle during
        construction, that NVMe homes are written through (else one is allocated for it). ``parts``,
        ``staging``, ``written_together``, ``writes``: the NVMe homes' (:class:`Homes`). ``land``: updates are
        written by the optimizer thread during the step that follows each backward (not delayed), so the next
        forward's first parameters may land (:class:`Landings`). ``before_home(i)``: called before parameter
        ``i`` is read for its home (the engine fills the optimizer's masters from it then, so each parameter's
        memory goes once it is homed, not after every master is filled)."""
        self.module, self.store, self.copies, self.dtype = module, store, copies, dtype
        self.shards = shards
        self.max_live, self.bucket = max_live, bucket
        self.counters = {"resident": 0, "in_flight": 0, "waited": 0, "fetches": 0, "released": 0,
                         "trace_invalidations": 0, "landed": 0, "refetched": 0, "read_outside": 0}
        self._mark = dict(self.counters)  # counters at the end of the last optimizer step
        self.last_step: dict[str, float] = {}
        self.params: list[ParamRecord] = []
        self._by_param: dict[int, ParamRecord] = {}
        self._uses: dict[int, list[ParamRecord]] = {}  # id(module) -> the parameters its FETCH slot fetches
        self._slots: list[SlotHandle] = []
        self._original_forward: Callable[..., Any] | None = None
        self.landings = Landings(copies, enabled=land)
        self.homes: Homes | None = None
        self.trace: ForwardTrace | None = None
        try:
            self.homes = Homes(params, store, copies, dtype, store.device, persistence_threshold=persistence_threshold,
                               nvme_path=nvme_path, aio=aio, shards=shards, scratch=scratch, parts=parts,
                               staging=staging, written_together=written_together, writes=writes)
            self.window = DeviceWindow(self.params, store, copies, dtype, self.homes, self.landings, self.counters,
                                       max_live=max_live)
            self._build(params, homes, persistence_threshold, scratch, before_home)
            self.trace = ForwardTrace(module, refuse=_NO_COPY)
            self.prefetcher = Prefetcher(self.trace, self.window, self.counters, bucket=bucket)
            self._install()
        except BaseException as exc:
            close_after_failure(self.close, exc)
            raise

    def _build(self, params: list[torch.nn.Parameter], homes: list[torch.Tensor | None],
               persistence_threshold: int, scratch: torch.Tensor | None,
               before_home: Callable[[int], None] | None) -> None:
        """Records every parameter once its home holds its value (so ``close`` after a failure here hands back
        exactly the parameters that moved), and puts persistent ones on the device."""
        assert self.homes is not None
        with contextlib.closing(self.homes.build(params, homes, persistence_threshold, scratch, before_home)) as built:
            for rec in built:
                self.params.append(rec)
                self._by_param[id(rec.param)] = rec
                if rec.persistent:
                    self.window.materialize(rec)
                    source = rec.home if rec.home is not None and not rec.sharded else rec.param.detach().reshape(-1)
                    self.window.upload_now(rec, source)
                    rec.state = ParamState.AVAILABLE
                rec.param.data = rec.device.view(rec.shape) if rec.persistent else self.window.placeholder(rec)

    # hooks ------------------------------------------------------------------------------------------------------

    def _install(self) -> None:
        assert self.trace is not None
        self._slots.append(on_forward(self.module, Slot.STEP, pre=lambda *_: self.begin_step(),
                                      post=lambda *_: self._forward_done(), refuse=_NO_COPY))
        for mod in self.module.modules():
            own = [self._by_param[id(p)] for p in mod.parameters(recurse=False) if id(p) in self._by_param]
            if own:
                self._hook_module(mod, own)
        for mod in self.module.modules():
            if isinstance(mod, torch.nn.MultiheadAttention):  # its forward reads out_proj's parameters itself
                for p in mod.out_proj.parameters():
                    if id(p) in self._by_param:
                        self.register_external(mod, p)
        self.trace.on_read = self._fetch_read
        original = self.module.forward

        @functools.wraps(original)
        def forward(*args: Any, **kwargs: Any) -> Any:
            with self.saved_tensors():
                return original(*args, **kwargs)

        self.module.forward = forward
        self._original_forward = original

    def _hook_module(self, mod: torch.nn.Module, own: list[ParamRecord]) -> None:
        self._uses[id(mod)] = own
        self._slots.append(on_forward(mod, Slot.FETCH, pre=functools.partial(self._pre_forward, own),
                                      post=functools.partial(self._post_forward, own), refuse=_NO_COPY))

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

    def _fetch_read(self, reader: torch.nn.Module, param: torch.nn.Parameter) -> None:
        """While the trace records, a torch function is about to read ``param`` in ``reader``'s forward: if no
        running module has fetched it, it is fetched now and declared for ``reader``, which counts as its user
        until its forward ends (its FETCH slot, now covering it, releases it as its own)."""
        rec = self._by_param.get(id(param))
        if rec is None or rec.users or rec.persistent or rec.held:
            return
        self.register_external(reader, rec.param)
        self.counters["read_outside"] += 1
        self.fetch(rec)
        rec.users += 1
        log.debug("offload: %s's forward reads a parameter of another module (%s): fetched with it from now on",
                  type(reader).__name__, tuple(rec.shape))

    def _pre_forward(self, own: list[ParamRecord], *_: Any) -> None:
        for rec in own:
            self.fetch(rec)
            rec.users += 1

    def _post_forward(self, own: list[ParamRecord], *_: Any) -> None:
        recomputing = self.window.phase == "backward"  # activation checkpointing re-runs forward inside
        for rec in own:  # backward, saving the parameters themselves: keep them until their gradient is in
            rec.users -= 1
            if rec.users == 0 and not recomputing and not rec.persistent and not rec.held:
                self.window.unused(rec)  # kept while the window has room: backward may want it soon

    def _forward_done(self) -> None:
        """The root module returned: with autograd recording, backward comes next, so start its first fetches."""
        if torch.is_grad_enabled():
            self.window.phase = "backward"
            self.prefetcher.restart()
            self.prefetcher.prefetch()

    def saved_tensors(self) -> Any:
        """A context in which what autograd saves of a parameter is a reference, fetched again by backward (the
        model's forward runs in it; so does :meth:`Engine.gathered`'s block)."""
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, t: torch.Tensor) -> Any:
        if t.device != self.window.device or not t.is_floating_point():
            return t
        rec = self.window.by_storage.get(t.untyped_storage().data_ptr())
        if rec is None:
            return t
        return (rec, t.storage_offset(), tuple(t.shape), tuple(t.stride()))

    def _unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        rec, offset, shape, stride = packed
        self.window.phase = "backward"
        self.fetch(rec)
        # A frozen parameter: no gradient says when backward is done with it, so it is evictable at once, least
        # recently used first (a later use fetches it again), and its buffer is never handed to another fetch
        # (autograd may still read it). Kept until backward ended, a frozen base filled the device beyond the window.
        if not rec.param.requires_grad:
            self.window.frozen_in_backward.add(rec.index)
            if not rec.persistent and not rec.held:
                self.window.unused(rec)
        assert rec.device is not None
        return rec.device.as_strided(shape, stride, offset)

    # fetches ----------------------------------------------------------------------------------------------------

    def fetch(self, rec: ParamRecord) -> None:
        """Makes ``rec`` AVAILABLE on the device (waiting if needed), then prefetches along the trace. A piece's
        use in a forward that trains goes into the ranks' trace (``Comm.trace``): a persistent one is gathered by
        no collective. Uses that make no gradient (a no_grad forward, a gathered() block's) may differ by rank."""
        trace = self.trace
        trace.quiet += 1  # (its own torch calls are no reads of the model's)
        try:
            if rec.sharded and not rec.held and torch.is_grad_enabled():
                self.shards.comm.note("use", rec.index)
            self.prefetcher.follow(rec)
            self.counters["fetches"] += 1
            self.counters[self.window.ready(rec)] += 1
            self.prefetcher.prefetch()
        finally:
            trace.quiet -= 1

    def finish_fetches(self) -> None:
        """Waits for every fetch in flight (in index order, the same on every rank): before a checkpoint reads the
        homes, so that no prefetch's read or gather runs beside it."""
        for rec in self.params:
            if rec.state is ParamState.FETCHING:
                self.window.finish(rec)

    def hold(self, params: list[torch.nn.Parameter]) -> list[ParamRecord]:
        """Makes ``params`` AVAILABLE and keeps them so until :meth:`unhold`, for code that uses them outside their
        modules' forwards; not part of the traces (a window full of held parameters fetches beyond itself, within
        the device budget). A collective for sharded ones: every rank holds the same parameters in the same order."""
        recs: list[ParamRecord] = []
        try:
            for p in params:
                rec = self._by_param[id(p)]
                rec.held += 1
                recs.append(rec)
                self.window.ready(rec)
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

    def unhold(self, recs: list[ParamRecord]) -> None:
        """Undoes :meth:`hold`: a parameter no one holds any more is evictable again, and the window is brought back
        within its bound, least recently used first."""
        for rec in recs:
            rec.held -= 1
            if rec.held == 0 and rec.users == 0 and not rec.persistent and rec.state is ParamState.AVAILABLE:
                self.window.unused(rec)
        self.window.evict(0)

    # step boundaries --------------------------------------------------------------------------------------------

    def _reset_users(self) -> None:
        """No module is running at a phase boundary. Counts can be left over when a forward did not finish its
        modules: an exception, or activation checkpointing stopping a recomputation early once it has what it
        needs (the remaining post-hooks never run)."""
        for rec in self.params:
            rec.users = 0

    def begin_step(self) -> None:
        """Before a forward: orders restart from the top, and the trace records if it is to. A landing no update
        completed (a skipped step) ends here."""
        self._reset_users()
        self.landings.chosen = set()
        self.window.frozen_in_backward.clear()  # a backward this object did not run (another engine's) ends here too
        for rec in self.params:
            if rec.state is ParamState.LANDING:
                self.window.cancel_landing(rec)
        self.window.phase = "forward"
        self.prefetcher.restart()
        self.trace.begin_forward()

    def begin_backward(self, step_follows: bool) -> None:
        """Before backward: with an update to follow, choose the parameters that will land (:class:`Landings`)."""
        self.landings.chosen = Landings.head(self.trace.order, self.params, min(self.bucket, self.max_live)) \
            if self.landings.enabled and step_follows and self.homes.space is not None else set()

    def end_backward(self, step_follows: bool) -> None:
        """After backward: release what backward fetched (landings stay, for the update) and close the recording
        of both orders. Unless an optimizer step comes first (it would make copies fetched now stale), start the
        next forward's fetches."""
        self._reset_users()
        self.landings.chosen = set()
        for rec in self.params:
            if rec.state is not ParamState.LANDING or not step_follows:
                self.window.release(rec)
        self.window.frozen_in_backward.clear()
        self.trace.fix()  # a forward that did not end as the root's (an error, an interrupt) recorded the order
        self.prefetcher.end_backward()
        self.window.phase = "forward"
        if not step_follows:
            self.prefetcher.prefetch()

    def grad_done(self, param: torch.nn.Parameter) -> None:
        """A trainable parameter's gradient is accumulated: backward will not use it again."""
        rec = self._by_param.get(id(param))
        if rec is None or rec.users > 0 or rec.held:  # held: stays as it is until the block ends
            return
        if rec.index in self.landings.chosen and rec.state is ParamState.AVAILABLE:
            self.window.begin_landing(rec)
        else:
            self.window.release(rec)

    def updated(self) -> None:
        """The optimizer has written new parameters to every home: landed parameters are AVAILABLE, persistent ones
        copied again, other device copies released; start the next forward's fetches."""
        landed = {rec.index for rec in self.params
                  if rec.state is ParamState.LANDING and self.window.complete_landing(rec)}
        self.last_step = self._rates({k: v - self._mark[k] for k, v in self.counters.items()})
        self._mark = dict(self.counters)
        self._reset_users()
        for rec in self.params:
            if rec.index in landed or (rec.persistent and not rec.trains):  # a frozen one's value is unchanged
                continue
            if rec.persistent:  # now, not at its next fetch: read between steps (a callback, the model after
                self.window.refresh(rec)  # train()) it holds the new value; sharded, a collective in index order
            elif rec.state is not ParamState.RELEASED:
                self.window.release(rec)  # fetched before the update: holds the old values
        self.window.phase = "forward"
        self.prefetcher.restart()
        self.prefetcher.prefetch()

    # values -----------------------------------------------------------------------------------------------------

    def write_home(self, index: int, value: torch.Tensor) -> None:
        """Stores a parameter's new low-precision value (a host tensor) in its home, and in the device copy it may
        have (a prefetched one too). On the training thread, between steps: ``write_parameter`` and the loads of
        checkpoints and state dicts."""
        rec = self.params[index]
        if rec.state is ParamState.FETCHING:  # its copy may still be reading the home about to be overwritten
            self.window.finish(rec)
            self.copies.synchronize()
        if rec.state is ParamState.LANDING:
            self.window.cancel_landing(rec)
        self.homes.write(rec, value)
        if rec.state is ParamState.AVAILABLE:
            if rec.home is not None and not rec.sharded:
                self.window.refresh(rec)
            else:  # the full value is here: no read of the home (a sharded one's gather is a collective)
                self.window.upload_now(rec, value)

    def write_home_part(self, index: int, start: int, value: torch.Tensor) -> Any:
        """Starts storing elements ``start``.. of a parameter's new value in its home: one of the parts of an NVMe
        home (the optimizer thread writes each sub-group's segment as soon as it is updated), or a range of a host
        copy; a LANDING parameter's device buffer gets it too. Returns the handle of the write (and copy):
        ``value`` must stay untouched until it has been waited on."""
        rec = self.params[index]
        write = self.homes.write_part(rec, start, value)
        if rec.home is not None:
            return write
        copy = self.landings.land_part(rec, start, value)
        return write if copy is None else AllOf([write, copy])

    def read_home(self, index: int) -> torch.Tensor:
        """A parameter's current value from its home, as a new host tensor in its shape."""
        return self.homes.read(self.params[index])

    def index_of(self, param: torch.nn.Parameter) -> int:
        return self._by_param[id(param)].index

    # reporting and lifetime -------------------------------------------------------------------------------------

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
        return {**self._rates(self.counters), "last_step": self.last_step, "nvme": self.homes.stats(),
                "pieces_nvme": self.shards.swap_stats() if self.shards is not None else None}

    def reset_counters(self) -> None:
        for k in self.counters:
            self.counters[k] = 0
        self._mark = dict(self.counters)

    def close(self) -> None:
        """Removes the hooks and hands the model back whole, as plain tensors holding each parameter's current
        value. Safe on a half-built object (a failure in ``__init__``): only the parameters recorded are touched."""
        for h in self._slots:
            h.remove()
        self._slots.clear()
        if self.trace is not None:
            self.trace.close()
        if self._original_forward is not None:
            self.module.__dict__.pop("forward", None)  # the instance attribute; the class's forward shows through
            self._original_forward = None  # (popped again, harmlessly, by a close an interrupt cut short here)
        if self.homes is None:
            return
        self.homes.drain()  # fetches in flight land first
        # the homes go even if the GPU failed the hand-back
        run_all([functools.partial(_hand_back, self), self.window.close, self.homes.close])


def _hand_back(offload: ParameterOffload) -> None:
    """Every parameter back as a plain tensor holding its current value: on the device where the whole model fits
    its budget beside what else is there; else in host memory, a host home handed over as it is and the rest (NVMe
    homes, pieces, device copies) read into memory this machine has free now, every rank agreeing; else left NaN
    placeholders, and close raises saying so once all is freed. A model offloaded because the device cannot hold it
    would otherwise run the device, or the host, out of memory as its engine closes."""
    window, params, shards = offload.window, offload.params, offload.shards
    offload.copies.synchronize()  # fetches' copies land first: homes and staging are freed after
    window.trim(0)  # the cached buffers are ours to drop
    size = torch.empty((), dtype=offload.dtype).element_size()
    need = sum(rec.numel for rec in params) * size
    held = sum(rec.device.numel() for rec in params if rec.device is not None) * size
    device = offload.store.accounts[Tier.DEVICE]
    fits = device.budget is None or device.current - held + need <= device.budget
    card = free_device_memory(window.device)  # the CUDA driver's count: the context, other processes, torch's
    if card is not None:  # cache (returned first) are in no budget; a piece's gather takes two buffers more
        fits = fits and need - held + 2 * max((rec.numel * size for rec in params), default=0) <= card
    new = sum(rec.numel for rec in params if rec.home is None or rec.sharded) * size
    room = new <= default_host_budget()
    if shards is not None:  # the reads below are collectives: every rank takes the same way
        fits, room = (bool(v) for v in shards.comm.min_ints([int(fits), int(room)]))
    where: str | None = "device" if fits else "host" if room else None
    if where != "device":  # (on the CPU the device tier is RAM too: the host is no worse a place, said quietly)
        log.log(logging.INFO if where == "host" and window.device.type == "cpu" else logging.WARNING,
                "offload: the model's offloaded parameters (%s) do not fit the device (budget %s, %s) "
                "beside what it holds%s: %s", fmt_bytes(need), fmt_bytes(device.budget or 0),
                "the driver's free memory " + fmt_bytes(card) if card is not None else "no driver count",
                " on some rank" if shards is not None else "",
                "they are handed back in host memory (move the model when it fits)" if room else
                f"nor does this machine's free memory hold the {fmt_bytes(new)} read back; they stay NaN "
                "placeholders")
    uploaded: list[torch.nn.Parameter] = []  # moved to the host too if the card runs out part way
    for rec in params:
        if rec.state is ParamState.LANDING:
            window.cancel_landing(rec)
        if rec.state is ParamState.FETCHING:
            try:
                window.finish(rec)
            except Exception:  # noqa: BLE001 - a prefetch nobody waited for: its home is read again just below,
                pass  # and that read raises if the fault is still there
        if where is None:
            rec.param.data = window.placeholder(rec)
        elif where == "host" and rec.home is not None and not rec.sharded:
            rec.param.data = rec.home.view(rec.shape)  # the home itself: the newest value, no copy
        else:
            # a piece of a parameter is read (a collective) on every rank alike, whatever each holds
            fresh = rec.state is ParamState.RELEASED or rec.stale or rec.sharded
            value = offload.read_home(rec.index) if fresh else rec.device.view(rec.shape)
            if where == "device":
                try:
                    value = offload.copies.upload(value) if fresh else value.clone()
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
            offload.store.free(Tier.DEVICE, rec.device)
            rec.device = None
        rec.state = ParamState.RELEASED
    if where is None:
        raise RuntimeError(
            f"close(): the model's parameters ({fmt_bytes(need)}) fit neither the device budget nor this "
            "machine's free memory, so they were not handed back (the model holds NaN placeholders; everything "
            "else was freed). Save the weights before close (engine.save_safetensors or save_checkpoint) and "
            "load them where they fit, or into a model built inside offload.init")
