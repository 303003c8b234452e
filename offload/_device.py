"""The one place the training device is decided, from ``offload.device``: "auto", "cpu", "cuda" or "cuda:N".

"auto" is ``cuda:LOCAL_RANK`` when CUDA is available (cuda:0 when the launcher made one GPU visible to each
process) and the CPU otherwise (the DEVICE tier is then CPU memory held to ``offload.device_memory_budget``);
"cuda" insists on CUDA. The process-group join (:func:`offload.dist.join`)
calls :func:`resolve_device` once per engine, makes the device current and picks the backend from it (NCCL for
CUDA, gloo for the CPU); every layer then reads ``Plan.device``. Nothing else asks ``torch.cuda.is_available()``
to decide where a tensor goes. Tests and scripts that want "the device this machine trains on" call
:func:`default_device`.
"""

from __future__ import annotations

import os
import re

import torch

_SPEC = re.compile(r"auto|cpu|cuda(:\d+)?")


def check_spec(value: object, key: str = "offload.device") -> str:
    """``value`` as a device spec, or ValueError naming ``key`` and what is allowed."""
    if not isinstance(value, str) or not _SPEC.fullmatch(value.lower()):
        raise ValueError(f"{key} must be \"auto\", \"cpu\", \"cuda\" or \"cuda:N\" (N a device index), got {value!r}")
    return value.lower()


def resolve_device(spec: str = "auto", *, local_rank: int | None = None, local_world_size: int = 1) -> torch.device:
    """The device an engine trains on. ``local_rank``/``local_world_size``: this process's place among the ranks
    on its machine (default: torchrun's LOCAL_RANK, else 0). Raises, naming the fix, when CUDA is asked for and
    absent, or when more ranks share a machine than it has GPUs (NCCL cannot put two ranks on one GPU)."""
    spec = check_spec(spec)
    if local_rank is None:
        local_rank = int(os.environ.get("LOCAL_RANK", "0") or 0)
    if spec == "cpu" or (spec == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError(f"offload.device is {spec!r} but there is no CUDA device (torch.cuda.is_available() is "
                         "False); set offload.device to \"auto\" or \"cpu\"")
    count = torch.cuda.device_count()
    isolated = _one_gpu_per_process(count)
    if spec.startswith("cuda:"):
        index = int(spec.split(":")[1])
        if index >= count:
            raise ValueError(f"offload.device is {spec!r} but this machine has {count} CUDA device(s) (cuda:0.."
                             f"cuda:{count - 1})")
        if local_world_size > 1 and not isolated:
            raise ValueError(f"offload.device {spec!r} names one GPU for all {local_world_size} ranks on this "
                             "machine; set it to \"cuda\" (each rank takes cuda:LOCAL_RANK) or \"auto\"")
        return torch.device("cuda", index)
    if isolated:
        return torch.device("cuda", 0)
    if local_world_size > count or local_rank >= count:
        raise RuntimeError(f"{max(local_world_size, local_rank + 1)} ranks on this machine but {count} CUDA "
                           f"device(s): NCCL cannot put several ranks on one GPU. Launch at most {count} process(es) "
                           f"per machine (torchrun --nproc-per-node {count}), or set offload.device to \"cpu\" to "
                           "train on the CPU over gloo")
    return torch.device("cuda", local_rank)


def _one_gpu_per_process(count: int) -> bool:
    """Whether the launcher gave this process a GPU of its own (CUDA_VISIBLE_DEVICES naming one device, as SLURM's
    ``--gpus-per-task=1`` does): every rank then sees it as cuda:0, whatever its local rank."""
    visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    return count == 1 and len(visible) == 1


def default_device() -> torch.device:
    """The device ``offload.device: "auto"`` picks for this process (tests and examples use it for references)."""
    return resolve_device("auto", local_world_size=1)


def free_device_memory(device: torch.device) -> int | None:
    """Bytes the CUDA driver has free on ``device`` once torch's cache is handed back: what no byte budget sees
    (the CUDA context, other processes). None on the CPU, where the DEVICE tier is its byte budget alone."""
    if device.type != "cuda":
        return None
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info(device)[0]


def fast_bf16(device: torch.device) -> bool:
    """Whether bfloat16 matmuls run at full speed on ``device``: a CUDA GPU that supports bf16, or a CPU with
    AVX-512 BF16 or AMX. On other CPUs torch converts bf16 through fp32 in its slowest paths (measured on an AVX2
    EPYC: 0.9 GFLOP/s against 100 in fp32), so the demo trains in fp32 there and the engine warns."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())

