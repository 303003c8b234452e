"""Swap files changed behind the engine's back: bytes altered, the file truncated (and re-extended with zeros).

Every read verifies the per-block checksums recorded by the write, so an alteration fails the read's ``wait()``
with OSError(EBADMSG) naming the key and the file, for every backend and both the direct and the bounced path;
other keys stay readable, and rewriting the key heals it.
"""

from __future__ import annotations

import errno
import os

import pytest
import torch

from _faults import bounded
from nvme_swapper import AioConfig, SwapEngine, aligned_tensor
from nvme_swapper._native import _library, checksum, memory_at

BS = 1 << 16
SIZES = {"a": 5000, "b": 3 * BS + 4096 + 12, "c": 2 * BS}  # bytes; "b" spans four blocks, the last one short


def filled(nbytes: int, seed: int, aligned: bool) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
    if aligned:
        out = aligned_tensor(nbytes, torch.uint8, pin_memory=False)
    else:
        out = torch.empty(nbytes + 1, dtype=torch.uint8)[1:]  # one byte off the page: the bounced path
    out.copy_(data)
    return out


def offset_of(engine: SwapEngine, key: str) -> int:
    return engine._index[key].extent.offset


def alter(path, offset: int) -> None:
    fd = os.open(path, os.O_RDWR)
    try:
        old = os.pread(fd, 1, offset)
        os.pwrite(fd, bytes([old[0] ^ 0x40]), offset)
        os.fsync(fd)
    finally:
        os.close(fd)


def store_all(engine: SwapEngine, aligned: bool) -> dict[str, torch.Tensor]:
    data = {k: filled(n, i, aligned) for i, (k, n) in enumerate(SIZES.items())}
    for k, t in data.items():
        engine.write(k, t).wait(30)
    return data


def read(engine: SwapEngine, key: str, aligned: bool) -> torch.Tensor:
    out = filled(SIZES[key], 99, aligned)
    bounded(lambda: engine.read(key, out).wait(30))
    return out


@pytest.mark.parametrize("backend, o_direct", [("aio", True), ("threads", True), ("threads", False),
                                               ("aiofiles", True)])
@pytest.mark.parametrize("aligned", [True, False])
def test_altered_byte_fails_the_read_naming_key_and_file(tmp_path, backend, o_direct, aligned):
    cfg = AioConfig(backend=backend, block_size=BS, thread_count=2, queue_depth=4, o_direct=o_direct)
    with SwapEngine(tmp_path, cfg) as engine:
        data = store_all(engine, aligned)
        swap = engine._file.path
        for where in (10, 2 * BS + 7, 3 * BS + 4096 + 11):  # first block, a middle block, the last byte
            alter(swap, offset_of(engine, "b") + where)
            with pytest.raises(OSError) as info:
                read(engine, "b", aligned)
            err = info.value
            assert err.errno == errno.EBADMSG and err.filename == str(swap), err
            assert "read of key 'b' failed: checksum mismatch in block" in str(err)
            assert f"block {where // BS} " in str(err)
            alter(swap, offset_of(engine, "b") + where)  # flip it back: readable again
            assert torch.equal(read(engine, "b", aligned), data["b"])
        alter(swap, offset_of(engine, "b") + 5)
        for k in ("a", "c"):  # the other keys are untouched
            assert torch.equal(read(engine, k, aligned), data[k])
        engine.write("b", data["b"]).wait(30)  # rewriting heals the key
        assert torch.equal(read(engine, "b", aligned), data["b"])
        assert engine.stats()["failed"] == 3


@pytest.mark.parametrize("backend", ["aio", "threads"])
def test_truncated_swap_file_fails_reads_of_the_lost_keys(tmp_path, backend):
    cfg = AioConfig(backend=backend, block_size=BS, thread_count=2, queue_depth=4)
    with SwapEngine(tmp_path, cfg) as engine:
        data = store_all(engine, aligned=True)
        swap = engine._file.path
        ends = {k: offset_of(engine, k) + SIZES[k] for k in SIZES}
        last = max(ends, key=ends.get)
        cut = offset_of(engine, last) + BS // 2
        os.truncate(swap, cut)  # the file now ends inside `last`'s first block
        with pytest.raises(OSError, match=f"read of key '{last}' failed") as info:
            read(engine, last, True)
        assert info.value.filename == str(swap) and info.value.errno in (errno.EIO, errno.EBADMSG)
        os.truncate(swap, engine._file.size)  # re-extended: zeros where the bytes were
        with pytest.raises(OSError, match=f"read of key '{last}' failed: checksum mismatch") as info:
            read(engine, last, True)
        assert info.value.errno == errno.EBADMSG
        for k in SIZES:
            if ends[k] <= cut:
                assert torch.equal(read(engine, k, True), data[k])


def test_checksum_off_returns_the_altered_bytes(tmp_path):
    cfg = AioConfig(block_size=BS, checksum=False)
    with SwapEngine(tmp_path, cfg) as engine:
        data = store_all(engine, aligned=True)
        alter(engine._file.path, offset_of(engine, "c") + 100)
        got = read(engine, "c", True)
        assert int((got != data["c"]).sum()) == 1 and engine.stats()["checksum"] is None


def test_checksum_properties():
    assert _library() is not None, "the C helper builds here"
    buf = aligned_tensor(1 << 20, torch.uint8, pin_memory=False)
    view = memory_at(buf.data_ptr(), buf.numel())
    base = checksum(buf.data_ptr(), buf.numel())
    assert checksum(buf.data_ptr(), buf.numel() - 1) != base  # the length counts (trailing zeros)
    seen = {base}
    for pos in (0, 1, 7, 8, 63, 64, 4095, 65536, (1 << 20) - 1):
        for bit in (0, 3, 7):
            view[pos] ^= 1 << bit
            seen.add(checksum(buf.data_ptr(), buf.numel()))
            view[pos] ^= 1 << bit
    assert len(seen) == 1 + 9 * 3  # every single-bit flip changes it
    assert checksum(buf.data_ptr(), buf.numel()) == base
    # swapping two 8-byte words (same multiset of bytes) changes it too
    view[0:8], view[8:16] = bytes(range(1, 9)), bytes(range(9, 17))
    a = checksum(buf.data_ptr(), 64)
    view[0:8], view[8:16] = bytes(range(9, 17)), bytes(range(1, 9))
    assert checksum(buf.data_ptr(), 64) != a


def test_fallback_without_the_c_helper_still_detects_changes(tmp_path, monkeypatch):
    from nvme_swapper import _native

    monkeypatch.setattr(_native, "_library", lambda: None)  # as when no C compiler is found
    assert _native.checksum_kind() == "crc32"
    with SwapEngine(tmp_path, AioConfig(block_size=BS, thread_count=2, queue_depth=2)) as engine:
        assert engine.backend == "threads" and engine.stats()["checksum"] == "crc32"
        data = store_all(engine, aligned=True)
        alter(engine._file.path, offset_of(engine, "b") + BS + 1)
        with pytest.raises(OSError, match="read of key 'b' failed: checksum mismatch in block 1 "):
            read(engine, "b", True)
        assert torch.equal(read(engine, "a", True), data["a"])
