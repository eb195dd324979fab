"""The machine a plan runs on, as the simulator sees it: nodes of GPUs, two link classes, and
how fast a GPU computes attention.

Rank -> node map: the CP group's ranks are **consecutive within a node** (Megatron orders CP
ranks so; with tensor parallelism inside the node, pass ``gpus_per_node`` = the number of *CP
ranks* per node, or an explicit ``node_of``). Rank r sits on node ``r // gpus_per_node``.

Link classes: ``"intra"`` (two ranks on one node: NVLink through NVSwitch) and ``"inter"``
(different nodes: one NIC per GPU, through the InfiniBand fabric). Each GPU has its own egress
and ingress budget per class: transfers of one round that leave a GPU on the same class share
its bandwidth; the two classes run side by side.

Worked example (2 nodes x 4 GPUs)::

    rank:  0 1 2 3 | 4 5 6 7          link(3, 4) == "inter"   link(1, 2) == "intra"
    node:  0 0 0 0 | 1 1 1 1

Defaults (one H100 SXM5 GPU of a DGX/HGX H100 node; all assumptions, override them with
measured values):

* ``intra_bandwidth`` 450e9 B/s per direction: NVLink 4 gives an H100 SXM5 900 GB/s of total
  (bidirectional) NVLink bandwidth (NVIDIA H100 datasheet); through NVSwitch one GPU can send
  all of it to any peer. Achieved NCCL bandwidth is lower; nccl-tests all_reduce busbw on
  8x H100 SXM5 reaches about 460-480 GB/s against this 450 GB/s per direction.
* ``inter_bandwidth`` 50e9 B/s per direction: one 400 Gb/s NDR InfiniBand port (ConnectX-7) per
  GPU, as in DGX H100 (8 compute-fabric ports per 8 GPUs). Line rate; no congestion modelled.
* ``intra_latency`` 5 us, ``inter_latency`` 10 us: the fixed cost of one point-to-point round
  (kernel launch, handshake, first byte). Order-of-magnitude assumptions, not measurements;
  ``nccl-tests``' ``sendrecv_perf`` at small sizes measures them on a real machine.
* ``attention_flops`` 400e12 FLOP/s: sustained attention throughput (forward; the backward is
  modelled as 2.5x the forward FLOPs at the same rate). FlashAttention-3 measures 430-620
  TFLOP/s forward at head dim 128 on H100 SXM5 and the Triton FlashAttention-2 330-480
  (pytorch/benchmark PR #2391, bf16, 512-16K tokens); 400 is a round, slightly conservative
  value. Small blocks run below it -- see ``kernel_latency``.
* ``kernel_latency`` 5 us: fixed cost per attention kernel call (launch and tail effects).
* ``memory_bandwidth`` 3.35e12 B/s: H100 SXM5 HBM3 (datasheet); prices the element-wise
  merges of partial outputs and gradient accumulators.
* ``host_op_time`` 23 us: the host's time per torch op the executor issues that is not a view
  (Python, dispatch, launch) and per point-to-point call, each rank's host issuing its ops in
  order and its GPU waiting where the host is behind (:mod:`.hostops` counts the ops,
  :mod:`.hostcost` says where the number comes from: one H200 rank alone, docs/performance.md);
  0 leaves the host out (the model before issue 52).
* ``host_view_time`` 3 us: the host's time per view the executor makes (a slice, no device
  work; fitted with ``host_op_time`` on the same H200 runs, :mod:`.hostcost`).
* ``host_lead`` 0 us: how far the host is ahead of its GPU when a direction of the attention starts
  -- the layer's other work (projections, MLP: long GEMMs, few ops) lets the host queue ops
  before the GPU reaches them, unless something makes the host wait for the GPU before each call.
  0, the default, prices that worst case (until stop 71 the plan check's all-reduce on an NCCL
  group did, once per call; it now runs over a gloo twin of the group). A Llama-3-8B-like layer
  (hidden 4096, FFN 14336) at 4K tokens per rank gives its host about 2 ms forward, more
  backward (docs/performance.md, "The host's lead").
* ``mask_piece`` 2048 tokens: a masked block runs as kernel calls on pieces of at most this many
  query x key tokens (the runtime's default on CUDA, :data:`~.mask.MASK_PIECE`): empty pieces are
  skipped, whole-document pieces run the causal / full fast path, the rest are computed densely
  and masked -- the simulator prices exactly those calls.
"""

from __future__ import annotations

import math

from dataclasses import dataclass

from .hostcost import HOST_OP_TIME, HOST_VIEW_TIME
from .mask import MASK_PIECE

__all__ = ["Topology", "LINK_CLASSES"]

LINK_CLASSES = ("intra", "inter")


@dataclass(frozen=True)
class Topology:
    """``nodes`` x ``gpus_per_node`` GPUs, CP ranks consecutive within a node (see module doc).

    ``node_of``, when given, is the node of each CP rank (overrides the consecutive map; use it
    for CP groups whose ranks are strided across nodes).
    """

    nodes: int = 1
    gpus_per_node: int = 8
    intra_bandwidth: float = 450e9
    inter_bandwidth: float = 50e9
    intra_latency: float = 5e-6
    inter_latency: float = 10e-6
    attention_flops: float = 400e12
    kernel_latency: float = 5e-6
    memory_bandwidth: float = 3.35e12
    node_of: tuple[int, ...] | None = None
    mask_piece: int = MASK_PIECE["cuda"]
    host_op_time: float = HOST_OP_TIME
    host_view_time: float = HOST_VIEW_TIME
    host_lead: float = 0.0

    def __post_init__(self) -> None:
        for name in ("nodes", "gpus_per_node"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {getattr(self, name)!r}")
        for name in ("intra_bandwidth", "inter_bandwidth", "attention_flops", "memory_bandwidth"):
            if not 0 < getattr(self, name) < math.inf:
                raise ValueError(f"{name} must be finite and > 0, got {getattr(self, name)!r}")
        for name in ("intra_latency", "inter_latency", "kernel_latency", "host_op_time", "host_view_time",
                     "host_lead"):
            if not 0 <= getattr(self, name) < math.inf:
                raise ValueError(f"{name} must be finite and >= 0, got {getattr(self, name)!r}")
        if self.node_of is not None:
            object.__setattr__(self, "node_of", tuple(int(n) for n in self.node_of))

    @classmethod
    def for_cp(cls, world_size: int, gpus_per_node: int = 8, **links) -> "Topology":
        """The smallest machine of ``gpus_per_node``-GPU nodes that holds a CP group of
        ``world_size`` consecutive ranks (e.g. 256 ranks -> 32 nodes x 8)."""
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        return cls(nodes=-(-world_size // gpus_per_node), gpus_per_node=gpus_per_node, **links)

    @property
    def capacity(self) -> int:
        return self.nodes * self.gpus_per_node

    def check(self, world_size: int) -> None:
        """Raise ValueError unless a CP group of ``world_size`` ranks fits this machine."""
        if self.node_of is not None:
            if len(self.node_of) < world_size:
                raise ValueError(f"node_of names the nodes of {len(self.node_of)} ranks, the CP group has {world_size}")
            return
        if world_size > self.capacity:
            raise ValueError(f"a CP group of {world_size} ranks does not fit {self.nodes} nodes x "
                             f"{self.gpus_per_node} GPUs ({self.capacity} GPUs); allowed: CP size <= {self.capacity}")

    def node(self, rank: int) -> int:
        """The node of CP rank ``rank``."""
        if self.node_of is not None:
            return self.node_of[rank]
        return rank // self.gpus_per_node

    def nodes_used(self, world_size: int) -> int:
        return len({self.node(r) for r in range(world_size)})

    def ranks_per_node(self, world_size: int) -> int | None:
        """Consecutive CP ranks per node for a group of ``world_size`` ranks (None: one node) --
        what a placement's ``ranks_per_node`` means; ValueError when nodes hold unequal or
        non-consecutive blocks of ranks. E.g. the inner group of a Ulysses hybrid of degree 2 on
        nodes of 8 GPUs has 4 inner ranks per node."""
        nodes = [self.node(r) for r in range(world_size)]
        if len(set(nodes)) == 1:
            return None
        n = nodes.count(nodes[0])
        if world_size % n or any(nodes[i] != nodes[i - i % n] or (i % n == 0 and i and nodes[i] == nodes[i - 1])
                                 for i in range(world_size)):
            raise ValueError(f"CP ranks sit on nodes {nodes}: not equal blocks of consecutive ranks")
        return n

    def link(self, src: int, dst: int) -> str:
        """Link class of a transfer from rank ``src`` to rank ``dst``: "intra" or "inter"."""
        return "intra" if self.node(src) == self.node(dst) else "inter"

    def bandwidth(self, link: str) -> float:
        return self.intra_bandwidth if link == "intra" else self.inter_bandwidth

    def latency(self, link: str) -> float:
        return self.intra_latency if link == "intra" else self.inter_latency

    def describe(self) -> str:
        return (f"{self.nodes} node(s) x {self.gpus_per_node} GPUs; intra {self.intra_bandwidth / 1e9:g} GB/s "
                f"{self.intra_latency * 1e6:g} us, inter {self.inter_bandwidth / 1e9:g} GB/s "
                f"{self.inter_latency * 1e6:g} us per GPU per direction; attention "
                f"{self.attention_flops / 1e12:g} TFLOP/s, {self.kernel_latency * 1e6:g} us per kernel, "
                f"HBM {self.memory_bandwidth / 1e12:g} TB/s; host {self.host_op_time * 1e6:g} us per torch op, "
                f"{self.host_view_time * 1e6:g} per view"
                + (f", {self.host_lead * 1e6:g} us ahead" if self.host_lead and self.host_priced else ""))

    @property
    def host_priced(self) -> bool:
        """Whether the host's time is priced (``host_op_time`` > 0; 0 leaves the host out, views included)."""
        return self.host_op_time > 0
