"""Overlap readiness: the executor's buffer pool reaches a steady state -- a ring (1xP) or column
(Px1) plan allocates a fixed number of buffers per forward / backward call however many rounds
it runs (every round after the first few reuses freed buffers)."""

from __future__ import annotations

import collections
import itertools
import threading

import pytest
import torch

from megatron_mesh.comm.inprocess import run_inprocess
from megatron_mesh.plan import build_mesh_plan
from megatron_mesh.runtime import executor as executor_module
from megatron_mesh.runtime.api import forward_backward

import cases


def allocations(monkeypatch, world: int, tile) -> list[collections.Counter]:
    """New (not recycled) buffers per forward / backward call and buffer kind, over every virtual
    rank of one forward + backward of the causal ``tile`` plan."""
    per_call: dict[int, collections.Counter] = {}
    lock = threading.Lock()
    calls = itertools.count()
    new_buffers = executor_module.Executor._buffers
    new_tensors = executor_module.Buffers._new

    def buffers(self, *args, **kwargs):
        bufs = new_buffers(self, *args, **kwargs)
        with lock:
            bufs.call = next(calls)  # one Buffers per forward / backward call
            per_call[bufs.call] = collections.Counter()
        return bufs

    def counting_new(self, key):
        with lock:
            per_call[self.call][key.kind] += 1
        return new_tensors(self, key)

    monkeypatch.setattr(executor_module.Executor, "_buffers", buffers)
    monkeypatch.setattr(executor_module.Buffers, "_new", counting_new)
    p = cases.Problem(world, 4, 2, True, torch.float32)
    Q, K, V, dO = cases.make_inputs(p)
    plan = build_mesh_plan(world, tile, p.shape)

    def fn(rank, comm):
        forward_backward(*(p.shard(x, rank) for x in (Q, K, V, dO)), plan, comm=comm)

    run_inprocess(fn, world, timeout=60)
    monkeypatch.undo()
    assert len(per_call) == 2 * world  # a forward and a backward per rank
    return list(per_call.values())


@pytest.mark.parametrize("orient", ["ring", "column"])
def test_buffer_pool_reaches_steady_state(monkeypatch, orient):
    seen = {}
    for world in (4, 6, 8):
        counts = allocations(monkeypatch, world, (1, world) if orient == "ring" else (world, 1))
        most: dict[str, int] = {}  # per kind: the most any one call allocated
        for c in counts:
            for kind, n in c.items():
                most[kind] = max(most.get(kind, 0), n)
        seen[world] = most
    assert seen[4] == seen[6] == seen[8], seen
    # kv / q: double buffering; dkv / dq: own accumulator + one in flight + incoming + current
    assert 1 <= max(seen[8].values()) <= 4, seen[8]
    moving = {"ring": {"kv", "dkv"}, "column": {"q", "o", "do", "dq"}}[orient]
    assert moving <= seen[8].keys(), seen[8]  # the kinds that travel do go through the pool
