"""Masks and Ulysses hybrids on real gloo process groups, forward and backward against a dense
fp64 reference with the same mask, in ONE spawn of 8 processes (split into concurrent subgroups
per CP size):

* every mode (ring, each Mesh tile, TASP, TASP over emulated nodes) under packed documents
  (shorter than a half-chunk, crossing chunk and rank boundaries, one token each) and sliding
  windows (one token, less than a half-chunk, several chunks), causal and full, MHA/GQA/MQA,
  fp32 and bf16, for every CP size 1..8; Transformer Engine's THD layout at P <= 4;
* skipping is real: a half-chunk window at P = 8 moves at most 0.2x ring attention's unmasked
  bytes in every mode, documents that never cross a rank move nothing -- measured by
  ``comm_counter()`` and equal to the plan's bytes;
* Ulysses x Mesh (every inner tile) / TASP / ring for (U, M) in (2,2), (2,3), (3,2), (2,4), (4,2),
  each all-to-all round one ``all_to_all_single`` over its Ulysses group (as Megatron's groups route it);
* chunked and prefix attention with documents in every mode, zigzag and balanced, at P = 3, 4, 8
  (part "mask_kinds"; their in-process breadth: test_mask_kinds_numerics.py);
* inputs in any memory layout at P = 5, 6 (part "strides"; the in-process breadth: test_strides.py).
"""

import pytest

from megatron_mesh.plan import MODES, AttentionShape, mesh_bytes_formula

import cases
import mask_cases
from test_strides import record_failures

GLOO_PARTS = ("mask_kinds", "strides")


@pytest.fixture(scope="module")
def results(dist_results):
    per_rank = dist_results
    merged: dict = {"masked": {}, "halo": {}, "hybrid": {}, "balanced": {}}
    for rank_result in per_rank:
        for kind in merged:
            for size, recs in rank_result[kind].items():
                merged[kind].setdefault(size, []).append(recs)
    return merged


def _check(per_rank_records):
    assert per_rank_records and all(per_rank_records), "no cases ran"
    bad = [f"group rank {r}: {rec.case}: {name} error {rec.abs_err[name]:.2e} ({ratio:.2f}x tolerance)"
           for r, recs in enumerate(per_rank_records) for rec in recs for name, ratio in rec.ratios.items()
           if not ratio <= 1.0]
    assert not bad, "\n".join(bad[:20])
    wrong = [f"group rank {r}: {rec.case}: measured {(rec.sent, rec.received)} != planned {rec.planned}"
             for r, recs in enumerate(per_rank_records) for rec in recs if (rec.sent, rec.received) != rec.planned]
    assert not wrong, "\n".join(wrong[:20])
    # a hybrid's all-to-all rounds went as one all_to_all_single each (its Ulysses group's sub-group),
    # packing and unpacking no more than the host model counts (hostops.wire_copies: none where the
    # buffers of a run of copies lie side by side; the transport also skips those that happen to lie
    # in order -- at U 2 a rank's q, k and v cuts for its one peer -- which the model prices high)
    off = [f"group rank {r}: {rec.case}: (all-to-all calls, packed, unpacked) {rec.collectives[0]}, the plan's "
           f"{rec.collectives[1]}"
           for r, recs in enumerate(per_rank_records) for rec in recs
           if rec.collectives[0][0] != rec.collectives[1][0]
           or any(made > planned for made, planned in zip(rec.collectives[0][1:], rec.collectives[1][1:]))]
    assert not off, "\n".join(off[:20])


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5, 6, 7, 8])
def test_masked_attention_matches_dense_reference_and_moves_the_planned_bytes(results, world):
    _check(results["masked"][world])


def test_half_chunk_window_is_a_halo_exchange_in_every_mode(results, record_property):
    """P = 8, T = 16, window 8 tokens: measured bytes <= 0.2x ring attention unmasked."""
    shape = AttentionShape(seq_local=16, batch=1, heads=4, kv_heads=4, head_dim=16, itemsize=2)
    ring = mesh_bytes_formula(8, (1, 8), shape).sent
    records = results["halo"][8]
    _check(records)
    ratios = {}
    for recs in records:
        for rec in recs:
            if "window" in rec.case:
                ratios[rec.case] = max(ratios.get(rec.case, 0), rec.sent / ring)
    record_property("halo_bytes_over_ring_unmasked", ratios)
    assert len(ratios) == 6 and all(r <= 0.2 for r in ratios.values()), ratios


def test_documents_inside_halves_move_nothing(results):
    docs = [rec for recs in results["halo"][8] for rec in recs if "docs" in rec.case]
    assert len(docs) == 8 * 6 and all((r.sent, r.received) == (0, 0) for r in docs)


@pytest.mark.parametrize("world", [4, 6, 8])
def test_hybrid_matches_dense_reference_and_moves_the_planned_bytes(results, world):
    """Through the transport Megatron's groups give a hybrid: each all-to-all round one collective."""
    _check(results["hybrid"][world])
    assert all(rec.collectives[1][0] >= 4 for recs in results["hybrid"][world] for rec in recs)  # q/kv, o, dy, dq/dkv


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5, 6, 7, 8])
def test_balanced_layout_matches_dense_reference_and_moves_the_planned_bytes(results, world):
    """Every mode on the work-balanced, document-aware layout, forward and backward exact against
    the dense fp64 reference, bytes as planned (P = 1..8, odd sizes included, hybrids at even P);
    Mesh on layouts that name their blocks' owners too (P >= 2), where blocks move."""
    _check(results["balanced"][world])
    assert len(results["balanced"][world][0]) >= 6
    owned = [[rec for rec in recs if "block owners" in rec.case] for recs in results["balanced"][world]]
    assert all(len(recs) == (2 if world > 1 else 0) for recs in owned)
    assert world == 1 or all(sum(rec.sent for rec in recs) > 0 for recs in zip(*owned))  # each case moves bytes


def test_cpu_problem_samples_move_the_planned_bytes(results):
    """Seeds 0-2 of the CPU problem (scaled to 2K tokens) on the balanced layout under ring (seeds
    0 and 2) and TASP (seed 1), and under Mesh on the layout whose blocks' owners
    plan/balance_owners.py chose: exact, and every rank's measured bytes are the plan's (the
    full-size samples, every mode: scripts/compare_attention.py --seed 0..2, docs/performance.md)."""
    from mask_cases import cpu_problem_samples

    docs = [f"docs={list(cu)}" for cu in cpu_problem_samples()]
    recs = [[rec for rec in by_rank if any(d in rec.case for d in docs)] for by_rank in results["balanced"][8]]
    assert all(len(r) == 6 for r in recs)
    assert all(sum("owners_layout" in rec.case for rec in r) == 3 for r in recs)
    _check(recs)
    assert all(sum(rec.sent for rec in case) > 0 for case in zip(*recs))  # the samples' long documents move


def test_max_errors_summary(results, record_property):
    worst = {}
    for kind in results.values():
        for recs_by_rank in kind.values():
            for recs in recs_by_rank:
                for rec in recs:
                    worst[rec.dtype] = max(worst.get(rec.dtype, 0.0), max(rec.abs_err.values()))
    record_property("max_abs_err", worst)
    assert set(worst) == {"torch.float32", "torch.bfloat16"}


def test_a_round_taking_rows_home_is_sent_and_received_as_it_lies(results):
    """The rounds whose buffers the arena places side by side in the order they go (a Ulysses
    group's output coming home into its head slices; on a layout balanced for the groups its rows
    going home, where each member's are one range: hostops.wire_copies) neither pack nor unpack on
    gloo, as the host model counts: at U = 4, on the zigzag and on the balanced layout."""
    recs = [rec for part in ("hybrid", "balanced") for world in results[part] for recs in results[part][world]
            for rec in recs if rec.collectives[1][0] and "ulysses_size=4" in rec.case]
    for rec in recs:
        made, planned = rec.collectives
        assert made[1] <= planned[1] and made[2] <= planned[2], rec.case
    zigzag = [rec.collectives for rec in recs if "balanced" not in rec.case]
    balanced = [rec.collectives for rec in recs if "balanced" in rec.case]
    # measured: on the zigzag the output's return round unpacks nothing on every rank; on the
    # balanced layout some rounds neither pack nor unpack
    assert zigzag and all(made[2] < made[0] and planned[2] < planned[0] for made, planned in zigzag)
    assert balanced and any(made[1] < made[0] and made[2] < made[0] and planned[1] < planned[0]
                            for made, planned in balanced)


@pytest.mark.parametrize("world", [3, 4, 8])
def test_chunked_and_prefix_on_gloo_match_the_reference_and_move_the_planned_bytes(gloo, world):
    """The real distributed path (mask_cases.kinds_grid in the shared spawn): every mode, zigzag and
    balanced, each rank's outputs and gradients exact, its measured bytes the plan's."""
    per_rank = gloo["mask_kinds"][world]
    cases.assert_accurate(per_rank)
    cases.assert_bytes_as_expected(per_rank)
    assert len(per_rank[0]) == 2 * len(MODES) and all(rec.expected_bytes for rec in per_rank[0])


@pytest.mark.parametrize("world", [5, 6])
def test_memory_layouts_on_gloo_groups(gloo, world):
    per_rank = gloo["strides"][world]
    assert len(per_rank) == world and all(len(recs) == len(mask_cases.strides_cases(world, 1)) for recs in per_rank)
    failures = record_failures(per_rank)
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures[:20])
