"""Communicator over a torch.distributed process group (gloo on CPU, NCCL on GPU).

A round is one ``batch_isend_irecv``: with NCCL it runs on NCCL's own stream, so ``wait()`` only
makes the current stream wait (no host synchronisation) and block kernels of the same step
overlap with it. Messages between two ranks are matched in posting order, which the plan keeps
identical on both sides.
"""

from __future__ import annotations

from typing import Sequence

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


class TorchDistCommunicator(Communicator):
    """P2P over ``group`` (None: the default group); plan ranks are group ranks."""

    def __init__(self, group: dist.ProcessGroup | None = None):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.global_ranks = dist.get_process_group_ranks(group) if group is not None else list(range(self.world_size))

    def _start(self, sends: Sequence[tuple[int, Tensor]], recvs: Sequence[tuple[int, Tensor]]) -> Work:
        ops = [dist.P2POp(dist.isend, t, self.global_ranks[p], group=self.group) for p, t in sends]
        ops += [dist.P2POp(dist.irecv, t, self.global_ranks[p], group=self.group) for p, t in recvs]
        return _Works(dist.batch_isend_irecv(ops))
