"""A mask's groups (chunked attention's chunks) as the balanced layout's and the layout choice's
units: chunked(c) inside documents is causal attention inside documents cut at chunk boundaries,
so the layout balances -- and the choice prices -- exactly what it would for those documents.
Before: the balanced layout cut each whole document in zigzag portions, scattering its chunks over
many ranks (at 256 GPUs, 1M tokens, chunk 8192: 3.6x the zigzag's bytes), and ``--cp-layout auto``
took it unpriced."""

from __future__ import annotations

import random

import pytest

from megatron_mesh import masks
from megatron_mesh.plan import AttentionShape, Mask, resolve
from megatron_mesh.plan.balance import balanced_layout
from megatron_mesh.plan.choice import choose_layout
from megatron_mesh.plan.layouts import Sample, get_layout_kind
from megatron_mesh.plan.maskkinds import Chunked, Prefix
from megatron_mesh.plan.topology import Topology
from megatron_mesh.plan.validate import validate_plan


def _cut(cu: list[int], size: int) -> list[int]:
    """cu_seqlens with every document cut at its chunk boundaries (counted from its start)."""
    out = [0]
    for a, b in zip(cu, cu[1:]):
        out += list(range(a + size, b, size)) + [b]
    return out


def _documents(seed: int, total: int) -> list[int]:
    rng, cu = random.Random(seed), [0]
    while cu[-1] < total:
        cu.append(min(total, cu[-1] + rng.choice([1, 3, 7, 20, 45, 90, 200])))
    return cu


def test_group_spans_of_each_kind():
    assert Chunked(4).group_spans(10) == [(0, 4), (4, 8), (8, 10)]
    assert Mask(True).group_spans(10) == [(0, 10)]
    assert Prefix(3).group_spans(10) == [(0, 10)]
    bounds = [(0, 6), (6, 16)]  # the chunked module's worked example
    assert Chunked(4).causal_groups(bounds) == [(0, 4), (4, 6), (6, 10), (10, 14), (14, 16)]
    assert Mask(True).causal_groups(bounds) == bounds
    for other in (Mask(False), Mask(True, (3, 0)), Prefix(2)):  # not causal documents: not priced as such
        assert other.causal_groups(bounds) is None


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("world,size", [(4, 16), (8, 32), (6, 5)])
def test_the_balanced_layout_of_chunks_is_that_of_the_cut_documents(seed, world, size):
    cu = _documents(seed, 48 * world)
    chunked = balanced_layout(cu, world, mask=Chunked(size))
    cut = balanced_layout(_cut(cu, size), world)
    assert chunked.rank_runs == cut.rank_runs
    shape = AttentionShape(seq_local=cu[-1] // world, heads=2, kv_heads=1, head_dim=4)
    mask = masks.documents(cu) & masks.chunked(size)
    for mode in ("ring", "tasp", "a2a+ring"):
        validate_plan(resolve(mode, world, shape, **({"ulysses_size": 2} if "+" in mode else {}))
                      .build(shape, mask, chunked))


def test_auto_prices_chunked_attention_as_its_chunks():
    cu = _documents(1, 8 * 512)
    shape = AttentionShape(seq_local=512, heads=32, kv_heads=8, head_dim=128)
    topo = Topology(nodes=1, gpus_per_node=8)
    sample = Sample(cu, 8, shape=shape, mask=Chunked(64), topology=topo, mode="ring")
    layout = get_layout_kind("balanced").build(sample)
    expected = choose_layout(layout, shape, topo, "ring", 1, Chunked(64).causal_groups(layout.documents()))[0]
    assert get_layout_kind("auto").pick(sample) == expected
    # a prefix is not priced: the balanced layout, as under a window
    assert get_layout_kind("auto").pick(Sample(cu, 8, shape=shape, mask=Prefix(64), topology=topo)) == "balanced"
