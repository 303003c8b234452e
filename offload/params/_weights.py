"""Weights: where the model's low-precision parameters live for one engine, and how new values reach them.

The plan's parameter tier decides the shape, and with it the one update sink (:mod:`._sinks`) the optimizer hands
each sub-group's new values to:

* DEVICE: one flat buffer per param group on the DEVICE tier; each trainable parameter becomes a view into it
  (``p.data = view``: the same ``nn.Parameter`` objects, so tied weights, hooks and user references survive). The
  optimizer writes new values into it (the CPU device tier: in the kernel's own pass, :class:`~._sinks.FlatSink`;
  CUDA: through pinned staging and the host-to-device stream, :class:`~._sinks.UploadSink`). With the delayed
  update the optimizer writes a HOST copy instead, which :meth:`Weights.apply_update` copies to the device at the
  next step. With several ranks (stages 0-2) each rank updates its range and :meth:`after_step` (delayed:
  :meth:`apply_update`) all-gathers the rest.
* HOST: flat host buffers that the optimizer updates in place (stage 3 on several ranks: this rank's pieces only,
  :class:`~._shards.ParamShards`); :class:`~._offload.ParameterOffload` fetches a window to the device.
* NVME: a swap key per parameter (several ranks: per piece, in the rank's own folder), rewritten from the
  optimizer thread after each sub-group's update (:class:`~._sinks.HomeSink`, :class:`~._sinks.PieceSink`); a
  window is fetched as for HOST.

Frozen parameters and buffers are moved to the device once, here (floating point ones in the training dtype).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from nvme_swapper import aligned_tensor

from .._cleanup import close_after_failure, run_all
from ..dist import Comm, GradPartition
from ..memory import Copy, CopyStreams, Tier, TieredStore, fmt_bytes
from ..optim._layout import FlatLayout
from ..persist import buffers_from_pretrained_keeps
from ..plan import UPDATE_BUFFERS, Partition, Plan
from . import ParameterOffload, check_window
from ._shards import ParamShards
from ._sinks import FlatSink, HomeSink, PieceSink, UpdateSink, UploadSink

if TYPE_CHECKING:
    from ..optim.offloaded import OffloadedAdam

_FIX_HOST = "raise offload.host_memory_budget or home the parameters on nvme"


class Weights:
    """Owns the low-precision parameters' buffers (device flats, host homes, delayed-update copies), the update sink
    the optimizer hands new values to (set as ``optimizer.sink``) and, with parameter offload, the
    :class:`ParameterOffload` and :class:`ParamShards` that hold them. ``close()`` hands the model back with plain
    tensors holding the current values."""

    def __init__(self, plan: Plan, module: torch.nn.Module, layout: FlatLayout, store: TieredStore,
                 copies: CopyStreams, comm: Comm, optimizer: OffloadedAdam, *, aio: Any,
                 nvme_path: str | None) -> None:
        self.plan, self.module, self.layout, self.store, self.copies = plan, module, layout, store, copies
        self.flats: list[torch.Tensor] = []  # DEVICE tier: the parameters are views into these
        self._host: list[torch.Tensor] = []  # HOST tier: homes, or the delayed update's copies
        self.params: ParameterOffload | None = None
        self.shards: ParamShards | None = None
        self.sink: UpdateSink | None = None
        self._optimizer = optimizer  # holds the sink too (optimizer.sink), dropped with it at close
        self.pending = False  # delayed update: the optimizer's newest values are not on the device yet
        self._reserved = 0  # bytes reserved on the DEVICE tier for the flat parameters
        # a model given with its parameters in the training dtype keeps its float buffers' dtypes: such a model
        # (transformers' from_pretrained(torch_dtype=bf16)) holds fp32 on purpose there (RoPE's inv_freq: rounded
        # to bf16, its angles drift by radians at long positions); a model converted here converts its buffers,
        # but for those a transformers model loaded in the training dtype would hold in another
        self._keep_buffer_dtypes = all(p.dtype == plan.dtype for p in module.parameters() if p.is_floating_point())
        self._kept_buffers = set() if self._keep_buffer_dtypes else buffers_from_pretrained_keeps(module, plan.dtype)
        # each parameter, its storage address (DEVICE tier; parameter offload moves it) and whether it trains
        self._held: list[tuple[torch.nn.Parameter, int | None, bool]] = []
        try:
            if plan.param_tier is Tier.DEVICE:  # every buffer before the first parameter moves: a budget that
                self._reserve_device()  # misses one leaves the model as it was given
                self.flats = self._device_flats()
                if plan.delayed:  # updates land in host buffers, copied to the device at the next step
                    host = [self._allocate_host(f.numel(), "delayed-update parameters", "raise "
                                                "offload.host_memory_budget or turn off "
                                                "offload_optimizer.delayed_update") for f in self.flats]
                    self.sink = FlatSink(host, layout)
                elif plan.cuda_path and plan.optimizer_tier is not Tier.DEVICE and self.flats:
                    self.sink = UploadSink(self.flats, store, copies, layout)  # pinned staging, allocated here
                else:
                    self.sink = FlatSink(self.flats, layout)
                optimizer.sink = self.sink
                self._flatten_to_device(optimizer)
            else:
                self._offload(comm, optimizer, aio, nvme_path)
            trains = {id(p) for p in layout.params}
            self._held = [(p, p.data_ptr() if self.params is None else None, id(p) in trains)
                          for p in layout.params + self.frozen()]
        except BaseException as exc:
            close_after_failure(self.close, exc)
            raise

    # construction -----------------------------------------------------------------------------------------------

    def _allocate_host(self, numel: int, what: str, fix: str) -> torch.Tensor:
        t = self.store.allocate(Tier.HOST, numel, self.plan.dtype, what, fix)
        self._host.append(t)
        return t

    def frozen(self) -> list[torch.Tensor]:
        trainable = {id(p) for p in self.layout.params}
        return [p for p in self.module.parameters() if id(p) not in trainable]

    def _reserve_device(self) -> None:
        """The DEVICE tier holds the flat parameters, the frozen tensors, and room for the largest gradient."""
        size = torch.empty((), dtype=self.plan.dtype).element_size()
        flat = sum(n for n in self.layout.group_numel) * size
        frozen = sum(t.numel() * (size if t.is_floating_point() else t.element_size())
                     for t in self.frozen() + list(self.module.buffers()))
        grad = max((p.numel() for p in self.layout.params), default=0) * size
        self.store.accounts[Tier.DEVICE].reserve(
            flat + frozen + grad, f"the model's {fmt_bytes(flat)} of {self.plan.dtype} parameters, "
            f"{fmt_bytes(frozen)} of frozen tensors and one {fmt_bytes(grad)} gradient",
            "raise offload.device_memory_budget (parameter offload is the other way out)")
        self._reserved = flat + frozen + grad

    def _device_flats(self) -> list[torch.Tensor]:
        """One flat buffer per param group on the device, zeroed: the alignment padding between parameters stays
        zero."""
        plan = self.plan
        return [torch.zeros(numel, dtype=plan.dtype, device=plan.device) if plan.cuda
                else aligned_tensor(numel, plan.dtype, pin_memory=False) for numel in self.layout.group_numel]

    def _flatten_to_device(self, optimizer: OffloadedAdam) -> None:
        """Each trainable parameter becomes a view into its group's flat, each frozen one and each buffer moves."""
        layout, flats = self.layout, self.flats
        with torch.no_grad():
            for i, p in enumerate(layout.params):  # each one read into the masters, then moved: its memory goes
                optimizer.fill_masters(i + 1)
                self._place(layout.param_view(flats[layout.param_group[i]], i), p.detach())
                p.data = layout.param_view(flats[layout.param_group[i]], i)
            for p in self.frozen():
                p.data = self._to_device(p.data)
        self._move_buffers()

    def _place(self, dst: torch.Tensor, value: torch.Tensor) -> None:
        """``value`` (the user's tensor, on any device, any float dtype) into ``dst`` on the device."""
        if value.device == dst.device or not self.plan.cuda:
            dst.copy_(value)
        else:  # behind the compute stream, which may have written dst (zeroed it) or still read it
            self.copies.to_device(dst, value.to(dst.dtype).contiguous(), after=self.copies.mark()).wait()

    def _to_device(self, t: torch.Tensor, keep_dtype: bool = False) -> torch.Tensor:
        dtype = self.plan.dtype if t.is_floating_point() and not keep_dtype else t.dtype
        if t.device == self.plan.device and t.dtype == dtype:
            return t
        if t.device.type == "cpu" and self.plan.cuda:
            return self.copies.upload(t, dtype)
        return t.to(self.plan.device, dtype)

    def _move_buffers(self) -> None:
        with torch.no_grad():
            for prefix, mod in self.module.named_modules():
                for name, buf in mod._buffers.items():
                    if buf is not None:
                        keep = self._keep_buffer_dtypes or f"{prefix}.{name}".lstrip(".") in self._kept_buffers
                        mod._buffers[name] = self._to_device(buf, keep_dtype=keep)

    def _offload(self, comm: Comm, optimizer: OffloadedAdam, aio: Any, nvme_path: str | None) -> None:
        """Parameter offload: homes on HOST (the flat host buffers the optimizer updates in place) or NVMe (a key
        per parameter, rewritten after each sub-group's update; with several ranks in stage 3, keys of this rank's
        pieces in its own folder); the device holds a window (params/_offload.py)."""
        plan, layout = self.plan, self.layout
        frozen = self.frozen()
        check_window([p.numel() for p in layout.params + frozen], plan.persistence_threshold, plan.max_live,
                     plan.dtype, self.store.accounts[Tier.DEVICE].budget)  # before any parameter moves
        homes: list[torch.Tensor | None] = [None] * (len(layout.params) + len(frozen))
        home_sink: HomeSink | None = None
        if plan.partition is Partition.PER_PARAM:  # frozen parameters are partitioned too, in a layout of their own
            pieces = plan.frozen_pieces(frozen)
            if plan.param_tier is Tier.NVME:  # pieces in this rank's NVMe folder, staging for those in flight
                self.shards = ParamShards(comm, layout, self.copies, frozen=pieces, store=self.store,
                                          dtype=plan.dtype, nvme_path=nvme_path, aio=aio,
                                          staging_cap=plan.read_staging(layout.piece + (pieces.piece if pieces
                                                                                        else [])),
                                          writes=UPDATE_BUFFERS)
                self.sink = PieceSink(self.shards, self.store, self.copies, layout, plan.dtype, UPDATE_BUFFERS)
            else:  # each home holds this rank's piece of every parameter
                fix = "raise offload.host_memory_budget or use more ranks"
                flats = [self._allocate_host(layout.owned_numel(g), f"this rank's share of the parameters of param "
                                             f"group {g}", fix) for g in range(len(layout.group_numel))]
                frozen_flat = self._allocate_host(pieces.owned_numel(0), "this rank's share of the frozen "
                                                  "parameters", fix) if pieces else None
                self.shards = ParamShards(comm, layout, self.copies, frozen=pieces, flats=flats,
                                          frozen_flat=frozen_flat)
                self.sink = FlatSink(flats, layout, owned_only=True)
            with torch.no_grad():
                for i, p in enumerate(layout.params):
                    optimizer.fill_masters(i + 1)
                    self.shards.write(i, p.detach())
                for k, p in enumerate(frozen):  # the module's tensor is freed as parameter offload takes it over
                    self.shards.write(len(layout.params) + k, p.detach())
        elif plan.param_tier is Tier.HOST:
            flats = [self._allocate_host(n, f"the host home of param group {g}", _FIX_HOST)
                     for g, n in enumerate(layout.group_numel)]
            if frozen:  # taken with the rest, before any parameter moves: a budget they miss leaves the model as is
                sizes = [p.numel() for p in frozen]
                block = self._allocate_host(sum(sizes), "the host homes of the frozen parameters", _FIX_HOST)
                homes[len(layout.params):] = block.split(sizes)
            with torch.no_grad():
                for i, p in enumerate(layout.params):  # each one read into the masters, then moved to its home
                    optimizer.fill_masters(i + 1)
                    view = layout.param_view(flats[layout.param_group[i]], i)
                    view.copy_(p.detach())
                    homes[i] = view.view(-1)
                    p.data = view  # the user's tensor is freed here, not after every home is written
                for k, p in enumerate(frozen):
                    homes[len(layout.params) + k].copy_(p.detach().reshape(-1))
            self.sink = FlatSink(flats, layout)
        else:  # the homes' writes go through its staging, the initial ones too (idle until the first update)
            self.sink = home_sink = HomeSink(self.store, self.copies, layout, plan.dtype, UPDATE_BUFFERS)
        optimizer.sink = self.sink
        self._move_buffers()
        trainable = len(layout.params)
        self.params = ParameterOffload(
            self.module, layout.params + frozen, homes, self.store, self.copies, plan.dtype,
            persistence_threshold=plan.persistence_threshold, max_live=plan.max_live, bucket=plan.prefetch_bucket,
            nvme_path=nvme_path if plan.param_tier is Tier.NVME else None, aio=aio, shards=self.shards,
            scratch=self.sink.scratch, parts=self._segments(), land=not plan.delayed,
            staging=plan.read_staging([p.numel() for p in layout.params + frozen if p.numel() >
                                       plan.persistence_threshold]) if plan.cuda_path and self.shards is None else 0,
            # each parameter read into the masters just before it moves to its home
            before_home=lambda i: optimizer.fill_masters(min(i + 1, trainable)),
            written_together=[[(seg.param, seg.param_start) for seg in sg.segments] for sg in layout.sub_groups],
            writes=UPDATE_BUFFERS)
        if home_sink is not None:
            home_sink.homes = self.params
        optimizer.fill_masters()  # the rest: sub-groups of padding alone

    def _segments(self) -> list[list[tuple[int, int]]]:
        """Per trainable parameter, the (start, numel) of its segment in each optimizer sub-group, in order."""
        parts: list[list[tuple[int, int]]] = [[] for _ in self.layout.params]
        for sg in self.layout.sub_groups:
            for seg in sg.segments:
                parts[seg.param].append((seg.param_start, seg.numel))
        return parts

    # reading and writing values ---------------------------------------------------------------------------------

    def read(self, p: torch.nn.Parameter) -> torch.Tensor:
        """A parameter's current low-precision value as a host tensor, wherever it lives."""
        if self.params is not None:
            return self.params.read_home(self.params.index_of(p))
        return self.copies.download(p)

    def write(self, p: torch.nn.Parameter, value: torch.Tensor) -> None:
        """Sets a parameter's low-precision value wherever it lives (rounded to its dtype)."""
        with torch.no_grad():
            if self.params is not None:
                # homes are host memory or NVMe files, whose writes take host tensors only
                host = value.detach().to("cpu", self.plan.dtype).reshape(-1)
                self.params.write_home(self.params.index_of(p), host)
            else:
                self._place(p.data, value)

    def write_pending(self, i: int, device_value: torch.Tensor, update: torch.Tensor) -> None:
        """Delayed update, resuming mid-pipeline: parameter ``i`` holds ``device_value`` on the device and
        ``update`` (the newest, not yet applied) in the host copy."""
        layout = self.layout
        with torch.no_grad():
            self._place(layout.params[i].data, device_value)
            layout.param_view(self._host[layout.param_group[i]], i).copy_(update)

    # steps ------------------------------------------------------------------------------------------------------

    def apply_update(self, zero: GradPartition) -> list[Copy]:
        """Delayed update: the parameters of the last finished update go to the device (the compute stream sees
        them from now on): this rank's range from its host copy, the others' by an all-gather (a collective, so
        every rank calls this at the same point). Returns the copies that still read the host copy: the next
        update waits for them."""
        if not self.pending:
            return []
        after = self.copies.mark()
        owned = self.layout.owned
        copies = [self.copies.to_device(dst[lo:hi], src[lo:hi], after=after)
                  for dst, src, (lo, hi) in zip(self.flats, self._host, owned)]
        for copy in copies:
            self.copies.use(copy)
        zero.gather_params(self.flats)
        self.pending = False
        return copies

    def after_step(self, zero: GradPartition) -> None:
        """The optimizer has finished writing new values: they reach every rank and every device copy."""
        if self.plan.param_tier is Tier.DEVICE and not self.plan.delayed:
            self.copies.use_uploads()
            zero.gather_params(self.flats)  # every rank's updated share, to every rank
        if self.params is not None:
            self.params.updated()

    def check_trainable(self) -> None:
        """Raises if a parameter's ``requires_grad`` differs from what it was at initialize as a backward starts:
        a newly frozen parameter would go on moving with Adam's momentum, a newly unfrozen one never train while its
        ``.grad`` grows. Checked at backward, not at forward: a forward with flags flipped for its duration (peft's
        ``disable_adapter()``, a DPO step's reference pass) is fine."""
        for p, _, trains in self._held:
            if p.requires_grad != trains:
                raise RuntimeError(
                    f"parameter {self._name(p)!r} {'was' if trains else 'was not'} trainable at offload.initialize "
                    f"and has requires_grad={p.requires_grad} at this backward: the engine trains the parameters it "
                    "was given, with optimizer state for those only. To change which parameters train, close this "
                    "engine (the model keeps its current weights) and initialize again")

    def check_held(self) -> None:
        """Raises if a parameter's tensor was replaced behind the engine (``model.to(dtype)``, ``.half()``,
        ``.cpu()`` on a GPU, ``p.data = ...`` after initialize): the optimizer's updates would go to the engine's
        tensors, no longer the model's, and training would silently stop (with parameter offload: a dtype error
        deep in some layer). Once per forward: one address (parameter offload: dtype and device) per parameter."""
        plan, offloaded = self.plan, self.params is not None
        for p, ptr, _ in self._held:
            if (p.dtype != plan.dtype or p.device != plan.device) if offloaded else p.data_ptr() != ptr:
                raise RuntimeError(
                    f"parameter {self._name(p)!r} is now {p.dtype} on {p.device}, no longer the tensor the engine "
                    f"trains ({plan.dtype} on {plan.device}): a model.to(), .half(), .float(), .cpu() or `p.data = "
                    "...` after offload.initialize replaced it, so updates would not reach it. Choose the dtype in "
                    "the config (bf16 / fp16 enabled) and the device with offload.device, or convert the model "
                    "before initialize; set values with engine.load_state_dict or model.load_state_dict. Close "
                    "this engine and initialize again")

    def _name(self, param: torch.nn.Parameter) -> str:
        return next((n for n, p in self.module.named_parameters() if p is param), "?")

    def finish_fetches(self) -> None:
        """Parameter offload: waits for the fetches in flight (a checkpoint reads the homes after them)."""
        if self.params is not None:
            self.params.finish_fetches()

    def register_external(self, module: torch.nn.Module, param: torch.nn.Parameter) -> None:
        if self.params is not None:
            self.params.register_external(module, param)

    def stats(self) -> dict[str, Any] | None:
        return self.params.stats() if self.params is not None else None

    def close(self) -> None:
        """Hands the model back (parameter offload: plain device tensors with the current values) and frees the
        host buffers and the device reservation. The hand-back cut short (an interrupt) frees nothing it reads: the
        next call hands back again."""
        run_all([self._close_sink, self._close_params, self._free])

    def _close_sink(self) -> None:
        """Waits for the writes it still has in flight (before the homes' files close) and frees its staging."""
        if self.sink is not None:
            self.sink.close()
            self.sink = None
            self._optimizer.sink = None  # (the optimizer's reference: none left to a closed sink's buffers)

    def _close_params(self) -> None:
        if self.params is not None:
            self.params.close()
            self.params = None

    def _free(self) -> None:
        if self.shards is not None:
            self.shards.close()
            self.shards = None
        for t in self._host:
            self.store.free(Tier.HOST, t)
        self._host = []
        if self._reserved:
            self.store.accounts[Tier.DEVICE].release(self._reserved)
            self._reserved = 0
