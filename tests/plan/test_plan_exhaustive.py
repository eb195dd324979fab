"""Every tile a x b = P for EVERY P up to 256 (tests/plan/test_plan_mesh.py checks every P up to 16 fully, matching up to 64 and
samples above): exact cover, matching transfers, a deadlock-free dry run, perfectly balanced
causal work and bytes equal to the closed form (both backward modes). Pure Python, but the cost
grows as P^2 per tile: P <= 123 takes about half an hour on one core, all of it several hours,
so it runs only on request (pass node ids such as
``tests/plan/test_plan_exhaustive.py::test_every_tile_of_every_P_up_to_256[200]`` to pick sizes)::

    scripts/test.sh tests/plan/test_plan_exhaustive.py --exhaustive
"""

import pytest

from megatron_mesh.plan import AttentionShape, build_mesh_plan, mesh_bytes_formula, plan_bytes, rank_work, tile_shapes
from megatron_mesh.plan import mesh as mesh_module
from megatron_mesh.plan.validate import validate_plan

pytestmark = pytest.mark.exhaustive

SHAPE = AttentionShape(seq_local=4, batch=1, heads=4, kv_heads=2, head_dim=8, itemsize=2)


@pytest.fixture(autouse=True)
def _forget_plans():
    """A validated plan keeps every rank's op lists (hundreds of MB near P = 256): drop the
    builder's cache after each P, or the sweep runs out of memory."""
    yield
    mesh_module._build_mesh_plan.cache_clear()


@pytest.mark.parametrize("P", range(1, 257))
def test_every_tile_of_every_P_up_to_256(P):
    for tile in tile_shapes(P):
        plan = build_mesh_plan(P, tile, SHAPE)
        validate_plan(plan, dataflow=False)  # cover + matching + dry run
        for direction in ("forward", "backward"):
            work = rank_work(plan, direction)
            assert max(work) == min(work), (P, tile, direction)
        for backward_chunks in ("refetch", "keep"):
            got = plan_bytes(build_mesh_plan(P, tile, SHAPE, backward_chunks=backward_chunks), SHAPE)
            want = mesh_bytes_formula(P, tile, SHAPE, backward_chunks)
            assert all(g == want for g in got), (P, tile, backward_chunks, got[0], want)
