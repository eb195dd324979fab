"""The communicator contract and byte counting.

A communicator moves the transfers of one round: it starts all sends and receives of the round
asynchronously and returns a handle whose ``wait()`` completes them. It never knows about
attention. Every byte it moves is reported to the active :func:`comm_counter` blocks.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator, Mapping, Protocol, Sequence

from torch import Tensor

__all__ = ["Work", "Communicator", "CommCount", "comm_counter", "record_bytes", "total_bytes", "total_sent_to"]


class Work(Protocol):
    def wait(self) -> None: ...


class _Done:
    def wait(self) -> None:
        return None


DONE: Work = _Done()


class Communicator(ABC):
    """Point-to-point transport over the ranks of one CP group (``rank`` is this rank's index)."""

    rank: int
    world_size: int

    @property
    def members(self) -> object:
        """Which group of ranks this is, as a rank's arenas key it (:class:`~megatron_mesh.runtime.state.Arenas`):
        calls over one group (every layer's, forward and backward) run one after another and share
        the rank's scratch bytes; calls over two groups may run at once (a thread per group) and
        must not. None: the process's one group (a single rank, a rank replayed alone)."""
        return None

    @abstractmethod
    def _start(self, sends: Sequence[tuple[int, Tensor]], recvs: Sequence[tuple[int, Tensor]]) -> Work:
        """Start the round; tensors are contiguous; peers are group ranks other than ``rank``."""

    def start(self, sends: Sequence[tuple[int, Tensor]], recvs: Sequence[tuple[int, Tensor]]) -> Work:
        """Post every send and receive of a round (in list order per peer) and return a handle."""
        self._check(sends, recvs)
        if not sends and not recvs:
            return DONE
        self._count(sends, recvs)
        return self._start(sends, recvs)

    def exchange(self, group: tuple[int, ...], sends: Sequence[tuple[int, Tensor]],
                 recvs: Sequence[tuple[int, Tensor]]) -> Work:
        """A round that every rank of ``group`` (group ranks, this one among them) posts, moving
        data only among them: an all-to-all (a Ulysses group's; the plan's ``Post.group``). A
        transport with a process group of exactly these ranks moves it in one collective call
        (:class:`~megatron_mesh.comm.torch_dist.TorchDistCommunicator`); this default moves it as
        :meth:`start` does -- the same bytes into the same buffers, a call per tensor."""
        return self.start(sends, recvs)

    def _check(self, sends, recvs) -> None:
        for peer, t in (*sends, *recvs):
            if peer == self.rank or not 0 <= peer < self.world_size:
                raise ValueError(f"rank {self.rank} cannot transfer with peer {peer} (group of {self.world_size})")
            if not t.is_contiguous():
                raise ValueError("transfers need contiguous tensors")

    @staticmethod
    def _count(sends, recvs) -> None:
        sent_to: dict[int, int] = {}
        for peer, t in sends:
            sent_to[peer] = sent_to.get(peer, 0) + t.numel() * t.element_size()
        record_bytes(sum(sent_to.values()), sum(t.numel() * t.element_size() for _, t in recvs), len(sends), sent_to)


@dataclass
class CommCount:
    """Bytes this rank's plugin communication sent and received inside a :func:`comm_counter`.
    ``sent_to`` splits ``bytes_sent`` by receiver: peer -> bytes, the peer as the communicator names
    it, i.e. its rank in the CP group (not its global rank), so the counts of a group's ranks form
    its sender x receiver matrix."""

    bytes_sent: int = 0
    bytes_received: int = 0
    messages_sent: int = 0
    sent_to: dict[int, int] = field(default_factory=dict)

    def add(self, sent: int, received: int, messages: int, sent_to: Mapping[int, int] | None) -> None:
        self.bytes_sent += sent
        self.bytes_received += received
        self.messages_sent += messages
        for peer, n in (sent_to or {}).items():
            self.sent_to[peer] = self.sent_to.get(peer, 0) + n


_local = threading.local()  # one stack per thread: in-process virtual ranks run one per thread
_totals = CommCount()  # everything this process sent/received since start (for per-step logging)
_totals_lock = threading.Lock()


def _stack() -> list[CommCount]:
    if not hasattr(_local, "stack"):
        _local.stack = []
    return _local.stack


def record_bytes(sent: int, received: int, messages: int = 0, sent_to: Mapping[int, int] | None = None) -> None:
    """Credit a round's bytes to the process totals and this thread's open counters; ``sent_to``:
    the sent bytes per peer (group rank), summing to ``sent`` when given."""
    if sent_to is not None and sum(sent_to.values()) != sent:
        raise ValueError(f"bytes per peer {dict(sent_to)} sum to {sum(sent_to.values())}, not to the {sent} bytes sent")
    with _totals_lock:
        _totals.add(sent, received, messages, sent_to)
    for c in _stack():
        c.add(sent, received, messages, sent_to)


def total_bytes() -> tuple[int, int]:
    """(sent, received) bytes of all plugin communication of this process so far (all threads);
    the training scripts log its growth per iteration."""
    with _totals_lock:
        return _totals.bytes_sent, _totals.bytes_received


def total_sent_to() -> dict[int, int]:
    """Bytes this process sent so far per peer (its rank in the CP group), all threads: a copy.
    One process is one rank of one CP group in Megatron; in-process virtual ranks (threads) share
    a process, so read their per-rank counts from :func:`comm_counter` instead."""
    with _totals_lock:
        return dict(_totals.sent_to)


def active_counters() -> list[CommCount]:
    """This thread's open :func:`comm_counter` blocks: the list object itself, so counters opened
    or closed later stay in step (hand it to :func:`counting_into`)."""
    return _stack()


@contextmanager
def counting_into(counters: list[CommCount]) -> Iterator[None]:
    """Credit this thread's transfers inside the block to ``counters`` (another thread's
    :func:`active_counters`). Autograd runs the backward of CUDA tensors on its own device thread,
    yet those bytes belong to the ``comm_counter()`` of the thread that ran the forward."""
    previous = _stack()
    _local.stack = counters
    try:
        yield
    finally:
        _local.stack = previous


@contextmanager
def comm_counter() -> Iterator[CommCount]:
    """Count the bytes the plugin sends and receives on this rank inside the block, forward and
    backward (run ``loss.backward()`` inside the block to include it)::

        with megatron_mesh.comm_counter() as c:
            out = megatron_mesh.mesh_attention(q, k, v, tile=(2, 2))
            out.sum().backward()
        print(c.bytes_sent, c.bytes_received, c.sent_to)  # sent_to: {peer group rank: bytes}
    """
    c = CommCount()
    stack = _stack()
    stack.append(c)
    try:
        yield c
    finally:
        # by identity: CommCount compares by value, so list.remove would drop an equal outer counter
        stack[:] = [x for x in stack if x is not c]  # in place: counting_into may share this list
