"""The executor's arena (plan/arena.py): every buffer a rank makes in one direction at a fixed
place, laid out once per plan and shape. No two buffers live at the same time share a byte,
every place lies inside the arena and starts aligned, the blocks whose key/value pieces follow
each other read one run (``spans``) and the others' pieces are gathered in one go where they can
(``gathers``) -- in every mode, dense and masked, odd P."""

from __future__ import annotations

import pytest

from megatron_mesh.plan import MODES, AttentionShape, Key, Mask, balanced_layout, resolve
from megatron_mesh.plan.arena import ALIGN, scratch_layout
from megatron_mesh.plan.ir import Attend, AttendBackward, Free, Post
from megatron_mesh.plan.memory import buffer_memory

SHAPE = AttentionShape(seq_local=24, batch=2, heads=4, kv_heads=2, head_dim=8, itemsize=2, v_head_dim=6)


def _settings(mode: str, world: int) -> dict:
    if mode.startswith("a2a+"):
        return {"ulysses_size": 2}
    return {"tile": (2, world // 2)} if mode == "mesh" and world % 2 == 0 else {}


def _plans():
    for mode in MODES:
        for world in (4, 5, 6):
            if mode.startswith("a2a+") and world % 2:
                continue
            settings = _settings(mode, world)
            yield mode, world, resolve(mode, world, SHAPE, **settings).build(SHAPE)
            cu = (0, 7, 30, 31, 60, world * SHAPE.seq_local)
            mask = Mask(causal=True, documents=tuple(zip(cu, cu[1:])), window=(9, 0))
            yield mode, world, resolve(mode, world, SHAPE, **settings).build(SHAPE, mask)
    layout = balanced_layout((0, 20, 50, 51, 96), 4)
    mask = Mask(causal=True, documents=((0, 20), (20, 50), (50, 51), (51, 96)))
    yield "tasp", 4, resolve("tasp", 4, SHAPE).build(SHAPE, mask, layout)


def _ranges(places) -> list[tuple[int, int]]:
    return [(p.offset, p.offset + p.nbytes) for p in places]


@pytest.mark.parametrize("mode, world, plan", list(_plans()), ids=lambda x: str(x) if not hasattr(x, "mode") else "")
def test_live_buffers_never_share_bytes(mode, world, plan):
    for rank in range(world):
        rp = plan.rank(rank)
        for direction in ("forward", "backward"):
            layout = scratch_layout(plan, rank, direction, SHAPE)
            if direction == "forward":  # what the backward reads of the forward lives outside the arena,
                # whose bytes the backward (and the next layer's forward) take over
                assert not {key for _, key in layout.places} & set(rp.saved), (mode, rank)
            live: dict[Key, tuple] = {key: ident for ident in layout.places for key in [ident[1]] if ident[0] < 0}
            for ident, places in layout.places.items():
                for a, b in _ranges(places):
                    assert 0 <= a and b <= layout.size, (mode, rank, direction, ident)
            for i, op in enumerate(rp.ops(direction)):
                made = [ident for ident in layout.places if ident[0] == i]
                for ident in made:
                    mine = _ranges(layout.places[ident])
                    for other in live.values():
                        assert not any(a < d and c < b for a, b in mine for c, d in _ranges(layout.places[other])), \
                            (mode, world, rank, direction, i, ident, other)
                    live[ident[1]] = ident
                if type(op) is Free:
                    live.pop(op.key, None)
                if type(op) in (Attend, AttendBackward) and i in layout.spans:
                    # a span is exactly the pieces, one after another
                    pieces = [(layout.places[live[key]], sel) for key, sel in
                              ((k, op.col(j)) for j, k in enumerate(op.kv))]
                    for t, run in enumerate(layout.spans[i]):
                        pos = run.offset
                        for places, sel in pieces:
                            for a, b in sel or ((0, places[t].tokens),):
                                assert places[t].offset + a * places[t].row == pos
                                pos += (b - a) * places[t].row
                        assert pos == run.offset + run.nbytes
            starts = {p.offset for places in layout.places.values() for p in places[:1]}
            assert layout.size % ALIGN == 0 and all(s % 2 == 0 for s in starts)


def test_the_arena_holds_at_least_the_live_peak_and_tasp_reads_runs():
    """The arena of every mode is at least the memory model's live peak of its direction and at
    most a few times it; TASP's steps read their whole slots as runs of the arena (no copy) and
    gather the rest in one go."""
    world = 8
    shape = AttentionShape(seq_local=64, batch=1, heads=4, kv_heads=2, head_dim=8, itemsize=2)
    for mode in MODES:
        plan = resolve(mode, world, shape, **_settings(mode, world)).build(shape)
        for rank in range(world):
            mem = buffer_memory(plan, shape, rank)
            for direction, peak in (("forward", mem.forward_peak), ("backward", mem.backward_peak)):
                size = scratch_layout(plan, rank, direction, shape).size
                assert size <= mem.held and size <= 3 * peak + 4 * ALIGN, (mode, rank, direction, size, peak)
    tasp = resolve("tasp", world, shape).build(shape)
    layout = scratch_layout(tasp, 3, "forward", shape)
    multi = [i for i, op in enumerate(tasp.rank(3).forward) if type(op) is Attend and len(op.kv) > 1]
    assert multi and set(multi) == set(layout.spans) | set(layout.gathers), (multi, layout.spans, layout.gathers)
    assert layout.spans and layout.gathers
    # its input cuts (the seven slots of its own chunk) are one group per tensor kind
    assert [(keys[0].kind, len(keys)) for keys, *_ in layout.cuts] == [("kv", world - 1)]
    assert sum(1 for op in tasp.rank(3).forward if type(op) is Post) == world - 1


def _hybrid_plans():
    """Ulysses hybrids whose copies make runs: on layouts balanced for their groups (rounds by
    document set), on the zigzag, with K/V heads replicated over a group (fewer than U)."""
    cu = (0, 7, 40, 41, 90, 150, 192)
    docs = Mask(causal=True, documents=tuple(zip(cu, cu[1:])))
    for mode, world, U, kv in (("a2a+tasp", 8, 2, 2), ("a2a+tasp", 8, 4, 4), ("a2a+ring", 8, 4, 2),
                               ("a2a+mesh", 8, 8, 8)):
        shape = AttentionShape(seq_local=24, batch=2, heads=8, kv_heads=kv, head_dim=8, itemsize=2)
        placement = resolve(mode, world, shape, ulysses_size=U)
        yield mode, U, kv, shape, placement.build(shape, docs, balanced_layout(cu, world, group=U))
        yield mode, U, kv, shape, placement.build(shape)


def test_copy_runs_are_the_host_model_s_runs_and_lie_side_by_side():
    """Every run of copies the host model counts as one copy per tensor
    (:func:`~megatron_mesh.plan.arena_runs.copy_run_candidates`, read off the ops) is one in the arena:
    its buffers lie side by side in the order of the copies -- all three ways occur (a round's
    buffers into the group's rows, the group's rows into buffers going home, the buffers come
    home into head slices)."""
    from megatron_mesh.plan.arena_runs import copy_run_candidates
    from megatron_mesh.plan.ir import Copy

    ways = set()
    for mode, U, kv, shape, plan in _hybrid_plans():
        for rank in range(plan.world_size):
            for direction in ("forward", "backward"):
                ops = plan.rank(rank).ops(direction)
                layout = scratch_layout(plan, rank, direction, shape)
                candidates = copy_run_candidates(plan, ops)
                assert {i for _, run in candidates for i in run} == set(layout.copy_runs), (mode, U, rank, direction)
                for way, run in candidates:
                    ways.add(way)
                    got = layout.copy_runs[run[0]]
                    assert got.ops == tuple(run) and all(layout.copy_runs[i] is got for i in run)
                    assert all(type(ops[i]) is Copy for i in run)
                    arena = got.src if got.src is not None else got.dst
                    side = [ops[i].src if got.src is not None else ops[i].dst for i in run]
                    idents = {key: ident for ident in layout.places for key in [ident[1]] if ident[0] <= run[-1]}
                    for t, p in enumerate(arena):  # the run is the buffers, one after another
                        starts = [layout.places[idents[k]][t].offset for k in side]
                        sizes = [layout.places[idents[k]][t].nbytes for k in side]
                        assert starts[0] == p.offset and p.nbytes == sum(sizes)
                        assert all(a + n == b for a, n, b in zip(starts, sizes, starts[1:]))
    assert ways == {"gather", "scatter", "heads"}


def test_cuts_of_consecutive_head_slices_are_one_group():
    """A Ulysses rank's sends of one kind to its peers are one group of cuts (one gather per
    tensor) where their head slices follow each other; its own slice (a view) splits them, and
    K/V heads replicated over the group (fewer than U) do not follow each other."""
    from megatron_mesh.plan.arena_runs import cut_groups

    cu = (0, 7, 40, 41, 90, 150, 192)
    docs = Mask(causal=True, documents=tuple(zip(cu, cu[1:])))
    for kv in (4, 2):
        shape = AttentionShape(seq_local=24, batch=2, heads=8, kv_heads=kv, head_dim=8, itemsize=2)
        plan = resolve("a2a+tasp", 8, shape, ulysses_size=4).build(shape, docs, balanced_layout(cu, 8, group=4))
        rp = plan.rank(1)  # head slice 1 of group 0: its peers' slices 0 | 2, 3
        groups = [([(k.kind, k.heads) for k in keys], slices)
                  for keys, slices in cut_groups(plan, rp, "forward", shape.heads, shape.kv_heads)]
        q = [(sorted({h for _, h in keys}), slices) for keys, slices in groups if keys[0][0] == "q"]
        kvs = [(sorted({h for _, h in keys}), slices) for keys, slices in groups if keys[0][0] == "kv"]
        assert q == [([0], 1), ([2, 3], 2)], groups
        assert kvs == ([([0], 1), ([2, 3], 2)] if kv == 4 else [([0], 1), ([2], 1), ([3], 1)]), groups
        layout = scratch_layout(plan, 1, "forward", shape)
        assert [slices for *_, slices in layout.cuts] == [slices for _, slices in groups]
