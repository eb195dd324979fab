"""The API under hostile distributed use (the last part of the shared 8-rank spawn, see
conftest.dist_results): ranks that disagree on the call -- mode, documents (a cached plan on some
ranks and a new one on others, or two cached plans whose transfers have the same shapes), softmax
scale, dtype, local shape, window, a hybrid's window, through the Megatron adapter's wrapped
communicator, one rank's bad input, one rank with another plugin version, one rank's own process
settings (the check off or bad, a bad mask piece) or grad mode (torch.no_grad()), the attention
sinks' kind, the value head dim -- fail at once on every
rank naming the difference, instead of hanging or returning a wrong result; a rank passing a group
it is not in gets an error naming the group; after destroy_process_group() and a new init with the
ranks swapped, group=None means the new group."""

import api_cases
import pytest
from api_cases import DOCS

import megatron_mesh as mm
from megatron_mesh.runtime import agreement

MISMATCH = "PlanMismatchError: the ranks of this CP group disagree on the attention plan"


@pytest.fixture(scope="module")
def results(dist_results):
    return [r["hostile"] for r in dist_results]


def test_ranks_that_disagree_on_the_plan_fail_naming_both(results):
    for rank, r in enumerate(results):
        msg = r["disagree"]
        assert msg.startswith(MISMATCH), msg
        assert "mode: rank 0: mesh (CP 8, tile 2x4" in msg and "ranks 1-7: mesh (CP 8, tile 1x8" in msg, msg
        assert r["agree"] == "ok"


def _docs(name: str) -> str:
    cu = DOCS[name]
    return f"3 [{' '.join(f'{a}:{b}' for a, b in zip(cu, cu[1:]))}]"


# call -> what every rank's PlanMismatchError must name (api_cases.disagreements, P = 8)
DIFFERENCES = {
    "documents_cached_vs_new": f"documents: rank 0: {_docs('A')}, ranks 1-7: {_docs('B')}",
    "documents_new_vs_cached": f"documents: rank 0: {_docs('B')}, ranks 1-7: {_docs('A')}",
    "documents_same_shape": f"documents: ranks 0-2, 4-7: {_docs('A')}, rank 3: {_docs('B')}",
    "documents_unseen": f"documents: rank 0: {_docs('C')}, ranks 1-7: {_docs('D')}",
    "softmax_scale": "softmax_scale: rank 0: 0.5, ranks 1-7: 0.35355339059327373",
    "dtype": "dtype: rank 0: bfloat16, ranks 1-7: float32",
    # rank 1's head dim also changes its default softmax scale 1/sqrt(head_dim)
    "local_shape": "local shape [s_local, batch, heads, head_dim]: rank 0: q [4, 2, 4, 8], k/v [4, 2, 2, 8], rank 1: "
                   "q [4, 1, 4, 16], k/v [4, 1, 2, 16], ranks 2-7: q [4, 1, 4, 8], k/v [4, 1, 2, 8]; softmax_scale: "
                   "ranks 0, 2-7: 0.35355339059327373, rank 1: 0.25",
    "window": "mask: rank 0: causal,window=3:0, ranks 1-7: causal,window=4:0",
    "chunk_size": "mask: rank 0: chunked=3, ranks 1-7: chunked=5",
    "prefix_length": "mask: ranks 0-3, 5-7: prefix=3, rank 4: prefix=2",
    "hybrid_window": "mask: ranks 0-4, 6-7: causal,window=3:0, rank 5: causal,window=4:0",
    "adapter": f"documents: rank 0: {_docs('B')}, ranks 1-7: {_docs('A')}",
    # rank 1's layout sets apart the hybrid's first and last documents (its span chunks' order)
    "balanced_hide": f"layout: ranks 0, 2-7: {mm.balanced_layout(api_cases.DOCS['A'], 8, group=2).text()}, rank 1: "
                     f"{mm.balanced_layout(api_cases.DOCS['A'], 8, group=2, hide=True).text()}",
    "sinks": "softmax offset (sinks): ranks 0, 2-7: fixed, rank 1: learnable",
    "sinks_on_some_ranks": "softmax offset (sinks): ranks 0-1, 3-7: fixed, rank 2: none",
    "value_head_dim": "local shape [s_local, batch, heads, head_dim]: rank 0: q [4, 1, 4, 8], k/v [4, 1, 2, 8], v head "
                      "dim 6, ranks 1-7: q [4, 1, 4, 8], k/v [4, 1, 2, 8]",
    # another plugin version on one node: same inputs, same plan digest, other plan code
    "plan_code": "plan code (version, source digest, tunables): rank 0: "
                 f"{agreement.plan_code().replace(agreement._source_digest(), api_cases.OTHER_SOURCE)}, ranks 1-7: "
                 f"{agreement.plan_code()}",
    # one rank's own process: the check off (it still joins the group's first check), torch.no_grad()
    "agreement_off_on_one_rank": f"{agreement.SWITCH}: ranks 0-1, 3-7: 1 (every call), rank 2: 0 (off)",
    "no_grad_on_one_rank": "backward: ranks 0-1, 3-7: yes, rank 2: no (grad mode off, or no input requires grad)",
}


@pytest.mark.parametrize("call", sorted(DIFFERENCES))
def test_every_rank_raises_naming_the_difference(results, call):
    """Each disagreement raises on every rank (none hangs, none returns) within seconds, and the
    message names exactly what differs: the plan's digest and the placement's repr are left out
    when a field they derive from differs."""
    for rank, r in enumerate(results):
        outcome, seconds = r["disagreements"][call]
        assert outcome.startswith(MISMATCH), (rank, outcome)
        assert outcome.endswith(": " + DIFFERENCES[call]), (rank, outcome)
        assert seconds < 10, (rank, call, seconds)


def test_agreeing_calls_between_the_disagreements_run(results):
    for r in results:
        d = r["disagreements"]
        assert [d[name][0] for name in ("documents_agree_A", "documents_agree_B", "hybrid_agree", "sinks_agree",
                                        "chunked_agree")] == ["ok"] * 5
        assert d["agreement_off_everywhere"][0] == "ok"  # every rank without the check: right, no hang
        assert d["after"][0] < 1e-12  # the group is still usable and right after every disagreement


@pytest.mark.parametrize("call, error", [
    ("bad_input_on_one_rank", "ValueError: window left must be an int >= 0 or None (unlimited), got -1"),
    ("bad_inner_on_one_rank", "ValueError: inner must be a mode with a Ulysses hybrid, one of mesh, tasp, ring; "
                              "got 'bogus'"),
    ("bad_gpus_per_node_on_one_rank", "ValueError: CP ranks per node (gpus_per_node) must be a positive divisor of "
                                      "the CP size 8, got 0"),
    ("bad_offset_on_one_rank", "ValueError: softmax_offset must have shape [4] (one logit per query head of q), "
                               "got [3]"),
    # one rank's own process settings, read where it still joins the check (they failed after it)
    ("agreement_bad_on_one_rank", "ValueError: MEGATRON_MESH_PLAN_AGREEMENT must be 1 (check every attention call, "
                                  "the default) or 0 (no check), got 'yes'"),
    ("mask_piece_bad_on_one_rank", "ValueError: MEGATRON_MESH_MASK_PIECE must be a positive integer, got '0'"),
])
def test_a_rank_with_bad_input_raises_it_and_the_others_name_it(results, call, error):
    """One rank's bad argument -- to attention() or to a wrapper (hybrid_attention's inner) -- or
    bad process setting raises there and, within seconds, a PlanMismatchError naming it on the
    others: none waits for it."""
    for rank, r in enumerate(results):
        outcome, seconds = r["disagreements"][call]
        if rank == 2:
            assert outcome == error
        else:
            assert outcome == f"{MISMATCH} (each must pass the same mode, settings, mask, layout, dtype, local shape, " \
                              f"softmax scale and kernel, in the same grad mode and with the same " \
                              f"MEGATRON_MESH_PLAN_AGREEMENT; running it would hang or return a wrong result): input: " \
                              f"ranks 0-1, 3-7: valid, rank 2: raised {error}"
        assert seconds < 10


def test_a_rank_outside_the_group_is_told_so(results):
    for rank in (2, 3):
        msg = results[rank]["not_member"]
        # not the placeholder's ranks, which torch makes up (they named an unrelated group)
        assert msg.startswith(f"ValueError: this process (global rank {rank}) is not a member of the process group it "
                              "was asked to attend over (torch.distributed.new_group was called without this rank)"), msg


def test_a_gloo_twin_given_on_one_rank_only_is_an_error_not_a_hang(results):
    """check_plans_over is collective: given on rank 0 alone, it raises there after its wait, naming
    the ranks that did not come, and keeps nothing (a reviewer's hang, stop 81); given on every rank,
    the calls are checked over the twin and ranks that disagree still raise, every one."""
    msg = results[0]["twin_on_one_rank"]
    assert msg.startswith("RuntimeError: check_plans_over: not every rank of the group gave it within 2 s -- call it "
                          "on every rank of the group, with the same groups ("), msg
    assert "1, 2, 3, 4, 5, 6, 7" in msg or "1-7" in msg, msg
    assert results[0]["twin_on_one_rank_kept"] is False
    for r in results:
        assert (r["twin_on_every_rank"], r["twin_kept"], r["twin_agree"]) == ("ok", True, "ok")
        assert r["twin_disagree"].startswith(MISMATCH) and "softmax_scale" in r["twin_disagree"], r["twin_disagree"]


def test_group_none_follows_a_reinitialised_process_group(results):
    for r in results:
        for name, err in r["reinit"].items():
            assert isinstance(err, float) and err < 1e-5, (name, err)
