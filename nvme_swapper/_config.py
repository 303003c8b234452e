"""AioConfig: how the swap engine issues I/O. Frozen, validated when built, parsed from DeepSpeed's ``aio`` JSON."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

BACKENDS = ("auto", "aio", "threads", "aiofiles")


@dataclass(frozen=True)
class AioConfig:
    """I/O settings of one :class:`~nvme_swapper.SwapEngine`.

    block_size: bytes per request (a power of two, 4 KiB to 256 MiB). Large tensors move in requests of this size.
    queue_depth: requests in flight at most across the engine's threads (each thread keeps queue_depth //
        thread_count in flight; so queue_depth >= thread_count).
    thread_count: worker threads (DeepSpeed's newer name ``intra_op_parallelism`` is accepted in JSON).
    backend: "aio" (kernel AIO on O_DIRECT files, several requests in flight per thread), "threads" (pread/pwrite,
        one request in flight per thread), "aiofiles" (portable buffered I/O via aiofiles, for comparison), or "auto"
        (aio where it can be built, else threads).
    single_submit: submit one request per io_submit call instead of a batch (DeepSpeed's key; aio backend only).
    overlap_events: refill the queue as each request completes rather than after the whole batch (aio backend only).
    o_direct: bypass the page cache. When a filesystem refuses O_DIRECT the engine falls back to buffered I/O,
        logs it once and reports it in ``stats()``.
    checksum: keep a checksum of every block written and verify it on every read, so a swap file truncated or
        altered behind the engine's back fails the read (OSError EBADMSG naming the key and the file) instead of
        returning wrong bytes. Computed by the worker threads as each block's I/O completes (see bench/checksum.py
        for its cost).
    """

    block_size: int = 1 << 20
    queue_depth: int = 8
    thread_count: int = 1
    backend: str = "auto"
    single_submit: bool = False
    overlap_events: bool = True
    o_direct: bool = True
    checksum: bool = True

    def __post_init__(self) -> None:
        for name in ("block_size", "queue_depth", "thread_count"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"aio.{name} must be an integer, got {value!r}")
        for name in ("single_submit", "overlap_events", "o_direct", "checksum"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"aio.{name} must be true or false, got {getattr(self, name)!r}")
        bs = self.block_size
        if bs < 4096 or bs > (256 << 20) or bs & (bs - 1):
            raise ValueError(f"aio.block_size must be a power of two from 4096 to {256 << 20} bytes, got {bs}")
        if not 1 <= self.thread_count <= 64:
            raise ValueError(f"aio.thread_count must be 1..64, got {self.thread_count}")
        if not 1 <= self.queue_depth <= 256 * self.thread_count:
            raise ValueError(f"aio.queue_depth must be 1..{256 * self.thread_count} (256 per thread), "
                             f"got {self.queue_depth}")
        if self.queue_depth < self.thread_count:
            raise ValueError(f"aio.queue_depth ({self.queue_depth}) must be at least aio.thread_count "
                             f"({self.thread_count}): each thread needs one request slot")
        if self.backend not in BACKENDS:
            raise ValueError(f"aio.backend must be one of {', '.join(BACKENDS)}; got {self.backend!r}")

    @property
    def depth_per_thread(self) -> int:
        return self.queue_depth // self.thread_count

    @classmethod
    def from_dict(cls, section: Mapping[str, Any], *, prefix: str = "aio") -> "AioConfig":
        """Parses a DeepSpeed-shaped ``aio`` section. Unknown keys raise ValueError naming them."""
        if not isinstance(section, Mapping):
            raise ValueError(f"{prefix} must be an object, got {type(section).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        values: dict[str, Any] = {}
        for key, value in section.items():
            if key == "intra_op_parallelism":
                key = "thread_count"
            if key == "use_gds":
                if value:
                    raise ValueError(f"{prefix}.use_gds: GPUDirect Storage is not supported; set it to false")
                continue
            if key not in known:
                raise ValueError(f"unknown key {prefix}.{key}; allowed: {', '.join(sorted(known | {'use_gds'}))}")
            if key in values:
                raise ValueError(f"{prefix}.thread_count given twice (thread_count and intra_op_parallelism)")
            if key == "backend" and isinstance(value, str):
                value = value.lower()  # as every other choice in the JSON configuration
            values[key] = value
        try:
            return cls(**values)
        except ValueError as exc:
            raise ValueError(str(exc).replace("aio.", f"{prefix}.", 1)) from None
