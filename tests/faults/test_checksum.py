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
from hypothesis import given, settings
from hypothesis import strategies as st

from _faults import bounded
from nvme_swapper import AioConfig, SwapEngine, aligned_tensor
from nvme_swapper._native import _library, checksum, checksum_isa, checksum_variants, memory_at

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


_M = (1 << 64) - 1
_KEYS = (0x40d68dea0c3e39b3, 0xf6069bcb4e650071, 0xf4a91fdc907de039, 0x856e8bb9e2118d5e, 0xcba2113022300068,
         0xb0d8c24a75bc7ade, 0x11acd26bf8662e5d, 0xd78807ba63a2a004, 0x12598145f5dd65fd, 0x067c72245c3de249,
         0x8dd646b953495095, 0x79f38251848589bc, 0x907f6d4cf1b77b5d, 0x460e2e87e2076c82, 0x727f5d3d83e6b8ed,
         0x088ffaa84ca13e1e, 0x0522330b5c893202, 0xa6150904fc034975, 0xea013e1b185ed6a8, 0x495593ef97e28dfc,
         0xf99498b7703aae40, 0x75bad36ebcfb3491, 0xd6eeb32ea3760f7c, 0xe6c00031cec46577)


def _mix64(h: int) -> int:
    h ^= h >> 33
    h = h * 0xff51afd7ed558ccd & _M
    h ^= h >> 33
    h = h * 0xc4ceb9fe1a85ec53 & _M
    return h ^ (h >> 33)


def reference_hash(data: bytes) -> int:
    """swp_hash as the docs define it (docs/reliability.md), in Python integers: the C variants must equal it."""
    acc = [_KEYS[(i + 3) % 8] for i in range(8)]

    def accumulate(stripe: bytes, key: int) -> None:
        for i in range(8):
            w = int.from_bytes(stripe[8 * i:8 * i + 8], "little")
            k = w ^ _KEYS[key + i]
            acc[i ^ 1] = (acc[i ^ 1] + w) & _M
            acc[i] = (acc[i] + (k & 0xffffffff) * (k >> 32)) & _M

    whole = len(data) // 64
    for s in range(whole):
        accumulate(data[64 * s:64 * s + 64], s % 16)
        if s % 16 == 15:
            for i in range(8):
                a = acc[i] ^ (acc[i] >> 47) ^ _KEYS[16 + i]
                acc[i] = a * 0x9e3779b1 & _M
    if len(data) % 64:
        accumulate(data[64 * whole:].ljust(64, b"\0"), whole % 16)
    h = _mix64(len(data) ^ 0x9e3779b97f4a7c15)
    for i in range(8):
        h = (_mix64(h ^ acc[i]) + i) & _M
    return h


@settings(max_examples=60, deadline=None)
@given(data=st.binary(min_size=0, max_size=5000), offset=st.integers(0, 63))
def test_every_hash_variant_equals_the_reference(data, offset):
    """The SSE2 and AVX2 rounds (whichever this CPU runs) give the scalar definition's hash at any length and
    any alignment of the bytes."""
    assert _library() is not None, "the C helper builds here"
    buf = torch.zeros(len(data) + 64, dtype=torch.uint8)
    if data:
        buf[offset:offset + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    got = checksum_variants(buf.data_ptr() + offset, len(data))
    assert "scalar" in got and (checksum_isa() == "scalar" or "sse2" in got)
    assert set(got.values()) == {reference_hash(data)}
    assert checksum(buf.data_ptr() + offset, len(data)) == got[checksum_isa()]


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
