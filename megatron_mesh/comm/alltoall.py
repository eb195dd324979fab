"""Communicator that moves a whole round with one ``all_to_all_single`` (TASP's collective form).

A round of TASP sends one slot to each of up to P - 1 peers and receives one from each: a
personalised all-to-all. This transport packs every tensor of the round into one byte buffer
ordered by peer, runs one asynchronous ``all_to_all_single`` with per-peer split sizes, and on
``wait()`` copies the received bytes into the receive tensors. It moves (and ``comm_counter()``
counts) exactly the payload bytes of the P2P transport; the price is one pack and one unpack copy
per round.

A collective needs every rank of the group to call it for every round, so this transport only
serves plans in which all ranks post the same rounds (TASP plans do: each rank is on every ring).
A rank with nothing to move in a round still joins the collective with empty buffers.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from .base import Communicator, Work
from .torch_dist import all_to_all_round, check_member

__all__ = ["AllToAllCommunicator"]


class AllToAllCommunicator(Communicator):
    """One ``all_to_all_single`` per round over ``group`` (None: the default group)."""

    def __init__(self, group: dist.ProcessGroup | None = None, device: torch.device | None = None):
        self.group = group
        check_member(group)
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        if device is None:  # where the empty buffers of a rank with nothing to move live
            nccl = dist.get_backend(group) == "nccl"
            device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
        self.device = device

    @property
    def members(self) -> tuple:  # the same key as a point-to-point communicator's of the group
        return ("group", id(self.process_group))

    @property
    def process_group(self) -> dist.ProcessGroup:
        return self.group if self.group is not None else dist.distributed_c10d._get_default_group()

    def start(self, sends: Sequence[tuple[int, Tensor]], recvs: Sequence[tuple[int, Tensor]]) -> Work:
        if not sends and not recvs:  # still a collective: every rank joins every round
            return self._start(sends, recvs)
        return super().start(sends, recvs)

    def _start(self, sends: Sequence[tuple[int, Tensor]], recvs: Sequence[tuple[int, Tensor]]) -> Work:
        device = (sends or recvs)[0][1].device if (sends or recvs) else self.device
        return all_to_all_round(self.group, self.world_size, sends, recvs, device)
