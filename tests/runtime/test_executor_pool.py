"""Overlap readiness: the executor's buffers live in an arena laid out once per plan
(``plan/arena.py``) and kept from call to call. A ring (1xP) or column (Px1) plan's arena has the
same size at P = 4, 6 and 8 however many rounds it runs (freed buffers' places are taken again);
a later call allocates nothing but what it returns (the output, the gradients); and the arena is
what the memory model says the executor holds (``buffer_memory().held``: one arena per rank
for both directions, as large as the larger one's)."""

from __future__ import annotations

import collections
import threading

import pytest
import torch

from megatron_mesh.comm.inprocess import run_inprocess
from megatron_mesh.plan import build_mesh_plan
from megatron_mesh.plan.arena import scratch_layout
from megatron_mesh.plan.memory import buffer_memory
from megatron_mesh.runtime import buffers
from megatron_mesh.runtime.api import forward_backward

import cases


def _run_twice(monkeypatch, world: int, tile):
    """Two forward + backward calls of the causal ``tile`` plan on every virtual rank: per call,
    the buffers each rank allocated for itself (by kind), and each rank's arena objects after
    each call."""
    own: list[collections.Counter] = [collections.Counter(), collections.Counter()]
    arenas: list[dict] = [{}, {}]
    lock = threading.Lock()
    call = threading.local()
    real_own = buffers.Buffers.own

    def counting_own(self, key):
        with lock:
            own[call.n][key.kind] += 1
        return real_own(self, key)

    monkeypatch.setattr(buffers.Buffers, "own", counting_own)
    p = cases.Problem(world, 4, 2, True, torch.float32)
    Q, K, V, dO = cases.make_inputs(p)
    plan = build_mesh_plan(world, tile, p.shape, causal=True)

    def fn(rank, comm):
        for n in range(2):
            call.n = n
            forward_backward(*(p.shard(x, rank) for x in (Q, K, V, dO)), plan, comm=comm)
            arenas[n][rank] = buffers.scratch(torch.device("cpu"), rank).arena

    run_inprocess(fn, world, timeout=60)
    monkeypatch.undo()
    return plan, p.shape, own, arenas


@pytest.mark.parametrize("orient", ["ring", "column"])
def test_arena_reaches_steady_state(monkeypatch, orient):
    sizes = {}
    for world in (4, 6, 8):
        tile = (1, world) if orient == "ring" else (world, 1)
        plan, shape, own, arenas = _run_twice(monkeypatch, world, tile)
        sizes[world] = {(r, d): scratch_layout(plan, r, d, shape).size for r in range(world)
                        for d in ("forward", "backward")}
        # a later call finds its arena made: the same tensors, and it allocates only its results
        assert all(arenas[1][r] is arenas[0][r] for r in range(world)), world
        assert own[1] == collections.Counter({"o": world, "dq": world, "dkv": world}), (world, own[1])
        for r in range(world):
            held = max(sizes[world][(r, "forward")], sizes[world][(r, "backward")])
            assert buffer_memory(plan, shape, r).held == held, (world, r)
            assert buffer_memory(plan, shape, r).peak <= max(sizes[world][(r, "forward")],
                                                             sizes[world][(r, "backward")]), (world, r)
    # the rounds reuse the freed places: P does not change the arena (the middle ranks' of each P)
    assert sizes[4][(1, "forward")] == sizes[6][(1, "forward")] == sizes[8][(1, "forward")], sizes
    assert sizes[4][(1, "backward")] == sizes[6][(1, "backward")] == sizes[8][(1, "backward")], sizes
