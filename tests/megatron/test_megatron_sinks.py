"""gpt-oss-style layers through Megatron: a tiny GPTModel whose layers have attention sinks
(``softmax_type`` learnable / off-by-one, Megatron's ``softmax_offset``) and alternate a sliding
window with full attention, GQA, with and without end-of-document documents (Megatron's zigzag and
the balanced layout), at CP 4 (mesh, tasp, ring, the three Ulysses hybrids, a per-layer list) and TP 2 x CP 2,
matches CP 1 -- Megatron's own DotProductAttention where it applies the mask -- in loss and in
every parameter gradient, the sinks' included (tests/megatron_sink_cases.py, in the shared
Megatron spawn). The learnable sinks are Megatron's parameter: the same name, shape, local heads
under TP and distributed-checkpoint entry.
"""

import pytest

pytest.importorskip("megatron.core", reason="needs megatron-core (scripts/setup_env.sh installs it)")

import megatron_cases  # noqa: E402

pytestmark = pytest.mark.megatron

LAYOUTS = [(1, 4), (2, 2)]  # (TP, CP)
RTOL = 1e-5

# run in the one spawn shared with the other model tests; per rank, one record per case
MEGATRON_CASES = {"gpt_sinks_equivalence": LAYOUTS}


@pytest.fixture(scope="module")
def records(megatron_models):
    assert megatron_models["gpt_sinks_equivalence"][0], "no cases ran"
    return megatron_models["gpt_sinks_equivalence"]


def test_sinks_with_alternating_windows_match_cp1(records):
    """Loss and every parameter gradient (the sinks' included) of every case = its CP 1 reference."""
    assert not megatron_cases.model_failures(records, RTOL, RTOL), megatron_cases.model_failures(records, RTOL, RTOL)


def test_every_mode_layout_and_sink_kind_ran(records):
    got = {(r["tp"], r["cp"], r["softmax_type"], r["what"], r["label"]) for r in records[0]}
    for what in ("plain", "zigzag", "balanced"):
        for label in ("mesh", "tasp", "ring", "a2a+mesh"):
            assert (1, 4, "learnable", what, label) in got
        for label in ("mesh 2x1", "ring"):
            assert (2, 2, "learnable", what, label) in got
    for label in ("a2a+tasp", "a2a+ring", "a2a+mesh / ring per layer"):
        assert (1, 4, "learnable", "plain", label) in got
    for what in ("plain", "zigzag"):
        assert (1, 4, "off-by-one", what, "tasp") in got
    for r in records[0]:
        assert r["windows"] == [(5, 0), None], r["case"]  # layer 1 windowed, layer 2 full (skip frequency 2)
        if r["label"].endswith("per layer"):
            assert r["modes"] == ["a2a+mesh", "ring"]
        if r["what"] == "balanced":  # one layout per sample for both layers, balancing their summed work
            assert r["stacked"] and all("stack" in names for names in r["stacked"]), (r["case"], r["stacked"])
            assert any("full" not in names for names in r["stacked"]), (r["case"], r["stacked"])


def test_learnable_sinks_are_megatrons_parameter(records):
    """Local heads under TP (4 heads: 4 per rank at TP 1, 2 at TP 2); a nonzero gradient that
    the CP ranks' shares sum to; the checkpoint entry of Megatron's own module (same key, global
    shape and TP shard); off-by-one is a fixed tensor with no entry."""
    for recs in records:
        for r in recs:
            heads = 4 // r["tp"]
            assert r["offsets"] == [[heads], [heads]], r["case"]
            if r["softmax_type"] == "off-by-one":
                assert r["entries"] == {} and not r["sink_grad"], r["case"]
                continue
            assert len(r["sink_grad"]) == 2 and all(any(abs(x) > 1e-6 for x in g) for g in r["sink_grad"]), r["case"]
            keys = sorted(r["entries"])
            assert keys == [f"decoder.layers.{i}.self_attention.core_attention.softmax_offset" for i in (0, 1)], keys
            for shape, offset, local, kind in r["entries"].values():  # [layers, heads], this TP rank's heads
                assert (shape, local, kind) == ([2, 4], [heads], "ShardedTensor"), r["entries"]
            if r["ref_entries"] is not None:  # Megatron's DotProductAttention at CP 1
                assert r["entries"] == r["ref_entries"], (r["case"], r["entries"], r["ref_entries"])
