"""TASP distributed test cases: parts of the one gloo spawn (see ``cases.run_gloo``).

Inputs, the dense fp64 reference and the tolerances are those of ``cases``. Each case also
counts the ``all_to_all_single`` calls it made: one per round the plan posts (forward +
backward) with the all-to-all transport, none with P2P -- so each transport provably ran.
"""

from __future__ import annotations

import itertools
from contextlib import contextmanager
from dataclasses import replace

import torch

import megatron_mesh as mm
from megatron_mesh.plan import Post, build_tasp_plan, resolve, tasp_bytes_formula

from cases import HEADS, Problem, Result, dense_reference, measure

NODE_SHAPES = {4: (2,), 6: (2,), 8: (4,)}  # world -> emulated gpus_per_node values


def seq_local_for(world: int) -> int:
    """Smallest convenient local length: >= 8, and each zigzag half holds one token per ring plus
    one more, so slots have uneven sizes (the general case)."""
    return max(8, 2 * (world - 1) + 2)


@contextmanager
def counting_all_to_all():
    """Count ``torch.distributed.all_to_all_single`` calls in the block (the all-to-all transport
    looks it up on the module at every round)."""
    import torch.distributed as dist

    calls = [0]
    original = dist.all_to_all_single

    def counted(*args, **kwargs):
        calls[0] += 1
        return original(*args, **kwargs)

    dist.all_to_all_single = counted
    try:
        yield calls
    finally:
        dist.all_to_all_single = original


def _case(rank: int, p: Problem, label: str, group, transport: str = "p2p", gpus_per_node=None, ref=None,
          **kwargs) -> Result:
    plan = build_tasp_plan(p.world, p.shape, causal=p.causal, ranks_per_node=gpus_per_node)
    rounds = sum(isinstance(op, Post) for d in ("forward", "backward") for op in plan.rank(rank).ops(d))
    with counting_all_to_all() as calls:
        res = measure(rank, p, label,
                      lambda q, k, v: mm.tasp_attention(q, k, v, group=group, causal=p.causal, transport=transport,
                                                        gpus_per_node=gpus_per_node, **kwargs),
                      ref, plan=plan, formula=tasp_bytes_formula(p.world, p.shape))
    return replace(res, collectives=(calls[0], rounds if transport == "alltoall" else 0))


def tasp_grid(rank: int, world: int, group=None) -> list[Result]:
    """causal/full x MHA/GQA x fp32/bf16, each transport on half of them (balanced so that each
    sees both masks, both dtypes and both head layouts); then the same grid on emulated nodes of
    each size in ``NODE_SHAPES[world]`` (gpus_per_node)."""
    results = []
    for gpus_per_node in (None, *NODE_SHAPES.get(world, ())):
        for causal, heads, dtype in itertools.product((True, False), ("MHA", "GQA"), (torch.float32, torch.bfloat16)):
            transport = "alltoall" if causal ^ (dtype == torch.bfloat16) ^ (heads == "GQA") else "p2p"
            p = Problem(world, *HEADS[heads], causal, dtype, seq_local=seq_local_for(world))
            results.append(_case(rank, p, f"P={world} nodes_of={gpus_per_node} causal={causal} {heads} {dtype} "
                                          f"{transport}", group, transport, gpus_per_node))
    return results


def tasp_variants(rank: int, world: int, group=None) -> list[Result]:
    """MQA, the math kernel with a custom softmax scale, a longer fp64 sequence (several tokens
    per slot) on both transports, and documents on the all-to-all transport under each
    backward_chunks setting (ranks that keep pull nothing in the backward, and still join)."""
    T = seq_local_for(world)
    results = [_case(rank, Problem(world, *HEADS["MQA"], True, torch.float32, seq_local=T), f"P={world} MQA causal fp32",
                     group)]
    p = Problem(world, 4, 2, True, torch.float32, seq_local=T, seed=1)
    results.append(_case(rank, p, f"P={world} math kernel scale=0.3", group, ref=dense_reference(p, 0.3),
                         kernel="math", softmax_scale=0.3))
    for transport in ("p2p", "alltoall"):
        p = Problem(world, 4, 2, True, torch.float64, seq_local=4 * world + 2, seed=2)
        results.append(_case(rank, p, f"P={world} fp64 long {transport}", group, transport))
    # a long document on most ranks: under backward_chunks "auto" the ranks reading most of it
    # refetch and the others keep (and pull nothing in the backward) -- the all-to-all transport
    # still needs every rank in every round's collective
    p = Problem(world, 4, 2, True, torch.float32, seq_local=12, seed=3, cu_seqlens=(0, 12 * world - 2, 12 * world))
    for backward_chunks in ("auto", "keep", "refetch"):
        plan = resolve("tasp", world, p.shape, backward_chunks=backward_chunks).build(p.shape, p.mask)
        rounds = sum(isinstance(op, Post) for d in ("forward", "backward") for op in plan.rank(rank).ops(d))
        with counting_all_to_all() as calls:
            res = measure(rank, p, f"P={world} documents alltoall backward_chunks={backward_chunks}",
                          lambda q, k, v: mm.tasp_attention(q, k, v, group=group, cu_seqlens=p.cu_seqlens,
                                                            transport="alltoall", backward_chunks=backward_chunks),
                          plan=plan)
        results.append(replace(res, collectives=(calls[0], rounds)))
    # every document inside one zigzag half: nothing moves, so no round is posted -- not 2 x 8
    # all-to-alls of empty buffers on every rank
    p = Problem(world, 4, 2, True, torch.float32, seq_local=12, seed=4, cu_seqlens=tuple(range(0, 12 * world + 1, 6)))
    plan = resolve("tasp", world, p.shape).build(p.shape, p.mask)
    rounds = sum(isinstance(op, Post) for d in ("forward", "backward") for op in plan.rank(rank).ops(d))
    with counting_all_to_all() as calls:
        res = measure(rank, p, f"P={world} documents inside the halves alltoall",
                      lambda q, k, v: mm.tasp_attention(q, k, v, group=group, cu_seqlens=p.cu_seqlens,
                                                        transport="alltoall"), plan=plan)
    results.append(replace(res, collectives=(calls[0], rounds)))
    return results
