"""The API under hostile distributed use (the last part of the shared 8-rank spawn, see
conftest.dist_results): ranks that disagree on the
plan fail at once on every rank naming both plans, instead of hanging until gloo's 30-minute
timeout; a rank passing a group it is not in gets an error naming the group; after
destroy_process_group() and a new init with the ranks swapped, group=None means the new group."""

import pytest


@pytest.fixture(scope="module")
def results(dist_results):
    return [r["hostile"] for r in dist_results]


def test_ranks_that_disagree_on_the_plan_fail_naming_both(results):
    for rank, r in enumerate(results):
        msg = r["disagree"]
        assert msg.startswith("PlanMismatchError: the ranks of this CP group disagree on the attention plan"), msg
        assert "mesh tile 2x4" in msg and "mesh tile 1x8" in msg, msg
        assert r["agree"] == "ok"


def test_a_rank_outside_the_group_is_told_so(results):
    for rank in (2, 3):
        msg = results[rank]["not_member"]
        assert msg.startswith(f"ValueError: this process (global rank {rank}) is not a member of the process group "
                              "[0, 1]"), msg


def test_group_none_follows_a_reinitialised_process_group(results):
    for r in results:
        for name, err in r["reinit"].items():
            assert isinstance(err, float) and err < 1e-5, (name, err)
