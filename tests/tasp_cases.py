"""TASP distributed test cases, run inside spawned gloo process groups (see megatron_mesh.launch).

Each function runs on every rank and returns result records that the pytest side asserts on. The
inputs, the dense fp64 reference and the tolerances are those of ``cases`` (Mesh-Attention's).
"""

from __future__ import annotations

import itertools

import torch

from megatron_mesh.comm.alltoall import AllToAllCommunicator
from megatron_mesh.runtime import tasp_api
from megatron_mesh.runtime.tasp_api import tasp_attention

from cases import HEADS, Problem, _scaled_reference, run_local


def seq_local_for(world: int) -> int:
    """Smallest convenient local length: >= 8, and each zigzag half holds one token per ring plus
    one more, so slots have uneven sizes (the general case)."""
    return max(8, 2 * (world - 1) + 2)


def _record(rank: int, p: Problem, label: str, fn, ref=None, gpus_per_node=None) -> dict:
    from megatron_mesh.plan import AttentionShape, plan_bytes, tasp_bytes_formula
    from megatron_mesh.plan.tasp import build_tasp_plan

    ratios, abs_err, (sent, recv), _ = run_local(rank, p, fn, ref)
    itemsize = torch.tensor([], dtype=p.dtype).element_size()
    shape = AttentionShape(p.seq_local, p.batch, p.heads, p.kv_heads, p.head_dim, itemsize)
    plan = build_tasp_plan(p.world, shape, causal=p.causal, gpus_per_node=gpus_per_node)
    planned = plan_bytes(plan, shape)[rank]
    formula = tasp_bytes_formula(p.world, shape)
    return dict(case=label, ratios=ratios, abs_err=abs_err, sent=sent, received=recv,
                planned=(planned.sent, planned.received), formula=(formula.sent, formula.received))


def tasp_grid(rank: int, world: int, node_shapes: tuple[int, ...] = ()) -> list[dict]:
    """causal/full x MHA/GQA x fp32/bf16, each transport on half of them (balanced so that each
    sees both masks, both dtypes and both head layouts); then the same grid on emulated nodes of
    each size in ``node_shapes`` (gpus_per_node)."""
    records = []
    for gpus_per_node in (None, *node_shapes):
        for causal, heads, dtype in itertools.product((True, False), ("MHA", "GQA"), (torch.float32, torch.bfloat16)):
            h, g = HEADS[heads]
            transport = "alltoall" if causal ^ (dtype == torch.bfloat16) ^ (heads == "GQA") else "p2p"
            p = Problem(world, h, g, causal, dtype, seq_local=seq_local_for(world))
            fn = lambda q, k, v: tasp_attention(q, k, v, causal=causal, transport=transport,  # noqa: E731
                                                gpus_per_node=gpus_per_node)
            label = f"P={world} nodes_of={gpus_per_node} causal={causal} {heads} {dtype} {transport}"
            rec = _record(rank, p, label, fn, gpus_per_node=gpus_per_node)
            rec["alltoall_comm"] = any(isinstance(c, AllToAllCommunicator) for c in tasp_api._A2A.values())
            records.append(rec)
    return records


def tasp_variants(rank: int, world: int) -> list[dict]:
    """MQA, the math kernel with a custom softmax scale, and a longer sequence (several tokens per
    slot) on both transports."""
    records = []
    p = Problem(world, *HEADS["MQA"], True, torch.float32, seq_local=seq_local_for(world))
    records.append(_record(rank, p, f"P={world} MQA causal fp32",
                           lambda q, k, v: tasp_attention(q, k, v)))
    p = Problem(world, 4, 2, True, torch.float32, seq_local=seq_local_for(world), seed=1)
    records.append(_record(rank, p, f"P={world} math kernel scale=0.3",
                           lambda q, k, v: tasp_attention(q, k, v, kernel="math", softmax_scale=0.3),
                           ref=_scaled_reference(p, 0.3)))
    for transport in ("p2p", "alltoall"):
        p = Problem(world, 4, 2, True, torch.float64, seq_local=4 * world + 2, seed=2)
        records.append(_record(rank, p, f"P={world} fp64 long {transport}",
                               lambda q, k, v: tasp_attention(q, k, v, transport=transport)))
    return records
