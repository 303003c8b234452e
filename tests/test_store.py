"""The tiered store: residency transitions, budgets that hold, a failed write-back that loses nothing, and the
staging arena's ring."""

from __future__ import annotations

import contextlib
import errno
import os
import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nvme_swapper import AioConfig, FileIO, SwapHandle
from offload.memory import BudgetExceeded, BufferPool, Residency, StagingArena, Tier, TierAccount, TieredStore


def make_store(tmp_path, host_budget=None, file_io=None, buffers=2, numel=50_000):
    store = TieredStore(torch.device("cpu"), {Tier.HOST: host_budget}, pin_memory=False)
    store.open_nvme(tmp_path, AioConfig(block_size=1 << 16), slot_bytes=numel * 4, buffer_count=buffers,
                    total_bytes=3 * numel * 4, what="test tensors", file_io=file_io)
    for k in ("a", "b", "c"):
        store.register(k, numel, torch.float32)
    return store


def test_residency_transitions_and_contents(tmp_path):
    store = make_store(tmp_path)
    try:
        for i, k in enumerate("abc"):
            store.stage(k).fill_(i + 1)
            assert store.residency(k) is Residency.HOST
            t = store.evict(k)
            assert store.residency(k) in (Residency.EVICTING, Residency.NVME)
            t.wait()
            assert store.residency(k) is Residency.NVME
        fa, fb = store.fetch("a"), store.fetch("b")
        assert fa is not None and fb is not None
        assert store.fetch("c") is None  # two buffers, both taken: nothing started
        assert store.residency("c") is Residency.NVME
        assert torch.all(fa.wait() == 1) and torch.all(fb.wait() == 2)
        store.release("a")
        assert torch.all(store.acquire("c") == 3) and store.residency("c") is Residency.HOST
        moved = store.moved
        assert moved["host->nvme"] == 3 * 200_000 and moved["nvme->host"] == 3 * 200_000
    finally:
        store.close()
    assert list(tmp_path.iterdir()) == []


def test_budget_is_enforced_and_names_the_key():
    account = TierAccount(Tier.HOST, 1000)
    account.reserve(600, "x")
    with pytest.raises(BudgetExceeded, match=r"host tier: y needs 500 B .*600 B.* budget of 1000 B.*"
                                             r"offload.host_memory_budget"):
        account.reserve(500, "y")
    assert account.current == 600 and account.peak == 600
    account.release(600)
    with pytest.raises(BudgetExceeded, match="lower the buffer count"):
        BufferPool(4, 1 << 20, account, pin_memory=False, what="pool", fix="lower the buffer count")
    assert account.current == 0
    store = TieredStore(torch.device("cpu"), {Tier.DEVICE: 4096}, pin_memory=False)
    with pytest.raises(BudgetExceeded, match="device tier"):
        store.allocate(Tier.DEVICE, 2048, torch.float32, "params")
    assert store.memory_report()["device"] == {"current": 0, "peak": 0, "budget": 4096}


class FailWrites(FileIO):
    def __init__(self):
        self.fail = False

    def pwrite(self, fd, buf, offset):
        if self.fail:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return super().pwrite(fd, buf, offset)

    def aio_run(self, ctx, depth, fd, is_write, transfers, single_submit=False, overlap=True):
        if self.fail and is_write:
            return (0, -errno.EIO)
        return super().aio_run(ctx, depth, fd, is_write, transfers, single_submit, overlap)


def test_failed_write_back_keeps_the_bytes(tmp_path):
    faults = FailWrites()
    store = make_store(tmp_path, file_io=faults)
    try:
        store.stage("a").fill_(1.0)
        store.evict("a").wait()
        block = store.acquire("a")
        block.fill_(7.0)  # new state, only in the buffer
        faults.fail = True
        with pytest.raises(OSError, match="'a'"):
            store.evict("a").wait()
        assert store.residency("a") is Residency.HOST and torch.all(store.acquire("a") == 7.0)
        faults.fail = False
        store.evict("a").wait()  # retried: now durable
        assert store.residency("a") is Residency.NVME  # read back from the file, not the buffer it left
        assert torch.all(store.acquire("a") == 7.0)
    finally:
        store.close()


def test_a_read_whose_wait_is_cut_short_keeps_its_buffer(tmp_path, monkeypatch):
    """A Ctrl-C while acquire waits for a read cuts the wait short, not the read: the read keeps its staging buffer
    (given back, the next key's read would share it and the late read land in that key's bytes) and the next
    acquire finishes it."""
    gate = threading.Event()
    gate.set()

    class SlowReads(FileIO):
        def pread(self, fd, buf, offset):
            gate.wait(10)
            return super().pread(fd, buf, offset)

    store = make_store(tmp_path, file_io=SlowReads())
    try:
        for i, k in enumerate("abc"):
            store.stage(k).fill_(i + 1)
            store.evict(k).wait()
        gate.clear()
        wait = SwapHandle.wait

        def interrupted(self, timeout=None):
            monkeypatch.setattr(SwapHandle, "wait", wait)
            raise KeyboardInterrupt

        monkeypatch.setattr(SwapHandle, "wait", interrupted)
        with pytest.raises(KeyboardInterrupt):
            store.acquire("a")
        assert store.residency("a") is Residency.FETCHING  # still reading into its buffer
        b = store.fetch("b")  # the other buffer
        assert store.fetch("c") is None  # none free: a's is still a's
        gate.set()
        assert torch.all(store.acquire("a") == 1) and torch.all(b.wait() == 2)
        store.release("a")
        assert torch.all(store.acquire("c") == 3) and torch.all(store.acquire("b") == 2)
    finally:
        gate.set()
        store.close()


def test_drain_never_spins_on_a_record_left_half_changed(tmp_path):
    """A write-back record a second Ctrl-C left half changed (its buffer gone, still queued): drain drops it
    instead of retrying it forever, so a close after it ends."""
    store = make_store(tmp_path)
    try:
        store.stage("a").fill_(1.0)
        store.evict("a").wait()
        m = store._managed["a"]
        m.residency, m.slot = Residency.NVME, None  # as _reclaim leaves it just before its popleft
        store._evicting.append(m)
        done = threading.Event()

        def drain():
            with contextlib.suppress(Exception):  # whether it raises is not the point: that it ends
                store.drain()
            done.set()

        threading.Thread(target=drain, name="offload-test-drain", daemon=True).start()
        assert done.wait(10) and not store._evicting
    finally:
        store.close()


@settings(max_examples=60, deadline=None)
@given(pages=st.integers(1, 16), ops=st.lists(st.tuples(st.booleans(), st.integers(0, 16 * 1024)), max_size=60))
def test_staging_arena_lends_disjoint_pieces_and_refuses_only_when_full(pages, ops):
    """Any sequence of takes and gives (oldest first; the newest at once when its use could not start): pieces out
    never overlap, each starts on a page (the swap engine's O_DIRECT reads need it) and lies in the buffer, a take
    is refused only when no free run of its whole pages lies where the ring may place it, and an empty arena takes
    any piece of its size; all of it comes back at the end."""
    per = 1024  # float32 elements per page
    cap = pages * per
    store = TieredStore(torch.device("cpu"), {Tier.HOST: 4 * cap}, pin_memory=False)
    arena = StagingArena(store, cap, torch.float32, "staging", "")
    base = arena.buffer.data_ptr()
    out: list[tuple[int, int, torch.Tensor]] = []  # [start, end of its pages) and the piece, oldest first
    for take, n in ops:
        if take and 0 < n <= cap:
            span = -(-n // per) * per
            fits = arena.fits(n)
            piece = arena.take(n)
            assert fits == (piece is not None)
            if piece is None:
                assert out, "an empty arena refused a piece that fits"
                oldest, end = out[0][0], out[-1][1]
                assert (cap - end < span and oldest < span) if end > oldest else (oldest - end < span), (out, n)
                continue
            start = (piece.data_ptr() - base) // 4
            assert piece.numel() == n and piece.data_ptr() % 4096 == 0 and start + span <= cap
            assert all(start + span <= a or b <= start for a, b, _ in out), (out, start, n)
            out.append((start, start + span, piece))
        elif out:
            arena.give(out.pop(0 if n % 2 else -1)[2])
    for _, _, piece in out:
        arena.give(piece)
    assert arena.take(cap) is not None
    with pytest.raises(RuntimeError, match="out of order"):
        arena.give(arena.buffer[1:])
    with pytest.raises(RuntimeError, match="exceeds its arena"):
        arena.take(cap + 1)
    arena.close()
    assert store.memory_report()["host"]["current"] == 0


class Reading:
    """A copy still reading a piece: done once waited for (records the wait)."""

    def __init__(self) -> None:
        self.waited = False

    def done(self) -> bool:
        return self.waited

    def wait(self) -> None:
        self.waited = True


def test_a_staging_piece_given_back_busy_is_reused_only_after_its_copy():
    """A piece that comes back with its copy to the device still reading it (the CUDA path: neither the fetch
    thread nor training waits for that copy) is not lent again until the copy is done: a take that needs its
    room is refused, or with ``block`` waits for the copy; closing waits for copies still reading."""
    store = TieredStore(torch.device("cpu"), {Tier.HOST: 1 << 20}, pin_memory=False)
    arena = StagingArena(store, 2048, torch.float32, "staging", "")
    first = arena.take(2048)
    copy = Reading()
    arena.give(first, busy=copy)
    assert not arena.fits(1024) and arena.take(1024) is None and not copy.waited
    again = arena.take(1024, block=True)
    assert copy.waited and again.data_ptr() == first.data_ptr()
    last = Reading()
    arena.give(again, busy=last)
    arena.close()
    assert last.waited and store.memory_report()["host"]["current"] == 0
