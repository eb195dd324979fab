"""The mode registry and the Placement object: one place that knows every CP mode, one object
that knows where a mode puts things (tile, rank order, rings, node map, Ulysses groups) -- and the
proof that a new mode is one file: registering one (with an option) gives it a Megatron flag, a
start-up check, mask-aware plans and a planner row, with no other file touched."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import pytest

from helpers import package_comparisons, str_literals
from megatron_mesh.plan import (MODES, AttentionShape, Mask, Placement, Topology, choose_tile, resolve, setting,
                                validate_plan)
from megatron_mesh.plan.mesh import BACKWARD_CHUNKS
from megatron_mesh.plan.modes import HYBRID_PREFIX, RingMode, parse_mode_spec, register

SHAPE = AttentionShape(seq_local=16, batch=1, heads=8, kv_heads=2, head_dim=8)


def test_registry_holds_every_mode():
    assert list(MODES) == ["ring", "mesh", "tasp", "a2a+mesh", "a2a+tasp", "a2a+ring"]


@pytest.mark.parametrize("call, match", [
    (lambda: resolve("meshy", 4, SHAPE), r"unknown CP mode 'meshy'; allowed: ring, mesh, tasp"),
    (lambda: resolve("mesh", 4, SHAPE, tiles="2x2"), r"CP mode 'mesh' takes no setting tiles; its settings: tile"),
    (lambda: resolve("mesh", 4, SHAPE, tile="3x2"), r"tile 3x2 does not fit CP size 4"),
    (lambda: resolve("a2a+mesh", 4, SHAPE, ulysses_size=2, tile="4x1"),  # the inner group's size, named as such
     r"CP mode 'a2a\+mesh' at CP size 4 = all-to-all 2 x inner mesh over 2 ranks: tile 4x1 does not fit CP size 2"),
    (lambda: resolve("mesh", 4, SHAPE, schedule="fast"), r"schedule must be one of greedy, lockstep, got 'fast'"),
    (lambda: resolve("tasp", 8, SHAPE, ranks_per_node=3), r"positive divisor of the CP size 8, got 3"),
    (lambda: resolve("tasp", 15, SHAPE, ranks_per_node=5), r"no decomposition into 5 Hamiltonian paths \(none exists for 3 and 5\)"),
    (lambda: resolve("ring", 0, SHAPE), r"CP size must be a positive integer, got 0"),
    (lambda: resolve("tasp", 4, SHAPE, transport="mpi"), r"transport must be one of p2p, alltoall, got 'mpi'"),
    (lambda: resolve("a2a+tasp", 4, SHAPE, ulysses_size=2, transport="alltoall"),
     r"transport 'alltoall': CP mode 'a2a\+tasp' runs its all-to-all and the inner tasp rounds point-to-point"),
    (lambda: parse_mode_spec("mesh:2x2:q"), r"mode 'mesh:2x2:q' has 2 settings after the name; mesh takes at most 1: "
                                            r"mesh:TILE"),
    # the backward's keep limit: a number >= 0, and only where backward chunks are "auto"
    (lambda: resolve("ring", 4, SHAPE, backward_keep_limit=-1), r"backward_keep_limit must be a number >= 0 .*got -1"),
    (lambda: resolve("mesh", 4, SHAPE, backward_keep_limit=float("nan")), r"backward_keep_limit .*got nan"),
    (lambda: resolve("tasp", 4, SHAPE, backward_keep_limit="2"), r"backward_keep_limit .*got '2'"),
    (lambda: resolve("a2a+tasp", 4, SHAPE, ulysses_size=2, backward_keep_limit=True), r"backward_keep_limit .*got True"),
    (lambda: resolve("ring", 4, SHAPE, backward_chunks="refetch", backward_keep_limit=3.0),
     r"backward_keep_limit 3.0 applies only with backward_chunks='auto', got backward_chunks='refetch'"),
    (lambda: resolve("mesh", 4, SHAPE, backward_keep_limit=3.0).with_options(backward_chunks="keep"),
     r"backward_keep_limit 3.0 applies only with backward_chunks='auto', got backward_chunks='keep'"),
])
def test_bad_settings_name_the_value(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_mode_specs_of_the_command_line():
    assert parse_mode_spec("mesh:2x2") == ("mesh", {"tile": "2x2"})
    assert parse_mode_spec("a2a+mesh:2:1x2") == ("a2a+mesh", {"ulysses_size": 2, "tile": "1x2"})
    assert parse_mode_spec("tasp:4") == ("tasp", {"ranks_per_node": 4})
    assert parse_mode_spec("ring") == ("ring", {})


def test_mesh_placement_owns_its_rings_and_groups():
    p = resolve("mesh", 4, SHAPE, tile="2x2", contiguous="q")
    assert p.rings() == {"q": ((0, 1), (2, 3)), "kv": ((0, 2), (1, 3))}
    assert p.groups() == ((0, 1), (0, 2), (1, 3), (2, 3))
    plan = p.build(AttentionShape(seq_local=16, heads=8, kv_heads=2, head_dim=8))
    assert plan.rings == p.rings()  # one owner: the plan's rings are the placement's
    assert p.describe() == "mesh (CP 4, tile 2x2, schedule greedy, backward auto, contiguous q)"


def test_tasp_placement_routes_same_node_peers():
    p = resolve("tasp", 8, SHAPE, ranks_per_node=4)
    assert p.groups() == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert p.build(SHAPE).rings == p.rings()  # rings only; the node groups are transport routes
    # backward_chunks changes only the mask-aware plans: where it shows, it says so
    assert p.describe() == ("tasp (CP 8, transport p2p, CP ranks per node 4, backward auto under masks (the dense "
                            "plan refetches))")
    assert resolve("tasp", 8, SHAPE, backward_chunks="refetch").describe() == (
        "tasp (CP 8, transport p2p, CP ranks per node 8)")
    # a keep limit away from its default says so, in every mode's words
    assert "backward auto, keep limit 3.0 under masks" in resolve("tasp", 8, SHAPE, backward_keep_limit=3.0).describe()
    assert resolve("ring", 4, SHAPE, backward_keep_limit=0.5).describe() == \
        "ring (CP 4, zigzag ring, backward auto, keep limit 0.5)"
    assert "backward auto, keep limit inf," in resolve("mesh", 4, SHAPE, backward_keep_limit=float("inf")).describe()
    assert resolve("ring", 4, SHAPE, backward_chunks="refetch", backward_keep_limit=2.0).options.backward_keep_limit == 2.0


def test_hybrid_placement_has_ulysses_groups_and_mapped_inner_rings():
    p = resolve("a2a+mesh", 8, SHAPE, ulysses_size=2, tile=(2, 2), contiguous="q")
    rings = p.rings()
    assert rings["a2a"] == ((0, 1), (2, 3), (4, 5), (6, 7))
    # inner Q rings of head slice 0 are inner ranks {0,1},{2,3} -> CP ranks {0,2},{4,6}; slice 1: {1,3},{5,7}
    assert rings["q"] == ((0, 2), (4, 6), (1, 3), (5, 7))
    assert p.inner.tile == (2, 2) and p.ulysses == 2 and p.tile == (2, 2)
    assert p.build(SHAPE).rings == rings
    assert "all-to-all 2 x mesh (CP 4, tile 2x2" in p.describe()


def test_auto_tile_is_the_one_chooser():
    """mesh tile 'auto' everywhere is choose_tile's fastest; the bytes objective is the closed form."""
    topo = Topology(nodes=2, gpus_per_node=4)
    p = resolve("mesh", 8, SHAPE, tile="auto", ranks_per_node=4)
    assert (p.tile, p.options.contiguous) == choose_tile(8, SHAPE, topo)
    fixed = resolve("mesh", 8, SHAPE, tile="2x4", contiguous="auto", ranks_per_node=4)
    assert fixed.tile == (2, 4) and (fixed.tile, fixed.options.contiguous) == choose_tile(8, SHAPE, topo, tile=(2, 4))
    assert choose_tile(8, SHAPE, topo, objective="bytes")[0] in ((2, 4), (4, 2), (1, 8), (8, 1))
    with pytest.raises(ValueError, match="objective must be 'time' or 'bytes'"):
        choose_tile(8, SHAPE, topo, objective="speed")
    with pytest.raises(ValueError, match="takes a concrete tile; tile 'auto' is chosen by"):
        from megatron_mesh.plan import build_mesh_plan

        build_mesh_plan(8, "auto", SHAPE)


# -- a new mode is one file ------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Ring2Options:
    backward_chunks: Literal[BACKWARD_CHUNKS] = setting("refetch", flag="--ring2-backward-chunks",
                                                        help="ring2: keep or refetch the chunks in the backward")


class _Ring2(RingMode):
    """Ring attention under another name, with its own option and Megatron flag: what a new mode's
    file holds (its options, its dense plan, its description), nothing else."""

    name = "ring2"
    Options = _Ring2Options

    def describe(self, p: Placement) -> str:
        return f"ring2 (CP {p.world_size}, backward {p.options.backward_chunks})"


@pytest.fixture()
def ring2():
    register(_Ring2())
    yield
    for name in ("ring2", HYBRID_PREFIX + "ring2"):
        MODES.pop(name, None)


def test_a_new_mode_is_one_file_and_one_registration(ring2, megatron_args):
    """Registered, the mode has: its Ulysses hybrid; a Megatron flag, applicable where its layers
    run and checked at start-up; its settings on the layers' config; mask-aware plans (documents)
    that validate; and a planner row -- with no other file touched."""
    from megatron_mesh.megatron.args import apply_args
    from megatron_mesh.megatron.checks import validate_args
    from megatron_mesh.megatron.placement import resolve_placement
    from megatron_mesh.megatron.args import MeshTransformerConfig
    from megatron_mesh.tools.planner import default_modes, evaluate

    assert HYBRID_PREFIX + "ring2" in MODES
    plugin = ["--spec", "megatron_mesh.megatron.spec", "gpt_layer_spec", "--transformer-impl", "local",
              "--attention-dropout", "0", "--context-parallel-size", "4", "--seq-length", "64"]
    args = megatron_args([*plugin, "--cp-comm-type", "ring2", "--ring2-backward-chunks", "keep"])
    validate_args(args, have_te=False)
    config = MeshTransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=8, num_query_groups=2)
    apply_args(args, config)
    placement = resolve_placement("ring2", config, (0, 1, 2, 3))
    assert placement.options.backward_chunks == "keep" and placement.describe() == "ring2 (CP 4, backward keep)"
    with pytest.raises(ValueError, match=r"--ring2-backward-chunks keep is given, but no layer runs ring2 or "
                                         r"a2a\+ring2 at CP > 1 \(--cp-comm-type ring\)"):
        validate_args(megatron_args([*plugin, "--cp-comm-type", "ring", "--ring2-backward-chunks", "keep"]))
    with pytest.raises(SystemExit):
        megatron_args([*plugin, "--cp-comm-type", "ring2", "--ring2-backward-chunks", "never"])  # argparse's choices

    docs = Mask.from_cu_seqlens([0, 5, 40, 64], 64, True, (9, 0))
    plan = resolve("ring2", 4, SHAPE, backward_chunks="keep").build(SHAPE, docs)
    assert plan.mode == "ring2" and plan.facts.direct and plan.backward_chunks == "keep"
    validate_plan(plan)
    validate_plan(resolve("a2a+ring2", 4, SHAPE, ulysses_size=2).build(SHAPE, docs))

    assert "ring2" in default_modes()
    rows, skipped = evaluate(4, SHAPE, Topology(nodes=1, gpus_per_node=4), modes=("ring2",))
    assert [r.mode for r in rows] == ["ring2"] and not skipped


def test_a_new_modes_dense_plan_says_its_own_name(ring2):
    """Mode.build stamps the plan with the mode's name: a toy mode whose dense plan is ring's
    builder's says "ring2", not "ring" (as its mask-aware plan does), and so does its hybrid's."""
    plan = resolve("ring2", 4, SHAPE).build(SHAPE)
    assert plan.mode == "ring2" and not plan.facts.direct
    validate_plan(plan)
    assert plan.to_text().splitlines()[0] == resolve("ring", 4, SHAPE).build(SHAPE).to_text().splitlines()[0].replace(
        "ring", "ring2", 1)
    hybrid = resolve("a2a+ring2", 4, SHAPE, ulysses_size=2).build(SHAPE)
    assert hybrid.mode == "a2a+ring2"
    validate_plan(hybrid)


# -- nobody else knows a mode by name --------------------------------------------------------------------
def test_no_mode_name_is_compared_outside_the_registry():
    """No ``== "mesh"`` / ``in ("tasp", ...)`` ladders outside a mode's own file and the registry
    (megatron_mesh/plan/modes/): every consumer asks the registry."""
    names = set(MODES) | {HYBRID_PREFIX}
    found = [f"{where} {sorted(hits)}" for where, _, operands in package_comparisons("plan/modes")
             if (hits := {x for o in operands for x in str_literals(o)} & names)]
    assert not found, "mode names compared outside the registry:\n" + "\n".join(found)
