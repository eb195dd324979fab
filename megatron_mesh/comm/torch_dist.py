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

Example: CP group of 4 ranks with Mesh tile 2x2; rank 0's Q ring is {0, 1} and its KV ring {0, 2}::

    comm = TorchDistCommunicator(cp_group, routes={1: q_ring_group, 2: kv_ring_group})
    # a round sending to 1 and 2 becomes one batch on q_ring_group and one on kv_ring_group
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch.distributed as dist
from torch import Tensor

from .base import Communicator, Work

__all__ = ["TorchDistCommunicator"]


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


class TorchDistCommunicator(Communicator):
    """P2P over ``group`` (None: the default group); plan ranks are group ranks.

    ``routes`` maps a peer (group rank) to a sub-group holding this rank and that peer; transfers
    with peers not in ``routes`` go over ``group`` itself. Bytes are counted once per transfer by
    :meth:`Communicator.start`, whichever group carries it.
    """

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
        # fixed issue order of the groups: the main group first, then by first appearance in routes
        self._order = {id(group): 0}
        for sub in self.routes.values():
            self._order.setdefault(id(sub), len(self._order))

    @property
    def process_group(self) -> dist.ProcessGroup:
        """The live process group (the default group when ``group`` is None)."""
        return self.group if self.group is not None else dist.distributed_c10d._get_default_group()

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
        return _Works(works)
