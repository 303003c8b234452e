"""tune_aio: measures a directory's disk over a grid of AioConfig settings and picks the fastest.

Why: the best block size, queue depth and thread count depend on the device, the filesystem and the machine, and
a wrong choice costs up to half of the disk's throughput (docs/benchmarks.md). Each setting is measured with the
real engine: a :class:`SwapEngine` writes ``size`` bytes from one page-aligned buffer into space it reserved first
(so the timed write is an overwrite, as every write after the first training step is), then reads them back. Both
go straight to the disk with O_DIRECT; where the filesystem refuses O_DIRECT the engine falls back to buffered I/O,
the result says so, and the page cache is dropped before each read.

Noise: every setting is measured ``repeats`` times, the rounds interleave all settings in a shuffled order (so a
slow spell of a shared disk hits every setting alike), and the medians are compared. The score is the rate of
moving equal bytes both ways, ``2 / (1/write + 1/read)``: the optimizer step reads and writes the same bytes, and a
disk that does not overlap the two takes the sum of both times. Settings within ``tolerance`` (3%) of the best
score are treated as tied, and the smallest of them wins: fewest threads, then the lowest queue depth, then the
smallest block (less memory in flight, less CPU, the same speed).
"""

from __future__ import annotations

import os
import random
import shutil
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ._buffers import aligned_tensor
from ._config import AioConfig
from ._engine import SwapEngine

KiB, MiB = 1 << 10, 1 << 20
BLOCK_SIZES = (256 * KiB, MiB, 4 * MiB, 8 * MiB)
QUEUE_DEPTHS = (1, 4, 16, 32)
THREAD_COUNTS = (1, 2)


@dataclass(frozen=True)
class Trial:
    """One setting and its measured rates (GB/s, 10^9 bytes per second; the medians and every sample)."""

    block_size: int
    queue_depth: int
    thread_count: int
    write_samples: tuple[float, ...]
    read_samples: tuple[float, ...]

    @property
    def write_gbps(self) -> float:
        return statistics.median(self.write_samples)

    @property
    def read_gbps(self) -> float:
        return statistics.median(self.read_samples)

    @property
    def score_gbps(self) -> float:
        """Equal bytes written and read, one after the other: the harmonic mean of the two rates."""
        w, r = self.write_gbps, self.read_gbps
        return 2 / (1 / w + 1 / r) if w > 0 and r > 0 else 0.0

    def key(self) -> tuple[int, int, int]:
        """Smaller is cheaper: fewer threads, then fewer requests in flight, then smaller requests."""
        return (self.thread_count, self.queue_depth, self.block_size)


@dataclass(frozen=True)
class TuneResult:
    """What :func:`tune_aio` measured and chose."""

    directory: str
    size: int
    repeats: int
    tolerance: float
    o_direct: bool
    backend: str
    trials: tuple[Trial, ...]
    best: Trial
    seconds: float
    fallback_reason: str | None = None
    tied: tuple[Trial, ...] = field(default=())

    def fragment(self) -> dict[str, dict[str, int]]:
        """The chosen setting as a DeepSpeed-shaped ``aio`` config section."""
        b = self.best
        return {"aio": {"block_size": b.block_size, "queue_depth": b.queue_depth, "thread_count": b.thread_count}}

    def table(self) -> str:
        """The grid as text: one line per setting, medians in GB/s, the choice marked with *, ties with +."""
        lines = [(f"{'block':>8s} {'depth':>6s} {'threads':>8s} {'write GB/s':>11s} {'read GB/s':>10s} "
                  f"{'score GB/s':>11s}")]
        for t in self.trials:
            mark = "*" if t is self.best else ("+" if t in self.tied else " ")
            block = f"{t.block_size // MiB}M" if t.block_size >= MiB else f"{t.block_size // KiB}K"
            lines.append(f"{block:>8s} {t.queue_depth:6d} {t.thread_count:8d} {t.write_gbps:11.2f} "
                         f"{t.read_gbps:10.2f} {t.score_gbps:11.2f} {mark}")
        return "\n".join(lines)

    def as_dict(self) -> dict[str, Any]:
        """Everything measured, JSON-ready (every sample, not only the medians)."""
        return {
            "directory": self.directory, "size": self.size, "repeats": self.repeats, "tolerance": self.tolerance,
            "o_direct": self.o_direct, "backend": self.backend, "fallback_reason": self.fallback_reason,
            "seconds": self.seconds, "fragment": self.fragment(),
            "trials": [{"block_size": t.block_size, "queue_depth": t.queue_depth, "thread_count": t.thread_count,
                        "write_gbps": t.write_gbps, "read_gbps": t.read_gbps, "score_gbps": t.score_gbps,
                        "write_samples": list(t.write_samples), "read_samples": list(t.read_samples)}
                       for t in self.trials],
        }


def grid(block_sizes: Sequence[int] = BLOCK_SIZES, queue_depths: Sequence[int] = QUEUE_DEPTHS,
         thread_counts: Sequence[int] = THREAD_COUNTS, checksum: bool = True) -> list[AioConfig]:
    """Every valid combination (a thread needs at least one request slot, so queue_depth >= thread_count)."""
    if not block_sizes or not queue_depths or not thread_counts:
        raise ValueError("tune_aio: block_sizes, queue_depths and thread_counts must each list at least one value")
    return [AioConfig(block_size=b, queue_depth=q, thread_count=t, checksum=checksum)
            for t in sorted(set(thread_counts)) for q in sorted(set(queue_depths)) for b in sorted(set(block_sizes))
            if q >= t]


def drop_cache(path: Path) -> None:
    """For buffered I/O: makes the next read come from the disk, not from the pages a write left in memory."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def measure(directory: Path, cfg: AioConfig, buf: Any) -> tuple[float, float, dict[str, Any]]:
    """One measurement: (write GB/s, read GB/s, the engine's stats) of ``buf`` written into reserved space (an
    overwrite) and read back through a SwapEngine with ``cfg`` in ``directory``."""
    nbytes = buf.numel() * buf.element_size()
    with SwapEngine(directory, cfg) as eng:
        eng.reserve(nbytes)
        t = time.perf_counter()
        eng.write("tune", buf).wait()
        write = nbytes / (time.perf_counter() - t) / 1e9
        stats = eng.stats()
        if not stats["o_direct"]:
            drop_cache(eng.directory / "swap.0")
        t = time.perf_counter()
        eng.read("tune", buf).wait()
        read = nbytes / (time.perf_counter() - t) / 1e9
    return write, read, stats


def tune_aio(directory: str | os.PathLike[str], *, size: int = 1 << 30, block_sizes: Sequence[int] = BLOCK_SIZES,
             queue_depths: Sequence[int] = QUEUE_DEPTHS, thread_counts: Sequence[int] = THREAD_COUNTS,
             repeats: int = 3, tolerance: float = 0.03, checksum: bool = True,
             progress: Callable[[int, int], None] | None = None) -> TuneResult:
    """Measures every setting of the grid on ``directory`` (see the module docstring) and returns the choice.

    size: bytes written and read per measurement (one buffer of this size is allocated; the swap files, removed
        at the end, take as much disk). Larger is steadier; 1 GiB takes about a second per measurement on a
        3 GB/s disk.
    checksum: measure with the per-block checksums training uses by default (AioConfig(checksum=True)).
    progress: called with (done, total) after each measurement.
    """
    if not isinstance(size, int) or size < 4 * KiB or size % (4 * KiB):
        raise ValueError(f"tune_aio: size must be a positive multiple of 4096 bytes, got {size!r}")
    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"tune_aio: repeats must be at least 1, got {repeats!r}")
    if not 0 <= tolerance < 1:
        raise ValueError(f"tune_aio: tolerance must be in [0, 1), got {tolerance!r}")
    configs = grid(block_sizes, queue_depths, thread_counts, checksum)
    if not configs:
        raise ValueError(f"tune_aio: no valid setting: every queue depth in {list(queue_depths)} is below every "
                         f"thread count in {list(thread_counts)}")
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(root).free
    if size + (64 << 20) > free:
        raise ValueError(f"tune_aio: size {size} bytes does not fit in {root} ({free} bytes free)")
    buf = aligned_tensor(size, pin_memory=False)
    buf.random_(0, 256)
    writes: dict[AioConfig, list[float]] = {c: [] for c in configs}
    reads: dict[AioConfig, list[float]] = {c: [] for c in configs}
    stats: dict[str, Any] = {}
    start = time.perf_counter()
    done, total = 0, len(configs) * repeats
    for r in range(repeats):
        order = list(configs)
        random.Random(r).shuffle(order)
        for cfg in order:
            w, rd, stats = measure(root, cfg, buf)
            writes[cfg].append(w)
            reads[cfg].append(rd)
            done += 1
            if progress is not None:
                progress(done, total)
    trials = tuple(Trial(c.block_size, c.queue_depth, c.thread_count, tuple(writes[c]), tuple(reads[c]))
                   for c in configs)
    top = max(t.score_gbps for t in trials)
    tied = tuple(sorted((t for t in trials if t.score_gbps >= top * (1 - tolerance)), key=Trial.key))
    return TuneResult(directory=str(root), size=size, repeats=repeats, tolerance=tolerance,
                      o_direct=bool(stats.get("o_direct")), backend=str(stats.get("backend")), trials=trials,
                      best=tied[0], seconds=time.perf_counter() - start,
                      fallback_reason=stats.get("fallback_reason"), tied=tied)

