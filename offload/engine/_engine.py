"""Engine: wires the layers a :class:`~offload.plan.Plan` asks for, and is the API a training loop calls.

What ``initialize`` builds, in order, and who owns what afterwards (``close()`` stops it all, in reverse):

* the process group and this rank's device (:func:`offload.dist.join`); every rank's parameters and buffers made
  rank 0's where they differ (:func:`offload.dist.agree_with_rank0`); then the frozen :class:`Plan`;
* the :class:`TieredStore` (budgets of DEVICE, HOST and NVME, the swap engine, staging buffers) and the
  :class:`CopyStreams` every device<->host copy goes through;
* the :class:`FlatLayout` of the trainable parameters and the :class:`OffloadedAdam` holding fp32 master weights
  and moments on HOST or NVME, with gradient buffers on HOST;
* :class:`Weights`: where the low-precision parameters live (device flats, host or NVMe homes with a device
  window) and how the optimizer's new values reach them;
* :class:`GradientStream`: gradients from the device to the host buffers, bucketed, as they become final;
* :class:`UpdateGate` (``plan.overlap_forward``): ``step()`` returns with the updates queued, and each module's
  forward waits only for the sub-groups it reads (traced in the first forward), so the next forward runs beside
  Adam;
* the engine's own hooks: a post-accumulate-grad hook per trainable parameter, and its slots on the root module's
  forward (Ctrl-C held, the model's tensors checked, and the one place inputs are moved to the device:
  ``_inputs.py``); and :class:`ModelStateHooks`, through which the model's own ``load_state_dict()`` reaches the
  fp32 masters and its ``state_dict()`` the offloaded parameters' values.

``torch.compile(model)`` may be handed over: the engine's ``module`` is the model it wraps (hooks, names,
checkpoints and exports as without compile) and its forward runs the compiled one (the hooks run eagerly between
the compiled graphs, see offload/_hooks.py).

The engine's other jobs each have their module and owner: the step, its :class:`Phase` and counters
(:class:`StepController`, ``_step.py``), finiteness and the gradient norm (``_norm.py``), Ctrl-C holds, close and
exit (:class:`Lifetime`, ``_lifetime.py``), and, owning no state, the persistence facade (``_persistence.py``),
the reports (``_reports.py``) and DeepSpeed's accessors (``_compat.py``), which :class:`Engine` inherits. What
``initialize`` checks before it builds is ``_setup.py``.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping

import torch

from nvme_swapper import FileIO, arena_device

from .. import _state
from .._cleanup import close_after_failure
from .._hooks import Hook, Slot, on_forward, weakly
from .._precision import LossScaler
from ..config import OffloadConfig
from ..dist import Comm, CommError, GradPartition, ReduceBuckets, StartSync, agree_on_settings, agree_with_rank0, join
from ..dist._group import report_failed_start
from ..memory import CopyStreams, HeapTrim, TieredStore, prepare_nvme_path
from ..optim._layout import FlatLayout
from ..optim._schedule import WarmupSchedule, build_scheduler
from ..optim.offloaded import OffloadedAdam
from ..plan import ModelSizes, Partition, Plan, resolve
from ._compat import DeepSpeedAccessors
from ._gate import UpdateGate
from ._gathered import Gathered
from ._grads import GradientStream
from ._inputs import MoveInputs
from ._lifetime import Lifetime, held, take_sigterm
from ._model_state import ModelStateHooks
from ._norm import GradNorm
from ._persistence import Persistence
from ._reports import Reports
from ._setup import accepted, note_moved, shared_settings, trainable_groups, warn_slow_bf16, warn_widened
from ._step import Phase, StepController
from ..params._weights import Weights


class Engine(Persistence, Reports, DeepSpeedAccessors):
    """Returned by :func:`offload.initialize`. See the module docstring."""

    _offload_engine = True  # (offload._state.is_engine: known without importing this module)

    def __init__(self, model: torch.nn.Module, config: OffloadConfig | Mapping[str, Any] | str | Path | None = None,
                 *, param_groups: Iterable[dict[str, Any]] | None = None, _file_io: FileIO | None = None) -> None:
        """``_file_io`` (tests only): the OS-call boundary of the optimizer state's swap engine, to inject faults."""
        try:  # a failure before the ranks' group exists is this rank's word in their start vote (dist/_group.py)
            self.config = cfg = OffloadConfig.load(config)
            self.module = accepted(model, cfg)  # what hooks, names and checkpoints see
        except BaseException as exc:
            report_failed_start(exc)
            raise
        self._call = model  # what a forward runs: torch.compile(model) stays compiled
        self._steps = StepController(self)  # the phase, the counters and the accumulation window
        self._life = Lifetime(self)  # Ctrl-C holds, and what close() undoes
        self.scaler = LossScaler(cfg.fp16)
        self.lr_scheduler: WarmupSchedule | None = None
        self.store: TieredStore | None = None
        self.copies: CopyStreams | None = None
        self.optimizer: OffloadedAdam | None = None  # type: ignore[assignment]
        self.weights: Weights | None = None
        self.grads: GradientStream | None = None
        self._norm: GradNorm | None = None
        self._zero: GradPartition | None = None
        self._reduce: ReduceBuckets | None = None  # stages 1-2 on several ranks
        self._heap: HeapTrim | None = None  # the CPU device's free heap pages returned during backward
        self._gate: UpdateGate | None = None  # plan.overlap_forward: the step's updates finish beside the forward
        self.start_sync: StartSync | None = None  # the parameters and buffers copied from rank 0 at start
        try:
            group = join(cfg.offload.comm_timeout, cfg.offload.device)
        except BaseException:
            self._steps.mark_closed()  # (nothing to close: __del__ passes it over)
            raise
        try:
            self.comm = Comm(group)
        except BaseException:
            self._steps.mark_closed()
            group.close()
            raise
        self.world_size = group.world_size
        given = {id(p): (p.dtype, p.device) for p in self.module.parameters()}
        # Ctrl-C held, as over every engine call: a press stops the build between its parts (never inside one,
        # where threads, files or parameters would be half set up), and the cleanup runs whole
        try:
            with self._life.hold("offload.initialize") as hold:
                def stop_point() -> None:  # between the build's parts: Ctrl-C, or another rank failed to build
                    hold.raise_if_pressed()
                    self.comm.raise_if_stopped()

                self.config = cfg.for_world(group.world_size)  # train_batch_size: the accumulation it implies
                self._build(param_groups, _file_io, stop_point)
                stop_point()
                # no rank leaves before every rank has built: one that failed has closed its group, and the
                # others' barrier fails at once, quoting its error (Comm's diagnosis), not at their first step
                self.comm.barrier()
        except BaseException as exc:
            # closed (a cleanup cut short is finished at exit, or by the next initialize), saying why to the other
            # ranks (an error caused by another rank's failure quotes that one already)
            self._life.start_failed(None if isinstance(exc, CommError) else
                                    f"offload.initialize raised {type(exc).__name__}: {' '.join(str(exc).split())}")
            with self._life.hold("offload.initialize (its cleanup)"):
                close_after_failure(self._life.teardown, exc)
                note_moved(self.module, given, exc)
            raise
        self._steps.count_comm_from_here()
        _state.opened(self)
        take_sigterm()

    # construction -----------------------------------------------------------------------------------------------

    def _build(self, param_groups: Iterable[dict[str, Any]] | None, file_io: FileIO | None,
               stop_point: Callable[[], None]) -> None:
        cfg, pg = self.config, self.comm.pg
        self.world_size, self.rank = pg.world_size, pg.rank
        # the swap folders first, before any collective: a rank whose nvme_path is unusable fails while the others
        # wait in the first one, which fails at once, quoting its error (they would otherwise build on, for seconds)
        nvme = {name: self._prepare_nvme(name) for name in ("offload_optimizer", "offload_param")}
        groups, options = trainable_groups(self.module, param_groups)
        self.start_sync = agree_with_rank0(self.module, self.comm)  # before any rank reads its copy of the model
        trainable = {id(p) for g in groups for p in g}
        sizes = ModelSizes.of([p for g in groups for p in g],
                              [p for p in self.module.parameters() if id(p) not in trainable],
                              list(self.module.buffers()))
        in_ram = sum(p.numel() * p.element_size() for g in groups for p in g
                     if p.device.type == "cpu" and arena_device(p) is None)
        whole = tuple(name or type(m).__name__ for name, m in self.module.named_modules()
                      if isinstance(m, torch.nn.MultiheadAttention))
        self._plan = plan = resolve(cfg, sizes, device=pg.device, world_size=pg.world_size, rank=pg.rank,
                                    local_world_size=pg.local_world_size, model_in_ram=in_ram, fetched_whole=whole)
        self.device, self.dtype, self.stage = plan.device, plan.dtype, plan.stage
        agree_on_settings(shared_settings(cfg, plan), self.comm)
        warn_slow_bf16(plan.device, plan.dtype)
        warn_widened([p for g in groups for p in g], plan.dtype)
        self.store = TieredStore(plan.device, dict(plan.budgets), pin_memory=plan.pin_memory, file_io=file_io)
        for p in {id(p): p for p in self.module.parameters()}.values():  # built in offload.init's arena: its disk
            dev = arena_device(p)  # space comes back as the parameters move to their homes
            if dev is not None:
                self.store.reclaimable[dev] += p.numel() * p.element_size()
        self.copies = CopyStreams(plan.device, self.store.count)
        stop_point()
        self.layout = FlatLayout(groups, plan.sub_group_size, world_size=plan.world_size, rank=plan.rank,
                                 per_param=plan.partition is Partition.PER_PARAM, align=plan.align)
        embeddings = {id(m.weight): m.weight.shape[-1] for m in self.module.modules()
                      if isinstance(m, torch.nn.Embedding)}
        sparse = {i: embeddings[id(p)] for i, p in enumerate(self.layout.params) if id(p) in embeddings} \
            if cfg.sparse_gradients else {}
        self.optimizer = OffloadedAdam(self.layout, self.store, self.copies, cfg.optimizer, plan.optimizer_tier,
                                       group_options=options, nvme_path=nvme["offload_optimizer"],
                                       buffer_count=plan.buffer_count, aio=cfg.aio, grad_dtype=plan.grad_dtype,
                                       grad_sets=2 if plan.delayed else 1, grad_slots=plan.grad_slots,
                                       lazy_rows=sparse if cfg.sparse_gradients == "lazy" else None,
                                       cuda_path=plan.cuda_path, overlap_forward=plan.overlap_forward)
        self._norm = GradNorm(self.optimizer, self.comm, self.world_size)
        self.lr_scheduler = build_scheduler(cfg.scheduler, self.optimizer)
        stop_point()
        if plan.trim_heap:
            self._heap = HeapTrim(sizes.numel * plan.dtype_bytes)
        self._zero = GradPartition(self.comm, self.layout)
        # reads each parameter into the optimizer's masters just before it moves it to its home
        self.weights = Weights(plan, self.module, self.layout, self.store, self.copies, self.comm, self.optimizer,
                               aio=cfg.aio, nvme_path=nvme["offload_param"])
        stop_point()
        self.optimizer.fill_masters()
        stop_point()
        self.grads = GradientStream(plan, self.layout, self.store, self.copies, dest=self.optimizer.grads.of,
                                    on_ready=self._steps.sub_group_ready)
        self.optimizer.grad_handles = self.grads.handles
        if plan.world_size > 1 and not self.layout.per_param:
            self._reduce = ReduceBuckets(self.comm, self.layout, self.store, self.copies, bucket=plan.grad_bucket,
                                         dtype=plan.dtype, overlap=cfg.zero_optimization.overlap_comm,
                                         deliver=self.grads.receive, sparse=frozenset(sparse))
        self._install_hooks()
        if plan.overlap_forward:
            self._gate = UpdateGate(self.module, self.layout, self.optimizer, self.copies,
                                    on_error=self._steps.updates_failed)

    def _prepare_nvme(self, name: str) -> str | None:
        """The checked swap directory of ``zero_optimization.<name>``: with several ranks, a ``rank<r>`` folder of
        its nvme_path per rank (removed at close if left empty), so ranks sharing a disk never share files."""
        section = getattr(self.config.zero_optimization, name)
        if section.device != "nvme":
            return section.nvme_path
        path = prepare_nvme_path(section.nvme_path, f"zero_optimization.{name}.nvme_path")
        if self.world_size > 1:
            sub = path / f"rank{self.rank}"
            if not sub.exists():
                self._life.rmdir_at_close(sub)
            path = prepare_nvme_path(sub, f"zero_optimization.{name}.nvme_path (rank {self.rank})")
        return str(path)


    def _install_hooks(self) -> None:
        """The engine's slots on the root's forward (offload/_hooks.py): Ctrl-C held over every forward, a plain
        ``model(x)`` too, from before the first pre-hook to after the last hook, which runs when the forward raises
        too; the check that the model still holds the engine's tensors, before the forward trace (it touches every
        parameter, as a read the trace would record); the inputs moved to the device. Then each trainable
        parameter's post-accumulate-grad hook, and the model's own ``state_dict()``/``load_state_dict()``."""
        root, life = self.module, self._life
        self._move_inputs = MoveInputs(self.device, torch.float16 if self.config.fp16.enabled and
                                       self.config.fp16.auto_cast else None)
        life.remove_at_close(on_forward(root, Slot.HOLD, pre=life.hold_forward, always=life.release_forward),
                             on_forward(root, Slot.CHECK_HELD, pre=self._check_held),
                             on_forward(root, Slot.INPUTS, pre=self._move_inputs))
        for i, p in enumerate(self.layout.params):
            life.remove_at_close(p.register_post_accumulate_grad_hook(Hook(self._grad_hook(i))))
        life.remove_at_close(*ModelStateHooks(self).handles)

    def _grad_hook(self, i: int) -> Any:
        on_grad = weakly(self._steps.on_grad)

        def hook(p: torch.Tensor) -> None:
            on_grad(i, p)
        return hook

    def _check_held(self, *_: Any) -> None:
        self.weights.check_held()

    def plan(self) -> Plan:
        """What this engine runs with (device, placements, sizes) and why: ``print(engine.plan().describe())``."""
        return self._plan

    # the training step (_step.py) -------------------------------------------------------------------------------

    @held("the forward")
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._call(*args, **kwargs)

    forward = __call__

    def train(self, mode: bool = True) -> "Engine":
        self.module.train(mode)
        return self

    def eval(self) -> "Engine":
        return self.train(False)

    @property
    def phase(self) -> Phase:
        return self._steps.phase

    @property
    def global_steps(self) -> int:
        return self._steps.global_steps

    @property
    def micro_steps(self) -> int:
        return self._steps.micro_steps

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the micro-batch at hand ends its window, so that the ``step()`` after its backward updates
        (DeepSpeed's meaning, before that backward or after it): every gradient_accumulation_steps micro-batches,
        or as set by :meth:`set_gradient_accumulation_boundary`."""
        return self._steps.is_boundary()

    def set_gradient_accumulation_boundary(self, is_boundary: bool | None) -> None:
        """Says, before a micro-batch's backward, whether the step after it updates (True) or accumulates (False),
        overriding the count of gradient_accumulation_steps until set to None: for loops that decide the
        boundary themselves, such as transformers' Trainer with an epoch that is not a multiple of the
        accumulation steps (DeepSpeed's method of the same name)."""
        self._steps.set_boundary(is_boundary)

    @held("engine.backward")
    def backward(self, loss: torch.Tensor, *, scale_wrt_gas: bool = True) -> torch.Tensor:
        """Backward of ``loss`` scaled by the fp16 loss scale and, unless ``scale_wrt_gas`` is False (a loss the
        caller already normalised over the accumulation window), by 1/gradient_accumulation_steps; returns ``loss``
        (as DeepSpeed's does).

        If it raises in a window's first micro-batch before any update started, the window is dropped and the
        engine is idle again; otherwise (earlier micro-batches, or updates already running) it is FAILED until a
        checkpoint is loaded."""
        return self._steps.backward(loss, scale_wrt_gas)

    @held("engine.zero_grad")
    def zero_grad(self) -> None:
        """Drops the gradients of an unfinished accumulation window (a loop interrupted between backward and
        step), as ``model.zero_grad()`` does for a plain model, so the next window starts afresh; nothing to do
        after a step. Refused once the window's updates have started (its last micro-batch's backward starts them
        unless clipping or fp16 must see every gradient first): ``step()`` finishes them."""
        self._steps.zero_grad()

    @held("engine.step")
    def step(self) -> None:
        """At an accumulation boundary: overflow check, clipping, the optimizer step; a no-op between micro-batches.
        Gradients are consumed (the next backward starts from zero)."""
        self._steps.step()

    @property
    def last_grad_norm(self) -> float | None:
        """The global L2 norm of the last step's gradients (unscaled, before clipping; inf or nan where they
        overflowed), the same on every rank; None before the first step. Without clipping or fp16 the updates sum
        it as they run (the CPU Adam kernel squares each gradient it reads), so where ``step()`` returns before its
        updates end (``plan().overlap_forward``, the delayed update) reading it waits for them: read it when you log,
        not every step."""
        # a failed or closed engine does not wait (its updates may never end): what they summed, if whole
        waits = self.phase not in (Phase.FAILED, Phase.CLOSED)
        return self._norm.read(self._steps.finish_updates if waits else None)

    @held("engine.finish_step")
    def finish_step(self) -> None:
        """Waits until the last step's update is in every parameter. ``step()`` returns before (the next forward
        waits for each parameter as it reaches it: ``plan().overlap_forward``), so call this to read parameters
        directly in between, as an EMA of the weights does; the engine's own calls and ``state_dict()`` do it
        themselves."""
        self._steps.check_open()
        self._steps.settle()

    @held("engine.apply_delayed_update")
    def apply_delayed_update(self) -> None:
        """Delayed update: waits for the update in flight and puts its parameters on the device now (``step``
        does this itself; call it to see the newest parameters before the next step)."""
        self._steps.check_open()
        self.optimizer.finish()
        for copy in self.weights.apply_update(self._zero):
            copy.wait()

    # parameters -------------------------------------------------------------------------------------------------

    def parameters_current(self) -> None:
        """Every value the engine has computed is in the parameters: the updates queued or running, and a delayed
        update's (``engine.gathered`` and code that reads parameters between steps)."""
        self._steps.finish_updates()
        if self._plan.delayed:
            self.apply_delayed_update()

    def finish_fetches(self) -> None:
        """No parameter prefetch or gather in flight (a checkpoint reads beside none)."""
        self.weights.finish_fetches()

    def write_pending(self, index: int, device_value: torch.Tensor, master: torch.Tensor) -> None:
        """Delayed update, resumed: parameter ``index`` holds ``device_value`` until the update of ``master``."""
        self.weights.write_pending(index, device_value, master)

    def refuse_writes_over_started_updates(self, what: str, trainable: bool) -> None:
        """Raises where weights written now would be overwritten by the window's updates already running."""
        self._steps.refuse_writes_over_started_updates(what, trainable)

    def register_external_parameter(self, module: torch.nn.Module, param: torch.nn.Parameter) -> None:
        """With parameter offload, a parameter is on the device while its own module runs; declare here one that
        ``module`` reads directly although another module owns it. Without parameter offload it matters only
        while the step's updates finish beside the next forward, for a read the first forward's trace missed."""
        self.weights.register_external(module, param)
        if self._gate is not None:
            self._gate.register_external(module, param)

    @contextlib.contextmanager
    def gathered(self, params: torch.nn.Parameter | Iterable[torch.nn.Parameter] | None = None) -> Iterator[None]:
        """For the block, ``params`` (default: all the model's) are whole on the device, for code that uses them
        outside the forwards of their modules: a loss that multiplies by the output embedding itself, a generation
        loop, an initialisation or a norm you log. What autograd saves of them in the block is fetched again by
        backward, inside the block or after it. What the block writes into them is kept: their new values become
        their fp32 masters and homes at its end. ``engine.step()`` belongs after the block. With several ranks a
        collective (every rank passes the same parameters), and rank 0's changes are kept. DeepSpeed's
        ``zero.GatheredParameters``; see ``engine/_gathered.py``."""
        self._steps.expect("engine.gathered()", Phase.IDLE, Phase.ACCUMULATING)
        given = [params] if isinstance(params, torch.Tensor) else list(self.module.parameters() if params is None
                                                                        else params)
        owned = {id(p) for p in self.module.parameters()}
        strays = [i for i, p in enumerate(given) if id(p) not in owned]
        if strays:
            raise ValueError(f"engine.gathered: entry {strays[0]} of params is not a parameter of the engine's model")
        self.parameters_current()  # the values the block reads are the newest
        block = Gathered(self, list({id(p): p for p in given}.values()))
        with self._life.hold("engine.gathered"):  # the block's own code is the user's: Ctrl-C lands there at once
            block.enter()
        try:
            with self._steps.step_refused():
                yield
        finally:
            with self._life.hold("engine.gathered"):
                block.exit()

    @held("engine.read_parameter")
    def read_parameter(self, p: torch.nn.Parameter) -> torch.Tensor:
        """A parameter's current low-precision value as a host tensor, wherever it lives."""
        self._steps.finish_updates()
        return self.weights.read(p)

    @held("engine.write_parameter")
    def write_parameter(self, p: torch.nn.Parameter, value: torch.Tensor) -> None:
        """Sets a parameter's low-precision value wherever it lives (rounded to its dtype)."""
        self._steps.finish_updates()
        self.weights.write(p, value)

    # lifetime (_lifetime.py) ------------------------------------------------------------------------------------

    @held("engine.close")
    def close(self) -> None:
        """Joins the optimizer thread, closes the swap engines (removing their files) and frees the tiers' buffers.
        The model keeps working with its current parameters. A close cut short (a second Ctrl-C) is finished by
        the next call, or at exit."""
        self._life.close()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        life = self.__dict__.get("_life")  # (none where the config or the model was refused)
        if life is not None:
            life.collected()


def initialize(model: torch.nn.Module, config: OffloadConfig | Mapping[str, Any] | str | Path | None = None, *,
               param_groups: Iterable[dict[str, Any]] | None = None, model_parameters: Iterable[Any] | None = None,
               config_params: Mapping[str, Any] | None = None, args: Any = None,
               lr_scheduler: Callable[[torch.optim.Optimizer], Any] | None = None, optimizer: Any = None,
               training_data: Any = None, _file_io: FileIO | None = None) -> Engine:
    """Wraps ``model`` (in place) for offloaded training under ``config`` (a dict, a JSON path, or OffloadConfig).
    Fails here, with the numbers, if the configuration cannot fit its tier budgets or an nvme_path is unusable.

    DeepSpeed's keywords, for scripts ported as they are: ``config_params`` is ``config``; ``args`` gives it from
    ``args.deepspeed_config``; ``model_parameters`` is ``param_groups`` (plain parameters: one group, the frozen
    ones left out); ``lr_scheduler`` a callable building a scheduler on ``engine.optimizer`` (stepped and saved as
    the config's). ``optimizer`` and ``training_data`` are refused, naming what to do instead.
    ``_file_io`` is for fault-injection tests (see :class:`Engine`)."""
    if optimizer is not None:
        raise TypeError("initialize(optimizer=...): the optimizer here is the config's optimizer section (Adam or "
                        "AdamW, run on the offloaded fp32 masters), which a torch optimizer cannot drive; put its "
                        "lr, betas, eps and weight_decay there, and per-group values in param_groups")
    if training_data is not None:
        raise TypeError("initialize(training_data=...): build the DataLoader yourself (with a DistributedSampler "
                        "under torchrun) and feed its batches to engine(...)")
    if config_params is not None:
        if config is not None:
            raise ValueError("initialize: config and config_params are both given; pass one")
        config = config_params
    if config is None and args is not None:
        config = getattr(args, "deepspeed_config", None) or getattr(args, "deepscale_config", None)
    if model_parameters is not None:
        if param_groups is not None:
            raise ValueError("initialize: param_groups and model_parameters are both given; pass one")
        items = list(model_parameters)  # frozen parameters left out, in groups too, as DeepSpeed leaves them
        groups = items if items and all(isinstance(g, Mapping) for g in items) else [{"params": items}]
        param_groups = [{**g, "params": [p for p in g["params"] if p.requires_grad]} if "params" in g else g
                        for g in groups]
    if lr_scheduler is not None and (hasattr(lr_scheduler, "step") or not callable(lr_scheduler)):
        raise TypeError("initialize(lr_scheduler=...): a scheduler built on your own optimizer would not drive "
                        "this engine's; pass a callable, lr_scheduler=lambda opt: torch.optim.lr_scheduler."
                        "LambdaLR(opt, ...), which builds it on engine.optimizer")
    engine = Engine(model, config, param_groups=param_groups, _file_io=_file_io)
    if lr_scheduler is not None:
        if engine.lr_scheduler is not None:
            engine.close()
            raise ValueError("initialize: lr_scheduler is given and the config has a scheduler section; keep one")
        try:
            engine.lr_scheduler = lr_scheduler(engine.optimizer)
        except BaseException as exc:
            close_after_failure(engine.close, exc)
            raise
    return engine
