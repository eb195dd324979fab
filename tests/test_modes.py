"""The mode registry and the Placement object: one place that knows every CP mode, one object
that knows where a mode puts things (tile, rank order, rings, node map, Ulysses groups)."""

from __future__ import annotations

import pytest

from megatron_mesh.plan import MODES, AttentionShape, Placement, Topology, choose_tile, resolve
from megatron_mesh.plan.modes import Mode, register

SHAPE = AttentionShape(seq_local=16, batch=1, heads=8, kv_heads=2, head_dim=8)


def test_registry_holds_every_mode():
    assert list(MODES) == ["ring", "mesh", "tasp", "a2a+mesh", "a2a+tasp", "a2a+ring"]


@pytest.mark.parametrize("call, match", [
    (lambda: resolve("meshy", 4, SHAPE), r"unknown CP mode 'meshy'; allowed: ring, mesh, tasp"),
    (lambda: resolve("mesh", 4, SHAPE, tiles="2x2"), r"CP mode 'mesh' takes no setting tiles; its settings: tile"),
    (lambda: resolve("mesh", 4, SHAPE, tile="3x2"), r"tile 3x2 does not fit CP size 4"),
    (lambda: resolve("mesh", 4, SHAPE, schedule="fast"), r"schedule must be one of greedy, lockstep, got 'fast'"),
    (lambda: resolve("tasp", 8, SHAPE, gpus_per_node=3), r"positive divisor of the CP size 8, got 3"),
    (lambda: resolve("tasp", 15, SHAPE, gpus_per_node=5), r"no decomposition into 5 Hamiltonian paths \(none exists for 3 and 5\)"),
    (lambda: resolve("ring", 0, SHAPE), r"CP size must be a positive integer, got 0"),
    (lambda: resolve("tasp", 4, SHAPE, transport="mpi"), r"transport must be one of p2p, alltoall, got 'mpi'"),
])
def test_bad_settings_name_the_value(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_mesh_placement_owns_its_rings_and_groups():
    p = resolve("mesh", 4, SHAPE, tile="2x2", contiguous="q")
    assert p.rings() == {"q": ((0, 1), (2, 3)), "kv": ((0, 2), (1, 3))}
    assert p.groups() == ((0, 1), (0, 2), (1, 3), (2, 3))
    plan = p.build(AttentionShape(seq_local=16, heads=8, kv_heads=2, head_dim=8))
    assert plan.rings == p.rings()  # one owner: the plan's rings are the placement's
    assert p.describe() == "mesh (CP 4, tile 2x2, schedule greedy, backward refetch, contiguous q)"


def test_tasp_placement_routes_same_node_peers():
    p = resolve("tasp", 8, SHAPE, gpus_per_node=4)
    assert p.groups() == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert p.build(SHAPE).rings["kv"] == p.rings()["kv"]


def test_hybrid_placement_has_ulysses_groups_and_mapped_inner_rings():
    p = resolve("a2a+mesh", 8, SHAPE, ulysses_size=2, tile=(2, 2), contiguous="q")
    rings = p.rings()
    assert rings["a2a"] == ((0, 1), (2, 3), (4, 5), (6, 7))
    # inner Q rings of head slice 0 are inner ranks {0,1},{2,3} -> CP ranks {0,2},{4,6}; slice 1: {1,3},{5,7}
    assert rings["q"] == ((0, 2), (4, 6), (1, 3), (5, 7))
    assert p.inner.tile == (2, 2) and p.ulysses == 2
    assert "all-to-all 2 x mesh (CP 4, tile 2x2" in p.describe()


def test_auto_tile_is_the_one_chooser():
    """mesh tile 'auto' everywhere is choose_tile's fastest; the bytes objective is the closed form."""
    topo = Topology(nodes=2, gpus_per_node=4)
    p = resolve("mesh", 8, SHAPE, tile="auto", ranks_per_node=4)
    assert (p.tile, p.contiguous) == choose_tile(8, SHAPE, topo)
    fixed = resolve("mesh", 8, SHAPE, tile="2x4", contiguous="auto", ranks_per_node=4)
    assert fixed.tile == (2, 4) and (fixed.tile, fixed.contiguous) == choose_tile(8, SHAPE, topo, tile=(2, 4))
    assert choose_tile(8, SHAPE, topo, objective="bytes")[0] in ((2, 4), (4, 2), (1, 8), (8, 1))
    with pytest.raises(ValueError, match="objective must be 'time' or 'bytes'"):
        choose_tile(8, SHAPE, topo, objective="speed")


def test_a_new_mode_is_its_builder_plus_one_registry_line():
    """Register a mode (here: ring attention under another name) and every consumer knows it:
    the registry, Placement.build, the planner's rows."""
    from megatron_mesh.tools.planner import evaluate

    base = MODES["ring"]
    try:
        register(Mode("ring2", base.settings, lambda *a, **k: Placement("ring2", a[0], tile=(1, a[0])),
                      base.build, base.rings, lambda world, shape, topo: [Placement("ring2", world, tile=(1, world))],
                      lambda p: f"ring2 (CP {p.world_size})"))
        p = resolve("ring2", 4, SHAPE)
        assert p.build(SHAPE).world_size == 4
        rows, _ = evaluate(4, SHAPE, Topology(nodes=1, gpus_per_node=4), modes=("ring2",))
        assert [r.mode for r in rows] == ["ring2"]
    finally:
        del MODES["ring2"]
