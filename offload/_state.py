"""The engine's state contract: what code outside the engine (persistence, ``gathered``, the Trainer, the model's
own ``state_dict`` hooks) may read and write of a running engine, and the registry of open engines.

Persistence and the Trainer are written against :class:`EngineState`, never the engine's module: the engine imports
them (its ``save_checkpoint`` calls the save), so an import back would close a circle. ``tests/test_structure.py``
checks that no import circle exists and that persistence touches nothing of an engine outside this contract.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any, ContextManager, Protocol

import torch

if TYPE_CHECKING:
    from .dist import Comm
    from .memory import CopyStreams
    from .optim._layout import FlatLayout
    from .optim.offloaded import OffloadedAdam
    from ._precision import LossScaler


class WriteRefused(RuntimeError):
    """Trainable weights written once an accumulation window's updates have started: refused before any write
    (``refuse_writes_over_started_updates``, which every load of weights into an engine calls first)."""


class EngineState(Protocol):
    """An engine as persistence sees it. Sub-group state is read and written through the optimizer
    (``read_state``/``stage_state``/``done_state``), parameters through ``read_parameter``/``write_parameter``."""

    module: torch.nn.Module
    layout: "FlatLayout"
    comm: "Comm"
    optimizer: "OffloadedAdam"
    copies: "CopyStreams"
    scaler: "LossScaler"
    lr_scheduler: Any
    rank: int
    world_size: int
    device: torch.device
    dtype: torch.dtype
    @property
    def global_steps(self) -> int: ...

    @property
    def micro_steps(self) -> int: ...

    @property
    def gradient_accumulation_steps(self) -> int: ...

    def training_state(self) -> Any: ...

    def load_training_state(self, state: Any) -> None: ...

    def read_parameter(self, param: torch.nn.Parameter) -> torch.Tensor: ...

    def write_parameter(self, param: torch.nn.Parameter, value: torch.Tensor) -> None: ...

    def write_pending(self, index: int, device_value: torch.Tensor, master: torch.Tensor) -> None: ...

    def finish_fetches(self) -> None: ...

    def parameters_current(self) -> None: ...

    def refuse_writes_over_started_updates(self, what: str, trainable: bool) -> None: ...

    def gathered(self, params: Any = None) -> ContextManager[None]: ...

    def load_state_dict(self, state_dict: Any, strict: bool = True) -> Any: ...

    def consolidated_state_dict(self) -> dict[str, torch.Tensor]: ...


_open: "weakref.WeakSet[Any]" = weakref.WeakSet()


def opened(engine: EngineState) -> None:
    """Records an engine as open (its module's tensors are the engine's until ``closed``)."""
    _open.add(engine)


def closed(engine: EngineState) -> None:
    _open.discard(engine)


def is_open(engine: EngineState) -> bool:
    return engine in _open


def open_engines() -> list[Any]:
    return list(_open)


def holding(module: torch.nn.Module) -> Any:
    """The open engine that holds ``module``, if any."""
    return next((e for e in list(_open) if e.module is module), None)


def is_engine(obj: object) -> bool:
    """An offload Engine (checked by its contract's marker, without importing the engine)."""
    return getattr(type(obj), "_offload_engine", False) is True
