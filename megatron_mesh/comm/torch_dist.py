"""Communicator over a torch.distributed process group (gloo on CPU, NCCL on GPU).

A round is one ``batch_isend_irecv``: with NCCL it runs on NCCL's own stream, so ``wait()`` only
makes the current stream wait (no host synchronisation) and block kernels of the same step
overlap with it. Messages between two ranks are matched in posting order, which the plan keeps
identical on both sides.

Routes: a peer may be reached through a smaller process group that holds both ranks (a Mesh Q
ring, a KV ring, the ranks of one node). With NCCL each group is its own communicator on its own
stream, so the transfers of different rings of one round proceed independently. Because
``batch_isend_irecv`` needs every op of a batch on one group, a round is split into one batch per
group, issued in a fixed group order; routes are symmetric (both ends of a transfer use the same
group), so the per-pair posting order -- all that matching depends on -- is unchanged.

All-to-all rounds: a round the plan marks as one all-to-all over a group of ranks (a Ulysses
group's: ``Post.group``) goes as one ``all_to_all_single`` over the sub-group the routes reach
those ranks through, where it holds exactly them (:meth:`TorchDistCommunicator.exchange`): 2-4
host calls instead of a call per tensor and peer (28 for a rank's q/kv round at U = 8); a round
over every rank of the communicator's group (Ulysses over the whole CP group) over that group.
Without such a group (a Ulysses group smaller than a bare CP group, the public API's default) it
goes point to point: the same bytes into the same buffers.

Example: CP group of 4 ranks with Mesh tile 2x2; rank 0's Q ring is {0, 1} and its KV ring {0, 2}::

    comm = TorchDistCommunicator(cp_group, routes={1: q_ring_group, 2: kv_ring_group})
    # a round sending to 1 and 2 becomes one batch on q_ring_group and one on kv_ring_group
"""

from __future__ import annotations

from collections import Counter
from typing import Mapping, Sequence

import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

from .base import Communicator, Work

__all__ = ["TorchDistCommunicator", "all_to_all_round"]


class _Works:
    def __init__(self, works):
        self.works = works

    def wait(self) -> None:
        for w in self.works:
            w.wait()


def check_member(group) -> None:
    """ValueError where this process is not in ``group``: torch.distributed.new_group hands ranks
    outside the group a placeholder, whose ranks are not the group's (so the message names none)."""
    if group is not None and (group is dist.GroupMember.NON_GROUP_MEMBER or dist.get_rank(group) < 0):
        raise ValueError(f"this process (global rank {dist.get_rank()}) is not a member of the process group it was asked "
                         "to attend over (torch.distributed.new_group was called without this rank); call attention "
                         "on the ranks of that group only (each rank passes its own CP group)")


# a tensor's bytes as one flat uint8 view, made once per tensor: the executor hands a transport the
# same arena views every step, so a round's packing makes no view per step (weakly keyed by the
# tensor object: an entry goes with its tensor)
_BYTES = WeakIdKeyDictionary()


def _as_bytes(t: Tensor) -> Tensor:
    got = _BYTES.get(t)
    if got is None:
        got = _BYTES[t] = t.reshape(-1).view(torch.uint8)
    return got


# tensors' bytes that lie one after another in memory, as one view (made once per first tensor,
# addresses and sizes): a round whose sends (or receives) the arena placed side by side in the order the
# all-to-all moves them is sent from (received into) them as they lie -- no pack, no unpack
_RUNS = WeakIdKeyDictionary()


def _run_of(flat: list[Tensor]) -> Tensor | None:
    """One uint8 view over byte views ``flat`` where each starts where the one before ends (the
    same storage), else None."""
    if len(flat) < 2:
        return None
    ptrs = tuple((x.data_ptr(), x.numel()) for x in flat)  # addresses and sizes: the run's identity
    got = _RUNS.get(flat[0])
    if got is not None and got[0] == ptrs:
        return got[1]
    storage = flat[0].untyped_storage().data_ptr()
    if any(x.untyped_storage().data_ptr() != storage for x in flat) or any(
            a + n != b for (a, n), (b, _) in zip(ptrs, ptrs[1:])):
        return None
    run = flat[0].as_strided((sum(x.numel() for x in flat),), (1,))
    _RUNS[flat[0]] = (ptrs, run)
    return run


class _Unpack:
    """Completes the collective, then scatters the received bytes into the receive tensors."""

    def __init__(self, work, send: Tensor, recv: Tensor, targets: list[Tensor], sizes: list[int], packed: bool):
        # holding ``send`` keeps its memory from being reused while the collective may still read it
        self.work, self.send, self.recv, self.targets, self.sizes = work, send, recv, targets, sizes
        self.packed, self.unpacked = packed, bool(targets)  # what the round copied (a test reads it)

    def wait(self) -> None:
        self.work.wait()
        if self.targets:  # one split and one copy call for every receive of the round
            torch._foreach_copy_(self.targets, list(self.recv.split(self.sizes)))
        self.send = self.recv = None


def all_to_all_round(group, size: int, sends: Sequence[tuple[int, Tensor]], recvs: Sequence[tuple[int, Tensor]],
                     device: torch.device) -> Work:
    """One asynchronous ``all_to_all_single`` over ``group`` (``size`` ranks; peers are ranks of
    ``group``) moving a round's ``sends`` and ``recvs`` (each peer's in list order) as bytes:
    the sends packed by peer in one ``cat`` (none where one tensor is all of them, or where they
    lie side by side in that order: :func:`_run_of`), the receives in one buffer, copied into the
    receive tensors on ``wait()`` by one ``_foreach_copy_`` (none where one tensor is all, or they
    lie side by side): 1-4 host calls whatever the number of peers and tensors.
    Worked example: 3 ranks, rank 0 sends a (4 bytes) to 1 and b (2 bytes) to 2 and receives c
    from 1 and d from 2: in splits [0, 4, 2], out splits [0, |c|, |d|], one call."""
    by_peer: list[list[Tensor]] = [[] for _ in range(size)]
    for p, t in sends:
        by_peer[p].append(_as_bytes(t))
    in_splits = [sum(x.numel() for x in ts) for ts in by_peer]
    flat = [x for ts in by_peer for x in ts]
    packed = False
    if len(flat) == 1:
        send = flat[0]
    elif flat:  # tensors side by side in the order they go: sent as they lie
        run = _run_of(flat)
        packed = run is None
        send = run if run is not None else torch.cat(flat)
    else:
        send = torch.empty(0, dtype=torch.uint8, device=device)
    into: list[list[Tensor]] = [[] for _ in range(size)]
    for p, t in recvs:
        into[p].append(_as_bytes(t))
    out_splits = [sum(x.numel() for x in ts) for ts in into]
    targets = [x for ts in into for x in ts]
    run = targets[0] if len(targets) == 1 else _run_of(targets)
    if run is not None:  # straight into the one receive tensor, or into tensors side by side
        recv, targets = run, []
    else:
        recv = torch.empty(sum(out_splits), dtype=torch.uint8, device=device)
    work = dist.all_to_all_single(recv, send, out_splits, in_splits, group=group, async_op=True)
    return _Unpack(work, send, recv, targets, [x.numel() for x in targets], packed)


class TorchDistCommunicator(Communicator):
    """P2P over ``group`` (None: the default group); plan ranks are group ranks.

    ``routes`` maps a peer (group rank) to a sub-group holding this rank and that peer; transfers
    with peers not in ``routes`` go over ``group`` itself. Bytes are counted once per transfer by
    :meth:`Communicator.start`, whichever group carries it.
    """

    @property
    def members(self) -> tuple:  # the process group itself: two groups of the same ranks may run at once too
        return ("group", id(self.process_group))

    def __init__(self, group: dist.ProcessGroup | None = None,
                 routes: Mapping[int, dist.ProcessGroup] | None = None):
        self.group = group
        check_member(group)
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.global_ranks = dist.get_process_group_ranks(group) if group is not None else list(range(self.world_size))
        self.routes = dict(routes or {})
        me = self.global_ranks[self.rank]
        for peer, sub in self.routes.items():
            if not 0 <= peer < self.world_size or peer == self.rank:
                raise ValueError(f"route for peer {peer}: peers are the other ranks 0..{self.world_size - 1} "
                                 f"of the group (this rank is {self.rank})")
            members = dist.get_process_group_ranks(sub)
            if me not in members or self.global_ranks[peer] not in members:
                raise ValueError(f"route for peer {peer}: sub-group {members} must hold global ranks "
                                 f"{me} (this rank) and {self.global_ranks[peer]} (the peer)")
        self._collectives: dict = {}  # all-to-all group -> (its sub-group, rank map), or False (none)
        # the calls made, by kind ("batch_isend_irecv": a batch of a round's point-to-point
        # transfers on one group; "all_to_all_single": an all-to-all round; "all_to_all pack" /
        # "unpack": one that packed its sends, unpacked its receives): what a test or a
        # benchmark reads to see which way the rounds went
        self.calls: Counter = Counter()
        # fixed issue order of the groups: the main group first, then by first appearance in routes
        self._order = {id(group): 0}
        for sub in self.routes.values():
            self._order.setdefault(id(sub), len(self._order))

    @property
    def process_group(self) -> dist.ProcessGroup:
        """The live process group (the default group when ``group`` is None)."""
        return self.group if self.group is not None else dist.distributed_c10d._get_default_group()

    def exchange(self, group: tuple[int, ...], sends: Sequence[tuple[int, Tensor]],
                 recvs: Sequence[tuple[int, Tensor]]) -> Work:
        """An all-to-all round over ``group`` (:meth:`Communicator.exchange`): one
        ``all_to_all_single`` over the sub-group the routes reach ``group``'s ranks through, where
        it holds exactly them (a hybrid's Ulysses group: ``Placement.groups()``, as
        :class:`~megatron_mesh.megatron.groups.CPGroups` routes them), or over the communicator's
        own group where the round spans all of it; even with nothing to move (every member joins);
        else the round's point-to-point calls (:meth:`start`)."""
        sub = self._collectives.get(group)
        if sub is None:
            sub = self._collectives[group] = self._collective(group)
        if sub is False:
            return self.start(sends, recvs)
        self._check(sends, recvs)
        for peer, _ in (*sends, *recvs):
            if peer not in group:
                raise ValueError(f"rank {self.rank}: a transfer with rank {peer} in an all-to-all over ranks {group}")
        self._count(sends, recvs)
        pg, index = sub
        device = (sends or recvs)[0][1].device if (sends or recvs) else (
            torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(pg) == "nccl" else torch.device("cpu"))
        self.calls["all_to_all_single"] += 1
        work = all_to_all_round(pg, len(group), [(index[p], t) for p, t in sends], [(index[p], t) for p, t in recvs],
                                device)
        self.calls["all_to_all pack"] += work.packed
        self.calls["all_to_all unpack"] += work.unpacked
        return work

    def _collective(self, group: tuple[int, ...]):
        """(the sub-group, group rank -> its rank there) whose members are exactly ``group``'s
        ranks and that every peer of ``group`` is routed through -- or the communicator's own
        group where ``group`` is all of it and no peer is routed elsewhere (Ulysses over the whole
        CP group); False: none."""
        peers = [p for p in group if p != self.rank]
        if not peers or self.rank not in group:
            return False
        if len(group) == self.world_size and not any(p in self.routes for p in peers):
            return self.process_group, {p: p for p in group}
        subs = {id(self.routes.get(p)) for p in peers}
        if len(subs) != 1 or peers[0] not in self.routes:
            return False
        pg = self.routes[peers[0]]
        members = dist.get_process_group_ranks(pg)
        if sorted(members) != sorted(self.global_ranks[p] for p in group):
            return False
        return pg, {p: dist.get_group_rank(pg, self.global_ranks[p]) for p in group}

    def _start(self, sends: Sequence[tuple[int, Tensor]], recvs: Sequence[tuple[int, Tensor]]) -> Work:
        batches: dict[int, tuple[dist.ProcessGroup | None, list[dist.P2POp]]] = {}
        for op, transfers in ((dist.isend, sends), (dist.irecv, recvs)):
            for p, t in transfers:
                sub = self.routes.get(p, self.group)
                batch = batches.setdefault(self._order[id(sub)], (sub, []))[1]
                batch.append(dist.P2POp(op, t, self.global_ranks[p], group=sub))
        works = []
        for key in sorted(batches):
            works.extend(dist.batch_isend_irecv(batches[key][1]))
        self.calls["batch_isend_irecv"] += len(batches)
        return _Works(works)
