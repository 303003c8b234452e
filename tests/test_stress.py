"""Stress: random interleavings of write, read, delete (SwapEngine, from several threads and asyncio tasks at once)
and of stage, fetch, acquire, modify, evict, release, drain (TieredStore, from its one owner thread), for a bounded
time, checking every tensor's bytes after every read and the accounting at every quiescent point. Every wait has a
timeout and every round ends at a barrier with a timeout, so a deadlock fails the test instead of hanging it.
"""

from __future__ import annotations

import asyncio
import faulthandler
import random
import threading
import time

import torch

from nvme_swapper import AioConfig, SwapEngine, aligned_tensor
from offload.memory import Residency, Tier, TieredStore

PAGE, WAIT = 4096, 120.0  # generous: the disk is shared; a real hang still fails, with stacks
SECONDS = 4.0


def content(nbytes: int, seed: int, aligned: bool) -> torch.Tensor:
    t = aligned_tensor(nbytes, torch.uint8, pin_memory=False) if aligned else torch.empty(nbytes + 3,
                                                                                            dtype=torch.uint8)[3:]
    t.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)))
    return t


class Owner:
    """One thread's (or task's) keys and what each must hold."""

    def __init__(self, engine: SwapEngine, name: str, seed: int) -> None:
        self.engine, self.rng = engine, random.Random(seed)
        self.keys = [f"{name}/{i}" for i in range(4)]
        self.model: dict[str, torch.Tensor] = {}
        self.ops = 0

    def pick(self) -> tuple[str, str]:
        key = self.rng.choice(self.keys)
        op = self.rng.choice(["write", "write", "read", "read", "pipeline", "delete"]) if key in self.model \
            else "write"
        return op, key

    def new_content(self) -> torch.Tensor:
        nbytes = self.rng.choice([1, 100, PAGE, 3 * PAGE + 5, 70_000, 200_000])
        return content(nbytes, self.rng.randrange(1 << 30), aligned=self.rng.random() < 0.7)

    def check(self, key: str, got: torch.Tensor) -> None:
        assert torch.equal(got, self.model[key]), f"{key}: wrong bytes after {self.ops} ops"
        assert self.engine.nbytes(key) == self.model[key].numel()
        assert key in self.engine.keys()

    def step(self) -> None:
        op, key = self.pick()
        engine = self.engine
        if op == "write":
            t = self.new_content()
            engine.write(key, t).wait(WAIT)
            self.model[key] = t
        elif op == "read":
            out = content(self.model[key].numel(), 0, aligned=self.rng.random() < 0.5)
            engine.read(key, out).wait(WAIT)
            self.check(key, out)
        elif op == "pipeline":  # write, read, write, read without waiting in between: issue order holds
            a, b = self.new_content(), self.new_content()
            outs = [torch.empty_like(a), torch.empty_like(b)]
            handles = [engine.write(key, a), engine.read(key, outs[0]), engine.write(key, b), engine.read(key, outs[1])]
            for h in handles:
                h.wait(WAIT)
            assert torch.equal(outs[0], a) and torch.equal(outs[1], b)
            self.model[key] = b
        else:
            engine.delete(key)
            del self.model[key]
            assert key not in engine.keys()
        self.ops += 1

    async def astep(self) -> None:
        op, key = self.pick()
        if op in ("write", "pipeline"):
            t = self.new_content()
            await asyncio.wait_for(self.engine.awrite(key, t), WAIT)
            self.model[key] = t
        elif op == "read":
            out = torch.empty_like(self.model[key])
            await asyncio.wait_for(self.engine.aread(key, out), WAIT)
            self.check(key, out)
        else:
            self.engine.delete(key)
            del self.model[key]
        self.ops += 1


def check_accounting(engine: SwapEngine, owners: list[Owner]) -> None:
    engine.synchronize()
    stats = engine.stats()
    live = {k: t for o in owners for k, t in o.model.items()}
    assert sorted(engine.keys()) == sorted(live)
    assert stats["keys"] == len(live) and stats["in_flight"] == 0
    assert stats["live_bytes"] == sum(-(-t.numel() // PAGE) * PAGE for t in live.values())
    assert stats["live_bytes"] + stats["free_bytes"] + PAGE == stats["file_bytes"]  # page 0: the header


def test_swap_engine_under_threads_and_tasks(tmp_path):
    cfg = AioConfig(block_size=1 << 16, thread_count=3, queue_depth=6)
    with SwapEngine(tmp_path, cfg) as engine:
        threads = [Owner(engine, f"t{i}", i) for i in range(4)]
        tasks = [Owner(engine, f"a{i}", 100 + i) for i in range(3)]
        shared = Owner(engine, "shared", 999)  # one key set used by every thread, one op at a time
        shared_lock = threading.Lock()
        barrier = threading.Barrier(len(threads) + 2, timeout=2 * WAIT)
        deadline = time.monotonic() + SECONDS
        go = [True]  # decided by the checker alone, so every thread agrees on the last round
        errors: list[BaseException] = []

        def rounds(body) -> None:
            try:
                while True:
                    barrier.wait()  # a round starts: the checker has set go
                    if not go[0]:
                        return
                    body()
                    barrier.wait()  # the round ends: the checker looks at a quiescent engine
            except BaseException as exc:
                errors.append(exc)
                barrier.abort()

        def thread_body(owner: Owner) -> None:
            for _ in range(20):
                owner.step()
                if owner.rng.random() < 0.2:
                    with shared_lock:
                        shared.step()

        async def tasks_body() -> None:
            async def run(owner: Owner) -> None:
                for _ in range(10):
                    await owner.astep()
            await asyncio.wait_for(asyncio.gather(*(run(o) for o in tasks)), WAIT)

        workers = [threading.Thread(target=rounds, args=(lambda o=o: thread_body(o),)) for o in threads]
        workers.append(threading.Thread(target=rounds, args=(lambda: asyncio.run(tasks_body()),)))
        for w in workers:
            w.start()
        checks = 0
        try:
            while True:
                go[0] = time.monotonic() < deadline
                try:
                    barrier.wait()
                    if not go[0]:
                        break
                    barrier.wait()
                    check_accounting(engine, threads + tasks + [shared])
                    checks += 1
                except threading.BrokenBarrierError:
                    if errors:
                        raise errors[0] from None  # a worker failed: its error, not the barrier's
                    faulthandler.dump_traceback(all_threads=True)  # a worker hung: show where
                    raise
        finally:
            if errors:
                barrier.abort()
            for w in workers:
                w.join(WAIT)
        assert not errors, errors[0]
        assert not any(w.is_alive() for w in workers), "a worker hung"
        assert checks >= 2 and sum(o.ops for o in threads + tasks) > 100
        for o in threads + tasks + [shared]:  # every key, one last time
            for key, t in o.model.items():
                out = torch.empty_like(t)
                engine.read(key, out).wait(WAIT)
                assert torch.equal(out, t)


def test_tiered_store_random_sequences(tmp_path):
    """The store is single-threaded by design: one owner, random operation sequences, invariants after each."""
    numel, buffers, keys = 20_000, 3, [f"k{i}" for i in range(6)]
    store = TieredStore(torch.device("cpu"), {Tier.HOST: None}, pin_memory=False)
    store.open_nvme(tmp_path, AioConfig(block_size=1 << 16, thread_count=2, queue_depth=4), slot_bytes=numel * 4,
                    buffer_count=buffers, total_bytes=len(keys) * numel * 4, what="stress tensors")
    rng = random.Random(7)
    model: dict[str, torch.Tensor] = {}
    held: dict[str, torch.Tensor] = {}  # keys whose buffer we hold (acquired or staged), with what it must hold
    prefetched: set[str] = set()  # keys a fetch put in a buffer that no one holds yet
    host_bytes = store.memory_report()["host"]["current"]
    nvme_bytes = store.memory_report()["nvme"]["current"]
    try:
        for k in keys:
            store.register(k, numel, torch.float32)
        deadline, ops = time.monotonic() + SECONDS, 0
        while time.monotonic() < deadline:
            k = rng.choice(keys)
            choice = rng.random()
            room = len(held) + len(prefetched) < buffers
            if k not in model and k not in held:
                if room:
                    buf = store.stage(k)
                    buf.copy_(torch.randn(numel, generator=torch.Generator().manual_seed(ops)))
                    held[k] = buf.clone()
            elif k in held:
                if choice < 0.3:  # modify in place
                    buf = store.acquire(k)
                    assert torch.equal(buf, held[k])
                    buf.add_(1.0)
                    held[k] = buf.clone()
                elif choice < 0.8:
                    t = store.evict(k)
                    model[k] = held.pop(k)
                    if rng.random() < 0.5:
                        t.wait()
                        assert store.residency(k) is Residency.NVME
                elif k in model and torch.equal(held[k], model[k]):
                    store.release(k)  # clean: nothing to write
                    held.pop(k)
            elif choice < 0.4 and (room or k in prefetched):
                buf = store.acquire(k)
                assert torch.equal(buf, model[k]), f"{k}: wrong bytes after {ops} ops"
                held[k] = buf.clone()
                prefetched.discard(k)
            elif choice < 0.6 and k not in prefetched:
                started = store.residency(k) is Residency.NVME  # else its write-back is in flight: no read
                if store.fetch(k) is not None and started:
                    prefetched.add(k)
            elif choice < 0.75 and k in prefetched:
                store.release(k)
                prefetched.discard(k)
            elif choice < 0.85:
                store.drain()
                assert all(store.residency(x) in (Residency.HOST, Residency.NVME) for x in keys)
            # invariants after every operation
            for x in keys:
                res = store.residency(x)
                if x in held:
                    assert res is Residency.HOST
                elif x in prefetched:
                    assert res in (Residency.FETCHING, Residency.HOST)
                elif x not in model:
                    assert res is Residency.NVME
                else:
                    assert res in (Residency.EVICTING, Residency.NVME)
            report = store.memory_report()
            assert report["host"]["current"] == host_bytes and report["nvme"]["current"] == nvme_bytes
            ops += 1
        for k in list(held):
            store.evict(k)
            model[k] = held.pop(k)
        for k in prefetched:
            store.release(k)
        store.drain()
        for k, t in model.items():
            assert torch.equal(store.acquire(k), t)
            store.release(k)
        assert ops > 200
        assert store.swap_stats()["keys"] == len(model)
    finally:
        store.close()
    assert list(tmp_path.iterdir()) == []
