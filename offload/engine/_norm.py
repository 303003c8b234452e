"""Finiteness and the gradient norm: a loss refused before its backward can train NaN into the optimizer state
(:func:`check_loss`), and the global L2 norm of a step's gradients (:class:`GradNorm`, ``engine.last_grad_norm``).

The norm is known two ways. Where fp16's overflow check or clipping needs it before any update (and for a delayed
update on several ranks), :meth:`GradNorm.measure` reads this rank's whole gradient buffers and sums the squares
over ranks. Otherwise the CPU Adam kernel squares each gradient as it updates, and the norm is taken from those
sums when it is read (:meth:`GradNorm.read`), so a step never waits for it; with several ranks the updates end
inside the step, and the sums are all-reduced there, on every rank.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from ..dist import Comm
from ..ops import squared_norm
from ..optim.offloaded import OffloadedAdam


def _squares(g: torch.Tensor) -> float:
    """The sum of the squares of a gradient buffer: on the host in one native read of it (torch's norm would first
    widen a bf16 buffer into an fp32 copy); on a GPU torch's norm, which widens as it reads."""
    if g.device.type == "cpu":
        return squared_norm(g)
    n = torch.linalg.vector_norm(g, dtype=torch.float32).item()
    if math.isinf(n) and bool(torch.isfinite(g).all()):  # the squares overflowed, not the gradients
        n = torch.linalg.vector_norm(g, dtype=torch.float64).item()
    return n * n


def check_loss(loss: torch.Tensor, comm: Comm, world_size: int, *, fp16: bool, per_param: bool, at: str,
               offloaded: bool) -> None:
    """bf16/fp32: a non-finite loss would make every gradient NaN and Adam would write NaN into the masters and
    moments; refused (FloatingPointError) before its backward runs, so nothing changes (fp16 leaves it to the loss
    scaler, which skips the step). With several ranks every rank refuses together (a MIN over ranks), so none is
    left in a backward's collectives alone. Costs one host wait for the forward's result before backward is
    launched. Stage 3 on several ranks (fp16 too): the same all-reduce compares the parameters each rank used,
    gathered and reduced since the last backward (``Comm.trace``), as ranks that ran different modules of the same
    shapes computed with each other's pieces of different parameters, without any error. ``at``: the micro-batch
    and step, for the errors; ``offloaded``: parameter offload is on (a cause the error names)."""
    traced = world_size > 1 and per_param
    if fp16 and not traced:
        return
    if not traced:
        flag = torch.isfinite(loss.detach()).reshape(1).to(comm.pg.device, torch.int32)
        if world_size > 1:
            comm.all_reduce(flag, op=torch.distributed.ReduceOp.MIN)
        finite = int(flag.item())
    else:
        (finite,), same = comm.min_and_trace([1 if fp16 else int(bool(torch.isfinite(loss.detach())))])
        if not same:
            raise RuntimeError(
                f"engine.backward at {at}: the ranks "
                "used different parameters since the last backward (stage 3 on several ranks: a module "
                "run on some ranks only, such as an MoE expert the router chose on one rank, or a branch taken "
                "on one), so each computed with another parameter's pieces; this backward was not run and "
                "nothing changed. Under stage 3 every rank must run the same modules in the same order: call "
                "each expert on every rank, in one order (an empty batch will do), or train with stage 1 or 2")
    if finite:
        return
    value = loss.item()
    where = f"the loss is {value}" if not math.isfinite(value) else \
        "the loss is finite here but not on another rank"
    cause = (" With parameters offloaded, a parameter read outside any forward of the model (or, in a later "
             "forward, on a path the first forwards did not take) holds NaN there (released, it is a "
             "placeholder): run that code inside `with engine.gathered(param):`, or declare the read with "
             "engine.register_external_parameter(module, param) for the module whose forward makes it.") \
        if offloaded else ""
    raise FloatingPointError(
        f"{where} at {at}: its backward would train NaN into "
        "the optimizer state, so it was not run and nothing changed (earlier micro-batches of the window keep "
        "their gradients: catch the error to skip this batch, on every rank; a step() after it counts the "
        "batch, with no gradient, as DeepSpeed counts micro-batches by step()). Check the data (a batch whose "
        "labels are all ignored gives 0/0) and the learning rate." + cause)


class GradNorm:
    """The last step's gradient norm, the same on every rank: owns its value once known (a tensor while it is on
    the GPU, a float once read) and the step whose updates are still summing it."""

    def __init__(self, optimizer: OffloadedAdam, comm: Comm, world_size: int) -> None:
        self._optimizer, self._comm, self._world_size = optimizer, comm, world_size
        self._value: float | torch.Tensor | None = None  # the norm once known (a tensor: on the GPU)
        self._step: int | None = None  # a step whose norm its updates (still running) are summing

    @property
    def pending(self) -> bool:
        """A step's updates are summing the norm: :meth:`take` reads it (every rank, on several)."""
        return self._step is not None

    def new_step(self) -> None:
        """A step begins: the previous one's sums are no longer read."""
        self._step = None

    def set(self, value: float) -> None:
        """The norm is ``value`` (measured before the updates, or DeepSpeed's inf for an overflowed fp16 step)."""
        self._step, self._value = None, value

    def summed_by(self, step: int) -> None:
        """The updates of optimizer step ``step`` sum the norm as they run."""
        self._step, self._value = step, None

    def forget(self) -> None:
        """A load: the norm of a step the checkpoint does not hold."""
        self._step = self._value = None

    def measure(self) -> float:
        """The global norm (of the gradients as scaled): of this rank's share here, summed in squares over ranks
        (the same on every rank, so all skip an overflowing fp16 step together)."""
        whole = self._optimizer.grads.whole
        assert whole is not None, "the gradient norm needs every gradient: the plan holds them whole"
        return math.sqrt(self._comm.sum_float(math.fsum(_squares(g) for g in whole)))

    def take(self) -> None:
        """The norm of the pending step from what its updates summed, all-reduced over ranks (every rank is here:
        at the end of a step whose updates ran inside it); None if some update of it never ran. One rank takes it
        when it is read, so a step never waits for the device for it."""
        squares = self._optimizer.grad_squares(self._step)
        if isinstance(squares, torch.Tensor):  # on the GPU: all-reduced and rooted there, read on demand
            if self._world_size > 1:
                squares = squares.reshape(1)
                self._comm.all_reduce(squares)
            self._value = squares.reshape(()).sqrt()
        else:
            if self._world_size > 1:
                assert squares is not None, "with several ranks a step's updates end inside it"
                squares = self._comm.sum_float(squares)
            self._value = None if squares is None else math.sqrt(squares)
        self._step = None  # last: a read cut short (an interrupt in the all-reduce) takes it again

    def read(self, finish_updates: Callable[[], None] | None) -> float | None:
        """The norm as a float, taken first if its updates summed it: ``finish_updates`` waits for them where they
        may still run (None: a failed or closed engine, whose updates may never end, reads what they summed)."""
        if self._step is not None:
            if finish_updates is not None and not self._optimizer.squares_ready(self._step):
                finish_updates()
            self.take()
        if isinstance(self._value, torch.Tensor):  # the state is on the GPU: read it now, once
            self._value = float(self._value)
        return self._value
