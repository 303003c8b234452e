"""nvme_swapper: byte-exact round trips, ordering and concurrency, the buffered fallback, errors, and cleanup."""

from __future__ import annotations

import asyncio
import errno
import logging
import mmap
import os
import stat
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from nvme_swapper import (PAGE, AioConfig, FileIO, SwapEngine, aligned_tensor, checksum_kind, is_aligned,
                          tensor_checksum)

BACKENDS = ["aio", "threads", "aiofiles"]
DTYPES = [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.bfloat16,
          torch.float32, torch.float64, torch.bool, torch.complex64]


def random_tensor(numel: int, dtype: torch.dtype, *, aligned: bool, seed: int = 0, offset: int = 0) -> torch.Tensor:
    """Random bytes viewed as ``dtype``; page-aligned, or deliberately ``offset`` bytes past an aligned start."""
    size = torch.empty((), dtype=dtype).element_size()
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (numel * size,), dtype=torch.uint8, generator=gen)
    if aligned:
        buf = aligned_tensor(numel * size)
        buf.copy_(raw)
    else:
        base = aligned_tensor(numel * size + offset + size)
        buf = base[offset : offset + numel * size]
        buf.copy_(raw)
    return buf.view(dtype)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


# round trips ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("numel", [0, 1, PAGE - 1, PAGE, PAGE + 1, 3 * (1 << 16) + 5])
def test_round_trip_sizes(tmp_path, backend, numel):
    cfg = AioConfig(backend=backend, block_size=1 << 16, queue_depth=4, thread_count=2)
    with SwapEngine(tmp_path, cfg) as eng:
        for aligned in (True, False):
            src = random_tensor(numel, torch.uint8, aligned=aligned, offset=3, seed=numel)
            eng.write(f"k{aligned}", src).wait()
            out = torch.full_like(src, 7)
            eng.read(f"k{aligned}", out).wait()
            assert same_bytes(out, src)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    numel=st.integers(0, 300_000),
    dtype=st.sampled_from(DTYPES),
    offset=st.integers(0, PAGE - 1),
    backend=st.sampled_from(BACKENDS),
    block_shift=st.integers(12, 18),
    threads=st.integers(1, 3),
    seed=st.integers(0, 2**31),
)
def test_round_trip_property(tmp_path, numel, dtype, offset, backend, block_shift, threads, seed):
    """Any dtype, size, alignment and block geometry comes back byte for byte, including after an overwrite."""
    size = torch.empty((), dtype=dtype).element_size()
    offset -= offset % size  # torch views need element alignment; page misalignment is what we exercise
    cfg = AioConfig(backend=backend, block_size=1 << block_shift, thread_count=threads, queue_depth=threads * 2)
    with SwapEngine(tmp_path, cfg) as eng:
        first = random_tensor(numel, dtype, aligned=offset == 0, offset=offset, seed=seed)
        second = random_tensor(numel, dtype, aligned=False, offset=size, seed=seed + 1)
        eng.write("x", first).wait()
        eng.write("x", second).wait()
        out = random_tensor(numel, dtype, aligned=offset % 2 == 0, offset=offset, seed=seed + 2)
        eng.read("x", out).wait()
        assert same_bytes(out, second)
        if backend != "aiofiles":  # buffered aiofiles never needs a bounce; O_DIRECT does for `second`
            assert eng.stats()["bytes_bounced"] >= numel * size


def test_aligned_tensor():
    for shape, dtype in [(0, torch.float32), (1, torch.uint8), ((3, 5), torch.float64), (3 << 20, torch.bfloat16)]:
        t = aligned_tensor(shape, dtype)
        assert is_aligned(t) and t.is_contiguous() and t.dtype == dtype
        assert t.shape == ((shape,) if isinstance(shape, int) else shape)
        assert not t.any()
    assert aligned_tensor(4 << 20).data_ptr() % (2 << 20) == 0  # large buffers start on a huge-page boundary
    with pytest.raises(ValueError, match="negative"):
        aligned_tensor((-1, 2))


# ordering and concurrency -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_same_key_requests_run_in_issue_order(tmp_path, backend):
    cfg = AioConfig(backend=backend, block_size=1 << 16, thread_count=3, queue_depth=6)
    with SwapEngine(tmp_path, cfg) as eng:
        versions = [random_tensor(200_000, torch.uint8, aligned=v % 2 == 0, offset=5, seed=v) for v in range(6)]
        outs = [torch.empty(200_000, dtype=torch.uint8) for _ in versions]
        handles = []
        for v, out in zip(versions, outs):  # nothing waited between: write, read, write, read ...
            handles.append(eng.write("k", v))
            handles.append(eng.read("k", out))
        for h in handles:
            h.wait()
        for v, out in zip(versions, outs):
            assert same_bytes(out, v)


@pytest.mark.parametrize("backend", ["aio", "threads"])
def test_hundreds_of_keys_from_threads_and_asyncio(tmp_path, backend):
    """Hundreds of keys in flight from four threads and 64 asyncio tasks at once; every byte checked."""
    cfg = AioConfig(backend=backend, block_size=1 << 16, thread_count=2, queue_depth=16)
    with SwapEngine(tmp_path, cfg) as eng:
        errors: list[BaseException] = []

        def thread_work(t: int) -> None:
            try:
                data = {f"t{t}-{i}": random_tensor(1000 + 997 * i, torch.uint8, aligned=i % 3 == 0, offset=i,
                                                   seed=t * 1000 + i) for i in range(75)}
                writes = [eng.write(k, v) for k, v in data.items()]  # all in flight together
                for h in writes:
                    h.wait()
                outs = {k: torch.empty_like(v) for k, v in data.items()}
                reads = [eng.read(k, outs[k]) for k in data]
                for h in reads:
                    h.wait()
                for k, v in data.items():
                    assert same_bytes(outs[k], v), k
            except BaseException as exc:  # surfaced in the main thread below
                errors.append(exc)

        async def task_work(i: int) -> None:
            src = random_tensor(5000 + i * 131, torch.float32, aligned=i % 2 == 0, offset=4, seed=10_000 + i)
            await eng.awrite(f"a{i}", src)
            out = torch.empty_like(src)
            await eng.aread(f"a{i}", out)
            assert same_bytes(out, src)

        async def all_tasks() -> None:
            await asyncio.gather(*(task_work(i) for i in range(64)))

        threads = [threading.Thread(target=thread_work, args=(t,)) for t in range(4)]
        for t in threads:
            t.start()
        asyncio.run(all_tasks())
        for t in threads:
            t.join(timeout=120)
        assert not errors, errors
        assert len(eng.keys()) == 4 * 75 + 64
        assert eng.stats()["in_flight"] == 0


@pytest.mark.asyncio
async def test_asyncio_api(tmp_path):
    with SwapEngine(tmp_path, AioConfig(block_size=1 << 16)) as eng:
        src = random_tensor(123_457, torch.int16, aligned=True, seed=3)
        out = torch.zeros_like(src)
        await eng.awrite("k", src)
        await eng.aread("k", out)
        assert same_bytes(out, src)
        handle = eng.write("k2", src)
        await handle
        assert handle.done()


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(1, 5 * PAGE), min_size=1, max_size=30), writes=st.integers(1, 4),
       orders=st.lists(st.permutations(list(range(30))), min_size=1, max_size=6))
@example(sizes=[12 * PAGE] * 26 + [9 * PAGE], writes=4, orders=[list(range(30))] * 6)  # sub-groups, a short last
def test_rewrites_of_keys_of_many_sizes_stay_within_the_spare_room(sizes, writes, orders):
    """Keys of several sizes rewritten copy-on-write in any order, up to ``writes`` at once (an extent freed once
    its rewrite is done): the file never grows past the live extents, the header and cow_spare's room (best-fit
    over coalesced space grew 10-21% past it: a smaller key split a larger one's hole)."""
    import tempfile

    from nvme_swapper import cow_spare
    from nvme_swapper._swapfile import SwapFile

    live = sum(-(-n // PAGE) * PAGE for n in sizes)
    bound = PAGE + live + cow_spare([[n] for n in sizes], writes)
    with tempfile.TemporaryDirectory() as d:
        f = SwapFile(Path(d) / "swap", FileIO(), o_direct=False)
        try:
            f.reserve(live + cow_spare([[n] for n in sizes], writes))
            extents = [f.allocate(n) for n in sizes]
            in_flight: list[tuple[int, object]] = []
            for order in orders:
                for k in (k for k in order if k < len(sizes)):
                    in_flight.append((k, f.allocate(sizes[k])))
                    assert f.size <= bound, (f.size, bound)
                    if len(in_flight) == writes:
                        done, new = in_flight.pop(0)
                        f.free(extents[done])
                        extents[done] = new
                for done, new in in_flight:
                    f.free(extents[done])
                    extents[done] = new
                in_flight.clear()
        finally:
            f.close(remove=True)


def test_a_killed_processs_swap_folder_goes_at_the_next_start(tmp_path):
    """A process killed with its swap engine open (SIGKILL: no close) leaves its swap folder; the next engine on
    that directory removes it before anything is measured there, and only it: the folder of a live engine, one of
    another host (a shared filesystem) or pid namespace (a container on this host) and one without an owner record
    stay."""
    import json
    import subprocess
    import sys

    script = ("import os, signal, sys, torch; sys.path.insert(0, sys.argv[2]); from nvme_swapper import SwapEngine;"
              "e = SwapEngine(sys.argv[1]); e.write('k', torch.ones(1 << 18)).wait();"
              "os.kill(os.getpid(), signal.SIGKILL)")
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path), str(root)], capture_output=True)
    assert done.returncode == -9, done.stderr[-2000:]
    (dead,) = tmp_path.glob("swap-*")
    assert (dead / "swap.0").stat().st_size >= 1 << 20
    owner = json.loads((dead / ".owner").read_text())
    foreign, container, ownerless = tmp_path / "swap-foreign", tmp_path / "swap-container", tmp_path / "swap-ownerless"
    for folder, changed in ((foreign, {"host": "another-host"}), (container, {"pidns": owner["pidns"] + 1})):
        folder.mkdir()  # the same dead pid, on another host / in another pid namespace (its pids are not ours)
        (folder / ".owner").write_text(json.dumps({**owner, **changed}))
    ownerless.mkdir()
    with SwapEngine(tmp_path) as live, SwapEngine(tmp_path) as second:
        assert not dead.exists()
        assert live.directory.exists() and foreign.exists() and container.exists() and ownerless.exists()
        assert {p.name for p in tmp_path.glob("swap-*")} == {live.directory.name, second.directory.name,
                                                             "swap-foreign", "swap-container", "swap-ownerless"}


def test_overwrite_reuses_space_and_delete_returns_it(tmp_path):
    with SwapEngine(tmp_path, AioConfig(block_size=1 << 16)) as eng:
        src = random_tensor(1 << 20, torch.uint8, aligned=True)
        for _ in range(10):
            eng.write("k", src).wait()
        s = eng.stats()
        assert s["live_bytes"] == 1 << 20
        assert s["file_bytes"] <= PAGE + 2 * (1 << 20)  # one live extent plus one spare, however many overwrites
        eng.delete("k")
        assert eng.stats()["file_bytes"] == PAGE and eng.keys() == []
        with pytest.raises(KeyError):
            eng.delete("k")


# buffered fallback ------------------------------------------------------------------------------------------------


class RefuseODirect(FileIO):
    """A filesystem that refuses O_DIRECT at open, as tmpfs did before Linux 6.6 and some overlay mounts do."""

    def open(self, path, flags, mode=0o600):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument", path)
        return super().open(path, flags, mode)


@pytest.mark.parametrize("backend", ["auto", "aio", "threads"])
def test_buffered_fallback_when_o_direct_refused(tmp_path, caplog, backend):
    caplog.set_level(logging.WARNING, logger="nvme_swapper")
    with SwapEngine(tmp_path / backend, AioConfig(backend=backend, block_size=1 << 16), file_io=RefuseODirect()) as eng:
        s = eng.stats()
        assert s["o_direct"] is False and "refuses O_DIRECT" in s["fallback_reason"]
        assert eng.backend == "threads"
        src = random_tensor(300_001, torch.uint8, aligned=False, offset=1)
        eng.write("k", src).wait()
        out = torch.empty_like(src)
        eng.read("k", out).wait()
        assert same_bytes(out, src)
    assert sum("refuses O_DIRECT" in r.message for r in caplog.records) == 1
    with SwapEngine(tmp_path / backend, AioConfig(backend=backend), file_io=RefuseODirect()):
        pass
    assert sum("refuses O_DIRECT" in r.message for r in caplog.records) == 1  # said once per directory


@pytest.mark.parametrize("backend", ["auto", "aiofiles"])
def test_tmpfs(tmpfs_dir, backend):
    """On tmpfs (O_DIRECT since Linux 6.6; buffered before): round trips work either way and stats say which."""
    with SwapEngine(tmpfs_dir, AioConfig(backend=backend, block_size=1 << 16)) as eng:
        src = random_tensor(1_000_003, torch.uint8, aligned=True)
        eng.write("k", src).wait()
        out = torch.empty_like(src)
        eng.read("k", out).wait()
        assert same_bytes(out, src)
        s = eng.stats()
        assert isinstance(s["o_direct"], bool) and (s["o_direct"] or s["fallback_reason"])


# errors -----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["thread", "barrier", "header"])
def test_an_interrupt_while_the_engine_is_built_leaves_no_thread_file_or_fd(tmp_path, monkeypatch, where):
    """A KeyboardInterrupt (a second Ctrl-C) right after the second I/O thread started, after all of them passed
    their start, or while the swap file's header is written: the threads started leave, the swap file, its fd and
    the engine's folder go (before, the threads waited at their start barrier, or on their queue, forever and the
    fd stayed open on a deleted file)."""
    from nvme_swapper import _swapfile

    fds = set(os.listdir("/proc/self/fd"))
    if where == "thread":
        start = threading.Thread.start

        def start_then_interrupted(self):
            start(self)
            if self.name == "nvme_swapper-io-1":
                raise KeyboardInterrupt

        monkeypatch.setattr(threading.Thread, "start", start_then_interrupted)
    elif where == "barrier":  # once every thread has passed its start: they wait for work
        wait = threading.Barrier.wait

        def wait_then_interrupted(self, *args):
            index = wait(self, *args)
            if threading.current_thread() is threading.main_thread():
                time.sleep(0.2)  # (the threads are past their start, waiting on the queue)
                raise KeyboardInterrupt
            return index

        monkeypatch.setattr(threading.Barrier, "wait", wait_then_interrupted)
    else:
        def interrupted(self):
            raise KeyboardInterrupt

        monkeypatch.setattr(_swapfile.SwapFile, "_write_header", interrupted)
    with pytest.raises(KeyboardInterrupt):
        SwapEngine(tmp_path, AioConfig(thread_count=4, o_direct=False))
    monkeypatch.undo()
    assert not [t for t in threading.enumerate() if t.name.startswith("nvme_swapper")]
    assert set(os.listdir("/proc/self/fd")) <= fds and list(tmp_path.iterdir()) == []


def test_unknown_key_and_size_mismatch(tmp_path):
    with SwapEngine(tmp_path) as eng:
        with pytest.raises(KeyError, match="'missing'"):
            eng.read("missing", torch.empty(4))
        eng.write("k", torch.zeros(10, dtype=torch.float32)).wait()
        with pytest.raises(ValueError, match=r"40 bytes were written.* has 80"):
            eng.read("k", torch.empty(10, dtype=torch.float64))
        with pytest.raises(ValueError, match="not contiguous"):
            eng.write("nc", torch.zeros(4, 4).t())
        with pytest.raises(ValueError, match="key must be a str"):
            eng.write(3, torch.zeros(1))  # type: ignore[arg-type]
    for call in (lambda: eng.write("k", torch.zeros(1)), eng.keys, lambda: eng.nbytes("k"), lambda: eng.delete("k")):
        with pytest.raises(RuntimeError, match="is closed: its keys went with its swap file"):
            call()
    assert eng.stats()["writes"] == 1  # the final counters


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(block_size=1000), "block_size must be a power of two"),
        (dict(block_size=1 << 30), "block_size"),
        (dict(queue_depth=0), "queue_depth"),
        (dict(thread_count=4, queue_depth=2), r"queue_depth \(2\) must be at least aio.thread_count \(4\)"),
        (dict(thread_count=0), "thread_count"),
        (dict(backend="io_uring"), "backend must be one of"),
        (dict(block_size="1M"), "block_size must be an integer"),
        (dict(o_direct=1), "o_direct must be true or false"),
    ],
)
def test_config_errors_name_the_key(bad, match):
    with pytest.raises(ValueError, match=match):
        AioConfig(**bad)


def test_config_from_deepspeed_json():
    cfg = AioConfig.from_dict({"block_size": 1 << 20, "queue_depth": 8, "intra_op_parallelism": 2,
                               "single_submit": False, "overlap_events": True, "use_gds": False})
    assert cfg.thread_count == 2 and cfg.depth_per_thread == 4
    with pytest.raises(ValueError, match="unknown key aio.queue_dept"):
        AioConfig.from_dict({"queue_dept": 8})
    with pytest.raises(ValueError, match="given twice"):
        AioConfig.from_dict({"thread_count": 1, "intra_op_parallelism": 2})
    with pytest.raises(ValueError, match="use_gds"):
        AioConfig.from_dict({"use_gds": True})


class Faults(FileIO):
    """Fails chosen syscalls: ``fail[(op, nth)] = errno or ('short', nbytes)``; counts calls per op."""

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}
        self.fail: dict[str, object] = {}
        self.lock = threading.Lock()

    def _hit(self, op: str):
        with self.lock:
            self.calls[op] = self.calls.get(op, 0) + 1
            return self.fail.get(op)

    def pwrite(self, fd, buf, offset):
        f = self._hit("pwrite")
        if isinstance(f, int):
            raise OSError(f, os.strerror(f))
        if isinstance(f, tuple):
            return super().pwrite(fd, buf[: f[1]], offset)
        return super().pwrite(fd, buf, offset)

    def pread(self, fd, buf, offset):
        f = self._hit("pread")
        if isinstance(f, int):
            raise OSError(f, os.strerror(f))
        if isinstance(f, tuple):
            return super().pread(fd, buf[: f[1]], offset) if f[1] else 0
        return super().pread(fd, buf, offset)

    def aio_run(self, ctx, depth, fd, is_write, transfers, single_submit=False, overlap=True):
        f = self._hit("aio_write" if is_write else "aio_read")
        if isinstance(f, int):
            return (0, -f)
        if isinstance(f, tuple):  # the first transfer comes up short
            addr, n, off = transfers[0]
            done = super().aio_run(ctx, depth, fd, is_write, [(addr, f[1], off)])
            assert done is None
            return (0, f[1])
        return super().aio_run(ctx, depth, fd, is_write, transfers, single_submit, overlap)


def test_a_failed_space_reservation_names_the_file(tmp_path):
    """reserve() writes zeros with pwrite; its error says which file and how far it got, as every I/O error does."""
    faults = Faults()
    with SwapEngine(tmp_path, AioConfig(block_size=1 << 16), file_io=faults) as eng:
        faults.fail["pwrite"] = errno.EIO
        with pytest.raises(OSError) as info:
            eng.reserve(1 << 20)
        assert info.value.errno == errno.EIO and str(eng.directory) in str(info.value)
        assert "writing 1048576 bytes of zeros to reserve space" in str(info.value)
        faults.fail.clear()
        eng.write("k", aligned_tensor(4096, torch.uint8)).wait()  # the engine is still usable


@pytest.mark.parametrize("backend", ["aio", "threads"])
@pytest.mark.parametrize("op, fault, code", [
    ("write", errno.ENOSPC, errno.ENOSPC),
    ("write", errno.EIO, errno.EIO),
    ("write", ("short", 0), errno.ENOSPC),
    ("read", errno.EIO, errno.EIO),
    ("read", ("short", 0), errno.EIO),
])
def test_injected_io_errors_surface_from_wait(tmp_path, backend, op, fault, code):
    faults = Faults()
    cfg = AioConfig(backend=backend, block_size=1 << 16, thread_count=2, queue_depth=4)
    with SwapEngine(tmp_path, cfg, file_io=faults) as eng:
        old = random_tensor(300_000, torch.uint8, aligned=True, seed=1)
        new = random_tensor(300_000, torch.uint8, aligned=True, seed=2)
        eng.write("k", old).wait()
        syscall = {"aio": "aio_", "threads": "p"}[backend] + op
        if isinstance(fault, tuple):
            faults.fail["pwrite" if op == "write" else "pread"] = fault  # the synchronous retry fails too
        faults.fail[syscall] = fault
        handle = eng.write("k", new) if op == "write" else eng.read("k", aligned_tensor(old.numel()))
        with pytest.raises(OSError) as info:
            handle.wait()
        assert info.value.errno == code
        assert "'k'" in str(info.value) and str(eng.directory) in str(info.value)
        faults.fail.clear()
        out = torch.empty_like(old)
        eng.read("k", out).wait()
        assert same_bytes(out, old)  # a failed overwrite lost nothing; a failed read damaged nothing
        assert eng.stats()["failed"] == 1


def test_real_enospc_keeps_previous_content(small_ext4):
    """A real 16 MiB filesystem: a write that does not fit fails from wait() and the old bytes stay readable."""
    with SwapEngine(small_ext4, AioConfig(block_size=1 << 16)) as eng:
        old = random_tensor(6 << 20, torch.uint8, aligned=True, seed=1)
        eng.write("k", old).wait()
        handle = eng.write("k", random_tensor(12 << 20, torch.uint8, aligned=True, seed=2))
        with pytest.raises(OSError) as info:
            handle.wait()
        assert info.value.errno == errno.ENOSPC and "'k'" in str(info.value)
        out = torch.empty_like(old)
        eng.read("k", out).wait()
        assert same_bytes(out, old)
        with pytest.raises(OSError) as info:
            eng.reserve(64 << 20)
        assert info.value.errno == errno.ENOSPC
    assert os.listdir(small_ext4) == ["lost+found"]


def test_truncated_file_is_a_short_read_not_a_hang(tmp_path):
    with SwapEngine(tmp_path, AioConfig(block_size=1 << 16)) as eng:
        src = random_tensor(1 << 20, torch.uint8, aligned=True)
        eng.write("k", src).wait()
        os.truncate(eng.directory / "swap.0", PAGE + 4096)  # damaged behind the engine's back
        with pytest.raises(OSError, match="short read") as info:
            eng.read("k", torch.empty_like(src)).wait(timeout=30)
        assert info.value.errno == errno.EIO


# lifetime and permissions -----------------------------------------------------------------------------------------


def _open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("backend", BACKENDS)
def test_close_leaves_no_thread_file_or_descriptor(tmp_path, backend):
    before = _open_fds()
    eng = SwapEngine(tmp_path, AioConfig(backend=backend, thread_count=2, queue_depth=4))
    d = eng.directory
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(d / "swap.0").st_mode) == 0o600
    handles = [eng.write(f"k{i}", random_tensor(100_000, torch.uint8, aligned=True, seed=i)) for i in range(20)]
    eng.close()  # waits for the writes in flight
    assert all(h.done() for h in handles)
    eng.close()  # idempotent
    assert not d.exists() and list(tmp_path.iterdir()) == []
    assert _open_fds() <= before
    assert not [t for t in threading.enumerate() if t.name.startswith("nvme_swapper")]


def test_keep_leaves_file_and_manifest(tmp_path):
    with SwapEngine(tmp_path, keep=True) as eng:
        eng.write("k", torch.arange(10, dtype=torch.int64)).wait()
    manifest = (eng.directory / "manifest.json").read_text()
    assert '"k"' in manifest and (eng.directory / "swap.0").exists()
    assert stat.S_IMODE(os.stat(eng.directory / "manifest.json").st_mode) == 0o600


def test_directory_that_is_a_file(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ValueError, match="not a directory"):
        SwapEngine(f)


def test_keys_nbytes_and_stats(tmp_path):
    with SwapEngine(tmp_path) as eng:
        eng.write("b", torch.zeros(3, dtype=torch.float16)).wait()
        eng.write("a", torch.zeros(5, dtype=torch.float32)).wait()
        assert eng.keys() == ["a", "b"] and eng.nbytes("a") == 20 and eng.nbytes("b") == 6
        s = eng.stats()
        assert s["writes"] == 2 and s["bytes_written"] == 26 and s["keys"] == 2
        with pytest.raises(KeyError):
            eng.nbytes("c")


def test_wait_timeout(tmp_path):
    class Slow(FileIO):
        def __init__(self):
            self.gate = threading.Event()
            self.gate.set()  # open while the engine starts (it writes its files' headers), shut for the write below

        def pwrite(self, fd, buf, offset):
            self.gate.wait(10)
            return super().pwrite(fd, buf, offset)

    slow = Slow()
    eng = SwapEngine(tmp_path, AioConfig(backend="threads"), file_io=slow)
    slow.gate.clear()
    try:
        handle = eng.write("k", torch.zeros(PAGE, dtype=torch.uint8))
        with pytest.raises(TimeoutError, match="write of key 'k' not finished"):
            handle.wait(timeout=0.05)
        assert not handle.done()
    finally:
        slow.gate.set()
        eng.close()
    assert handle.done()


def test_unaligned_tensor_is_counted_as_bounced(tmp_path):
    """Under O_DIRECT an unaligned tensor goes through the bounce buffer whole, an aligned one its sub-page tail
    only; a buffered file bounces nothing."""
    with SwapEngine(tmp_path, AioConfig(block_size=1 << 16)) as eng:
        direct = eng.stats()["o_direct"]
        src = random_tensor(100_000, torch.uint8, aligned=False, offset=1)
        eng.write("k", src).wait()
        assert eng.stats()["bytes_bounced"] == (100_000 if direct else 0)
        aligned = random_tensor(100_000, torch.uint8, aligned=True)
        eng.write("k", aligned).wait()
        assert eng.stats()["bytes_bounced"] == (100_000 + 100_000 % PAGE if direct else 0)


@pytest.mark.parametrize("backend", ["aio", "threads", "aiofiles"])
@pytest.mark.parametrize("start", [0, 1], ids=["aligned-with-tail", "unaligned"])
def test_a_read_into_read_only_memory_is_refused_or_fails_naming_the_key(tmp_path, backend, start):
    """A read-only memory map as a read's destination: where the engine would copy into it from the bounce buffer
    (which would crash the process) the read is refused at once; elsewhere the kernel's EFAULT fails the wait.
    Either way the process lives, the map keeps its bytes and the engine serves the next read."""
    n = 3 * PAGE + 100
    src = random_tensor(n, torch.uint8, aligned=True, seed=9)
    backing = tmp_path / "map.bin"
    backing.write_bytes(bytes(range(256)) * (4 * PAGE // 256 + 1))
    with open(backing, "rb") as f, SwapEngine(tmp_path / "swap", AioConfig(backend=backend)) as eng:
        m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # torch: "the given buffer is not writable"
            mapped = torch.frombuffer(m, dtype=torch.uint8)
        out = mapped[start : start + n]
        before = out.clone()
        eng.write("k", src).wait()
        with pytest.raises((ValueError, OSError), match="'k'"):
            eng.read("k", out).wait(30)
        assert torch.equal(out, before)
        good = torch.empty(n, dtype=torch.uint8)
        eng.read("k", good).wait(30)
        assert torch.equal(good, src)
        del mapped, out
        m.close()


@pytest.mark.asyncio
@pytest.mark.parametrize("backend", ["aio", "threads", "aiofiles"])
async def test_a_cancelled_await_leaves_the_transfer_and_the_engine_working(tmp_path, backend):
    """asyncio.wait_for's timeout cancels the waiter, not the write: the write completes, the worker threads live
    on, and the engine serves the next requests (before, the cancelled future killed an I/O thread)."""
    with SwapEngine(tmp_path, AioConfig(backend=backend, block_size=1 << 16)) as eng:
        src = random_tensor(16 << 20, torch.uint8, aligned=True, seed=4)
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(eng.awrite("big", src), 1e-6)
        eng.synchronize()
        out = torch.empty_like(src)
        await eng.aread("big", out)
        assert same_bytes(out, src)
        eng.write("small", torch.ones(4)).wait(10)


def test_a_failed_growth_keeps_the_free_space_at_the_files_end(tmp_path):
    """A write that needs the file to grow on a full disk fails; the reserved room at the file's end stays free
    for the writes that fit in it."""
    class Full(FileIO):
        full = False

        def fallocate(self, fd, offset, length):
            if self.full:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return super().fallocate(fd, offset, length)

    io = Full()
    with SwapEngine(tmp_path, AioConfig(block_size=1 << 16), file_io=io) as eng:
        eng.write("a", aligned_tensor(1 << 20)).wait()
        eng.reserve(2 << 20)
        free = eng.stats()["free_bytes"]
        io.full = True
        with pytest.raises(OSError) as info:
            eng.write("b", aligned_tensor(3 << 20)).wait()
        assert info.value.errno == errno.ENOSPC
        assert eng.stats()["free_bytes"] == free
        src = random_tensor(1 << 20, torch.uint8, aligned=True, seed=5)
        eng.write("c", src).wait()  # fits in what was reserved
        out = torch.empty_like(src)
        eng.read("c", out).wait()
        assert same_bytes(out, src)


def test_lazy_conjugate_and_negative_views_are_refused(tmp_path):
    """Their memory holds the values before the flip: stored as they are, they would read back unflipped."""
    x = torch.randn(1000, dtype=torch.complex64)
    with SwapEngine(tmp_path, AioConfig(block_size=1 << 16)) as eng:
        with pytest.raises(ValueError, match="'k'.*lazy conjugate view"):
            eng.write("k", x.conj())
        eng.write("k", x.conj().resolve_conj()).wait()
        out = torch.empty_like(x)
        with pytest.raises(ValueError, match="'k'.*lazy conjugate view"):
            eng.read("k", out.conj())
        eng.read("k", out).wait()
        assert torch.equal(out, x.conj())
        with pytest.raises(ValueError, match="'n'.*lazy negative view"):
            eng.write("n", torch._neg_view(torch.randn(10)))
    with pytest.raises(ValueError, match="lazy conjugate or negative view: True"):
        tensor_checksum(x.conj())


def test_aiofiles_errors_name_the_key_and_the_file(tmp_path, monkeypatch):
    import aiofiles

    def broken(*args, **kwargs):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    with SwapEngine(tmp_path, AioConfig(backend="aiofiles")) as eng:
        monkeypatch.setattr(aiofiles, "open", broken)
        with pytest.raises(OSError) as info:
            eng.write("k", torch.ones(10)).wait(10)
        assert info.value.errno == errno.EIO
        assert "write of key 'k' failed" in str(info.value) and str(eng.directory) in str(info.value)


def test_pinning_without_cuda_is_a_clear_error():
    if torch.cuda.is_available():
        pytest.skip("CUDA is here, so pinning works (test_pinned_aligned_tensor_when_cuda)")
    with pytest.raises(ValueError, match="pin_memory=False"):
        aligned_tensor(10, pin_memory=True)


def test_pinned_aligned_tensor_when_cuda():
    if not torch.cuda.is_available():
        pytest.skip("CUDA not available")
    t = aligned_tensor(1 << 20, torch.float32)  # pinned by default with CUDA: registered, 2 MiB-aligned
    assert t.is_pinned() and is_aligned(t, 2 << 20)
    assert not aligned_tensor(1 << 20, torch.float32, pin_memory=False).is_pinned()


def test_tensor_checksum_follows_the_bytes_and_refuses_what_it_cannot_read():
    """Ranks compare their copies of a model by it: equal bytes, equal checksum, whatever the dtype says."""
    t = torch.randn(1000)
    assert tensor_checksum(t) == tensor_checksum(t.clone()) == tensor_checksum(t.view(torch.int32))
    changed = t.clone()
    changed[999] = changed[999].item() + 1
    assert tensor_checksum(changed) != tensor_checksum(t)
    assert checksum_kind() in ("swp_hash", "crc32")
    with pytest.raises(ValueError, match="contiguous host tensor.*contiguous\\(\\)"):
        tensor_checksum(t.view(10, 100).t())
