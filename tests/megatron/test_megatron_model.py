"""A tiny Megatron-Core GPTModel with context parallelism (CP 4, and TP 2 x CP 2) through the
plugin's layer spec: loss and every parameter gradient equal those of the same model at CP 1 with
Megatron's own attention, for Mesh (every tile), TASP, ring and a per-layer mode list, with
learned-absolute and rotary positions, MHA and GQA."""

import pytest

pytest.importorskip("megatron.core", reason="needs megatron-core (scripts/setup_env.sh installs it)")

import megatron_cases  # noqa: E402

pytestmark = pytest.mark.megatron

LAYOUTS = [  # (TP, CP, position embeddings, (query heads, KV heads))
    (1, 4, ["learned_absolute", "rope"], [(4, 4), (4, 2)]),
    (2, 2, ["rope"], [(4, 2)]),
]
LOSS_RTOL = 1e-5  # fp32: summation order differs between CP 4 and CP 1
GRAD_RTOL = 1e-5  # max |grad - ref| / max |ref| per parameter


MEGATRON_CASES = {"gpt_equivalence": LAYOUTS}  # run in the one spawn shared with the other model tests


@pytest.fixture(scope="module")
def records(megatron_models):
    per_rank = megatron_models["gpt_equivalence"]
    assert per_rank[0], "no cases ran"
    return per_rank


def _model_records(records):
    return [[rec for rec in recs if rec["label"] not in ("routing", "cpu_check")] for recs in records]


def test_cp_model_matches_cp1_reference(records):
    failures = megatron_cases.model_failures(_model_records(records), LOSS_RTOL, GRAD_RTOL)
    assert not failures, "\n".join(failures)


def test_every_mode_ran_through_the_plugin(records):
    recs = _model_records(records)[0]
    want = {"mesh 1x4", "mesh 2x2", "mesh 4x1", "mesh auto", "tasp", "tasp 2 nodes", "tasp alltoall", "ring",
            "per-layer mesh tasp"}
    assert want <= {rec["label"] for rec in recs if rec["cp"] == 4}
    assert {rec["label"] for rec in recs if rec["tp"] == 2} >= {"mesh 1x2", "mesh 2x1", "tasp", "ring"}
    for rec in recs:
        assert rec["attention_modules"] == ["PluginCoreAttention"], (rec["case"], rec["attention_modules"])
        expected = ["mesh", "tasp"] if rec["label"].startswith("per-layer") else [rec["label"].split()[0]] * 2
        assert rec["modes"] == expected, (rec["case"], rec["modes"])


def test_megatron_qkv_split_views_reach_the_plugin(records):
    """Megatron's QKV split hands core attention views of its fused projection (k and v of GQA
    without rotary positions: strided, head_dim stride 1); the model equivalence above holds with them."""
    recs = [rec for rec in _model_records(records)[0] if "learned_absolute heads=(4, 2)" in rec["case"]]
    assert recs and all({"k", "v"} <= set(rec["strided_inputs"]) for rec in recs), [
        (rec["case"], rec["strided_inputs"]) for rec in recs]


def test_mesh_rings_route_through_their_own_groups(records):
    """Tile 2x2 on CP ranks 0..3: Q rings {0, 1}, {2, 3}; KV rings {0, 2}, {1, 3} (global ranks,
    TP 1). Routing through them changes neither results nor counted bytes."""
    q_peer = {0: 1, 1: 0, 2: 3, 3: 2}
    kv_peer = {0: 2, 1: 3, 2: 0, 3: 1}
    for rank, recs in enumerate(records):
        (rec,) = [r for r in recs if r["label"] == "routing"]
        assert rec["flat_routes"] == {}
        assert rec["routes"] == sorted([q_peer[rank], kv_peer[rank]])
        assert rec["route_ranks"] == {q_peer[rank]: sorted([rank, q_peer[rank]]),
                                      kv_peer[rank]: sorted([rank, kv_peer[rank]])}
        assert rec["identical"], f"rank {rank}: routed and unrouted Mesh-Attention differ"
        assert rec["bytes"][0] == rec["bytes"][1] and rec["bytes"][0][0] > 0


def test_an_nccl_cp_group_is_checked_over_its_gloo_twin(records):
    """The plan check's all-reduce, read by the host, would wait for the GPU's queue once per call on
    an NCCL group; CPGroups gives each CP group a gloo twin of the same ranks and the check runs
    there (tests/megatron_cases._cpu_check, gloo standing in for NCCL): three calls, three checks,
    each on the twin; the same result; a rank with another softmax scale makes every rank raise."""
    for rank, recs in enumerate(records):
        (rec,) = [r for r in recs if r["label"] == "cpu_check"]
        assert not rec["is_cp_group"] and rec["twin_backend"] == "gloo"
        assert rec["twin_ranks"] == rec["cp_ranks"] == [0, 1, 2, 3]
        assert rec["checked_on"] == ["twin"] * 3, (rank, rec["checked_on"])
        assert rec["identical"]
        assert rec["mismatch"] and "softmax_scale: rank 0: 0.5" in rec["mismatch"], (rank, rec["mismatch"])
        assert rec["refused"] and "must hold the ranks of its group in the same order, [0, 1, 2, 3]" in rec["refused"]
        assert rec["after"], "destroy left the check on the twin"
