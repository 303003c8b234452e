"""Build, load and call the fused CPU Adam kernel (``cpu_adam.cpp``), with a pure-torch fallback.

The kernel is compiled on first use with ``torch.utils.cpp_extension`` for the widest instruction set this CPU has
(AVX-512, AVX2 or plain scalar code; read from /proc/cpuinfo), so one wheel serves every x86 machine and no flag the
CPU lacks is ever compiled in. Builds live under ``$OFFLOAD_CACHE_DIR`` (default ``~/.cache/offload``) in a directory
named after the ISA, the Python and torch versions and a hash of the source, the flags and the compiler, so every
install of the same source (two clones, two venvs, a checkout and a wheel) shares one build and a changed source
never loads an old one. One process at a time builds, under an OS lock that a killed build cannot leave held, in a
folder of its own that becomes the cached build only once whole; a build says so on the ``offload`` logger (a
warning: it is what a first run waits on), a cache hit says nothing.

Two environment variables, read on every call so tests can flip them:

* ``OFFLOAD_CPU_ADAM_BACKEND``: ``auto`` (default: native kernel, or the torch path with one warning if it cannot be
  built), ``native`` (fail loudly instead of falling back) or ``torch`` (always the torch path).
* ``OFFLOAD_CPU_ADAM_ISA``: ``avx512``, ``avx2`` or ``scalar`` to use a narrower kernel than the CPU allows.

The torch path evaluates the same formula in the same order, chunk by chunk so its temporaries stay small.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import importlib.util
import logging
import math
import os
import shutil
import sys
import sysconfig
import threading
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import torch

from nvme_swapper import build_key, cache_dir  # one build cache for the distribution

logger = logging.getLogger(__name__)

BACKEND_ENV = "OFFLOAD_CPU_ADAM_BACKEND"
ISA_ENV = "OFFLOAD_CPU_ADAM_ISA"

_SOURCE = Path(__file__).with_name("cpu_adam.cpp")

# Widest first. "requires": CPU flags that must all be present; "cflags": what the compiler gets for that level.
_ISA_LEVELS: dict[str, dict[str, tuple[str, ...]]] = {
    "avx512": {"requires": ("avx512f", "avx2", "fma", "f16c"), "cflags": ("-mavx512f", "-mavx2", "-mfma", "-mf16c")},
    "avx2": {"requires": ("avx2", "fma", "f16c"), "cflags": ("-mavx2", "-mfma", "-mf16c")},
    "scalar": {"requires": (), "cflags": ()},
}

# Type codes shared with cpu_adam.cpp.
_GRAD_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_OUT_CODES = {torch.bfloat16: 1, torch.float16: 2}
_NO_OUT = -1

# Elements per chunk on the torch path: big enough to amortise dispatch, small enough for the temporaries to stay
# in cache.
_TORCH_CHUNK = 1 << 18


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux's /proc/cpuinfo lists them (the flags the kernel lets programs use), else as
    py-cpuinfo reports them (the same names; it takes over a second, every start), else none (the scalar kernel)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    try:
        import cpuinfo

        return frozenset(cpuinfo.get_cpu_info().get("flags", ()))
    except Exception as exc:  # py-cpuinfo shells out and parses; any failure just means the scalar kernel
        logger.warning("offload: could not read CPU flags (%s); CPU Adam uses the scalar kernel", exc)
    return frozenset()


def supported_isas() -> list[str]:
    """Instruction-set levels this CPU can run, widest first (``scalar`` is always last)."""
    flags = cpu_flags()
    return [isa for isa, level in _ISA_LEVELS.items() if all(f in flags for f in level["requires"])]


def _requested_isa() -> str:
    supported = supported_isas()
    requested = os.environ.get(ISA_ENV, "").strip().lower()
    if not requested:
        return supported[0]
    if requested not in _ISA_LEVELS:
        raise ValueError(f"{ISA_ENV}={requested!r} is not an ISA level; use one of {list(_ISA_LEVELS)}")
    if requested not in supported:
        raise ValueError(f"{ISA_ENV}={requested!r} but this CPU only supports {supported}; unset it or pick one")
    return requested


def _requested_backend() -> str:
    backend = os.environ.get(BACKEND_ENV, "auto").strip().lower() or "auto"
    if backend not in ("auto", "native", "torch"):
        raise ValueError(f"{BACKEND_ENV}={backend!r}; use 'auto', 'native' or 'torch'")
    return backend


def _flags(isa: str) -> tuple[list[str], list[str]]:
    """The compiler's and the linker's flags for ``isa``."""
    return ["-O3", "-fopenmp", "-ffp-contract=off", *_ISA_LEVELS[isa]["cflags"]], ["-fopenmp"]


def build_directory(isa: str) -> Path:
    """Where the kernel for ``isa`` is cached: named after everything the built library depends on (the source, the
    flags, the compiler, the Python ABI and torch), so identical sources share it and any change builds anew."""
    cflags, ldflags = _flags(isa)
    digest = build_key(os.environ.get("CXX", "c++"),  # the compiler torch's build runs
                       _SOURCE.read_bytes(), " ".join(cflags).encode(), " ".join(ldflags).encode(),
                       sys.version.encode(), str(sysconfig.get_config_var("EXT_SUFFIX")).encode(),
                       torch.__version__.encode())
    version_tag = f"py{sys.version_info.major}{sys.version_info.minor}-torch{torch.__version__.replace('+', '_')}"
    return cache_dir() / "cpu_adam" / f"{isa}-{version_tag}-{digest}"


@contextlib.contextmanager
def _across_processes(build_dir: Path) -> Iterator[None]:
    """One process at a time builds ``build_dir``, under an OS lock (on a file beside it) that the kernel drops when
    its holder dies; a process that has to wait says so, since the wait lasts as long as a build."""
    with open(build_dir.parent / f"{build_dir.name}.lock", "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.warning("offload: waiting for another process building the CPU Adam kernel in %s", build_dir)
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@functools.lru_cache(maxsize=None)
def _build(isa: str) -> ModuleType:
    """The kernel for ``isa`` imported from its cached build, built first (once, whichever processes ask at the
    same time) where there is none. Raises on any build failure."""
    name = f"offload_cpu_adam_{isa}"
    build_dir = build_directory(isa)
    library = build_dir / f"{name}.so"
    if library.exists():
        module = _import(name, library)
    else:
        build_dir.parent.mkdir(parents=True, exist_ok=True)
        with _across_processes(build_dir):
            # (built meanwhile by the process this one waited for)
            module = _import(name, library) if library.exists() else _compile(name, isa, build_dir)
    assert module.isa == isa, f"built {name} but it reports ISA {module.isa}"
    return module


def _import(name: str, library: Path) -> ModuleType:
    """The extension module at ``library``, imported without a build step (no ninja run: a cache hit is free)."""
    spec = importlib.util.spec_from_file_location(name, library)
    assert spec is not None and spec.loader is not None, f"{library} is not an extension module"
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _compile(name: str, isa: str, build_dir: Path) -> ModuleType:
    """Builds the kernel in a folder of this process's own and renames it to ``build_dir`` once whole, so a builder
    killed midway (its half-written objects, torch's ``lock`` file that alone would make later builds wait forever)
    leaves only a staging folder, which the next build removes: under the lock, no other is being written. The
    caller holds the lock."""
    from torch.utils import cpp_extension

    for stale in build_dir.parent.glob(f".{build_dir.name}.build-*"):
        logger.warning("offload: removing %s, left by a CPU Adam build that was killed", stale)
        shutil.rmtree(stale, ignore_errors=True)
    staging = build_dir.parent / f".{build_dir.name}.build-{os.getpid()}"
    staging.mkdir()
    cflags, ldflags = _flags(isa)
    logger.warning("offload: building the CPU Adam kernel (%s) in %s, once per source version (up to a minute)...",
                   isa, build_dir)
    try:
        module = cpp_extension.load(name=name, sources=[str(_SOURCE)], build_directory=str(staging),
                                    extra_cflags=cflags, extra_ldflags=ldflags, verbose=False)
        with open(staging / f"{name}.so", "rb") as built:
            os.fsync(built.fileno())  # whole on disk before its name says so
        shutil.rmtree(build_dir, ignore_errors=True)  # (a folder without the library: never a build of ours)
        os.rename(staging, build_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return module


_warned_fallback = False
# Builds that failed in this process, by ISA: a failed build is not retried on every call (it takes seconds).
_build_errors: dict[str, Exception] = {}
# The engine calls adam_step from worker threads; the first calls must not build or import the module twice.
_build_lock = threading.Lock()


def _native_module() -> ModuleType | None:
    """The compiled kernel to use for this call, or None for the torch path (warning once if that is a fallback)."""
    global _warned_fallback
    backend = _requested_backend()
    if backend == "torch":
        return None
    isa = _requested_isa()
    try:
        with _build_lock:
            if isa in _build_errors:
                raise _build_errors[isa]
            return _build(isa)
    except Exception as exc:
        _build_errors[isa] = exc
        if backend == "native":
            raise RuntimeError(
                f"could not build the {isa} CPU Adam kernel ({exc}); install a C++ compiler, or set "
                f"{BACKEND_ENV}=auto to fall back to the slower torch implementation"
            ) from exc
        if not _warned_fallback:
            _warned_fallback = True
            logger.warning(
                "offload: could not build the %s CPU Adam kernel (%s); using the pure-torch implementation, "
                "which gives the same results several times slower. Install a C++ compiler (g++ or clang++) to fix.",
                isa,
                exc,
            )
        return None


def cpu_adam_backend() -> str:
    """Which implementation :func:`adam_step` uses now: ``"avx512"``, ``"avx2"``, ``"scalar"`` or ``"torch"``.

    Builds the kernel if that has not happened yet.
    """
    module = _native_module()
    return "torch" if module is None else module.isa


def _check_buffer(name: str, t: object, numel: int | None, dtypes: tuple[torch.dtype, ...],
                  fn: str = "adam_step") -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{fn}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise ValueError(f"{fn}: {name} is on {t.device}; the CPU Adam kernel needs CPU tensors")
    if t.dtype not in dtypes:
        allowed = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise ValueError(f"{fn}: {name} has dtype {t.dtype}; allowed: {allowed}")
    if t.is_sparse or t.layout != torch.strided:
        raise ValueError(f"{fn}: {name} has layout {t.layout}; only dense (strided) tensors are supported")
    if not t.is_contiguous():
        raise ValueError(f"{fn}: {name} is not contiguous; pass a flat contiguous buffer (.contiguous())")
    if numel is not None and t.numel() != numel:
        raise ValueError(f"{fn}: {name} has {t.numel()} elements but param has {numel}; sizes must match")
    return t


def adam_step(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    adamw_mode: bool = True,
    bias_correction: bool = True,
    grad_scale: float = 1.0,
    out: torch.Tensor | None = None,
) -> float:
    """One Adam (``adamw_mode=False``) or AdamW update, in place, in a single pass over memory. Returns the sum of
    the squares of ``grad / grad_scale``, taken in the same pass (the engine's gradient norm, without another read
    of the gradients): summed per vector lane in fp32 over at most 1024 elements, then in double.

    ``param``, ``exp_avg`` and ``exp_avg_sq`` are contiguous fp32 CPU tensors with the same number of elements;
    ``grad`` is fp32, bf16 or fp16 and is divided by ``grad_scale`` as it is read (loss-scale unscaling and gradient
    clipping for free). ``step`` is the 1-based count of this update, used for bias correction. When ``out`` (bf16 or
    fp16) is given it receives ``param.to(out.dtype)`` of the new parameters, rounded exactly as torch rounds.

    The arithmetic follows ``torch.optim.AdamW(fused=True)``: ``param *= 1 - lr*wd`` (AdamW) or ``grad += wd*param``
    (Adam); ``exp_avg.lerp_(grad, 1-beta1)``; ``exp_avg_sq = exp_avg_sq*beta2 + (1-beta2)*grad*grad``;
    ``param -= lr/bc1 * exp_avg / (sqrt(exp_avg_sq)/sqrt(bc2) + eps)``.
    """
    _check_buffer("param", param, None, (torch.float32,))
    n = param.numel()
    _check_buffer("grad", grad, n, tuple(_GRAD_CODES))
    _check_buffer("exp_avg", exp_avg, n, (torch.float32,))
    _check_buffer("exp_avg_sq", exp_avg_sq, n, (torch.float32,))
    if out is not None:
        _check_buffer("out", out, n, tuple(_OUT_CODES))
    step = int(step)
    if step < 1:
        raise ValueError(f"adam_step: step={step}; it counts updates from 1")
    if not (math.isfinite(grad_scale) and grad_scale > 0):
        raise ValueError(f"adam_step: grad_scale={grad_scale}; it must be a finite positive number")
    if bias_correction:
        bias_correction1 = 1.0 - beta1**step
        bias_correction2 = 1.0 - beta2**step
    else:
        bias_correction1 = bias_correction2 = 1.0
    lr, beta1, beta2, eps, weight_decay = float(lr), float(beta1), float(beta2), float(eps), float(weight_decay)
    module = _native_module()
    if module is None:
        return _torch_adam_step(
            param, grad, exp_avg, exp_avg_sq, out, lr, beta1, beta2, eps, weight_decay, adamw_mode,
            bias_correction1, bias_correction2, float(grad_scale),
        )  # fmt: skip
    return module.adam_step(
        param.data_ptr(), grad.data_ptr(), _GRAD_CODES[grad.dtype], exp_avg.data_ptr(), exp_avg_sq.data_ptr(),
        0 if out is None else out.data_ptr(), _NO_OUT if out is None else _OUT_CODES[out.dtype], n,
        lr, beta1, beta2, eps, weight_decay, bool(adamw_mode), bias_correction1, bias_correction2, float(grad_scale),
    )  # fmt: skip


def squared_norm(t: torch.Tensor, scale: float = 1.0) -> float:
    """The sum of the squares of ``t * scale`` (a contiguous fp32, bf16 or fp16 CPU tensor), in one read of it on
    every thread. ``torch.linalg.vector_norm(t, dtype=torch.float32)`` on the CPU first widens a bf16 tensor into an
    fp32 copy (twice its bytes, uncounted by any budget) and sums in one fp32 running total, which drifts (6% off in
    the squares at 2e8 elements; bench/cpu_adam.py). Here the sum is the update's: fp32 lanes over at most 1024
    elements, then double; where those overflow with every element finite, summed again scaled by the largest
    magnitude. inf or nan where ``t`` holds them."""
    _check_buffer("t", t, None, tuple(_GRAD_CODES), "squared_norm")
    squares = _sum_squares(t, scale)
    if math.isinf(squares):
        low, high = (float(v) for v in torch.aminmax(t))
        largest = max(-low, high)
        if math.isfinite(largest):  # the fp32 squares overflowed, not the data
            squares = _sum_squares(t, 1.0 / largest) * (largest * scale) ** 2
    return squares


def _sum_squares(t: torch.Tensor, scale: float) -> float:
    module = _native_module()
    if module is not None:
        return module.sum_squares(t.data_ptr(), _GRAD_CODES[t.dtype], t.numel(), float(scale))
    flat = t.view(-1)
    return math.fsum(torch.linalg.vector_norm(flat[i : i + _TORCH_CHUNK].float() * scale, dtype=torch.float64).item()
                     ** 2 for i in range(0, flat.numel(), _TORCH_CHUNK))


def _torch_adam_step(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    out: torch.Tensor | None,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    adamw_mode: bool,
    bias_correction1: float,
    bias_correction2: float,
    grad_scale: float,
) -> float:
    """The kernel's formula in torch ops, over chunks of the flat buffers (fp32 arithmetic, same order); returns the
    sum of the squares of the scaled gradient."""
    # Constants rounded to fp32 first, as the kernel does, so both paths see identical coefficients.
    def f32(x: float) -> float:
        return float(torch.tensor(x, dtype=torch.float32, device="cpu"))

    inv_grad_scale = f32(1.0 / grad_scale)
    decay = f32(1.0 - lr * weight_decay) if adamw_mode else 1.0
    l2 = 0.0 if adamw_mode else f32(weight_decay)
    lerp_weight = f32(1.0 - beta1)
    beta2_f, sq_weight = f32(beta2), f32(1.0 - beta2)
    bc2_sqrt, eps_f = f32(math.sqrt(bias_correction2)), f32(eps)
    step_size = f32(lr / bias_correction1)
    flat = [t.view(-1) for t in (param, grad, exp_avg, exp_avg_sq)]
    out_flat = None if out is None else out.view(-1)
    squares = 0.0
    for start in range(0, param.numel(), _TORCH_CHUNK):
        p, g_raw, m, v = (t[start : start + _TORCH_CHUNK] for t in flat)
        g = g_raw.float()
        if inv_grad_scale != 1.0:
            g = g * inv_grad_scale
        squares += torch.linalg.vector_norm(g, dtype=torch.float64).item() ** 2
        if l2 != 0.0:
            g = g + p * l2
        if decay != 1.0:
            p.mul_(decay)
        m.lerp_(g, lerp_weight)
        v.mul_(beta2_f).add_((g * sq_weight).mul_(g))
        denom = v.sqrt().div_(bc2_sqrt).add_(eps_f)
        p.sub_(m.mul(step_size).div_(denom))
        if out_flat is not None:
            out_flat[start : start + _TORCH_CHUNK].copy_(p)
    return squares


# Distance, within a 2 MiB huge page, between consecutive streams of one update (see host_stream_buffer).
_STREAM_STAGGER = 705 << 10


def host_stream_buffer(
    numel: int, dtype: torch.dtype = torch.float32, *, slot: int, anchor: torch.Tensor | None = None,
    pin_memory: bool = False,
) -> torch.Tensor:
    """A zero-filled huge-page host buffer for one stream of the Adam update (param, grad, exp_avg, ...).

    Buffers from :func:`nvme_swapper.aligned_tensor` all start on a 2 MiB boundary, so element ``i`` of every stream
    sits at the same offset of its huge page; when the physical pages are laid out evenly (a freshly booted host)
    the streams then hit the same DRAM banks in lockstep and the update runs up to twice as slow. Each ``slot`` starts
    ``705 KiB * slot`` further into its page (relative to ``anchor``'s offset when given, e.g. the parameter the
    state belongs to), which keeps streams apart in both the bank bits and the 4 KiB page offset. Costs up to
    2 MiB of padding per buffer. ``pin_memory``: page-locked for CUDA copies (see ``aligned_tensor``).
    """
    from nvme_swapper import HUGE_PAGE, aligned_tensor

    itemsize = torch.empty((), dtype=dtype).element_size()
    base = 0 if anchor is None else anchor.data_ptr() % HUGE_PAGE
    offset_bytes = (base + slot * _STREAM_STAGGER) % HUGE_PAGE
    offset_bytes -= offset_bytes % itemsize
    region = aligned_tensor(numel * itemsize + HUGE_PAGE, torch.uint8, pin_memory=pin_memory)
    # A tensor with its own storage of exactly ``numel`` elements (a plain slice would make torch.save write the
    # padding too); the numpy base chain keeps ``region`` and its mapping alive.
    body = torch.from_numpy(region.numpy()[offset_bytes : offset_bytes + numel * itemsize])
    return body.view(dtype)
