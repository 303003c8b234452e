"""Collectives of the partitioned engine: byte counting, and failures that name the rank at fault.

:class:`Comm` wraps the few collectives the engine needs (reduce-scatter, all-gather, all-reduce, broadcast,
barrier) over a :class:`~._group.ProcessGroup`. With world size 1 they are copies or nothing, so the engine has one
code path. Each call counts its payload (the size of the full buffer the collective is about: what the ZeRO paper
counts, Psi for a reduce-scatter of Psi elements) and its ring wire bytes (what each rank sends with a ring
algorithm: (N-1)/N of the payload; twice that for an all-reduce).

A rank that dies makes its peers' collectives fail at once (gloo sees the socket close); one that hangs makes
them fail when the group's timeout (``offload.comm_timeout``) expires. Either way the error alone does not say
who is at fault, so every rank runs a heartbeat thread that bumps a counter in the rendezvous store (the TCP
store behind MASTER_ADDR:MASTER_PORT; no shared files), next to the number of the collective it last entered.
On a failure, a rank marks itself failed in the store, watches the others' heartbeats for a few intervals, and
raises :class:`CommError` naming each rank whose heartbeat stopped (died or frozen), that is alive but has not
reached this collective (stuck in its own code, or running a different number of steps), or that failed waiting in
another kind of collective at the same number (a call made on some ranks only: a save behind a rank check).

Collectives about one parameter (stage 3's all-gathers and reduce-scatters) name it (``key``), and each rank folds
the names into ``trace`` in the order it issued them, and the parameters it used into a second trace (apart: a
deferred gather is issued whenever its read ends, between uses): ranks that ran different modules of the same
shapes (a branch, an MoE expert taken on some ranks only) gather each other's pieces of different parameters
without any error, and the engine compares the traces over ranks at each backward (``check_loss``,
offload/engine/_norm.py).
"""

from __future__ import annotations

import collections
import itertools
import threading
import time
import zlib
from enum import Enum
from typing import Any, Callable

import torch
import torch.distributed as dist

from ._group import ProcessGroup

_generation = itertools.count()  # engines made in this process, in the same order on every rank
_TRACE_MOD = (1 << 61) - 1  # a prime: the trace stays an int64 for the all-reduce that compares it
# torch 2.13 renamed these two (the old names warn at each call); torch 2.8, the minimum, has only the old names
_all_gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
_reduce_scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


def _fold(trace: int, what: str, key: int) -> int:
    """``trace`` followed by ``what`` of ``key``: the same on every rank that saw the same in the same order."""
    return (trace * 1_000_003 + zlib.crc32(what.encode()) + 2 * key + 1) % _TRACE_MOD


class CommError(RuntimeError):
    """A collective failed; the message names the rank(s) that stopped responding or fell behind."""


class OutOfStep(CommError):
    """The ranks met in a vote from different places: a rank failed after the collectives of an operation had
    started, raised, and voted where the others were still inside it (see :meth:`Comm.vote`)."""


class CommState(Enum):
    OPEN = "open"
    FAILED = "failed"  # a collective failed: the group is unusable, later calls re-raise
    CLOSED = "closed"


class Comm:
    """Collectives over ``pg`` (see the module docstring). ``close()`` stops the heartbeat and tears down what
    the process group's owner created."""

    def __init__(self, pg: ProcessGroup) -> None:
        self.pg = pg
        self.rank, self.world_size = pg.rank, pg.world_size
        self.state = CommState.OPEN
        self.payload_bytes: collections.Counter[str] = collections.Counter()
        self.wire_bytes: collections.Counter[str] = collections.Counter()
        self.calls: collections.Counter[str] = collections.Counter()
        self.seq = 0  # collectives entered, the same sequence on every rank
        self.trace = 0  # the keyed collectives issued since the owner last compared it over ranks
        self._uses = 0  # apart: deferred collectives interleave with uses as their reads happen to end
        self._error: CommError | None = None
        self._beat: _Heartbeat | None = None
        self.interval = min(1.0, max(0.05, pg.timeout / 10))
        self._scalar_device = pg.device  # the backend follows the device (NCCL: CUDA tensors, gloo: CPU ones)
        # collectives deferred by their owner (stage 3's NVMe pieces wait for their reads) are issued by this hook
        # before any other collective, so every rank issues them all in the same order
        self.before_collective: Callable[[], None] | None = None
        self._in_hook = False
        if pg.distributed and pg.store is not None:
            store = dist.PrefixStore(f"offload/{next(_generation)}", pg.store)
            self._beat = _Heartbeat(store, self, self.interval)

    # collectives ------------------------------------------------------------------------------------------------

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, *, key: int | None = None) -> None:
        """``out`` = this rank's 1/N chunk of the sum of every rank's ``inp``; ``key``: what it is about (traced)."""
        if self.world_size == 1:
            if out.data_ptr() != inp.data_ptr():
                out.copy_(inp)
            return
        self._run("reduce_scatter", inp, 1.0,
                  lambda: _reduce_scatter(out, inp, group=self.pg.group), key=key)

    def reduce(self, t: torch.Tensor, dst: int) -> Any:
        """Starts summing every rank's ``t`` into rank ``dst``'s ``t`` (the others' are left undefined); returns a
        handle whose ``wait()`` completes it. One reduce per owner of a bucket's range is how stages 1-2 move each
        gradient element once (the reduce-scatter volume) with buckets of any size."""
        if self.world_size == 1:
            return _Done()
        seq, t0 = self._enter("reduce", t, 1.0)
        work = self._call("reduce", seq, t0, lambda: dist.reduce(t, group_dst=dst, group=self.pg.group, async_op=True))
        return _Pending(self, work, "reduce", seq, t0)

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int]) -> None:
        """Rank r's ``in_splits[q]`` elements for q land in rank q's ``out`` (in rank order). Payload and wire are
        what this rank sends to the others (its own part never leaves it)."""
        if self.world_size == 1:
            out.copy_(inp)
            return
        sent = (inp.numel() - in_splits[self.rank]) * inp.element_size()
        seq, t0 = self._enter("all_to_all", inp, 0.0, sent=sent)
        self._call("all_to_all", seq, t0, lambda: dist.all_to_all_single(
            out, inp, output_split_sizes=out_splits, input_split_sizes=in_splits, group=self.pg.group))

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, *, async_op: bool = False,
                   key: int | None = None) -> Any:
        """``out`` = every rank's ``inp`` end to end (``inp`` may be this rank's chunk of ``out``). With
        ``async_op`` returns a handle whose ``wait()`` completes it. ``key``: what it is about (traced)."""
        if self.world_size == 1:
            if out.data_ptr() != inp.data_ptr():
                out.copy_(inp)
            return _Done() if async_op else None
        if async_op:
            seq, t = self._enter("all_gather", out, 1.0, key=key)
            work = self._call("all_gather", seq, t,
                              lambda: _all_gather(out, inp, group=self.pg.group, async_op=True))
            return _Pending(self, work, "all_gather", seq, t)
        self._run("all_gather", out, 1.0, lambda: _all_gather(out, inp, group=self.pg.group),
                  key=key)
        return None

    def all_reduce(self, t: torch.Tensor, op: Any = None) -> None:
        """In place: the sum (or ``op``) over ranks."""
        if self.world_size == 1:
            return
        op = op if op is not None else dist.ReduceOp.SUM
        self._run("all_reduce", t, 2.0, lambda: dist.all_reduce(t, op=op, group=self.pg.group))

    def broadcast(self, t: torch.Tensor, src: int) -> None:
        """In place: rank ``src``'s ``t`` on every rank."""
        if self.world_size == 1:
            return
        self._run("broadcast", t, 1.0, lambda: dist.broadcast(t, group_src=src, group=self.pg.group))

    def barrier(self) -> None:
        """Returns on each rank once every rank has called it."""
        if self.world_size == 1:
            return
        flag = torch.zeros(1, device=self._scalar_device)
        self._run("barrier", flag, 2.0, lambda: dist.all_reduce(flag, group=self.pg.group))
        flag.item()  # NCCL's all_reduce returns once queued: the host waits here, as a barrier must

    def vote(self, site: str, error: BaseException | None) -> int:
        """How many ranks failed (``error`` not None) at ``site``, a named point every rank reaches and where each
        says whether its own part succeeded, so that all raise together and none waits in a collective the others
        left. The ranks also compare ``site``: a rank that failed after an operation's collectives had started
        meets the others at another vote, and every rank raises then, rather than read the other vote's count
        (:class:`OutOfStep`; a rank with an error of its own raises that)."""
        if self.world_size == 1:
            return int(error is not None)
        crc = zlib.crc32(site.encode())
        codes = [float(crc & 0xFFFF), float(crc >> 16)]  # 16-bit halves: their sums and squares' sums are exact
        t = torch.tensor([*codes, *(c * c for c in codes), float(error is not None)], dtype=torch.float64,
                         device=self._scalar_device)
        try:
            self.all_reduce(t)
        except CommError as exc:  # the group failed under the vote: this rank's own error goes with it
            if error is None:
                raise
            raise CommError(f"{exc}; this rank had failed at {site!r} before: {type(error).__name__}: "
                            f"{error}") from error
        *sums, failed = t.tolist()
        # Cauchy-Schwarz: the sum's square is world x the sum of squares only when every rank sent the same code
        if any(sums[k] * sums[k] != sums[k + 2] * self.world_size for k in range(2)):
            if error is not None:
                raise error
            raise OutOfStep(f"rank {self.rank} voted at {site!r} where another rank voted elsewhere: a rank failed "
                            "after the collectives of an operation had started (see its error)")
        return int(failed)

    def rank0s(self, values: list[int]) -> list[int]:
        """``values`` as rank 0 has them (a collective; every rank passes as many): what each rank read for itself
        (a shared folder's listing, a comparison) becomes one answer, so all take the same path."""
        if self.world_size == 1:
            return list(values)
        t = torch.tensor(values, dtype=torch.int64, device=self._scalar_device)
        self.broadcast(t, 0)
        return t.tolist()

    def note(self, what: str, key: int) -> None:
        """Folds ``what`` happened to ``key`` into the trace of uses (stage 3's uses of parameters: one kept whole
        on the device is marked by no collective)."""
        self._uses = _fold(self._uses, what, key)

    def min_ints(self, values: list[int]) -> list[int]:
        """The MIN over ranks of ``values`` (int64s; every rank passes as many): what every rank can do."""
        if self.world_size == 1:
            return list(values)
        t = torch.tensor(values, dtype=torch.int64, device=self._scalar_device)
        self.all_reduce(t, op=dist.ReduceOp.MIN)
        return t.tolist()

    def min_and_trace(self, values: list[int]) -> tuple[list[int], bool]:
        """The MIN over ranks of ``values`` (integers), and whether every rank's ``trace`` is the same, in one
        all-reduce; collectives deferred by their owner are issued first, so they are in it. Every rank's trace
        starts anew."""
        if self.world_size > 1:
            self._flush_deferred()
        both = _fold(self.trace, "uses", self._uses)
        *mins, low, minus_high = self.min_ints([*values, both, -both])
        self.trace = self._uses = 0
        return mins, low == -minus_high

    def sum_float(self, value: float) -> float:
        """The sum over ranks of one float64 number (gradient norms)."""
        if self.world_size == 1:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=self._scalar_device)
        self.all_reduce(t)
        return float(t.item())

    # accounting and failure ----------------------------------------------------------------------------------------

    def _enter(self, op: str, t: torch.Tensor, wire_factor: float, *, sent: int | None = None,
               key: int | None = None) -> tuple[int, float]:
        """Counts a collective about ``t`` (``sent``: the bytes this rank sends, payload and wire, for
        collectives whose size differs per rank), folds its ``key`` into ``trace``, and returns its sequence
        number and start time."""
        if self.state is not CommState.OPEN:
            raise self._error or RuntimeError("the engine's process group is closed")
        self._flush_deferred()
        nbytes = t.numel() * t.element_size() if sent is None else sent
        if key is not None:
            self.trace = _fold(self.trace, op, key)
        self.seq += 1
        self.calls[op] += 1
        self.payload_bytes[op] += nbytes
        self.wire_bytes[op] += nbytes if sent is not None else \
            int(nbytes * wire_factor * (self.world_size - 1) / self.world_size)
        return self.seq, time.monotonic()

    def _flush_deferred(self) -> None:
        """Issues the collectives their owner deferred (``before_collective``), unless they are being issued."""
        if self.before_collective is not None and not self._in_hook:
            self._in_hook = True
            try:
                self.before_collective()
            finally:
                self._in_hook = False

    def _call(self, op: str, seq: int, t0: float, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except RuntimeError as exc:  # gloo/NCCL errors (DistBackendError is one)
            raise self._fail(op, seq, t0, exc) from exc

    def _run(self, op: str, t: torch.Tensor, wire_factor: float, fn: Callable[[], Any], *,
             key: int | None = None) -> None:
        seq, t0 = self._enter(op, t, wire_factor, key=key)
        self._call(op, seq, t0, fn)

    def _fail(self, op: str, seq: int, t0: float, exc: BaseException) -> CommError:
        elapsed = time.monotonic() - t0
        self.state = CommState.FAILED
        culprits = self._beat.diagnose(seq, op) if self._beat is not None else \
            "no heartbeat store to tell which rank is at fault"
        self._error = CommError(
            f"{culprits}: {op} (collective #{seq}) failed on rank {self.rank} of {self.world_size} after "
            f"{elapsed:.1f} s (offload.comm_timeout is {self.pg.timeout:g} s). Underlying error: "
            f"{str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__}")
        return self._error

    def raise_if_stopped(self) -> None:
        """Raises :class:`CommError` when another rank has stopped on an error of its own (see ``close``), naming
        it and quoting the error: a point where this rank may stop too, rather than go on to a collective."""
        stopped = self._beat.stopped if self._beat is not None else None
        if stopped is not None and stopped[0] != self.rank:
            self.state = CommState.FAILED
            self._error = CommError(f"rank {stopped[0]} failed: {stopped[1]} (so rank {self.rank} stops too)")
            raise self._error

    def stats(self) -> dict[str, Any]:
        return {"rank": self.rank, "world_size": self.world_size, "state": self.state.value,
                "calls": dict(self.calls), "payload_bytes": dict(self.payload_bytes),
                "wire_bytes": dict(self.wire_bytes)}

    def close(self, reason: str | None = None) -> None:
        """``reason``: why this rank stops (its engine failed to build, say), which the other ranks read (see
        :class:`_Heartbeat`)."""
        if self.state is CommState.CLOSED:
            return
        failed = self.state is CommState.FAILED
        self.state = CommState.CLOSED
        try:
            if self._beat is not None:
                self._beat.close(failed, reason)
        finally:
            self._beat = None
            self.pg.close()


class _Done:
    def wait(self) -> None:
        pass

    def done(self) -> bool:
        return True


class _Pending:
    """An asynchronous collective; ``wait()`` completes it, or raises the diagnosed error."""

    def __init__(self, comm: Comm, work: Any, op: str, seq: int, t0: float) -> None:
        self.comm, self.work, self.op, self.seq, self.t0 = comm, work, op, seq, t0

    def wait(self) -> None:
        self.comm._call(self.op, self.seq, self.t0, self.work.wait)

    def done(self) -> bool:
        return bool(self.work.is_completed())


class _Heartbeat:
    """A thread that publishes ``"<beat> <collective seq>"`` under key ``beat/<rank>`` every ``interval`` seconds;
    ``status/<rank>`` says "failed ..." (a collective failed) or "closed" once a rank is done. A rank that stops on
    an error of its own (its engine failed to build) writes ``stopped`` = "<rank> <why>", which every beat reads
    (one key, whatever the world size): the others' builds stop at their next stop point, and a collective that
    fails because of it is explained at once, with no heartbeat watched. Clocks are never compared across hosts:
    a rank is alive when its beat counter moves."""

    def __init__(self, store: Any, comm: Comm, interval: float) -> None:
        self.store, self.comm, self.interval = store, comm, interval
        self._stop = threading.Event()
        self._beats = 0
        self.stopped: tuple[int, str] | None = None  # (rank, why) of a rank that stopped on its own error
        self._publish()
        self._thread = threading.Thread(target=self._run, name="offload-heartbeat", daemon=True)
        self._thread.start()

    def _publish(self) -> None:
        self._beats += 1
        self.store.set(f"beat/{self.comm.rank}", f"{self._beats} {self.comm.seq}")

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self._publish()
                self._read_stopped()
            except Exception:  # the store is gone (its host died): diagnose() reports it
                return

    def _read_stopped(self) -> tuple[int, str] | None:
        if self.stopped is None and (word := self._read("stopped")) is not None:
            rank, _, why = word.partition(" ")
            self.stopped = (int(rank), why)
        return self.stopped

    def _read(self, key: str) -> str | None:
        return self.store.get(key).decode() if self.store.check([key]) else None

    def diagnose(self, seq: int, op: str) -> str:
        """Who is at fault for collective ``seq`` (an ``op``) failing here: watches the others for 3 heartbeat
        intervals, and reads where those that failed too were."""
        me, world = self.comm.rank, self.comm.world_size
        others = [r for r in range(world) if r != me]
        try:
            self.store.set(f"status/{me}", f"failed {seq} {op}")
            if (stopped := self._read_stopped()) is not None and stopped[0] != me:
                return f"rank {stopped[0]} failed: {stopped[1]}"
            before = {r: self._read(f"beat/{r}") for r in others}
            time.sleep(3 * self.interval)
            after = {r: self._read(f"beat/{r}") for r in others}
            status = {r: self._read(f"status/{r}") for r in others}
        except Exception as exc:  # noqa: BLE001 - any store failure means its host is unreachable
            return (f"rank 0 (or the torchrun agent hosting the rendezvous store) is unreachable, so it most likely "
                    f"died ({type(exc).__name__}: {exc})")
        dead, behind, failed = [], [], []
        for r in others:
            if status[r] == "closed":
                behind.append(f"rank {r} has closed its engine")
            elif status[r] is not None:
                _, their_seq, their_op = status[r].split(maxsplit=2)
                if (int(their_seq), their_op) == (seq, op):
                    failed.append(r)
                else:  # each waited in a collective the other never called: a call made on some ranks only
                    behind.append(f"rank {r} was in {their_op} (collective #{their_seq}) where rank {me} was in {op} "
                                  f"(#{seq}): the ranks called different collectives, so code that makes them ran "
                                  "on some ranks only (a save, load or evaluation behind a rank check, a branch); "
                                  "every rank must make the same calls")
            elif before[r] is None or before[r] == after[r]:
                dead.append(f"rank {r} stopped responding (its heartbeat did not move in the {3 * self.interval:.1f} "
                            "s this rank watched it after the failure: its process died or is frozen)")
            elif after[r] is not None and int(after[r].split()[1]) < seq:
                behind.append(f"rank {r} is alive but has not reached collective #{seq} (it is at "
                              f"#{after[r].split()[1]}: stuck in its own code, or running a different number of "
                              "steps)")
        found = dead + behind
        if not found and failed:
            return f"rank(s) {', '.join(map(str, failed))} failed too; no rank was found dead or behind"
        return "; ".join(found) if found else "no other rank was found dead or behind"

    def close(self, failed: bool, reason: str | None = None) -> None:
        self._stop.set()
        self._thread.join()
        try:
            if reason is not None:
                self.store.set("stopped", f"{self.comm.rank} {reason}")
            if not failed:
                self.store.set(f"status/{self.comm.rank}", "closed")
        except Exception:  # noqa: BLE001 - closing after the store's host exited
            pass
