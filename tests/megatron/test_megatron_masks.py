"""Masks through Megatron: a tiny GPTModel at CP 4 (and TP 2 x CP 2) with a sliding window
(``window_size``), end-of-document documents (``--reset-attention-mask``: sbhd PackedSeqParams
with per-sample document starts) on Megatron's zigzag and on each sample's balanced layout
(``--cp-layout balanced``: the batch split by :mod:`megatron_mesh.megatron.batch_layout`, RoPE
gathered at the layout's positions), and THD packing (TE's per-sequence CP layout,
``cu_seqlens`` real and padded) through every plugin mode -- Mesh (a tile and ``auto``), TASP,
ring, the Ulysses x Mesh hybrid and a per-layer mix -- and Mesh on its owners layout
(``--cp-layout owners``: blocks computed where the layout names) matches the same model at CP 1 with
Megatron's own attention and the equivalent dense mask: loss and every parameter gradient, rotary
positions."""

import pytest

pytest.importorskip("megatron.core", reason="needs megatron-core (scripts/setup_env.sh installs it)")

import megatron_cases  # noqa: E402

pytestmark = pytest.mark.megatron

LAYOUTS = [(1, 4), (2, 2)]  # (TP, CP)
LOSS_RTOL = 1e-5
GRAD_RTOL = 1e-5


MEGATRON_CASES = {"gpt_masked_equivalence": LAYOUTS,  # run in the one spawn shared with the other model tests
                  "gpt_mask_refusals": [(1, 4)]}


@pytest.fixture(scope="module")
def records(megatron_models):
    per_rank = megatron_models["gpt_masked_equivalence"]
    assert per_rank[0], "no cases ran"
    return per_rank


def test_masked_model_matches_cp1_reference(records):
    failures = megatron_cases.model_failures(records, LOSS_RTOL, GRAD_RTOL)
    assert not failures, "\n".join(failures)


def test_the_masks_matter(records):
    """Each reference's gradients differ from the same model's without its mask by far more than
    the tolerance: a layer that dropped the window or the documents would not match."""
    for rec in records[0]:
        assert rec["mask_effect"] > 100 * GRAD_RTOL, (rec["case"], rec["mask_effect"])
        assert rec["ref_loss"] != rec["unmasked_ref_loss"], rec["case"]


def test_every_mode_and_mask_ran(records):
    recs = records[0]
    got = {(r["tp"], r["cp"], r["what"], r["label"]) for r in recs}
    for what in ("window", "documents", "balanced", "thd", "chunked"):
        for label in ("mesh 2x2", "mesh auto", "tasp", "ring", "a2a+mesh U2 x M2", "a2a+mesh / mesh per layer"):
            assert (1, 4, what, label) in got
        for label in ("mesh 2x1", "ring"):
            assert (2, 2, what, label) in got
    # Mesh on its owners layout (--cp-layout owners): each sample's blocks computed where it names
    assert {r["label"]: r["owners"] for r in recs if r["what"] == "owners"} == {"mesh 2x2": [5, 3], "mesh auto": [5, 3]}
    for r in recs:
        if r["label"].startswith("a2a+mesh /"):
            assert r["modes"] == ["a2a+mesh", "mesh"]
        else:
            assert r["modes"] == [r["label"].split()[0]] * 2, (r["case"], r["modes"])


def test_masks_the_layers_would_not_apply_are_errors_not_wrong_losses(megatron_models):
    """A Python user's GPTModel at CP 4: documents on a batch split by Megatron's
    get_batch_on_this_cp_rank while the layers' layout is the balanced one, and a dense
    document mask without documents, stop with an error naming what to do (both ran with a wrong
    loss); Megatron's causal mask at the zigzag positions runs, with the mask-free loss."""
    for recs in megatron_models["gpt_mask_refusals"]:
        got = {r["case"]: r for r in recs}
        assert "this batch was not split by it" in got["balanced layout, zigzag split"]["error"]
        assert "cp_layout='zigzag'" in got["balanced layout, zigzag split"]["error"]
        assert "attention_mask masks other (query, key) pairs" in got["document mask, no documents"]["error"]
        assert got["causal mask"]["loss"] == got["no mask"]["loss"]
        assert got["window, causal mask"]["loss"] == got["window, no mask"]["loss"] != got["no mask"]["loss"]
