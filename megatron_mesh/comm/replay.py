"""One rank of a plan alone on a device: its rounds replayed from a recording.

The in-process transport (:mod:`.inprocess`) runs all P ranks of a plan on one device, one at a
time, handing over at every wait, so what it times is every rank's work plus the hand-overs. To
see what *one* rank's step costs on its own device -- its kernels and its host work (launches,
the executor's Python), with nothing else between them -- record the messages each rank received
in such a run once (:class:`Recorder`), then run that rank alone with a
:class:`ReplayCommunicator`: each of its rounds writes the recorded messages into its receive
buffers (one device copy each, as NCCL's receive writes them) and drops its sends. The rank then
computes exactly what it computed in the full run (tested bitwise), and its host runs ahead of
its device as on a real GPU of a P-GPU job, so a loop of steps shows whether the host or the
device sets the pace. What it leaves out is the communication itself: the transfers' time,
which on P devices overlaps the blocks (the planner prices it).

Worked example (ring, P = 4, forward): rank 0 posts 3 rounds, each receiving one KV chunk from
rank 3 (then 2, then 1: the chunks travel round the ring). :class:`Recorder` keeps the three
received chunks, in order; replayed, rank 0's round t receives the t-th, whoever would have sent
it, and its sends (its own chunk to rank 1) go nowhere.
"""

from __future__ import annotations

from typing import Sequence

from torch import Tensor

from .base import DONE, Communicator, Work

__all__ = ["Recorder", "ReplayCommunicator"]


class _Recorded:
    """A round's handle that keeps copies of its received tensors once they have arrived."""

    def __init__(self, work: Work, recvs: Sequence[tuple[int, Tensor]], into: list):
        self.work, self.recvs, self.into = work, recvs, into

    def wait(self) -> None:
        self.work.wait()
        if not self.into:  # once: a second wait may come after the buffers were reused
            self.into.append([(peer, t.clone()) for peer, t in self.recvs])


class Recorder(Communicator):
    """Wraps a rank's communicator and records, per round, a copy of every tensor it received
    and its sender (``rounds``: one list per round that had receives, in posting order). Hand
    :meth:`received` to a :class:`ReplayCommunicator` to run this rank again alone."""

    def __init__(self, comm: Communicator):
        self.comm, self.rank, self.world_size = comm, comm.rank, comm.world_size
        self.rounds: list[list[Tensor]] = []

    @property
    def members(self) -> object:
        return self.comm.members

    def __getattr__(self, name):  # process_group etc.: the wrapped communicator's (the plan agreement check)
        if name == "comm":
            raise AttributeError(name)
        return getattr(self.comm, name)

    def start(self, sends, recvs) -> Work:  # the wrapped communicator counts the bytes, once
        return self._record(self.comm.start(sends, recvs), recvs)

    def exchange(self, group, sends, recvs) -> Work:  # the wrapped transport's collective, if it has one
        return self._record(self.comm.exchange(group, sends, recvs), recvs)

    def _record(self, work: Work, recvs) -> Work:
        if not recvs:
            return work
        slot: list = []
        self.rounds.append(slot)  # in posting order, whatever order the rounds are waited in
        return _Recorded(work, recvs, slot)

    def _start(self, sends, recvs) -> Work:  # pragma: no cover -- start() delegates whole rounds
        raise NotImplementedError

    def received(self) -> list[list[tuple[int, Tensor]]]:
        """The rounds' received (sending rank, tensor) pairs (every round waited for: a round
        never waited leaves an empty entry, which is an error here)."""
        for i, r in enumerate(self.rounds):
            if not r:
                raise ValueError(f"round {i} of rank {self.rank} was never waited for: nothing was recorded")
        return [r[0] for r in self.rounds]


class ReplayCommunicator(Communicator):
    """Rank ``rank`` of ``world_size`` alone: round i (of those with receives, in posting order)
    copies ``rounds[i]`` into its receive buffers; sends go nowhere. After the last round it starts
    again from the first, so a loop of steps replays every step. ``rounds``: what
    :meth:`Recorder.received` returns, (sending rank, tensor) per receive.

    A receive that does not fit the recording -- another count of receives in a round, another
    sender, shape or dtype (another plan, or other inputs' sizes) -- is an error naming both.
    What it cannot tell is a call whose messages look the same: the same plan with other input
    values, or another plan with the same transfers (a causal and a non-causal ring). Those run
    on the recorded values and compute something else; replay the call that was recorded."""

    def __init__(self, rank: int, world_size: int, rounds: Sequence[Sequence[tuple[int, Tensor]]]):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in 0..{world_size - 1} (world_size {world_size}), got {rank}")
        if not rounds:
            raise ValueError(f"rank {rank} has no recorded rounds to replay")
        self.rank, self.world_size, self.rounds = rank, world_size, list(rounds)
        self.next = 0

    def _start(self, sends, recvs) -> Work:
        if not recvs:
            return DONE
        recorded = self.rounds[self.next]
        if len(recorded) != len(recvs):
            raise ValueError(f"rank {self.rank}, replayed round {self.next}: {len(recvs)} receives, "
                             f"{len(recorded)} recorded")
        for (peer, buf), (sender, src) in zip(recvs, recorded):
            if peer != sender or buf.shape != src.shape or buf.dtype != src.dtype:
                raise ValueError(f"rank {self.rank}, replayed round {self.next}: receive from rank {peer} is "
                                 f"{tuple(buf.shape)} {buf.dtype}, recorded from rank {sender} "
                                 f"{tuple(src.shape)} {src.dtype}")
            buf.copy_(src, non_blocking=True)
        self.next = (self.next + 1) % len(self.rounds)
        return DONE
