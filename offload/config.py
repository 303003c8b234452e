"""OffloadConfig: frozen dataclasses parsed from DeepSpeed-shaped JSON, validated when built.

Every value is checked where it is parsed, and an error names the full key (``zero_optimization.offload_optimizer.
buffer_count``), the value and what is allowed. Unknown keys are errors (with the closest known key suggested),
except a few DeepSpeed keys that only tune logging, which are accepted and listed in ``OffloadConfig.ignored``.
Defaults are ours and documented in docs/configuration.md where they differ from DeepSpeed's.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import logging
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from nvme_swapper import AioConfig

from ._device import check_spec

if TYPE_CHECKING:
    import torch

log = logging.getLogger("offload")

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
# DeepSpeed keys accepted without effect: logging and monitoring; knobs of DeepSpeed's own gradient averaging and
# checkpoint files (ours average exactly and always write whole fp32 weights); its activation-checkpointing API
_IGNORED = {"steps_per_print", "wall_clock_breakdown", "zero_allow_untested_optimizer", "dump_state",
            "memory_breakdown", "comms_logger", "flops_profiler", "tensorboard", "wandb", "csv_monitor",
            "prescale_gradients", "gradient_predivide_factor", "communication_data_type", "checkpoint",
            "activation_checkpointing", "zero_force_ds_cpu_optimizer"}
_IGNORED |= {"data_types", "compile"}  # the gradients accumulate in fp32 here; torch.compile the model yourself
# the same inside a section: in zero_optimization, the saving of 16-bit weights (every export here is the fp32
# masters, gathered) and knobs for what the engine does anyway (bf16's overflow check: a non-finite loss is always
# refused here, docs/configuration.md)
_IGNORED_IN = {"zero_optimization": {"stage3_gather_16bit_weights_on_model_save",
                                     "stage3_gather_fp16_weights_on_model_save", "memory_efficient_linear",
                                     "ignore_unused_parameters", "elastic_checkpoint", "load_from_fp32_weights",
                                     "module_granularity_threshold", "stage3_module_granularity_threshold",
                                     "use_multi_rank_bucket_allreduce",
                                     "log_trace_cache_warnings"},
               "zero_optimization.offload_optimizer": {"pipeline_read", "pipeline_write"},
               "bf16": {"immediate_grad_update", "check_grad_overflow"},
               "optimizer": {"torch_adam"}}
# DeepSpeed's switches for what is not built here: accepted at the values that leave it off (DeepSpeed's default
# first), refused at any other, naming what it would turn on
_OFF_ONLY: dict[str, dict[str, tuple[tuple[Any, ...], str]]] = {
    "": {"torch_autocast": ((False,), "torch.autocast around the forward is not built in: use bf16 or fp16")},
    "bf16": {"bf16_master_weights_and_grads": ((False,), "bf16 master weights: fp32 masters are always kept here")},
    "fp16": {"fp16_master_weights_and_grads": ((False,), "fp16 master weights: fp32 masters are always kept here")},
    "optimizer": {"amsgrad": ((False,), "AMSGrad is not built in, Adam and AdamW are")},
    "zero_optimization": {
        "zero_quantized_weights": ((False,), "ZeRO++ quantized communication is not built in"),
        "zero_quantized_gradients": ((False,), "ZeRO++ quantized communication is not built in"),
        "zero_quantized_nontrainable_weights": ((False,), "ZeRO++ quantized weights are not built in"),
        "zero_hpz_partition_size": ((1, 0), "ZeRO++ hierarchical partitioning is not built in"),
        "mics_shard_size": ((-1, 0), "MiCS sharding is not built in")},
    "zero_optimization.offload_optimizer": {
        "ratio": ((1.0,), "a partial optimizer offload is not built in: the whole optimizer state is offloaded")},
}


def _is_off(value: Any, offs: tuple[Any, ...]) -> bool:
    """Whether ``value`` leaves a switch of _OFF_ONLY off: its value, or a section's ``enabled``."""
    if isinstance(value, Mapping):
        value = value.get("enabled", False)
    return type(value) in (bool, int, float) and any(
        value == off and isinstance(value, bool) == isinstance(off, bool) for off in offs)


def is_auto(value: Any) -> bool:
    """DeepSpeed's ``"auto"`` (any case): a value filled in from elsewhere (the TrainingArguments, the plan)."""
    return isinstance(value, str) and value.lower() == "auto"


def without_auto(value: Any) -> Any:
    """JSON with every ``"auto"`` value left out (read as unset), for what needs a config before the Trainer
    fills it: offload.init, estimate."""
    if isinstance(value, Mapping):
        return {k: without_auto(v) for k, v in value.items() if not is_auto(v)}
    return value


def parse_bytes(value: Any, key: str) -> int:
    """An integer byte count from 1073741824, 1e9 or "1GiB" / "512 MB"; raises ValueError naming ``key``."""
    if isinstance(value, bool):
        raise ValueError(f"{key} must be a byte count, got {value!r}")
    if isinstance(value, (int, float)):
        if isinstance(value, float) and not math.isfinite(value) or value < 0 or value != int(value):
            raise ValueError(f"{key} must be a non-negative whole number of bytes, got {value!r}")
        return int(value)
    if isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([a-zA-Z]*)\s*", value)
        if m and m.group(2).lower() in _UNITS and math.isfinite(float(m.group(1))):
            return int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    raise ValueError(f"{key} must be a byte count such as 2147483648 or \"2GiB\" (units: B, KB, MB, GB, TB, KiB, "
                     f"MiB, GiB, TiB), got {value!r}")


class _Section:
    """Shared parsing: known keys only, typed values, errors that name the key."""

    _path = ""
    _aliases: dict[str, str] = {}
    _inert: frozenset[str] = frozenset()  # DeepSpeed's keys read and checked here, without effect: said when given

    @classmethod
    def from_dict(cls, d: Any, path: str | None = None):
        return cls(**cls._values(d, path if path is not None else cls._path))

    @classmethod
    def _values(cls, d: Any, path: str) -> dict[str, Any]:
        """The keys given in ``d``, checked and converted: keyword arguments of ``cls``."""
        if d is None:
            d = {}
        if not isinstance(d, Mapping):
            raise ValueError(f"{path or 'config'} must be a JSON object, got {type(d).__name__}")
        fields = {f.name: f for f in dataclasses.fields(cls)
                  if f.init and f.name not in ("ignored", "batch_keys", "optimizer_given")}
        values: dict[str, Any] = {}
        for key, value in d.items():
            name = cls._aliases.get(key, key)
            full = f"{path}.{key}" if path else key
            if name not in fields:
                if not path and key in _IGNORED:
                    values.setdefault("ignored", ())
                    values["ignored"] = (*values["ignored"], key)
                    continue
                if key in _IGNORED_IN.get(cls._path, ()):
                    log.warning("offload: config key accepted but without effect: %s", full)
                    continue
                if key in _OFF_ONLY.get(cls._path, {}):
                    offs, what = _OFF_ONLY[cls._path][key]
                    if not _is_off(value, offs):
                        allowed = ('"enabled": ' if isinstance(value, Mapping) else "") + " or ".join(
                            json.dumps(off) for off in offs)
                        raise ValueError(f"{full} = {json.dumps(value)} asks for what is not supported here: {what}; "
                                         f"only {allowed} is accepted (DeepSpeed's default, which leaves it off)")
                    continue
                hint = difflib.get_close_matches(key, list(fields) + list(cls._aliases), n=1)
                allowed = ", ".join(sorted(fields))
                raise ValueError(f"unknown key {full}" + (f" (did you mean {hint[0]!r}?)" if hint else "")
                                 + f"; allowed: {allowed}")
            values[name] = cls._convert(name, value, full)
            if name in cls._inert:
                log.warning("offload: config key accepted but without effect: %s", full)
        return values

    @classmethod
    def _convert(cls, name: str, value: Any, full: str) -> Any:
        return value


def _typed_section(cls: type[_Section], d: Any, path: str, types: tuple[str, ...], required: bool
                   ) -> tuple[str | None, dict[str, Any]]:
    """DeepSpeed's ``{"type": ..., "params": {...}}`` shape: the checked type (lower case; None if absent and not
    ``required``) and the parsed params as keyword arguments of ``cls``."""
    if not isinstance(d, Mapping):
        raise ValueError(f"{path} must be a JSON object, got {type(d).__name__}")
    extra = set(d) - {"type", "params"}
    if extra:
        raise ValueError(f"unknown key {path}.{sorted(extra)[0]}; allowed: params, type")
    if required and "type" not in d:
        raise ValueError(f"{path}.type is required: one of {', '.join(types)}")
    kind = _choice(f"{path}.type", d["type"], types) if "type" in d else None
    return kind, cls._values(d.get("params"), f"{path}.params")


def _check_type(full: str, value: Any, kind: type | tuple[type, ...], what: str) -> None:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if (isinstance(value, bool) and bool not in kinds) or not isinstance(value, kinds):
        if is_auto(value):
            raise ValueError(f"{full} must be {what}, got {value!r}: \"auto\" is filled in from the "
                             "TrainingArguments by OffloadTrainer (offload.integrations.transformers); with "
                             "offload.initialize give the value, or leave the key out for its default")
        raise ValueError(f"{full} must be {what}, got {value!r}")


def _int(full: str, value: Any, lo: int, hi: int | None = None) -> int:
    if isinstance(value, float) and value.is_integer():
        value = int(value)  # JSON writers turn 1e9 into a float
    _check_type(full, value, int, "an integer")
    if value < lo or (hi is not None and value > hi):
        raise ValueError(f"{full} must be in [{lo}, {hi if hi is not None else 'inf'}], got {value}")
    return value


def _float(full: str, value: Any, lo: float, hi: float | None = None, *, open_lo: bool = False) -> float:
    _check_type(full, value, (int, float), "a number")
    value = float(value)
    if not math.isfinite(value) or value < lo or (open_lo and value == lo) or (hi is not None and value > hi):
        bounds = f"{'(' if open_lo else '['}{lo}, {hi if hi is not None else 'inf'}]"
        raise ValueError(f"{full} must be in {bounds}, got {value}")
    return value


def _bool(full: str, value: Any) -> bool:
    _check_type(full, value, bool, "true or false")
    return value


def _choice(full: str, value: Any, allowed: tuple[str, ...]) -> str:
    if not isinstance(value, str) or value.lower() not in allowed:
        raise ValueError(f"{full} must be one of {', '.join(allowed)}; got {value!r}")
    return value.lower()


@dataclass(frozen=True)
class OptimizerConfig(_Section):
    """``optimizer``: Adam or AdamW on the CPU (CPUAdam), with DeepSpeed's parameter names."""

    _path = "optimizer"
    type: str = "adamw"
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    bias_correction: bool = True
    adam_w_mode: bool = True  # DeepSpeed's switch, read as DeepSpeed reads it: false makes type "Adam" add L2

    @property
    def adamw_mode(self) -> bool:
        """Decoupled weight decay: DeepSpeed's "Adam" is AdamW unless ``adam_w_mode`` is false; "AdamW" always."""
        return self.type == "adamw" or self.adam_w_mode

    @classmethod
    def from_dict(cls, d: Any, path: str | None = None) -> "OptimizerConfig":
        if d is None:
            return cls()
        kind, params = _typed_section(cls, d, path or cls._path, ("adam", "adamw", "cpuadam"), required=False)
        if kind is not None:
            params["type"] = "adamw" if kind == "cpuadam" else kind
        return cls(**params)

    @classmethod
    def _convert(cls, name: str, value: Any, full: str) -> Any:
        if name == "lr":
            return _float(full, value, 0.0)
        if name == "eps":
            return _float(full, value, 0.0, open_lo=True)
        if name == "weight_decay":
            return _float(full, value, 0.0)
        if name == "betas":
            if not isinstance(value, (list, tuple)) or len(value) != 2:
                raise ValueError(f"{full} must be a list of two numbers in [0, 1), got {value!r}")
            b = tuple(_float(f"{full}[{i}]", v, 0.0, 1.0) for i, v in enumerate(value))
            if any(x >= 1.0 for x in b):
                raise ValueError(f"{full} must be a list of two numbers in [0, 1), got {value!r}")
            return b
        if name in ("bias_correction", "adam_w_mode"):
            return _bool(full, value)
        if name == "type":
            return _choice(full, value, ("adam", "adamw"))
        return value


_SCHEDULERS = ("warmuplr", "warmupdecaylr", "warmupcosinelr")
# each type's params, as DeepSpeed's constructors take them
_SCHEDULER_PARAMS = {"warmuplr": ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type"),
                     "warmupdecaylr": ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type",
                                       "total_num_steps"),
                     "warmupcosinelr": ("warmup_min_ratio", "warmup_num_steps", "cos_min_ratio", "warmup_type",
                                        "total_num_steps")}
_CLIENT_SCHEDULER = ("a torch scheduler on engine.optimizer, stepped after engine.step() when "
                     "engine.was_step_applied(), its state_dict() saved in client_state (docs/getting-started.md, "
                     "section 7)")


@dataclass(frozen=True)
class SchedulerConfig(_Section):
    """``scheduler``: DeepSpeed's WarmupLR / WarmupDecayLR / WarmupCosineLR, stepped by ``engine.step()`` after
    every update (see offload/optim/_schedule.py for the formulas). ``type`` None: no scheduler, the optimizer's lr
    stays."""

    _path = "scheduler"
    type: str | None = None
    warmup_min_lr: float = 0.0
    warmup_max_lr: float | None = None  # None: each param group's lr (WarmupLR, DeepSpeed >= 0.17.2); 1e-3 (decay)
    warmup_num_steps: int = 1000
    warmup_type: str = "log"
    total_num_steps: int | None = None  # WarmupDecayLR / WarmupCosineLR: where the decay ends
    warmup_min_ratio: float = 0.0  # WarmupCosineLR: the share of each group's lr the warm-up starts from
    cos_min_ratio: float = 0.0001  # WarmupCosineLR: the share it ends at

    @classmethod
    def from_dict(cls, d: Any, path: str | None = None) -> "SchedulerConfig":
        if d is None:
            return cls()
        path = path or cls._path
        if isinstance(d, Mapping) and isinstance(d.get("type"), str) and d["type"].lower() in ("onecycle",
                                                                                               "lrrangetest"):
            raise ValueError(f"{path}.type {d['type']!r} is not built in here (built in: WarmupLR, WarmupDecayLR, "
                             f"WarmupCosineLR); for it use {_CLIENT_SCHEDULER}")
        kind, params = _typed_section(cls, d, path, _SCHEDULERS, required=True)
        allowed = _SCHEDULER_PARAMS[kind]
        for name in params:
            if name not in allowed:
                raise ValueError(f"{path}.params.{name} does not apply to {kind} (DeepSpeed's {kind} takes "
                                 f"{', '.join(allowed)})")
        return cls(**{**params, "type": kind})

    @classmethod
    def _convert(cls, name: str, value: Any, full: str) -> Any:
        if name == "warmup_min_lr":
            return _float(full, value, 0.0)
        if name == "warmup_max_lr":
            return None if value is None else _float(full, value, 0.0)
        if name in ("warmup_min_ratio", "cos_min_ratio"):
            return _float(full, value, 0.0, 1.0)
        if name == "warmup_num_steps":
            return _int(full, value, 0)  # (0 and 1 count as 2, as DeepSpeed's max(2, n); 0.19 refuses 0)
        if name == "total_num_steps":
            return None if value is None else _int(full, value, 1)
        if name == "warmup_type":
            return _choice(full, value, ("log", "linear"))
        if name == "type":
            raise ValueError(f"{full} belongs beside params: {{\"type\": ..., \"params\": {{...}}}}")
        return value

    def __post_init__(self) -> None:
        if self.type in ("warmupdecaylr", "warmupcosinelr") and self.total_num_steps is None:
            name = {"warmupdecaylr": "WarmupDecayLR", "warmupcosinelr": "WarmupCosineLR"}[self.type]
            raise ValueError(f"scheduler.params.total_num_steps is required for {name}")


@dataclass(frozen=True)
class FP16Config(_Section):
    """``fp16``: dynamic loss scaling with DeepSpeed's keys (loss_scale 0 means dynamic)."""

    _path = "fp16"
    enabled: bool = False
    loss_scale: float = 0.0
    initial_scale_power: int = 16
    loss_scale_window: int = 1000
    hysteresis: int = 2
    consecutive_hysteresis: bool = False
    min_loss_scale: float = 1.0
    auto_cast: bool = False

    @classmethod
    def _convert(cls, name: str, value: Any, full: str) -> Any:
        if name in ("enabled", "consecutive_hysteresis", "auto_cast"):
            return _bool(full, value)
        if name == "loss_scale":
            return _float(full, value, 0.0)
        if name == "initial_scale_power":
            return _int(full, value, 0, 64)
        if name in ("loss_scale_window", "hysteresis"):
            return _int(full, value, 1)
        if name == "min_loss_scale":
            return _float(full, value, 0.0, open_lo=True)
        return value


@dataclass(frozen=True)
class BF16Config(_Section):
    _path = "bf16"
    enabled: bool = False

    @classmethod
    def _convert(cls, name: str, value: Any, full: str) -> Any:
        return _bool(full, value)


_DEVICES = ("none", "cpu", "nvme")


@dataclass(frozen=True)
class _OffloadTarget(_Section):
    """What the two offload sections share: ``device``, ``nvme_path`` (required for nvme) and ``pin_memory``."""

    device: str = "none"
    nvme_path: str | None = None
    pin_memory: bool = True

    @classmethod
    def _convert(cls, name: str, value: Any, full: str) -> Any:
        if name == "device":
            return _choice(full, value, _DEVICES)
        if name == "nvme_path":
            _check_type(full, value, str, "a directory path")
            if "\x00" in value:
                raise ValueError(f"{full} must be a directory path without NUL characters, got {value!r}")
            return value
        if name == "pin_memory":
            return _bool(full, value)
        return cls._convert_own(name, value, full)

    @classmethod
    def _convert_own(cls, name: str, value: Any, full: str) -> Any:
        raise NotImplementedError

    def __post_init__(self) -> None:
        if self.device == "nvme" and not self.nvme_path:
            raise ValueError(f"{self._path}.nvme_path is required when {self._path}.device is \"nvme\"")


@dataclass(frozen=True)
class OffloadOptimizerConfig(_OffloadTarget):
    """``zero_optimization.offload_optimizer``: where fp32 master weights and Adam moments live."""

    _path = "zero_optimization.offload_optimizer"
    _inert = frozenset({"fast_init"})
    buffer_count: int | None = None  # None or "auto": derived by the plan (offload/plan.py)
    fast_init: bool = False
    delayed_update: bool = False
    overlap_step: bool = True  # update sub-groups during backward where the semantics allow (ours)
    overlap_forward: bool = False  # step() returns before its last updates; the next forward waits per module (ours)

    @classmethod
    def _convert_own(cls, name: str, value: Any, full: str) -> Any:
        if name == "buffer_count":
            return _derived_int(full, value, 1, 64)
        return _bool(full, value)


@dataclass(frozen=True)
class OffloadParamConfig(_OffloadTarget):
    """``zero_optimization.offload_param``: where low-precision parameters live between uses (stage 3)."""

    _path = "zero_optimization.offload_param"
    _inert = frozenset({"pin_memory", "buffer_count", "buffer_size", "max_in_cpu"})  # the engine sizes its own
    buffer_count: int = 5
    buffer_size: int = 100_000_000
    max_in_cpu: int = 1_000_000_000

    @classmethod
    def _convert_own(cls, name: str, value: Any, full: str) -> Any:
        if name == "buffer_count":
            return _int(full, value, 1, 1024)
        return _int(full, value, 1)


_DERIVED = ("sub_group_size", "stage3_max_live_parameters", "stage3_prefetch_bucket_size", "reduce_bucket_size")


def _derived_int(full: str, value: Any, lo: int, hi: int | None = None) -> int | None:
    """A size the plan derives when unset: ``"auto"`` (DeepSpeed configs written for transformers use it) and null
    mean unset; anything else must be an integer in range."""
    if value is None or is_auto(value):
        return None
    return _int(full, value, lo, hi)


@dataclass(frozen=True)
class ZeroConfig(_Section):
    """``zero_optimization``. The sizes left unset (or "auto") are derived at initialize from the budgets and the
    model (offload/plan.py): sub_group_size, offload_optimizer.buffer_count, stage3_max_live_parameters,
    stage3_prefetch_bucket_size and reduce_bucket_size."""

    _path = "zero_optimization"
    _inert = frozenset({"stage3_max_reuse_distance", "contiguous_gradients", "reduce_scatter", "allgather_bucket_size",
                        "allgather_partitions", "round_robin_gradients"})
    stage: int = 0
    sub_group_size: int | None = None  # None or "auto": derived from the budgets and the model (offload/plan.py)
    offload_optimizer: OffloadOptimizerConfig = field(default_factory=OffloadOptimizerConfig)
    offload_param: OffloadParamConfig = field(default_factory=OffloadParamConfig)
    stage3_max_live_parameters: int | None = None  # derived: half of the device budget (offload/plan.py)
    stage3_prefetch_bucket_size: int | None = None  # derived: the window
    stage3_param_persistence_threshold: int | None = None  # derived: 1e5, lower when the device budget is small
    stage3_max_reuse_distance: int = 1_000_000_000
    # DeepSpeed's communication tuning knobs: accepted, used where the partitioned engine has the same notion
    contiguous_gradients: bool = True
    overlap_comm: bool = True
    reduce_scatter: bool = True
    reduce_bucket_size: int | None = None  # elements per gradient copy to the host; None: the plan's (offload/plan.py)
    allgather_bucket_size: int = 500_000_000
    allgather_partitions: bool = True
    round_robin_gradients: bool = False

    # DeepSpeed's old spellings (before the offload sections), read as the sections they became
    _LEGACY = {"cpu_offload": ("offload_optimizer", "device"), "cpu_offload_param": ("offload_param", "device"),
               "cpu_offload_params": ("offload_param", "device"),
               "cpu_offload_use_pin_memory": ("offload_optimizer", "pin_memory")}

    @classmethod
    def from_dict(cls, d: Any, path: str | None = None) -> "ZeroConfig":
        path = path if path is not None else cls._path
        if isinstance(d, Mapping) and any(k in d for k in cls._LEGACY):
            d = dict(d)
            for old, (section, key) in cls._LEGACY.items():
                if old not in d:
                    continue
                value = _bool(f"{path}.{old}", d.pop(old))
                given = d.get(section)
                if isinstance(given, Mapping) and key in given:
                    raise ValueError(f"{path}.{old} (DeepSpeed's old spelling) and {path}.{section}.{key} are both "
                                     f"given; keep {path}.{section}")
                if key == "device" and not value:
                    continue
                d[section] = {**(given or {}), key: "cpu" if key == "device" else value}
                log.warning("offload: %s.%s is DeepSpeed's old spelling of %s.%s; read as %s", path, old, path,
                            section, json.dumps({key: d[section][key]}))
        return cls(**cls._values(d, path))

    @classmethod
    def _convert(cls, name: str, value: Any, full: str) -> Any:
        if name == "stage":
            return _int(full, value, 0, 3)
        if name == "offload_optimizer":
            return OffloadOptimizerConfig.from_dict(value, full)
        if name == "offload_param":
            return OffloadParamConfig.from_dict(value, full)
        if name in ("contiguous_gradients", "overlap_comm", "reduce_scatter", "allgather_partitions",
                    "round_robin_gradients"):
            return _bool(full, value)
        if name == "stage3_param_persistence_threshold":
            return _derived_int(full, value, 0)
        if name in _DERIVED:
            return _derived_int(full, value, 1)
        return _int(full, value, 1)

    def __post_init__(self) -> None:
        if self.offload_param.device != "none" and self.stage != 3:
            raise ValueError(f"zero_optimization.offload_param needs zero_optimization.stage 3 (parameter "
                             f"partitioning), got stage {self.stage}")


@dataclass(frozen=True)
class BudgetConfig(_Section):
    """``offload``: explicit per-tier byte budgets (what DeepSpeed lacks). On a machine without CUDA, the device
    tier is CPU memory held to device_memory_budget, so a CPU-only run behaves like a small GPU."""

    _path = "offload"
    device: str = "auto"  # "auto" (cuda:LOCAL_RANK when CUDA is there, else cpu), "cpu", "cuda" or "cuda:N"
    device_memory_budget: int | None = None  # None: the CUDA device's total memory; unlimited on CPU
    host_memory_budget: int | None = None  # None: 90% of the memory available at initialize
    nvme_memory_budget: int | None = None  # None: the free space of the nvme_path filesystem, less 5%
    comm_timeout: float = 1800.0  # seconds a collective waits for the other ranks before failing (torch's default)
    trim_host_heap: bool | None = None  # None or "auto": on when the device is the CPU (offload/memory/_heap.py)

    @classmethod
    def _convert(cls, name: str, value: Any, full: str) -> Any:
        if name == "comm_timeout":
            return _float(full, value, 0.0, open_lo=True)
        if name == "trim_host_heap":
            if value is None or is_auto(value):
                return None
            if not isinstance(value, bool):
                raise ValueError(f"{full} must be true, false or \"auto\", got {value!r}")
            return value
        if name == "device":
            return check_spec(value, full)
        return None if value is None else parse_bytes(value, full)


@dataclass(frozen=True)
class OffloadConfig(_Section):
    """The whole configuration. Build with :meth:`load` from a dict, a JSON path, or an existing OffloadConfig."""

    train_micro_batch_size_per_gpu: int = 1
    gradient_accumulation_steps: int = 1
    train_batch_size: int | None = None
    gradient_clipping: float = 0.0
    # nn.Embedding gradients sent as rows where cheaper (stages 0-2, several ranks); "lazy" also leaves the rows a
    # step did not touch as they are (lazy Adam)
    sparse_gradients: bool | str = False
    fp16: FP16Config = field(default_factory=FP16Config)
    bf16: BF16Config = field(default_factory=BF16Config)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    zero_optimization: ZeroConfig = field(default_factory=ZeroConfig)
    aio: AioConfig = field(default_factory=AioConfig)
    offload: BudgetConfig = field(default_factory=BudgetConfig)
    seed: int | None = None
    ignored: tuple[str, ...] = ()
    # which of the three batch keys the JSON gave: initialize derives the others as DeepSpeed does (for_world)
    batch_keys: frozenset[str] = field(default=frozenset(), compare=False, repr=False)
    # False: JSON without an optimizer section (the engine says that the defaults train; a DeepSpeed script's
    # optimizer passed to initialize has no counterpart here)
    optimizer_given: bool = field(default=True, compare=False, repr=False)

    _aliases = {"bfloat16": "bf16"}
    _BATCH = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")

    @classmethod
    def from_dict(cls, d: Any, path: str | None = None) -> "OffloadConfig":
        values = cls._values(d, path if path is not None else cls._path)
        if values.get("ignored"):  # said once, where the JSON is read (not again for each copy made of it)
            log.warning("offload: config keys accepted but without effect: %s", ", ".join(values["ignored"]))
        return cls(**values, batch_keys=frozenset(k for k in cls._BATCH if values.get(k) is not None),
                   optimizer_given="optimizer" in values)

    def _given_batch(self) -> frozenset[str]:
        """The batch keys the user set: the JSON's, or (a config built in Python) those away from their defaults."""
        if self.batch_keys:
            return self.batch_keys
        return frozenset(k for k, default in zip(self._BATCH, (None, 1, 1)) if getattr(self, k) != default)

    def for_world(self, world_size: int) -> "OffloadConfig":
        """The batch keys completed for ``world_size`` ranks as DeepSpeed completes them: train_batch_size =
        train_micro_batch_size_per_gpu x gradient_accumulation_steps x world size, any two giving the third (only
        train_batch_size: one micro-batch of train_batch_size / world size per step); all three must agree."""
        tbs, given = self.train_batch_size, self._given_batch()
        mbs, gas = self.train_micro_batch_size_per_gpu, self.gradient_accumulation_steps
        if tbs is None:
            return self
        if "gradient_accumulation_steps" not in given and "train_micro_batch_size_per_gpu" in given:
            gas = tbs // (mbs * world_size) if tbs % (mbs * world_size) == 0 else 0
        if "train_micro_batch_size_per_gpu" not in given:
            mbs = tbs // (gas * world_size) if tbs % (gas * world_size) == 0 else 0
        if not gas or not mbs or tbs != mbs * gas * world_size:
            raise ValueError(
                f"train_batch_size {tbs} must equal train_micro_batch_size_per_gpu x gradient_accumulation_steps x "
                f"the world size ({world_size}); given: " +
                ", ".join(f"{k} {getattr(self, k)}" for k in self._BATCH if k in given) +
                ". Set two of them (DeepSpeed derives the third) or make the three agree")
        return dataclasses.replace(self, train_micro_batch_size_per_gpu=mbs, gradient_accumulation_steps=gas)

    @classmethod
    def _convert(cls, name: str, value: Any, full: str) -> Any:
        if name in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
            return _int(full, value, 1)
        if name == "train_batch_size":
            return None if value is None else _int(full, value, 1)
        if name == "seed":
            return None if value is None else _int(full, value, 0)
        if name == "gradient_clipping":
            return _float(full, value, 0.0)
        if name == "sparse_gradients":
            if isinstance(value, str) and value.lower() == "lazy":
                return "lazy"
            _check_type(full, value, bool, 'true, false or "lazy"')
            return value
        if name == "fp16":
            return FP16Config.from_dict(value, full)
        if name == "bf16":
            return BF16Config.from_dict(value, full)
        if name == "optimizer":
            return OptimizerConfig.from_dict(value, full)
        if name == "scheduler":
            return SchedulerConfig.from_dict(value, full)
        if name == "zero_optimization":
            return ZeroConfig.from_dict(value, full)
        if name == "aio":
            return AioConfig.from_dict(value, prefix=full)
        if name == "offload":
            return BudgetConfig.from_dict(value, full)
        return value

    def __post_init__(self) -> None:
        if self.fp16.enabled and self.bf16.enabled:
            raise ValueError("fp16.enabled and bf16.enabled are both true; choose one")

    @property
    def dtype(self) -> "torch.dtype":
        import torch

        return torch.float16 if self.fp16.enabled else torch.bfloat16 if self.bf16.enabled else torch.float32

    @classmethod
    def load(cls, config: "OffloadConfig | Mapping[str, Any] | str | os.PathLike[str] | None") -> "OffloadConfig":
        if config is None:
            return cls()
        if isinstance(config, OffloadConfig):
            return config
        if isinstance(config, (str, os.PathLike)):
            config = read_json(config)
        return cls.from_dict(config)

    def to_dict(self) -> dict[str, Any]:
        """The configuration as DeepSpeed-shaped JSON values (for checkpoints and logs); ``load`` reads it back to
        an equal OffloadConfig. Unset optional values are left out."""
        out = _plain(self)
        opt = out["optimizer"]
        out["optimizer"] = {"type": opt.pop("type"), "params": opt}
        sched = out.pop("scheduler")
        if "type" in sched:
            kind = sched.pop("type")
            out["scheduler"] = {"type": kind, "params": {k: v for k, v in sched.items()
                                                         if k in _SCHEDULER_PARAMS[kind]}}
        out.update(dict.fromkeys(out.pop("ignored"), None))
        out.pop("batch_keys")
        out.pop("optimizer_given")
        zero = out["zero_optimization"]
        for section, kind in ((zero, ZeroConfig), (zero["offload_optimizer"], OffloadOptimizerConfig),
                              (zero["offload_param"], OffloadParamConfig)):
            defaults = {f.name: f.default for f in dataclasses.fields(kind)}
            for key in kind._inert & set(section):  # at their defaults: left out, as loading them again says so
                if section[key] == defaults[key]:
                    del section[key]
        given = self._given_batch()  # the others are derived at initialize: written, they would count as set
        for key in self._BATCH:
            if key not in given:
                out.pop(key, None)
        return out


def read_json(path: str | os.PathLike[str]) -> Any:
    """A config file's JSON, with errors that name the file."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ValueError(f"cannot read config file {path}: {exc.strerror}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"config file {path} is not valid JSON: {exc}") from None


def flat_fields(section: Any, prefix: str = "") -> dict[str, Any]:
    """Every leaf setting of a config (a frozen dataclass, sections included) by its dotted name."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        if dataclasses.is_dataclass(value):
            out.update(flat_fields(value, f"{prefix}{f.name}."))
        else:
            out[prefix + f.name] = value
    return out


def _plain(section: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        if dataclasses.is_dataclass(value):
            value = _plain(value)
        elif isinstance(value, tuple):
            value = list(value)
        if value is not None:
            out[f.name] = value
    return out
