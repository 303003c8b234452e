"""Shared fixtures: real filesystems to test against (a size-limited ext4 image, a tmpfs), mounted when we are root;
the thread-leak check; the session's set-up for runs on CUDA; what a run on a lent machine needs to be read after a
time limit cut it short (the versions it ran, each failure written out as it happens)."""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess
import threading
from pathlib import Path

import pytest

# Runs that must agree bit for bit (an engine against its reference, a child process against this one) need
# cuBLAS's deterministic workspace on CUDA; child processes inherit it.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

# Under pytest-xdist each worker is a process with torch's default of one compute thread per core: 12 workers on a
# lent 16-core machine ran about 200 threads, and tests that take 13 s ran past a 150 s limit. Each worker, and the
# processes its tests start, gets its share of the cores instead, unless OMP_NUM_THREADS says otherwise.
if "PYTEST_XDIST_WORKER_COUNT" in os.environ and "OMP_NUM_THREADS" not in os.environ:
    _cores = len(os.sched_getaffinity(0))
    os.environ["OMP_NUM_THREADS"] = str(max(1, _cores // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))


def pytest_sessionstart(session: pytest.Session) -> None:
    """Builds the C++ Adam kernel before the first test, so that a cold build (a minute on a fresh machine) is not
    charged to whichever engine test comes first under a per-test time limit (a failed build falls back to the
    torch implementation with a warning, and the kernel's own tests fail)."""
    from offload.ops._cpu_adam import cpu_adam_backend

    cpu_adam_backend()


def pytest_report_header() -> str:
    """The versions a failure may depend on: another machine (a lent GPU's) brings its own torch and transformers."""
    def version(name: str) -> str:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return "absent"

    import torch

    try:
        cuda = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    except RuntimeError as exc:  # a driver that fails here fails the tests that use it, with their own errors
        cuda = f"unreadable ({exc})"
    names = ("torch", "transformers", "peft", "accelerate", "safetensors", "deepspeed", "torchao")
    return f"offload test run: CUDA {cuda}; " + ", ".join(f"{n} {version(n)}" for n in names)


# where each failure's traceback goes as it happens (pytest prints them only at the end of the session, which a
# time limit on a lent machine may never reach); absolute, as tests change the working directory
FAILURES = os.path.abspath(os.environ["OFFLOAD_TEST_FAILURES"]) if os.environ.get("OFFLOAD_TEST_FAILURES") else None


def _record_failure(report: pytest.TestReport | pytest.CollectReport, when: str) -> None:
    """Appends a failed report to FAILURES. Under xdist the controller gets every worker's reports, so only it
    writes; a file that cannot be written is skipped, never a reason for the run to fail."""
    if FAILURES is None or not report.failed or "PYTEST_XDIST_WORKER" in os.environ:
        return
    try:
        with open(FAILURES, "a") as f:
            f.write(f"=== {report.nodeid} ({when})\n{report.longreprtext}\n\n")
    except OSError:
        pass


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _record_failure(report, report.when)


def pytest_collectreport(report: pytest.CollectReport) -> None:
    _record_failure(report, "collection")


def _run(*cmd: str) -> bool:
    return subprocess.run(cmd, capture_output=True).returncode == 0


def _mount(kind: str, target: Path, image: Path | None = None, size_mb: int = 16) -> bool:
    if os.geteuid() != 0:
        return False
    target.mkdir(parents=True, exist_ok=True)
    if kind == "tmpfs":
        return _run("mount", "-t", "tmpfs", "-o", f"size={size_mb}m,mode=0700", "tmpfs", str(target))
    assert image is not None
    with open(image, "wb") as f:
        f.truncate(size_mb << 20)
    if not shutil.which("mkfs.ext4") or not _run("mkfs.ext4", "-q", "-F", str(image)):
        return False
    return _run("mount", "-o", "loop", str(image), str(target))


@pytest.fixture
def small_ext4(tmp_path: Path):
    """A 16 MiB ext4 filesystem on a loop device: real ENOSPC from a real filesystem."""
    target = tmp_path / "small"
    if not _mount("ext4", target, tmp_path / "small.img"):
        pytest.skip("needs root and loop mounts to make a size-limited ext4 filesystem")
    yield target
    _run("umount", str(target))


@pytest.fixture
def tmpfs_dir(tmp_path: Path):
    target = tmp_path / "tmpfs"
    if not _mount("tmpfs", target, size_mb=64):
        pytest.skip("needs root to mount a tmpfs")
    yield target
    _run("umount", str(target))


@pytest.fixture(autouse=True)
def no_leaked_io_threads():
    """Every test must join the I/O and optimizer threads it started. Only threads started during the test count,
    so a test that failed and left threads behind fails alone instead of failing every test after it."""
    before = set(threading.enumerate())
    yield
    started = [t for t in threading.enumerate() if t not in before and t.name.startswith(("nvme_swapper", "offload"))]
    for t in started:
        t.join(timeout=2.0)  # one finishing its last job as close() returns
    alive = [t.name for t in started if t.is_alive()]
    assert not alive, f"threads left running: {alive}"
