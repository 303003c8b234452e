"""Shared by the fault-injection tests: a FileIO that fails chosen swap-file syscalls, a hang guard, and
:class:`Forks`, processes to kill that skip the interpreter's imports.

``Faults.arm(op, fault, times, after)`` lets ``after`` calls of ``op`` ("write" or "read", on either I/O path:
kernel AIO or pread/pwrite) through, then makes the next ``times`` fail with ``fault``: an errno (the call fails with
it), ``("short", n)`` (the call moves only ``n`` bytes), or an exception instance (raised from the worker thread as a
bug would be). ``times=None`` keeps failing until ``disarm``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Callable

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the shared test models

from nvme_swapper import FileIO  # noqa: E402


class Faults(FileIO):
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.armed: dict[str, tuple[object, int | None]] = {}
        self.passes: dict[str, int] = {}  # calls still let through before an armed fault
        self.hits: dict[str, int] = {"write": 0, "read": 0}

    def arm(self, op: str, fault: object, times: int | None = None, after: int = 0) -> None:
        with self.lock:
            self.armed[op] = (fault, times)
            self.passes[op] = after

    def disarm(self) -> None:
        with self.lock:
            self.armed.clear()

    def _take(self, op: str) -> object | None:
        with self.lock:
            if op not in self.armed:
                return None
            if self.passes.get(op, 0) > 0:
                self.passes[op] -= 1
                return None
            fault, times = self.armed[op]
            if times is not None:
                if times <= 1:
                    del self.armed[op]
                else:
                    self.armed[op] = (fault, times - 1)
            self.hits[op] += 1
            return fault

    def _sync(self, op: str, call: Callable[..., int], fd: int, buf: memoryview, offset: int) -> int:
        fault = self._take(op)
        if fault is None:
            return call(fd, buf, offset)
        if isinstance(fault, BaseException):
            raise fault
        if isinstance(fault, tuple):
            return call(fd, buf[: fault[1]], offset) if fault[1] else 0
        raise OSError(fault, os.strerror(fault))

    def pwrite(self, fd: int, buf: memoryview, offset: int) -> int:
        return self._sync("write", super().pwrite, fd, buf, offset)

    def pread(self, fd: int, buf: memoryview, offset: int) -> int:
        return self._sync("read", super().pread, fd, buf, offset)

    def aio_run(self, ctx, depth, fd, is_write, transfers, single_submit=False, overlap=True):
        fault = self._take("write" if is_write else "read")
        if fault is None:
            return super().aio_run(ctx, depth, fd, is_write, transfers, single_submit, overlap)
        if isinstance(fault, BaseException):
            raise fault
        if isinstance(fault, tuple):  # the first transfer comes up short
            addr, n, off = transfers[0]
            if fault[1]:
                assert super().aio_run(ctx, depth, fd, is_write, [(addr, fault[1], off)]) is None
            return (0, fault[1])
        return (0, -fault)


def bounded(fn: Callable[[], Any], seconds: float = 60.0) -> Any:
    """Runs ``fn`` on a helper thread; a call still running after ``seconds`` fails the test (a hang), instead
    of hanging the suite. Returns its result or raises its exception."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as exc:
            out["error"] = exc

    t = threading.Thread(target=run, name="test-bounded", daemon=True)
    t.start()
    t.join(seconds)
    if t.is_alive():
        pytest.fail(f"{getattr(fn, '__name__', fn)} still running after {seconds} s: a hang")
    if "error" in out:
        raise out["error"]
    return out.get("value")


# Forks' server: imports once, then forks a run per line of its stdin (JSON: code, argv, env, log, timeout) and
# answers each with the run's exit status as subprocess gives it (-9: killed by SIGKILL). A run's stdout and stderr
# go to its log; SIGALRM ends one that outlives its timeout (a hang: -14).
_SERVER = """
import json, os, signal, sys, traceback
sys.path.insert(0, sys.argv[1])
for name in sys.argv[2:]:
    __import__(name)
import torch
assert not torch.cuda.is_initialized(), "CUDA initialized before fork: the runs could not use it"
for line in sys.stdin:
    job = json.loads(line)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            fd = os.open(job["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            signal.alarm(job["timeout"])
            os.environ.update(job["env"])
            sys.argv = ["run", *job["argv"]]
            exec(compile(job["code"], "run", "exec"), {"__name__": "__run__"})
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), flush=True)
"""


class Forks:
    """Runs of a script, each a new process forked from one that imported ``modules`` once: a test that kills
    and restarts training many times pays the imports (torch, transformers: seconds each) once. Nothing of torch
    runs before a fork (no thread pool, no CUDA: NVML answers torch.cuda.is_available), so each run starts as a
    fresh process would. ``close()`` ends the server."""

    def __init__(self, modules: list[str]) -> None:
        tests = str(Path(__file__).resolve().parent.parent)
        env = {**os.environ, "PYTORCH_NVML_BASED_CUDA_CHECK": "1"}
        self.proc = subprocess.Popen([sys.executable, "-c", _SERVER, tests, *modules], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env)

    def run(self, code: str, argv: list[str], log: Path, env: dict[str, str] | None = None,
            timeout: int = 240) -> tuple[int, str]:
        """``code`` run with ``sys.argv[1:] = argv`` and ``env`` added to the environment, in a new process;
        returns its exit status (negative: the signal that ended it) and what it wrote (stdout and stderr)."""
        job = {"code": code, "argv": argv, "env": env or {}, "log": str(log), "timeout": timeout}
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        answer = self.proc.stdout.readline()
        if not answer:
            raise RuntimeError(f"the fork server ended (exit status {self.proc.wait()})")
        return int(answer), log.read_text()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(30)
