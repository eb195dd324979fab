"""The next micro-batch's layouts and plans, built ahead of its step (batch_layout.Lookahead,
runtime.api.prebuild): the items come out in order and once, errors where their item is asked
for, the Lookahead goes below Megatron's replay buffer, and a prebuilt plan is the one the next
call runs -- its rank's op lists already built. (The real runs through both entry scripts are
in test_megatron_pretrain_masks.py.)"""

from __future__ import annotations

import threading

import pytest
import torch

pytest.importorskip("megatron.core", reason="needs megatron-core (scripts/setup_env.sh installs it)")

import megatron_mesh as mm  # noqa: E402
from megatron_mesh.comm.inprocess import run_inprocess  # noqa: E402
from megatron_mesh.megatron.batch_layout import Lookahead, _ahead  # noqa: E402
from megatron_mesh.runtime.api import prebuild, prepare  # noqa: E402


def test_items_come_out_in_order_once_and_each_is_warmed():
    warmed, threads = [], set()

    def warm(item):
        warmed.append(item)
        threads.add(threading.current_thread().name)

    it = Lookahead(iter(range(6)), warm)
    assert list(it) == list(range(6))
    assert warmed == list(range(6))
    assert threads == {"megatron_mesh-lookahead"}  # never on the consumer's thread
    with pytest.raises(StopIteration):  # done stays done
        next(it)


def test_an_error_is_raised_where_its_item_is_asked_for_and_warm_errors_are_left_to_the_step():
    def source():
        yield 0
        yield 1
        raise ValueError("item 2 is bad")

    def warm(item):
        if item == 1:
            raise RuntimeError("the step will work this out again and raise it there")

    it = Lookahead(source(), warm)
    assert next(it) == 0 and next(it) == 1
    with pytest.raises(ValueError, match="item 2 is bad"):
        next(it)


def test_the_lookahead_goes_below_the_replay_buffer():
    from megatron.core.rerun_state_machine import RerunDataIterator

    rerun = RerunDataIterator(iter([{"i": 0}, {"i": 1}, {"i": 2}]))
    wrapped = _ahead([rerun, None], lambda item: None)
    assert wrapped[0] is rerun and isinstance(rerun.iterable, Lookahead) and wrapped[1] is None
    assert _ahead(rerun, lambda item: None).iterable is rerun.iterable  # once
    assert [next(rerun)["i"] for _ in range(3)] == [0, 1, 2]


def test_a_prebuilt_plan_is_the_one_the_next_call_runs():
    """Two ranks, TASP on the balanced layouts of two samples: after a call on the first, prebuild
    of the second builds this rank's plan; the call on the second gets that plan, its op lists
    already there, and the result is the dense reference's."""
    P, T = 2, 16
    first = mm.balanced_layout([0, 20, 26, 32], P)
    second = mm.balanced_layout([0, 5, 29, 32], P)
    assert first != second
    g = torch.Generator().manual_seed(0)
    Q, K, V = (torch.randn(P * T, 1, 2, 8, generator=g, dtype=torch.float64) for _ in range(3))

    def rank_fn(rank, comm):
        shard = lambda x, layout: mm.layout_shard(x, rank, layout)  # noqa: E731
        mm.attention(*(shard(x, first) for x in (Q, K, V)), mode="tasp", comm=comm, layout=first,
                     window=[None, 0])  # a list, as users pass it: remembered as a tuple
        built = prebuild(second)
        q, k, v = (shard(x, second) for x in (Q, K, V))
        plan = prepare(q, k, v, mode="tasp", comm=comm, layout=second, window=(None, 0)).plan
        ahead = rank in plan._cache  # prepare builds no op lists: only prebuild could have
        out = mm.attention(q, k, v, mode="tasp", comm=comm, layout=second, window=(None, 0))
        return built, ahead, out

    results = run_inprocess(rank_fn, P, timeout=120)
    assert all(built >= 1 and ahead for built, ahead, _ in results), [r[:2] for r in results]
    from megatron_mesh.kernels import reference_attention
    from megatron_mesh.plan import Mask

    want = reference_attention(Q, K, V, mask=Mask(True, None, second.documents()))
    for rank, (_, _, out) in enumerate(results):
        torch.testing.assert_close(out, mm.layout_shard(want, rank, second), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("off, layout, wrapped", [(False, "balanced", True), (True, "balanced", False),
                                                  (False, "zigzag", False)])
def test_pretrain_builds_its_iterators_with_the_lookahead_where_it_applies(monkeypatch, off, layout, wrapped):
    """install_lookahead wraps what Megatron's builder returns -- under --cp-layout balanced with
    documents from the batch at CP > 1, unless --no-cp-layout-lookahead -- and nothing else."""
    import argparse

    from megatron_mesh.megatron import batch_layout, ensure_typing_override
    from megatron_mesh.megatron.process import ProcessState

    ensure_typing_override()  # megatron.training needs typing.override (Python 3.12) on 3.11
    from megatron.core.rerun_state_machine import RerunDataIterator
    from megatron.training import global_vars, training

    built = (RerunDataIterator(iter([{"i": 0}])), [RerunDataIterator(iter([{"i": 1}]))], None)
    monkeypatch.setattr(training, "build_train_valid_test_data_iterators", lambda provider: built)
    args = argparse.Namespace(context_parallel_size=2, cp_layout=layout, reset_attention_mask=True,
                              reset_position_ids=True, no_cp_layout_lookahead=off, cp_thd_packing=False)
    monkeypatch.setattr(global_vars, "_GLOBAL_ARGS", args)
    batch_layout.install_lookahead(ProcessState(batch_documents=True))  # run_script's: documents from the position ids
    train, valid, test = training.build_train_valid_test_data_iterators(None)
    assert test is None
    assert isinstance(train.iterable, Lookahead) is wrapped and isinstance(valid[0].iterable, Lookahead) is wrapped
    assert next(train) == {"i": 0} and next(valid[0]) == {"i": 1}
