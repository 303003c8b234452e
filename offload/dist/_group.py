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

Before any group is made the ranks vote on the store every rank reaches first (the user's default store, or the
rendezvous store): each posts ``ok``, or the error that stopped its ``initialize`` (:func:`report_failed_start`),
under keys of that start, and each waits for every rank's word. A rank that failed before its group existed (a
config only it rejects) so makes the others fail at once with its own message, where they would otherwise have
waited in the rendezvous or in ``new_group`` until ``offload.comm_timeout`` (1800 s by default) and then said
only that a rank had not joined.
"""

from __future__ import annotations

import datetime
import itertools
import os
import time
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
_starts = itertools.count()  # starts of an engine in this process, in the same order on every rank: their vote keys
_FAILED = "failed "  # a vote's prefix of the error text of a rank that could not start
_HEARD_WAIT = 5.0  # seconds a rank that could not start waits for the others to read its word (its store may be
# the rendezvous server, which goes with its process)


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


def _torchrun_world() -> int:
    """The world size torchrun's environment gives (1: none)."""
    return _env_int("WORLD_SIZE", 1)


def _rendezvous_store(timeout: datetime.timedelta) -> Any:
    """The store behind torchrun's MASTER_ADDR:MASTER_PORT, connected once per process (a second rendezvous on
    MASTER_PORT would race the first store's server)."""
    global _store
    if _store is None:
        for name in ("MASTER_ADDR", "MASTER_PORT"):
            if not os.environ.get(name):
                raise _missing(name)
        _store, _, _ = next(dist.rendezvous("env://", _env_int("RANK"), _env_int("WORLD_SIZE"), timeout=timeout))
    return _store


def _default_store() -> Any:
    """The user's default group's store (private, but the only handle on it), or None."""
    try:
        return dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):
        return None


def _vote(store: Any, rank: int, world: int, word: str, timeout: float) -> None:
    """Posts this rank's ``word`` for this start and waits for every rank's; raises naming the ranks that could
    not start, with their own errors, or those that never answered within ``timeout``."""
    prefix = f"offload/start{next(_starts)}"
    store.set(f"{prefix}/{rank}", word)
    keys = [f"{prefix}/{r}" for r in range(world)]
    if word.startswith(_FAILED):
        _heard(store, prefix, world, keys)
        return
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout))
    except RuntimeError as exc:  # (DistStoreError is one) the wait timed out, or the store's host went
        missing = [r for r, k in enumerate(keys) if not _has(store, k)]
        raise RuntimeError(f"offload.initialize: rank(s) {missing or '?'} of {world} did not reach the start within "
                           f"offload.comm_timeout ({timeout:g} s): their processes died, hang, or are slower than "
                           f"that to get there (a long model load: raise comm_timeout). Store error: {exc}") from None
    words = {r: store.get(k).decode() for r, k in enumerate(keys)}
    store.add(f"{prefix}/heard", 1)
    failed = {r: w[len(_FAILED):] for r, w in words.items() if w.startswith(_FAILED)}
    if failed:
        raise RuntimeError("offload.initialize failed on " + "; ".join(
            f"rank {r}: {text}" for r, text in sorted(failed.items())) + f" (so it stops on rank {rank} too)")


def _has(store: Any, key: str) -> bool:
    try:
        return bool(store.check([key]))
    except RuntimeError:
        return False


def _word(store: Any, key: str) -> str:
    """A rank's word in a vote ("" before it gave one)."""
    return store.get(key).decode() if _has(store, key) else ""


def _heard(store: Any, prefix: str, world: int, keys: list[str]) -> None:
    """A rank that could not start waits, briefly, until every rank that did has read its word: the store may be
    this process's (rank 0 hosts the rendezvous server outside torchrun's agent), and goes with it. A rank still
    far from the start reads the word later, from a store that outlives this process under torchrun."""
    deadline = time.monotonic() + _HEARD_WAIT
    try:
        while time.monotonic() < deadline:
            failed = sum(_word(store, k).startswith(_FAILED) for k in keys)
            if store.add(f"{prefix}/heard", 0) >= world - failed:
                return
            time.sleep(0.05)
    except RuntimeError:  # the store went: nobody is left to tell
        return


def report_failed_start(exc: BaseException, timeout: float = 1800.0) -> None:
    """Tells the other ranks, through the start's vote, that this rank's ``initialize`` failed before its group
    was made, and why (their wait ends at once with this message). Nothing with one rank; a failure to reach the
    store is left to the error being raised."""
    delta = datetime.timedelta(seconds=timeout)
    try:
        if dist.is_available() and dist.is_initialized():
            world, rank, store = dist.get_world_size(), dist.get_rank(), _default_store()
        elif _torchrun_world() > 1 and dist.is_available():
            world, rank, store = _env_int("WORLD_SIZE"), _env_int("RANK"), _rendezvous_store(delta)
        else:
            return
        if world > 1 and store is not None:
            text = f"{type(exc).__name__}: {exc}".splitlines() or [type(exc).__name__]
            _vote(store, rank, world, _FAILED + " ".join(text)[:4000], timeout)
    except Exception:  # noqa: BLE001 - the error being raised is what this rank reports; the others time out
        pass


def join(timeout: float, device_spec: str = "auto") -> ProcessGroup:
    """The ranks to train with and this rank's device (see the module docstring). ``timeout``: seconds any
    collective may wait; ``device_spec``: the ``offload.device`` value."""
    global _ours, _world_users
    delta = datetime.timedelta(seconds=timeout)
    if dist.is_available() and dist.is_initialized():
        world, rank = dist.get_world_size(), dist.get_rank()
        if world == 1:
            device, _ = _device_for(device_spec, _env_int("LOCAL_RANK", 0), 1)
            return ProcessGroup(Origin.SINGLE, device, timeout=timeout)
        try:
            if os.environ.get("LOCAL_RANK"):
                local_rank, local_world = _env_int("LOCAL_RANK"), _env_int("LOCAL_WORLD_SIZE", world)
                device, backend = _device_for(device_spec, local_rank, local_world)
            else:  # started without torchrun's variables: ranks fill each machine's GPUs in order
                gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
                local_rank = rank % gpus if gpus else rank
                device, backend = _device_for(device_spec, local_rank, min(world, gpus) if gpus else world)
                local_world = world  # how many ranks share this machine is unknown: budgets assume they all do
        except BaseException as exc:
            report_failed_start(exc, timeout)
            raise
        store = _default_store()  # without it failures cannot name the rank
        if store is not None:
            _vote(store, rank, world, "ok", timeout)
        group = dist.new_group(timeout=delta, backend=backend)
        ours = _ours if _ours is not None and dist.group.WORLD is _ours else None
        _world_users += ours is not None
        return ProcessGroup(Origin.JOINED, device, rank, world, local_rank, local_world, timeout, backend, group,
                            store, world=ours)
    if _torchrun_world() <= 1:
        device, _ = _device_for(device_spec, _env_int("LOCAL_RANK", 0), 1)
        return ProcessGroup(Origin.SINGLE, device, timeout=timeout)
    if not dist.is_available():
        raise RuntimeError("WORLD_SIZE > 1 but this torch build has no torch.distributed")
    world, rank = _env_int("WORLD_SIZE"), _env_int("RANK")
    local_rank, local_world = _env_int("LOCAL_RANK", 0), _env_int("LOCAL_WORLD_SIZE", world)
    try:
        device, backend = _device_for(device_spec, local_rank, local_world)
    except BaseException as exc:
        report_failed_start(exc, timeout)
        raise
    _vote(_rendezvous_store(delta), rank, world, "ok", timeout)
    # a fresh namespace per group: a later engine must not read the addresses an earlier group published
    store = dist.PrefixStore(f"offload/pg{next(_created)}", _store)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=delta)
    _ours, _world_users = dist.group.WORLD, 1
    return ProcessGroup(Origin.CREATED, device, rank, world, local_rank, local_world, timeout, backend,
                        dist.group.WORLD, store, world=_ours)
