"""CPU Adam: the fused kernel and the CPUAdam optimizer against torch.optim.AdamW / Adam and a float64 reference.

Sizes 1, 7, 8191 and 2**20 + 3 hit the scalar-only case, the AVX2/AVX-512 tails and the multi-threaded split. The
native kernel and the pure-torch fallback are both exercised in the same run (OFFLOAD_CPU_ADAM_BACKEND).
"""

from __future__ import annotations

import fcntl
import io
import logging
import math
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from offload import CPUAdam
from offload.ops import _cpu_adam, adam_step, cpu_adam_backend, squared_norm, supported_isas

SIZES = [1, 7, 8191, 2**20 + 3]
STEPS = 100
HP = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8)
TOL = 5e-6


@pytest.fixture(params=["native", "torch"])
def backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv(_cpu_adam.BACKEND_ENV, request.param)
    monkeypatch.delenv(_cpu_adam.ISA_ENV, raising=False)
    if request.param == "native":
        try:
            cpu_adam_backend()
        except RuntimeError as exc:
            pytest.skip(f"native kernel unavailable here: {exc}")
    return request.param


@pytest.fixture
def native(monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv(_cpu_adam.BACKEND_ENV, "native")
    monkeypatch.delenv(_cpu_adam.ISA_ENV, raising=False)
    try:
        return cpu_adam_backend()
    except RuntimeError as exc:
        pytest.skip(f"native kernel unavailable here: {exc}")


@pytest.fixture(params=["widest", "avx2", "scalar", "torch"])
def any_kernel(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every implementation this CPU can run: the native kernel at each width it supports, and the torch path."""
    if request.param == "torch":
        monkeypatch.setenv(_cpu_adam.BACKEND_ENV, "torch")
        return request.param
    monkeypatch.setenv(_cpu_adam.BACKEND_ENV, "native")
    monkeypatch.delenv(_cpu_adam.ISA_ENV, raising=False)
    if request.param != "widest":
        if request.param not in supported_isas():
            pytest.skip(f"this CPU cannot run {request.param}")
        monkeypatch.setenv(_cpu_adam.ISA_ENV, request.param)
    return request.param


def assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Every element within TOL * max(1, |expected|)."""
    expected = expected.to(actual.dtype)
    bound = TOL * expected.abs().clamp_min(1.0)
    err = (actual - expected).abs()
    worst = int(torch.argmax(err - bound))
    assert bool((err <= bound).all()), (
        f"{what}: element {worst} is {actual.flatten()[worst].item()!r}, expected {expected.flatten()[worst].item()!r}"
    )


def assert_same_bits(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Bit-identical, except that any NaN matches any NaN."""
    assert actual.dtype == expected.dtype
    nan = torch.isnan(expected)
    assert torch.equal(torch.isnan(actual), nan), f"{what}: NaN positions differ"
    int_type = {2: torch.int16, 4: torch.int32}[actual.element_size()]
    a, e = actual.view(int_type)[~nan], expected.view(int_type)[~nan]
    if not torch.equal(a, e):
        i = int(torch.nonzero(a != e)[0])
        raise AssertionError(f"{what}: bits {int(a[i]) & 0xFFFF:#x} != {int(e[i]) & 0xFFFF:#x} at masked index {i}")


def make_grads(n: int, steps: int, dtype: torch.dtype, seed: int = 0, distinct: int = 10) -> list[torch.Tensor]:
    """``steps`` gradients cycling through ``distinct`` random ones (cheap at 2**20 elements)."""
    gen = torch.Generator().manual_seed(seed)
    # Varying scales so that exp_avg_sq spans many magnitudes and eps matters for some elements.
    scale = torch.logspace(-4, 1, n, dtype=torch.float32)[torch.randperm(n, generator=gen)]
    pool = [(torch.randn(n, generator=gen) * scale).to(dtype) for _ in range(min(steps, distinct))]
    return [pool[s % len(pool)] for s in range(steps)]


def initial_params(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 2


def run_kernel(
    p0: torch.Tensor, grads: list[torch.Tensor], out_dtype: torch.dtype | None = None, **kw: object
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    p, m, v = p0.clone(), torch.zeros_like(p0), torch.zeros_like(p0)
    out = None if out_dtype is None else torch.empty(p0.shape, dtype=out_dtype)
    hp = {**HP, "weight_decay": 0.0, **kw}
    for step, g in enumerate(grads, start=1):
        adam_step(p, g, m, v, step=step, out=out, **hp)
    return p, m, v, out


def run_torch(
    p0: torch.Tensor, grads: list[torch.Tensor], adamw_mode: bool, weight_decay: float, lr: float = HP["lr"]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    p = torch.nn.Parameter(p0.clone())
    cls = torch.optim.AdamW if adamw_mode else torch.optim.Adam
    opt = cls([p], lr=lr, betas=(HP["beta1"], HP["beta2"]), eps=HP["eps"], weight_decay=weight_decay)
    for g in grads:
        p.grad = g.float()
        opt.step()
    state = opt.state[p]
    return p.detach(), state["exp_avg"], state["exp_avg_sq"]


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("adamw_mode", [True, False], ids=["adamw", "adam"])
def test_kernel_matches_torch(native: str, size: int, grad_dtype: torch.dtype, adamw_mode: bool) -> None:
    p0, grads = initial_params(size), make_grads(size, STEPS, grad_dtype)
    out_dtype = None if grad_dtype == torch.float32 else grad_dtype
    p, m, v, out = run_kernel(p0, grads, out_dtype, weight_decay=0.05, adamw_mode=adamw_mode)
    p_ref, m_ref, v_ref = run_torch(p0, grads, adamw_mode, weight_decay=0.05)
    assert_close(p, p_ref, "param")
    assert_close(m, m_ref, "exp_avg")
    assert_close(v, v_ref, "exp_avg_sq")
    if out is not None:
        assert_same_bits(out, p.to(out_dtype), "low-precision copy")


@pytest.mark.parametrize("size", [7, 2**20 + 3])
@pytest.mark.parametrize("adamw_mode", [True, False], ids=["adamw", "adam"])
def test_fallback_gives_the_same_numbers(
    native: str, monkeypatch: pytest.MonkeyPatch, size: int, adamw_mode: bool
) -> None:
    p0, grads = initial_params(size), make_grads(size, 20, torch.bfloat16)
    kw = dict(weight_decay=0.1, adamw_mode=adamw_mode, grad_scale=3.0)
    p, m, v, out = run_kernel(p0, grads, torch.bfloat16, **kw)
    monkeypatch.setenv(_cpu_adam.BACKEND_ENV, "torch")
    assert cpu_adam_backend() == "torch"
    p_t, m_t, v_t, out_t = run_kernel(p0, grads, torch.bfloat16, **kw)
    assert_close(p_t, p, "param")
    assert_close(m_t, m, "exp_avg")
    assert_close(v_t, v, "exp_avg_sq")
    assert_same_bits(out_t, p_t.to(torch.bfloat16), "fallback low-precision copy")


@pytest.mark.parametrize("size", [1, 8191])
def test_torch_backend_matches_torch(backend: str, size: int) -> None:
    p0, grads = initial_params(size), make_grads(size, STEPS, torch.float16)
    p, m, v, out = run_kernel(p0, grads, torch.float16, weight_decay=0.05)
    p_ref, m_ref, v_ref = run_torch(p0, grads, True, weight_decay=0.05)
    assert_close(p, p_ref, "param")
    assert_close(m, m_ref, "exp_avg")
    assert_close(v, v_ref, "exp_avg_sq")
    assert_same_bits(out, p.to(torch.float16), "low-precision copy")


@pytest.mark.parametrize("adamw_mode", [True, False], ids=["adamw", "adam"])
def test_no_bias_correction_matches_float64_reference(backend: str, adamw_mode: bool) -> None:
    n, lr, wd = 8191, 1e-3, 0.05
    p0, grads = initial_params(n), make_grads(n, STEPS, torch.float32)
    p, m, v, _ = run_kernel(p0, grads, bias_correction=False, weight_decay=wd, adamw_mode=adamw_mode)
    b1, b2, eps = HP["beta1"], HP["beta2"], HP["eps"]
    p_ref, m_ref, v_ref = p0.double(), torch.zeros(n, dtype=torch.float64), torch.zeros(n, dtype=torch.float64)
    for g in grads:
        g = g.double()
        if adamw_mode:
            p_ref = p_ref * (1 - lr * wd)
        else:
            g = g + wd * p_ref
        m_ref = b1 * m_ref + (1 - b1) * g
        v_ref = b2 * v_ref + (1 - b2) * g * g
        p_ref = p_ref - lr * m_ref / (v_ref.sqrt() + eps)
    assert_close(p, p_ref, "param")
    assert_close(m, m_ref, "exp_avg")
    assert_close(v, v_ref, "exp_avg_sq")


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_grad_scale_divides_the_gradient(backend: str, grad_dtype: torch.dtype) -> None:
    n = 8191
    p0, grads = initial_params(n), make_grads(n, 10, torch.float32)
    # A power of two scales exactly, so the result is bit-identical to unscaled gradients.
    scaled = [(g * 1024).to(grad_dtype) for g in grads]
    plain = [(g * 1024).to(grad_dtype).float() / 1024 for g in grads]
    p_s, m_s, v_s, _ = run_kernel(p0, scaled, grad_scale=1024.0, weight_decay=0.01)
    p_p, m_p, v_p, _ = run_kernel(p0, plain, weight_decay=0.01)
    assert torch.equal(p_s, p_p) and torch.equal(m_s, m_p) and torch.equal(v_s, v_p)
    # Any other scale (e.g. a clipping coefficient) matches torch on the divided gradient.
    p_c, m_c, v_c, _ = run_kernel(p0, grads, grad_scale=3.7, weight_decay=0.01)
    p_ref, m_ref, v_ref = run_torch(p0, [g / 3.7 for g in grads], True, weight_decay=0.01)
    assert_close(p_c, p_ref, "param")
    assert_close(m_c, m_ref, "exp_avg")
    assert_close(v_c, v_ref, "exp_avg_sq")


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_returns_the_squared_norm_of_the_scaled_gradient(any_kernel: str, grad_dtype: torch.dtype) -> None:
    """The sum of squares the update takes in its pass (the engine's gradient norm) against float64, for every size
    class (scalar only, vector tails, several threads), every kernel width and the torch path."""
    for n in SIZES:
        grad = make_grads(n, 1, torch.float32)[0].to(grad_dtype)
        p, m, v = initial_params(n), torch.zeros(n), torch.zeros(n)
        out = torch.empty(n, dtype=torch.bfloat16)
        squares = adam_step(p, grad, m, v, step=1, grad_scale=3.7, weight_decay=0.1, out=out, **HP)
        want = (grad.double() / 3.7).square().sum().item()
        assert squares == pytest.approx(want, rel=2e-6), (n, squares, want)
    empty = torch.empty(0)
    assert adam_step(empty, empty, empty.clone(), empty.clone(), step=1, weight_decay=0.0, **HP) == 0.0


@settings(max_examples=60, deadline=None)
@given(n=st.integers(0, 3000), offset=st.integers(0, 40), scale=st.floats(1e-3, 1e3),
       grad_dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]), data=st.data())
def test_squared_norm_property(n: int, offset: int, scale: float, grad_dtype: torch.dtype, data: st.DataObject) -> None:
    """Any length, any start (unaligned views into larger buffers), any grad_scale and magnitudes from 1e-15 to
    1e15: within 2e-6 of float64 (fp16 gradients stay inside their range). The squares are fp32: beyond about 1e19
    they overflow to inf, which the optimizer then sums again in float64 (tests/test_engine.py)."""
    exponent = data.draw(st.integers(-15, 15)) if grad_dtype != torch.float16 else data.draw(st.integers(-4, 3))
    gen = torch.Generator().manual_seed(n + offset)
    grad = (torch.randn(n + offset, generator=gen) * 10.0**exponent).to(grad_dtype)[offset:]
    p, m, v = (torch.zeros(n + offset)[offset:] for _ in range(3))
    squares = adam_step(p, grad, m, v, step=1, grad_scale=scale, weight_decay=0.0, **HP)
    want = (grad.double() / scale).square().sum().item()
    assert squares == pytest.approx(want, rel=2e-6, abs=1e-300)
    if n and grad_dtype != torch.float16:  # the same gradients at 1e25 overflow the fp32 squares: inf, never finite
        huge = (grad.double() * 10.0 ** (25 - exponent)).to(grad_dtype)
        if bool(huge.isfinite().all()) and huge.abs().max() > 0:
            assert adam_step(p, huge, m, v, step=2, weight_decay=0.0, **HP) == math.inf


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_squared_norm_alone_matches_float64(any_kernel: str, dtype: torch.dtype) -> None:
    """``squared_norm`` (the norm clipping and fp16 need before any update) against float64 for every size class,
    kernel width and the torch path; 2**24 + 3 elements too, where torch's own ``vector_norm(dtype=torch.float32)``
    on the CPU is off by about 1e-3 in the squares (its fp32 running sum; 3% in the norm at 2e8 bf16 elements)."""
    for n in [*SIZES, 2**24 + 3]:
        t = make_grads(n, 1, torch.float32)[0].to(dtype) if n < 2**24 else torch.randn(n).to(dtype)
        want = t.double().square().sum().item()
        assert squared_norm(t, 0.5) == pytest.approx(want / 4, rel=1e-6), n
    assert squared_norm(torch.empty(0)) == 0.0


def test_squared_norm_of_extremes_and_bad_input() -> None:
    """Finite values whose fp32 squares overflow are summed again, scaled: a finite, right sum. inf and nan in the
    data come out as they are. Bad input is named."""
    huge = torch.full((1000,), 1e25)
    assert squared_norm(huge) == pytest.approx(1000 * 1e50, rel=1e-6)
    assert squared_norm(huge.to(torch.bfloat16)) == pytest.approx(1000 * float(torch.tensor(1e25).bfloat16()) ** 2,
                                                                  rel=1e-6)
    huge[3] = float("inf")
    assert squared_norm(huge) == math.inf
    huge[3] = float("nan")
    assert math.isnan(squared_norm(huge))
    with pytest.raises(ValueError, match="squared_norm: t is not contiguous"):
        squared_norm(torch.zeros(4, 4).t())
    with pytest.raises(ValueError, match="squared_norm: t has dtype torch.int64"):
        squared_norm(torch.zeros(4, dtype=torch.int64))


def _bits_to_float(bits: list[int]) -> torch.Tensor:
    return torch.tensor(bits, dtype=torch.int64).to(torch.int32).view(torch.float32)


def _copy_through_kernel(values: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """lr=0 and zero gradients leave the parameters as they are, so ``out`` receives ``values.to(out.dtype)``."""
    p = values.clone()
    zeros = torch.zeros_like(p)
    adam_step(p, zeros, zeros.clone(), zeros.clone(), step=1, lr=0.0, beta1=0.9, beta2=0.999, eps=1e-8,
              weight_decay=0.0, out=out)  # fmt: skip
    assert_same_bits(p, values, "param with lr=0")
    return out


EDGE_BITS = [
    0x00000000, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00000, 0x7F800001, 0x7FA12345, 0xFFFFFFFF,
    0x00000001, 0x807FFFFF, 0x00800000, 0x3F808000, 0x3F818000, 0x3F80C000, 0x7F7FFFFF, 0xFF7F8000,  # bf16 ties
    0x477FE000, 0x477FEFFF, 0x477FF000, 0x47800000, 0x33000000, 0x33000001, 0x33C00000, 0x387FE000,  # fp16 edges
    0x38800000, 0x387FF000, 0x3F801000, 0x3F803000, 0xB3800000, 0x337FFFFF,
]  # fmt: skip


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("offset", [0, 1, 5])
def test_low_precision_copy_is_exactly_torch_rounding(backend: str, out_dtype: torch.dtype, offset: int) -> None:
    gen = torch.Generator().manual_seed(7)
    random_bits = torch.randint(0, 2**32, (70_001,), generator=gen).tolist()
    values = _bits_to_float(EDGE_BITS * 3 + random_bits)
    # An output that does not start on a vector boundary exercises the aligned head of non-temporal stores.
    buffer = torch.empty(values.numel() + offset, dtype=out_dtype)
    out = _copy_through_kernel(values, buffer[offset:])
    assert_same_bits(out, values.to(out_dtype), f"{out_dtype} copy")


@settings(max_examples=60, deadline=None)
@given(
    bits=st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=200),
    out_dtype=st.sampled_from([torch.bfloat16, torch.float16]),
)
def test_low_precision_copy_property(bits: list[int], out_dtype: torch.dtype) -> None:
    values = _bits_to_float(bits)
    out = _copy_through_kernel(values, torch.empty(values.shape, dtype=out_dtype))
    assert_same_bits(out, values.to(out_dtype), f"{out_dtype} copy")


@settings(max_examples=40, deadline=None)
@given(
    bits=st.lists(st.integers(0, 2**16 - 1), min_size=1, max_size=100),
    grad_dtype=st.sampled_from([torch.bfloat16, torch.float16]),
)
def test_low_precision_gradients_read_exactly(bits: list[int], grad_dtype: torch.dtype) -> None:
    """The kernel widens bf16/fp16 gradients exactly like .float(): a one-step update from zero state agrees."""
    grad = torch.tensor(bits, dtype=torch.int32).to(torch.int16).view(grad_dtype)
    grad = torch.where(torch.isfinite(grad), grad, torch.zeros_like(grad))
    p0 = torch.ones(grad.shape)
    p, m, v, _ = run_kernel(p0, [grad], weight_decay=0.0)
    p_f, m_f, v_f, _ = run_kernel(p0, [grad.float()], weight_decay=0.0)
    assert_same_bits(m, m_f, "exp_avg")
    assert_same_bits(v, v_f, "exp_avg_sq")
    assert_same_bits(p, p_f, "param")


def test_empty_buffers_are_a_no_op(backend: str) -> None:
    empty = torch.empty(0)
    squares = adam_step(empty, empty, empty.clone(), empty.clone(), step=1, out=torch.empty(0, dtype=torch.bfloat16),
                        weight_decay=0.1, **HP)  # fmt: skip
    assert squares == 0.0  # nothing read, nothing summed


def test_concurrent_first_calls(native: str) -> None:
    from concurrent.futures import ThreadPoolExecutor

    p0, grads = initial_params(4099), make_grads(4099, 5, torch.float32)
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda _: run_kernel(p0, grads, weight_decay=0.1), range(4)))
    for other in results[1:]:
        assert torch.equal(results[0][0], other[0])


def test_result_does_not_depend_on_thread_count(native: str) -> None:
    n = 2**20 + 3
    p0, grads = initial_params(n), make_grads(n, 3, torch.bfloat16)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run_kernel(p0, grads, torch.bfloat16, weight_decay=0.1)
        torch.set_num_threads(2)
        two = run_kernel(p0, grads, torch.bfloat16, weight_decay=0.1)
    finally:
        torch.set_num_threads(before)
    for a, b, what in zip(one, two, ["param", "exp_avg", "exp_avg_sq", "copy"]):
        assert_same_bits(a, b, what)


@pytest.mark.parametrize("isa", ["avx2", "scalar"])
def test_narrower_isas_are_bit_identical(native: str, monkeypatch: pytest.MonkeyPatch, isa: str) -> None:
    if isa not in supported_isas():
        pytest.skip(f"this CPU cannot run {isa}")
    n = 8191
    p0, grads = initial_params(n), make_grads(n, 5, torch.float16)
    widest = run_kernel(p0, grads, torch.bfloat16, weight_decay=0.1, adamw_mode=False, grad_scale=2.5)
    monkeypatch.setenv(_cpu_adam.ISA_ENV, isa)
    assert cpu_adam_backend() == isa
    narrow = run_kernel(p0, grads, torch.bfloat16, weight_decay=0.1, adamw_mode=False, grad_scale=2.5)
    for a, b, what in zip(widest, narrow, ["param", "exp_avg", "exp_avg_sq", "copy"]):
        assert_same_bits(a, b, what)


def test_build_failure_falls_back_with_one_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    calls = []

    def broken(isa: str) -> None:
        calls.append(isa)
        raise OSError("no compiler")

    monkeypatch.setenv(_cpu_adam.BACKEND_ENV, "auto")
    monkeypatch.setattr(_cpu_adam, "_build", broken)
    monkeypatch.setattr(_cpu_adam, "_warned_fallback", False)
    monkeypatch.setattr(_cpu_adam, "_build_errors", {})
    p0, grads = initial_params(100), make_grads(100, 3, torch.float32)
    with caplog.at_level(logging.WARNING, logger="offload"):
        p, m, v, _ = run_kernel(p0, grads, weight_decay=0.05)
        assert cpu_adam_backend() == "torch"
    warnings = [r for r in caplog.records if "pure-torch" in r.getMessage()]
    assert len(warnings) == 1
    assert len(calls) == 1  # the failed build is not retried on every step
    p_ref, m_ref, v_ref = run_torch(p0, grads, True, weight_decay=0.05)
    assert_close(p, p_ref, "param")
    monkeypatch.setenv(_cpu_adam.BACKEND_ENV, "native")
    with pytest.raises(RuntimeError, match="C\\+\\+ compiler"):
        cpu_adam_backend()


BUILDING = "offload: building the CPU Adam kernel"
# A child prints which offload it imported, the kernel it runs, and whether py-cpuinfo (over a second) was imported.
_REPORT = ("import sys, offload; from offload.ops import cpu_adam_backend; "
           "print(offload.__file__); print(cpu_adam_backend()); print('cpuinfo' in sys.modules)")


def _install(root: Path) -> Path:
    """A copy of the packages, as a second clone, venv or wheel holds them."""
    src = Path(_cpu_adam.__file__).resolve().parents[2]
    for package in ("offload", "nvme_swapper"):
        shutil.copytree(src / package, root / package, ignore=shutil.ignore_patterns("__pycache__"))
    return root


def _kernel_process(install: Path | None, cache: Path, isa: str | None = "scalar",
                    new_session: bool = False) -> subprocess.Popen:
    """A process that loads the native kernel from ``install`` (None: this checkout) with ``cache`` as its cache."""
    env = {**os.environ, "OFFLOAD_CACHE_DIR": str(cache), _cpu_adam.BACKEND_ENV: "native"}
    env.pop(_cpu_adam.ISA_ENV, None)
    if isa is not None:
        env[_cpu_adam.ISA_ENV] = isa
    if install is not None:
        env["PYTHONPATH"] = str(install)
    return subprocess.Popen([sys.executable, "-c", _REPORT], cwd=cache.parent, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=new_session)


def _finish(child: subprocess.Popen, install: Path | None, isa: str) -> str:
    """The child's stderr, once it ran the kernel ``isa`` from ``install``'s source without py-cpuinfo."""
    try:
        out, err = child.communicate(timeout=300)
    finally:
        child.kill()
    assert child.returncode == 0, err[-3000:]
    imported, backend, cpuinfo = out.split()
    if install is not None:
        assert Path(imported).is_relative_to(install), imported
    assert backend == isa and cpuinfo == "False", out
    return err


def _builds(cache: Path) -> list[Path]:
    return sorted(p for p in (cache / "cpu_adam").iterdir() if p.is_dir())


@pytest.mark.slow  # two installs and a build: 18 s
def test_installs_of_the_same_source_share_one_build(tmp_path: Path) -> None:
    """Two installs of the same source (here two copies of the packages) started at once build the kernel once
    between them: the one that waited loads the other's build (they rebuilt it on every start: 14 s against 3.5 s).
    A builder killed midway (SIGKILL to it, ninja and the compiler) leaves only its own staging folder: never
    loaded, removed by the next build."""
    cache, a, b = tmp_path / "cache", _install(tmp_path / "a"), _install(tmp_path / "b")
    killed = _kernel_process(a, cache, new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not list((cache / "cpu_adam").glob(".*.build-*")) and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(1)  # the compiler at work
        os.killpg(killed.pid, signal.SIGKILL)
    finally:
        killed.kill()
        killed.wait()
    leftover = _builds(cache)
    assert leftover and all(p.name.startswith(".") for p in leftover), leftover  # its staging folder alone
    first = [_kernel_process(a, cache), _kernel_process(b, cache)]
    errors = [_finish(child, install, "scalar") for child, install in zip(first, (a, b))]
    assert sum(err.count(BUILDING) for err in errors) == 1, errors
    assert any("left by a CPU Adam build that was killed" in err for err in errors), errors
    (built,) = _builds(cache)  # one build, the staging folders gone
    assert (built / "offload_cpu_adam_scalar.so").is_file()


@pytest.mark.slow
def test_a_changed_source_builds_anew(tmp_path: Path) -> None:
    """An install whose kernel source differs (another version) builds its own, and never loads the other's; the
    first install's build stays, and its later runs load it without a build (the same file)."""
    cache, a, b = tmp_path / "cache", _install(tmp_path / "a"), _install(tmp_path / "b")
    source = b / "offload" / "ops" / "cpu_adam.cpp"
    source.write_text(source.read_text() + "\n// another version\n")
    assert BUILDING in _finish(_kernel_process(a, cache), a, "scalar")
    (built,) = _builds(cache)
    inode = (built / "offload_cpu_adam_scalar.so").stat().st_ino
    assert BUILDING in _finish(_kernel_process(b, cache), b, "scalar")
    assert len(_builds(cache)) == 2
    assert BUILDING not in _finish(_kernel_process(a, cache), a, "scalar")
    assert (built / "offload_cpu_adam_scalar.so").stat().st_ino == inode


def test_the_build_folder_is_named_after_the_source_and_flags(monkeypatch: pytest.MonkeyPatch,
                                                              tmp_path: Path) -> None:
    """Every input of the build is in its folder's name: another source or other flags, another folder."""
    isa = supported_isas()[-1]
    here = _cpu_adam.build_directory(isa)
    assert here.name.startswith(f"{isa}-py{sys.version_info.major}{sys.version_info.minor}-torch")
    copy, source = tmp_path / "cpu_adam.cpp", _cpu_adam._SOURCE.read_bytes()
    copy.write_bytes(source)
    monkeypatch.setattr(_cpu_adam, "_SOURCE", copy)
    assert _cpu_adam.build_directory(isa) == here  # the same bytes elsewhere: the same build
    copy.write_bytes(source + b"\n")
    changed = _cpu_adam.build_directory(isa)
    assert changed != here and changed.parent == here.parent
    copy.write_bytes(source)
    monkeypatch.setitem(_cpu_adam._ISA_LEVELS, isa, {**_cpu_adam._ISA_LEVELS[isa], "cflags": ("-DOTHER",)})
    assert _cpu_adam.build_directory(isa) not in (here, changed)


def test_a_build_in_progress_elsewhere_is_waited_for(native: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                     ) -> None:
    """A process that finds another building holds off (and says so) until that one's build is in place, then
    loads it without building."""
    built = _cpu_adam.build_directory(native)  # this checkout's, in the shared cache
    cache = tmp_path / "cache"
    monkeypatch.setenv("OFFLOAD_CACHE_DIR", str(cache))
    build = _cpu_adam.build_directory(native)
    build.parent.mkdir(parents=True)
    with open(build.parent / f"{build.name}.lock", "a") as held:  # another process building: its OS lock
        fcntl.flock(held, fcntl.LOCK_EX)
        child = _kernel_process(None, cache, isa=None)
        try:
            seen = _read_until(child, "waiting for another process building the CPU Adam kernel")
            time.sleep(1)
            assert child.poll() is None  # it waits
            shutil.copytree(built, build)  # the builder finishes
            fcntl.flock(held, fcntl.LOCK_UN)
            err = seen + _finish(child, None, native)
        finally:
            child.kill()
    assert BUILDING not in err, err


def _read_until(child: subprocess.Popen, text: str, timeout: float = 120) -> str:
    """What ``child`` wrote on stderr up to ``text``, which it must write within ``timeout`` seconds."""
    seen, deadline = "", time.monotonic() + timeout
    while text not in seen:
        ready, _, _ = select.select([child.stderr], [], [], max(deadline - time.monotonic(), 0))
        chunk = os.read(child.stderr.fileno(), 1 << 16).decode() if ready else ""
        assert chunk, f"the child did not write {text!r}: {seen[-2000:]}"
        seen += chunk
    return seen


# ---------------------------------------------------------------------------------------------------------------
# CPUAdam, the optimizer


def _model_params(seed: int = 3) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    shapes = [(1100, 1000), (1000,), (7,), (33, 65)]  # the first is large enough for huge-page state
    return [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]


def _set_grads(params: list[torch.nn.Parameter], step: int) -> None:
    gen = torch.Generator().manual_seed(1000 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)


def _clone(params: list[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(p.detach().clone()) for p in params]


def _assert_optimizers_agree(ours: torch.optim.Optimizer, theirs: torch.optim.Optimizer) -> None:
    for g_ours, g_theirs in zip(ours.param_groups, theirs.param_groups):
        for p, q in zip(g_ours["params"], g_theirs["params"]):
            assert_close(p.detach(), q.detach(), "param")
            assert_close(ours.state[p]["exp_avg"], theirs.state[q]["exp_avg"], "exp_avg")
            assert_close(ours.state[p]["exp_avg_sq"], theirs.state[q]["exp_avg_sq"], "exp_avg_sq")
            assert float(ours.state[p]["step"]) == float(theirs.state[q]["step"])


def _train(opt: torch.optim.Optimizer, steps: int, first: int = 0, sched: object = None) -> None:
    params = [p for g in opt.param_groups for p in g["params"]]
    for s in range(first, first + steps):
        _set_grads(params, s)
        opt.step()
        if sched is not None:
            sched.step()


@pytest.mark.parametrize("adamw_mode", [True, False], ids=["adamw", "adam"])
def test_optimizer_matches_torch(backend: str, adamw_mode: bool) -> None:
    params = _model_params()
    ours = CPUAdam(params, lr=2e-3, betas=(0.8, 0.99), eps=1e-7, weight_decay=0.02, adamw_mode=adamw_mode)
    cls = torch.optim.AdamW if adamw_mode else torch.optim.Adam
    theirs = cls(_clone(params), lr=2e-3, betas=(0.8, 0.99), eps=1e-7, weight_decay=0.02)
    _train(ours, 30)
    _train(theirs, 30)
    _assert_optimizers_agree(ours, theirs)


def _in_staggered_buffers(state: dict[str, torch.Tensor], param: torch.Tensor) -> bool:
    """exp_avg / exp_avg_sq start 705 KiB / 1410 KiB further into their 2 MiB pages than the parameter does."""
    huge = 2 << 20
    offsets = [(state[k].data_ptr() - param.data_ptr()) % huge for k in ("exp_avg", "exp_avg_sq")]
    return offsets == [705 << 10, 1410 << 10] and state["exp_avg"].data_ptr() % 64 == 0


def test_optimizer_state_uses_huge_page_buffers(native: str) -> None:
    params = _model_params()
    opt = CPUAdam(params)
    _train(opt, 1)
    big = opt.state[params[0]]
    assert _in_staggered_buffers(big, params[0])
    assert big["exp_avg"].is_contiguous() and big["exp_avg"].shape == params[0].shape
    assert big["exp_avg"].untyped_storage().nbytes() == params[0].numel() * 4  # no padding in checkpoints
    small = opt.state[params[2]]
    assert small["exp_avg"].untyped_storage().nbytes() == params[2].numel() * 4


def test_optimizer_with_lr_scheduler_and_param_groups(backend: str) -> None:
    params = _model_params()
    groups = [
        {"params": params[:2]},
        {"params": params[2:], "lr": 5e-3, "betas": (0.5, 0.9), "weight_decay": 0.3, "eps": 1e-6},
    ]
    ours = CPUAdam(groups, lr=1e-3, weight_decay=0.01)
    clones = _clone(params)
    theirs = torch.optim.AdamW(
        [{"params": clones[:2]}, {**groups[1], "params": clones[2:]}], lr=1e-3, weight_decay=0.01
    )
    lam = lambda step: 1.0 / (1 + step)  # noqa: E731
    s_ours = torch.optim.lr_scheduler.LambdaLR(ours, lam)
    s_theirs = torch.optim.lr_scheduler.LambdaLR(theirs, lam)
    _train(ours, 20, sched=s_ours)
    _train(theirs, 20, sched=s_theirs)
    assert ours.param_groups[0]["lr"] == pytest.approx(1e-3 / 21)
    assert ours.param_groups[1]["lr"] == pytest.approx(5e-3 / 21)
    _assert_optimizers_agree(ours, theirs)


def test_per_group_adamw_mode_and_bias_correction(native: str) -> None:
    params = _model_params()
    initial = _clone(params)
    ours = CPUAdam(
        [{"params": params[:2]}, {"params": params[2:], "adamw_mode": False, "bias_correction": False}],
        weight_decay=0.1,
    )
    _train(ours, 5)
    # Group 1 against torch.optim.AdamW; group 2 against the kernel called directly with the same settings.
    theirs = torch.optim.AdamW(_clone(initial[:2]), weight_decay=0.1)
    _train(theirs, 5)
    for p, q in zip(params[:2], theirs.param_groups[0]["params"]):
        assert_close(p.detach(), q.detach(), "group 1 param")
    grads = []
    for s in range(5):
        probe = _clone(initial)
        _set_grads(probe, s)
        grads.append([q.grad.flatten() for q in probe])
    for i in (2, 3):
        expected, *_ = run_kernel(initial[i].detach().flatten(), [g[i] for g in grads], weight_decay=0.1,
                                  adamw_mode=False, bias_correction=False)  # fmt: skip
        assert_same_bits(params[i].detach().flatten(), expected, "group 2 param")


def test_state_dict_round_trip(backend: str) -> None:
    params = _model_params()
    opt = CPUAdam(params, lr=3e-3, weight_decay=0.05)
    _train(opt, 10)
    sd = opt.state_dict()
    assert set(sd["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}
    assert torch.is_tensor(sd["state"][0]["step"]) and float(sd["state"][0]["step"]) == 10
    restored_params = _clone(params)
    restored = CPUAdam(restored_params, lr=3e-3, weight_decay=0.05)
    restored.load_state_dict(_through_file(sd))
    _train(opt, 10, first=10)
    _train(restored, 10, first=10)
    for p, q in zip(params, restored_params):
        assert torch.equal(p, q)
        assert torch.equal(opt.state[p]["exp_avg_sq"], restored.state[q]["exp_avg_sq"])


def _through_file(state_dict: dict[str, object]) -> dict[str, object]:
    """Like a checkpoint: state_dict() hands out the live state tensors, a saved and loaded copy does not."""
    buffer = io.BytesIO()
    torch.save(state_dict, buffer)
    buffer.seek(0)
    return torch.load(buffer)


def test_loads_torch_adamw_state_dict_and_back(backend: str) -> None:
    params = _model_params()
    theirs = torch.optim.AdamW(params, lr=3e-3, weight_decay=0.05)
    _train(theirs, 10)
    ours_params = _clone(params)
    ours = CPUAdam(ours_params, lr=1.0)
    ours.load_state_dict(_through_file(theirs.state_dict()))
    assert ours.param_groups[0]["lr"] == 3e-3 and ours.param_groups[0]["adamw_mode"]
    assert _in_staggered_buffers(ours.state[ours_params[0]], ours_params[0])  # moved into huge-page buffers
    _train(theirs, 10, first=10)
    _train(ours, 10, first=10)
    _assert_optimizers_agree(ours, theirs)
    # And back: torch.optim.AdamW resumes from CPUAdam's state with decoupled weight decay.
    back = torch.optim.AdamW(_clone(ours_params))
    back.load_state_dict(_through_file(ours.state_dict()))
    assert back.param_groups[0]["decoupled_weight_decay"]
    _train(back, 5, first=20)
    _train(ours, 5, first=20)
    _assert_optimizers_agree(ours, back)


def test_noncontiguous_params_and_grads(native: str) -> None:
    base = torch.randn(64, 48)
    p = torch.nn.Parameter(torch.empty(48, 64).t())  # transposed strides
    with torch.no_grad():
        p.copy_(base)
    assert not p.is_contiguous()
    q = torch.nn.Parameter(base.clone())
    ours, theirs = CPUAdam([p], weight_decay=0.1), torch.optim.AdamW([q], weight_decay=0.1)
    for s in range(5):
        g = torch.randn(64, 48, generator=torch.Generator().manual_seed(s))
        p.grad, q.grad = g.t().contiguous().t(), g.clone()  # grad with transposed strides too
        ours.step()
        theirs.step()
    assert_close(p.detach(), q.detach(), "param")


def test_step_closure_returns_loss(native: str) -> None:
    p = torch.nn.Parameter(torch.ones(3))
    opt = CPUAdam([p], lr=0.1)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = (p * p).sum()
        loss.backward()
        return loss

    assert float(opt.step(closure).detach()) == 3.0
    assert torch.all(p < 1)


# ---------------------------------------------------------------------------------------------------------------
# Errors


def _good(n: int = 16) -> dict[str, torch.Tensor]:
    return dict(param=torch.zeros(n), grad=torch.zeros(n), exp_avg=torch.zeros(n), exp_avg_sq=torch.zeros(n))


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(param=torch.zeros(16, dtype=torch.float64)), "param has dtype torch.float64; allowed: float32"),
        (dict(grad=torch.zeros(16, dtype=torch.float64)), "grad has dtype torch.float64; allowed: float32, bfloat16"),
        (dict(exp_avg=torch.zeros(15)), "exp_avg has 15 elements but param has 16"),
        (dict(exp_avg_sq=torch.zeros(32)[::2]), "exp_avg_sq is not contiguous"),
        (dict(grad=torch.zeros(16).to_sparse()), "grad has layout torch.sparse_coo"),
        (dict(param=torch.zeros(16, device="meta")), "param is on meta"),
        (dict(out=torch.zeros(16)), "out has dtype torch.float32; allowed: bfloat16, float16"),
        (dict(out=torch.zeros(8, dtype=torch.bfloat16)), "out has 8 elements"),
        (dict(step=0), "step=0"),
        (dict(grad_scale=0.0), "grad_scale=0.0"),
        (dict(grad_scale=float("inf")), "grad_scale=inf"),
        (dict(grad=[0.0] * 16), "grad must be a torch.Tensor"),
    ],
)
def test_adam_step_rejects_bad_arguments(change: dict[str, object], message: str) -> None:
    kwargs: dict[str, object] = {**_good(), "step": 1, **HP, "weight_decay": 0.0, **change}
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("+", r"\+")):
        adam_step(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "params, kwargs, message",
    [
        ([torch.nn.Parameter(torch.zeros(3))], dict(amsgrad=True), "amsgrad=True is not supported"),
        ([torch.nn.Parameter(torch.zeros(3, dtype=torch.complex64))], {}, "complex parameter"),
        ([torch.nn.Parameter(torch.zeros(3, device="meta"))], {}, "is on meta"),
        ([torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))], {}, "dtype torch.bfloat16 is not supported"),
        ([torch.nn.Parameter(torch.zeros(3))], dict(lr=-1.0), "invalid lr=-1.0"),
        ([torch.nn.Parameter(torch.zeros(3))], dict(betas=(0.9, 1.0)), r"invalid betas\[1\]=1.0"),
        ([torch.nn.Parameter(torch.zeros(3))], dict(eps=-1e-8), "invalid eps"),
        ([torch.nn.Parameter(torch.zeros(3))], dict(weight_decay=-0.1), "invalid weight_decay"),
    ],
)
def test_optimizer_rejects_unsupported_options(
    params: list[torch.Tensor], kwargs: dict[str, object], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        CPUAdam(params, **kwargs)  # type: ignore[arg-type]


def test_optimizer_rejects_unsupported_groups_added_later() -> None:
    opt = CPUAdam([torch.nn.Parameter(torch.zeros(3))])
    with pytest.raises(ValueError, match="amsgrad=True"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))], "amsgrad": True})
    with pytest.raises(ValueError, match="is on meta"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2, device="meta"))]})


def test_sparse_gradients_rejected_at_step() -> None:
    p = torch.nn.Parameter(torch.zeros(4, 3))
    opt = CPUAdam([p])
    p.grad = torch.zeros(4, 3).to_sparse()
    with pytest.raises(ValueError, match="sparse gradients are not supported"):
        opt.step()


def test_environment_overrides_are_validated(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(_cpu_adam.BACKEND_ENV, "gpu")
    with pytest.raises(ValueError, match="OFFLOAD_CPU_ADAM_BACKEND='gpu'"):
        cpu_adam_backend()
    monkeypatch.setenv(_cpu_adam.BACKEND_ENV, "auto")
    monkeypatch.setenv(_cpu_adam.ISA_ENV, "neon")
    with pytest.raises(ValueError, match="OFFLOAD_CPU_ADAM_ISA='neon'"):
        cpu_adam_backend()


def test_cpu_flags_without_py_cpuinfo_come_from_the_kernel(monkeypatch):
    """Where py-cpuinfo is missing (a machine set up without the package's dependencies), the flags come from
    /proc/cpuinfo, so the kernel is as wide as the CPU allows rather than scalar."""
    with_package = supported_isas()
    _cpu_adam.cpu_flags.cache_clear()
    monkeypatch.setitem(sys.modules, "cpuinfo", None)  # import cpuinfo raises ImportError
    try:
        assert supported_isas() == with_package
    finally:
        _cpu_adam.cpu_flags.cache_clear()
