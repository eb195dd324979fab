"""``tasp_attention``: TASP (topology-aware ring attention) over a CP group, differentiable.

Same layout, GQA rules, dtype rules and errors as :func:`megatron_mesh.mesh_attention`; the plan
comes from :func:`megatron_mesh.plan.tasp.build_tasp_plan` and runs on the shared executor.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import Tensor

from ..comm.alltoall import AllToAllCommunicator
from ..comm.base import Communicator
from ..kernels import BlockKernel
from ..plan.accounting import AttentionShape
from ..plan.ir import Plan
from ..plan.tasp import build_tasp_plan
from .api import group_communicator, plan_attention

__all__ = ["tasp_attention", "TRANSPORTS"]

# "p2p": one batch of isend/irecv per round (the default: no pack/unpack copies; measured in
#        docs/algorithms/tasp.md). "alltoall": one all_to_all_single per round.
TRANSPORTS = ("p2p", "alltoall")

_A2A: dict = {}


def _alltoall_communicator(group) -> Communicator:
    if group is None and not (dist.is_available() and dist.is_initialized()):
        return group_communicator(None)  # one rank: nothing is ever sent
    comm = _A2A.get(group)
    if comm is None:
        comm = _A2A[group] = AllToAllCommunicator(group)
    return comm


def tasp_attention(q: Tensor, k: Tensor, v: Tensor, *, group=None, causal: bool = True,
                   softmax_scale: float | None = None, gpus_per_node: int | None = None,
                   transport: str = "p2p", kernel: "str | BlockKernel" = "auto",
                   comm: Communicator | None = None) -> Tensor:
    """TASP attention over the CP group ``group`` (None: the default process group).

    Args:
        q: [s_local, batch, heads, head_dim], this rank's zigzag chunk (Megatron's CP layout).
        k, v: [s_local, batch, kv_heads, head_dim]; heads % kv_heads == 0 (GQA / MQA).
        causal: causal (True) or full (False) attention over the global sequence.
        softmax_scale: defaults to 1 / sqrt(head_dim).
        gpus_per_node: None -- one Hamiltonian decomposition over the whole group (one node);
            m -- the group spans nodes of m consecutive CP ranks: m rings chained over the nodes,
            one inter-node send per rank per step. Must divide the CP size; m = 3 and 5 are
            impossible (no Hamiltonian path decomposition exists) and raise ValueError.
        transport: "p2p" (batched isend/irecv per round) or "alltoall" (one all_to_all_single
            per round); ignored when ``comm`` is given.
        kernel: block kernel backend ("auto", "torch", "math", ...) or a BlockKernel instance.
        comm: an explicit communicator (tests, in-process transports).

    Each rank's local sequence must hold at least one token per ring in each zigzag half
    (s_local >= 2 * rings; rings = CP size - 1 on one node). Returns the attention output, shaped
    and typed like q; differentiable w.r.t. q, k, v.
    """
    if transport not in TRANSPORTS:
        raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
    if gpus_per_node is not None and (not isinstance(gpus_per_node, int) or isinstance(gpus_per_node, bool)
                                      or gpus_per_node < 1):
        raise ValueError(f"gpus_per_node must be None or a positive integer, got {gpus_per_node!r}")
    if comm is None and transport == "alltoall":
        comm = _alltoall_communicator(group)

    def build(world: int, shape: AttentionShape) -> Plan:
        return build_tasp_plan(world, shape, causal=causal, gpus_per_node=gpus_per_node)

    return plan_attention(q, k, v, build, group=group, softmax_scale=softmax_scale, kernel=kernel, comm=comm)
