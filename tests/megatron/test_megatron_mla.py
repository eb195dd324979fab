"""DeepSeek-style layers through Megatron on its zigzag and the balanced layout: a tiny GPTModel with
multi-latent attention (query/key head dim 24, value head dim 12, YaRN rotary applied by MLA at
each rank's positions), whole sequences and end-of-document documents, at CP 4 (mesh, tasp, ring,
a2a+mesh) on both layouts and TP 2 x CP 2 on the zigzag, matches the same model at CP 1 in loss and
every parameter gradient (tests/megatron_mla_cases.py, in the shared Megatron spawn). On the
balanced layout MLA's own rotary (YaRN, and plain RoPE with documents under mesh and a2a+mesh)
rotates each token at its global position (the hook batch_layout.follow_layout puts on it)."""

import pytest

pytest.importorskip("megatron.core", reason="needs megatron-core (scripts/setup_env.sh installs it)")

import megatron_cases  # noqa: E402

pytestmark = pytest.mark.megatron

# run in the one spawn shared with the other model tests; per rank, one record per case
MEGATRON_CASES = {"gpt_mla_equivalence": [(1, 4), (2, 2)]}  # (TP, CP)
RTOL = 1e-5


def test_mla_with_yarn_on_both_layouts_matches_cp1(megatron_models):
    per_rank = megatron_models["gpt_mla_equivalence"]
    failures = megatron_cases.model_failures(per_rank, RTOL, RTOL)
    assert per_rank[0] and not failures, failures
    got = {(r["tp"], r["cp"], r["what"], r["layout"], r["rope"], r["label"]) for r in per_rank[0]}
    for what in ("whole", "documents"):
        for layout in ("zigzag", "balanced"):
            assert {(1, 4, what, layout, "yarn", m) for m in ("mesh", "tasp", "ring", "a2a+mesh")} <= got, got
        assert {(2, 2, what, "zigzag", "yarn", m) for m in ("mesh 2x1", "ring")} <= got, got
    assert {(1, 4, "documents", "balanced", "rope", m) for m in ("mesh", "a2a+mesh")} <= got, got
    assert {(1, 4, "documents", "balanced", "yarn", m) for m in ("a2a+tasp", "a2a+ring")} <= got, got
    assert (2, 2, "documents", "balanced", "yarn", "mesh 2x1") in got, got
    for r in per_rank[0]:
        assert r["kinds"] == ["PluginCoreAttention"], r
        assert r["modes"] == [r["label"].split()[0]] * 2, r
