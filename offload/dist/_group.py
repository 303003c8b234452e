"""Process-group discovery: who am I among how many ranks, and who owns the torch.distributed group.

``join(timeout, device_spec)`` returns a :class:`ProcessGroup`, which carries the device this rank trains on: the
join is where the device is decided (:func:`offload._device.resolve_device`, from ``offload.device`` and this
process's local rank), made current (CUDA), and where the backend follows from it (NCCL for CUDA, gloo for the CPU):

* torch.distributed already initialized (by the user, or a launcher library): JOINED. The engine uses a group of
  its own made with ``new_group(timeout=..., backend=...)`` (so the configured timeout applies to its collectives,
  and its backend matches the device whatever the user's default group runs on) and never destroys the user's
  default group;
* not initialized, and torchrun's variables (``WORLD_SIZE`` > 1, ``RANK``, ``MASTER_ADDR``, ``MASTER_PORT``) in the
  environment: CREATED. The engine rendezvouses through ``env://`` (the TCP store at MASTER_ADDR:MASTER_PORT, which
  is all a multi-node run needs: no shared files), initializes the backend with the timeout, and destroys the
  group once it and every engine that joined it meanwhile are closed (a reference model's engine beside the
  policy's: destroying the default group destroys their subgroups too);
* otherwise: SINGLE, world size 1, no group at all. The engine runs the same code; collectives become copies or
  nothing (:mod:`._comm`).
"""

from __future__ import annotations

import datetime
import itertools
import os
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch
import torch.distributed as dist

from .._device import resolve_device

_store: Any = None  # the rendezvous store of torchrun's environment, kept for the process's life
_created = itertools.count()  # groups this process created, in the same order on every rank
_ours: Any = None  # the default group this process created, while it lives
_world_users = 0  # open engines on ``_ours``


class Origin(Enum):
    """Who initialized torch.distributed, which decides who tears it down."""

    SINGLE = "single"  # one process, no torch.distributed group
    JOINED = "joined"  # the user's (left alone at close)
    CREATED = "created"  # ours, from torchrun's environment (destroyed at close)


@dataclass
class ProcessGroup:
    """The ranks one engine trains with. ``group`` is None for SINGLE; ``store`` is the rendezvous key-value store
    (used for heartbeats; None when it cannot be had)."""

    origin: Origin
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    timeout: float = 1800.0
    backend: str = ""
    group: Any = None
    store: Any = None
    _closed: bool = field(default=False, repr=False)
    world: Any = field(default=None, repr=False)  # the default group of ours it counts in (``_ours``), or None

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def close(self) -> None:
        """Destroys what this object created: our subgroup (JOINED), and the whole group when the last engine on
        a default group we created closes."""
        global _ours, _world_users
        if self._closed:
            return
        self._closed = True
        try:
            if self.origin is Origin.JOINED and self.group is not None and dist.is_initialized():
                dist.destroy_process_group(self.group)
        finally:
            self.group = self.store = None
            if self.world is not None and self.world is _ours:  # (not one someone destroyed and made again)
                _world_users -= 1
                if _world_users == 0:
                    _ours = None
                    if dist.is_initialized() and dist.group.WORLD is self.world:
                        dist.destroy_process_group()
            # the last reference to a destroyed group: kept, its gloo threads lived into the interpreter's
            # shutdown, where one could abort the process (SIGABRT, "terminate called without an active exception")
            self.world = None


def release_store() -> None:
    """Drops the rendezvous store (at exit): its threads end while the interpreter can still join them."""
    global _store
    _store = None


def _missing(name: str) -> ValueError:
    return ValueError(f"environment variable {name} is not set, but WORLD_SIZE={os.environ['WORLD_SIZE']} says this "
                      "is one of several ranks; launch with torchrun (which sets RANK, LOCAL_RANK, MASTER_ADDR, "
                      "MASTER_PORT) or call torch.distributed.init_process_group before offload.initialize")


def _env_int(name: str, default: int | None = None) -> int:
    value = os.environ.get(name)
    if value is None:
        if default is None:
            raise _missing(name)
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from None


def _device_for(spec: str, local_rank: int, local_world_size: int) -> tuple[torch.device, str]:
    """This rank's device (made current when CUDA) and the backend that moves its tensors."""
    device = resolve_device(spec, local_rank=local_rank, local_world_size=local_world_size)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device, "nccl" if device.type == "cuda" else "gloo"


def join(timeout: float, device_spec: str = "auto") -> ProcessGroup:
    """The ranks to train with and this rank's device (see the module docstring). ``timeout``: seconds any
    collective may wait; ``device_spec``: the ``offload.device`` value."""
    global _store, _ours, _world_users
    delta = datetime.timedelta(seconds=timeout)
    if dist.is_available() and dist.is_initialized():
        world, rank = dist.get_world_size(), dist.get_rank()
        if world == 1:
            device, _ = _device_for(device_spec, _env_int("LOCAL_RANK", 0), 1)
            return ProcessGroup(Origin.SINGLE, device, timeout=timeout)
        if os.environ.get("LOCAL_RANK"):
            local_rank, local_world = _env_int("LOCAL_RANK"), _env_int("LOCAL_WORLD_SIZE", world)
            device, backend = _device_for(device_spec, local_rank, local_world)
        else:  # started without torchrun's variables: ranks fill each machine's GPUs in order
            gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
            local_rank = rank % gpus if gpus else rank
            device, backend = _device_for(device_spec, local_rank, min(world, gpus) if gpus else world)
            local_world = world  # how many ranks share this machine is unknown: budgets assume they all do
        group = dist.new_group(timeout=delta, backend=backend)
        store = None
        try:  # private, but the only handle on the user's store; without it failures cannot name the rank
            store = dist.distributed_c10d._get_default_store()
        except (AttributeError, RuntimeError, ValueError):
            pass
        ours = _ours if _ours is not None and dist.group.WORLD is _ours else None
        _world_users += ours is not None
        return ProcessGroup(Origin.JOINED, device, rank, world, local_rank, local_world, timeout, backend, group,
                            store, world=ours)
    if _env_int("WORLD_SIZE", 1) <= 1:
        device, _ = _device_for(device_spec, _env_int("LOCAL_RANK", 0), 1)
        return ProcessGroup(Origin.SINGLE, device, timeout=timeout)
    if not dist.is_available():
        raise RuntimeError("WORLD_SIZE > 1 but this torch build has no torch.distributed")
    world, rank = _env_int("WORLD_SIZE"), _env_int("RANK")
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        if not os.environ.get(name):
            raise _missing(name)
    local_rank, local_world = _env_int("LOCAL_RANK", 0), _env_int("LOCAL_WORLD_SIZE", world)
    device, backend = _device_for(device_spec, local_rank, local_world)
    if _store is None:  # once per process: rendezvous again on MASTER_PORT would race the old store's server
        _store, rank, world = next(dist.rendezvous("env://", rank, world, timeout=delta))
    # a fresh namespace per group: a later engine must not read the addresses an earlier group published
    store = dist.PrefixStore(f"offload/pg{next(_created)}", _store)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=delta)
    _ours, _world_users = dist.group.WORLD, 1
    return ProcessGroup(Origin.CREATED, device, rank, world, local_rank, local_world, timeout, backend,
                        dist.group.WORLD, store, world=_ours)
