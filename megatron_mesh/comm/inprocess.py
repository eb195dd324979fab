"""In-process transport: all P ranks of a plan in one process, as P *virtual ranks*.

Each virtual rank is a thread with its own :class:`InProcessCommunicator`; the communicators of
one run share a :class:`Mailbox`. This runs the full Mesh / ring / TASP forward and backward on
one device (one CPU, or one GPU with its CUDA kernels) with exactly the data flow of P real
ranks: same plans, same executor, same kernels, same bytes (``comm_counter()`` counts them in
:meth:`Communicator.start`, per thread).

Matching. Messages from ``src`` to ``dst`` form a channel and are matched in posting order, as
with gloo / NCCL P2P: the n-th send posted by ``src`` to ``dst`` lands in the n-th receive posted
by ``dst`` from ``src``. The transfer is made by whichever side posts second (NCCL semantics: a
transfer can complete once both sides have posted; neither side has to reach its ``Wait``), so
the mailbox never deadlocks where a real transport would not. Sender and receiver must not touch
the tensors between their post and their wait -- the contract of every transport. A
shape/dtype mismatch between matched tensors is a plan bug and fails the whole run.

Worked example (P = 2, ring attention, forward round 1; rank 0 happens to post first)::

    rank 0: post 1: send kv0->1 | recv kv1<-1   channel 0->1 keeps send #0 (kv0),
                                                channel 1->0 keeps receive #0 (rank 0's kv1 buffer)
    rank 1: post 1: send kv1->0 | recv kv0<-0   its send #0 on 1->0 meets rank 0's receive #0:
                                                kv1 is copied; its receive #0 on 0->1 meets
                                                rank 0's send #0: kv0 is copied
    rank 0: wait 1, rank 1: wait 1              both return at once: the transfers are done

Streams (CUDA). Each side records an event on its current stream when it posts; the copy runs on
the second poster's stream after waiting for both events, and records a "copied" event that both
sides' streams wait on in ``Work.wait()``. So the mailbox is safe when virtual ranks run on
different streams (``run_inprocess(..., streams=True)``), and ``wait()`` never blocks the host
on the device.

Driving forward and backward. Torch's autograd engine runs the CUDA part of every ``backward()``
on one worker thread per device, so P threads calling ``loss.backward()`` through the public
autograd functions would queue their plan backwards on that one thread, and the first one to wait
for a peer's message would block the peer forever. ``megatron_mesh.runtime.api.forward_backward``
therefore calls
:class:`~megatron_mesh.runtime.executor.Executor` ``forward`` / ``backward`` directly on each
virtual rank -- the same calls, layout views and casts as the autograd function --
so CPU and CUDA runs are driven identically (on CPU the autograd engine runs backward on the
calling thread, so the public functions also work there; the tests check that both agree
bitwise).

Failures. An exception on one virtual rank aborts the mailbox: every other rank waiting on it
raises at once, and :func:`run_inprocess` raises :class:`InProcessError` with the first failure
and every traceback. When every unfinished rank waits for a message nobody can send any more,
the run fails immediately, naming who waits for whom; anything else that hangs (e.g. a rank
stuck in compute) fails after ``timeout`` seconds.
"""

from __future__ import annotations

import threading
import time
import traceback
from collections import deque
from typing import Any, Callable, Sequence

import torch
from torch import Tensor

from .base import Communicator, Work

__all__ = ["Mailbox", "InProcessCommunicator", "InProcessError", "run_inprocess"]

_POLL_S = 0.25  # how often a waiting rank re-checks for an abort it may not have been notified of


class InProcessError(RuntimeError):
    """A virtual rank raised, the ranks deadlocked, or the run timed out. ``errors`` maps each
    rank that failed on its own (not merely aborted because of another) to its exception."""

    def __init__(self, message: str, errors: dict[int, BaseException] | None = None):
        super().__init__(message)
        self.errors = errors or {}


class _Aborted(RuntimeError):
    """Raised on a virtual rank because another rank failed (not a failure of its own)."""


class _Transfer:
    """One posted send or receive, waiting for its match on the channel."""

    __slots__ = ("rank", "peer", "side", "tensor", "seq", "ready", "copied", "done")

    def __init__(self, rank: int, peer: int, side: str, tensor: Tensor, seq: int):
        self.rank, self.peer, self.side, self.tensor, self.seq = rank, peer, side, tensor, seq
        self.ready = _record_event(tensor)  # the poster's stream has produced / released the tensor
        self.copied = None  # CUDA event after the copy (None on CPU)
        self.done = False


def _record_event(t: Tensor, timing: bool = False):
    if t.device.type != "cuda":
        return None
    ev = torch.cuda.Event(enable_timing=timing)
    ev.record(torch.cuda.current_stream(t.device))
    return ev


class Mailbox:
    """Channels between the ``world_size`` virtual ranks of one run (see the module doc).

    ``timed=True`` measures the copies (what a benchmark subtracts to get compute-only time):
    :meth:`copy_seconds` and ``copied_bytes``. ``turns=True`` times each rank's own work in a
    serial run (``busy``), synchronising the device at every hand-over -- which a run that does
    not ask for it is spared, so its ranks' device work may overlap the next rank's launches.
    """

    def __init__(self, world_size: int, timed: bool = False, turns: bool = False):
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size, self.timed, self.turns = world_size, timed, turns
        self.copied_bytes = 0
        self._cpu_seconds = 0.0
        self._cuda_events: list = []  # (start, end) pairs, read after the device is synchronised
        # A re-entrant lock: in serial mode a virtual rank holds it while it computes (see
        # run_inprocess) and still takes it again for its posts and waits.
        self.lock = threading.RLock()
        self.cond = threading.Condition(self.lock)
        self.sends: dict[tuple[int, int], deque[_Transfer]] = {}  # unmatched sends per (src, dst)
        self.recvs: dict[tuple[int, int], deque[_Transfer]] = {}  # unmatched receives per (src, dst)
        self.posted: dict[tuple[int, int, str], int] = {}  # message counters per (src, dst, side)
        self.blocked: dict[int, list[_Transfer]] = {}  # rank -> the transfers it waits for
        self.finished: set[int] = set()
        self.error: str | None = None
        # serial runs with turns=True: each rank's seconds holding the turn (its own work); the
        # device is synchronised at every hand-over so its queued work counts to the rank that
        # queued it
        self.serial = False
        self.busy = [0.0] * world_size
        self._since: dict[int, float] = {}

    # -- posting -----------------------------------------------------------------------------------
    def post(self, rank: int, sends: Sequence[tuple[int, Tensor]], recvs: Sequence[tuple[int, Tensor]]) -> list:
        with self.cond:
            self._check()
            mine = [self._post(rank, peer, t, "send") for peer, t in sends]
            mine += [self._post(rank, peer, t, "recv") for peer, t in recvs]
            self.cond.notify_all()
            return mine

    def _post(self, rank: int, peer: int, tensor: Tensor, side: str) -> _Transfer:
        src, dst = (rank, peer) if side == "send" else (peer, rank)
        n = self.posted.get((src, dst, side), 0)
        self.posted[(src, dst, side)] = n + 1
        tr = _Transfer(rank, peer, side, tensor, n)
        theirs = (self.recvs if side == "send" else self.sends).setdefault((src, dst), deque())
        if theirs:  # the peer posted first: this post completes the transfer
            other = theirs.popleft()
            snd, rcv = (tr, other) if side == "send" else (other, tr)
            self._copy(src, dst, snd, rcv)
        else:
            (self.sends if side == "send" else self.recvs).setdefault((src, dst), deque()).append(tr)
        return tr

    def _copy(self, src: int, dst: int, snd: _Transfer, rcv: _Transfer) -> None:
        a, b = snd.tensor, rcv.tensor
        if a.shape != b.shape or a.dtype != b.dtype:  # a plan bug: raised on the poster, aborts the run
            raise ValueError(f"message #{snd.seq} from rank {src} to rank {dst} does not match its receive: "
                             f"sent {tuple(a.shape)} {a.dtype}, receive buffer {tuple(b.shape)} {b.dtype}")
        self.copied_bytes += b.numel() * b.element_size()
        if b.device.type == "cuda":
            stream = torch.cuda.current_stream(b.device)
            for ev in (snd.ready, rcv.ready):
                if ev is not None:
                    stream.wait_event(ev)
            start = _record_event(b, timing=True) if self.timed else None
            b.copy_(a, non_blocking=True)
            snd.copied = rcv.copied = _record_event(b, timing=self.timed)
            if self.timed:
                self._cuda_events.append((start, snd.copied))
        else:
            t0 = time.perf_counter()
            b.copy_(a)
            self._cpu_seconds += time.perf_counter() - t0
        snd.done = rcv.done = True

    def copy_seconds(self) -> float:
        """Seconds spent in copies so far (``timed=True``; synchronise the device first on CUDA)."""
        if not self.timed:
            raise ValueError("copy times are measured only by a Mailbox(..., timed=True)")
        return self._cpu_seconds + sum(a.elapsed_time(b) for a, b in self._cuda_events) / 1e3

    # -- the turn of a serial run ------------------------------------------------------------------
    def take_turn(self, rank: int) -> None:
        """Serial runs: ``rank`` starts working (it holds the lock)."""
        if self.serial and self.turns:
            self._since[rank] = time.perf_counter()

    def end_turn(self, rank: int, device=None) -> None:
        """Serial runs: ``rank`` stops working (before it gives the lock up): its time so far,
        its queued device work included, is its own."""
        start = self._since.pop(rank, None)
        if start is not None:
            if device is not None and device.type == "cuda":
                torch.cuda.synchronize(device)
            self.busy[rank] += time.perf_counter() - start

    # -- waiting -----------------------------------------------------------------------------------
    def wait(self, rank: int, transfers: list[_Transfer]) -> None:
        with self.cond:
            while True:
                self._check()
                if all(t.done for t in transfers):
                    break
                self.blocked[rank] = transfers
                device = transfers[0].tensor.device if transfers else None
                try:
                    self._detect_deadlock()
                    self.end_turn(rank, device)
                    self.cond.wait(_POLL_S)
                finally:
                    self.take_turn(rank)
                    self.blocked.pop(rank, None)
        for t in transfers:  # the caller's stream may use / reuse the tensors once the copy is done
            if t.copied is not None:
                torch.cuda.current_stream(t.tensor.device).wait_event(t.copied)

    def finish(self, rank: int) -> None:
        with self.cond:
            self.finished.add(rank)
            self._detect_deadlock()
            self.cond.notify_all()

    def _detect_deadlock(self) -> None:
        # Transfers complete at post time, so once every unfinished rank is blocked in a wait
        # nobody will post again: the run can never make progress.
        # A rank registered as blocked whose transfers have completed meanwhile is about to wake.
        stuck = [r for r, trs in self.blocked.items() if not all(t.done for t in trs)]
        if stuck and len(stuck) + len(self.finished) == self.world_size and self.error is None:
            done = f" (ranks {sorted(self.finished)} have finished)" if self.finished else ""
            self._abort(f"deadlock: {self.waiting()}{done}")

    def waiting(self) -> str:
        """Who waits for what, e.g. "rank 0 waits for message #2 (receive from rank 1)"."""
        lines = []
        for r, trs in sorted(list(self.blocked.items())):  # list(): may be called without the lock
            t = next((t for t in trs if not t.done), None)
            if t is not None:
                what = "send to" if t.side == "send" else "receive from"
                lines.append(f"rank {r} waits for message #{t.seq} ({what} rank {t.peer})")
        return "; ".join(lines) or "no rank waits for a message"

    def unmatched(self) -> list[str]:
        """Posted transfers that never met their match (a plan bug once every rank has finished)."""
        return [f"{side} #{t.seq} between ranks {src} and {dst} (posted by rank {t.rank})"
                for side, table in (("send", self.sends), ("receive", self.recvs))
                for (src, dst), q in sorted(table.items()) for t in q]

    # -- failure -----------------------------------------------------------------------------------
    def _check(self) -> None:
        if self.error is not None:
            raise _Aborted(self.error)

    def _abort(self, reason: str) -> None:
        if self.error is None:
            self.error = reason
        self.cond.notify_all()

    def abort(self, reason: str) -> None:
        """Make every waiting virtual rank raise (callable from any thread, never blocks long)."""
        if self.error is None:
            self.error = reason  # waiting ranks poll this even if the notify below cannot happen
        if self.lock.acquire(timeout=_POLL_S):  # in serial mode a rank stuck in compute holds it
            try:
                self.cond.notify_all()
            finally:
                self.lock.release()


class _MailboxWork:
    def __init__(self, mailbox: Mailbox, rank: int, transfers: list[_Transfer]):
        self.mailbox, self.rank, self.transfers = mailbox, rank, transfers

    def wait(self) -> None:
        self.mailbox.wait(self.rank, self.transfers)


class InProcessCommunicator(Communicator):
    """Virtual rank ``rank`` of ``mailbox``'s group (one per thread)."""

    def __init__(self, mailbox: Mailbox, rank: int):
        if not 0 <= rank < mailbox.world_size:
            raise ValueError(f"rank {rank} out of range for a mailbox of {mailbox.world_size} ranks")
        self.mailbox, self.rank, self.world_size = mailbox, rank, mailbox.world_size

    @property
    def members(self) -> tuple:  # its world: two worlds of virtual ranks may run in one process at once
        return ("mailbox", id(self.mailbox))

    def _start(self, sends: Sequence[tuple[int, Tensor]], recvs: Sequence[tuple[int, Tensor]]) -> Work:
        return _MailboxWork(self.mailbox, self.rank, self.mailbox.post(self.rank, sends, recvs))


def run_inprocess(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0,
                  serial: bool = False, device: "str | torch.device | None" = None,
                  streams: bool = False, mailbox: Mailbox | None = None) -> list[Any]:
    """Run ``fn(rank, comm, *args)`` for every virtual rank in its own thread; return the results
    in rank order.

    ``serial=True`` lets one virtual rank run at a time (a rank hands over only while it waits
    for a message), so wall time is the sum of all ranks' work -- what a one-device benchmark
    wants -- and, with a ``Mailbox(..., turns=True)``, ``mailbox.busy[r]`` the seconds rank r held
    the turn (its own work; the device is synchronised at each hand-over): the busiest rank's is
    what one step of P devices would take without communication. ``device`` (a CUDA device) is made current in every thread;
    ``streams=True`` gives each virtual rank its own CUDA stream. ``mailbox``: a fresh :class:`Mailbox` of
    ``world_size`` ranks to use (e.g. a timed one); default a new one. Raises
    :class:`InProcessError` if a rank raises, the ranks deadlock, or the run is still going after
    ``timeout`` seconds.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not timeout > 0:
        raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
    dev = _threads_device(device, streams)
    mailbox = _fresh_mailbox(mailbox, world_size)
    mailbox.serial = serial
    results: list[Any] = [None] * world_size
    errors: dict[int, BaseException] = {}
    tracebacks: dict[int, str] = {}

    def body(rank: int) -> None:
        comm = InProcessCommunicator(mailbox, rank)
        try:
            if serial:
                mailbox.lock.acquire()
                mailbox.take_turn(rank)
            try:
                with _device_context(dev, streams):
                    results[rank] = fn(rank, comm, *args)
            finally:
                if serial:
                    mailbox.end_turn(rank, dev)
                    mailbox.lock.release()
        except BaseException as e:  # report every failure, and stop the ranks that wait on this one
            errors[rank] = e
            tracebacks[rank] = traceback.format_exc()
            if not isinstance(e, _Aborted):
                mailbox.abort(f"rank {rank} raised {type(e).__name__}: {e}")
        finally:
            mailbox.finish(rank)

    threads = [threading.Thread(target=body, args=(r,), name=f"virtual-rank-{r}", daemon=True)
               for r in range(world_size)]
    deadline = time.monotonic() + timeout
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    _raise_failures(getattr(fn, "__name__", repr(fn)), world_size, timeout, threads, mailbox, errors, tracebacks)
    return results


def _threads_device(device: "str | torch.device | None", streams: bool) -> "torch.device | None":
    """The device the ranks' threads make current (a CUDA device gets its index: threads start on
    device 0); ValueError for ``streams=True`` without a CUDA device."""
    dev = torch.device(device) if device is not None else None
    if dev is not None and dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())  # threads start on device 0: name it
    if streams and (dev is None or dev.type != "cuda"):
        raise ValueError(f"streams=True needs a CUDA device, got device={device!r}")
    return dev


def _fresh_mailbox(mailbox: Mailbox | None, world_size: int) -> Mailbox:
    """``mailbox``, checked to be a fresh one of ``world_size`` ranks, or a new one (None)."""
    if mailbox is None:
        return Mailbox(world_size)
    if mailbox.world_size != world_size or mailbox.posted or mailbox.finished:
        used = "already used" if mailbox.posted or mailbox.finished else "unused"
        raise ValueError(f"mailbox must be a fresh Mailbox of {world_size} ranks, got an {used} one of "
                         f"{mailbox.world_size} ranks")
    return mailbox


def _raise_failures(name: str, world_size: int, timeout: float, threads: list[threading.Thread], mailbox: Mailbox,
                    errors: dict[int, BaseException], tracebacks: dict[int, str]) -> None:
    """Raise :class:`InProcessError` for a timeout, a rank's own failure, a deadlock, or
    transfers left unmatched, in that order."""
    running = [r for r, t in enumerate(threads) if t.is_alive()]
    if running:
        waits = mailbox.waiting()
        mailbox.abort(f"timed out after {timeout:g} s")
        raise InProcessError(f"{name} on {world_size} virtual ranks timed out after {timeout:g} s (a hang or "
                             f"deadlock); ranks still running: {running}; {waits}", _own(errors))
    own = _own(errors)
    if own:
        first = next(iter(own))  # the first rank that failed (dicts keep insertion order)
        detail = "\n".join(f"rank {r}:\n{tracebacks[r]}" for r in sorted(own))
        raise InProcessError(f"{name} failed on virtual rank {first}: {type(own[first]).__name__}: "
                             f"{own[first]}\n{detail}", own) from own[first]
    if errors:  # every failure is an abort without a rank's own error: the mailbox found a deadlock
        raise InProcessError(f"{name} on {world_size} virtual ranks: {mailbox.error}")
    left = mailbox.unmatched()
    if left:
        raise InProcessError(f"{name}: every rank finished but transfers were never matched: {'; '.join(left)}")


def _own(errors: dict[int, BaseException]) -> dict[int, BaseException]:
    return {r: e for r, e in errors.items() if not isinstance(e, _Aborted)}


class _device_context:
    """Make ``device`` current in this thread (and give it its own stream when asked)."""

    def __init__(self, device: torch.device | None, stream: bool):
        self.device, self.stream, self.ctx = device, stream, []

    def __enter__(self):
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            if self.stream:
                s = torch.cuda.Stream(self.device)
                s.wait_stream(torch.cuda.current_stream(self.device))  # inputs made on the default stream
                self.ctx.append(torch.cuda.stream(s))
                self.ctx[-1].__enter__()
        return self

    def __exit__(self, *exc):
        if self.ctx:
            s = torch.cuda.current_stream(self.device)
            self.ctx.pop().__exit__(*exc)
            torch.cuda.current_stream(self.device).wait_stream(s)  # results are used on the default stream
        return False
