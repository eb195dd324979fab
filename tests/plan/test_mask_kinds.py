"""The open mask (plan/maskkinds): chunked and prefix attention, each with documents, as the plan
layer sees them -- the rule, its key intervals and vectorised form agree; block classification is
exactly the mask; every mode's plan covers exactly the allowed pairs at P <= 8 on the zigzag and
the balanced layout and moves fewer bytes than the causal plan; chunked attention with one chunk
per rank moves at most a window's halo; the balanced layout balances the kind's work; the text
form round-trips (agreement tells two chunk sizes apart); compositions and bad input; the
planner's --mask."""

from __future__ import annotations

import itertools
import pickle

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from helpers import assert_blocks_exact

from megatron_mesh import masks
from megatron_mesh.plan import MODES, AttentionShape, Mask, ZigzagLayout, plan_bytes, resolve
from megatron_mesh.plan.balance import balanced_layout
from megatron_mesh.plan.docwork import max_work, zigzag_runs
from megatron_mesh.plan.maskkinds import Chunked, MaskKind, Prefix, mask_from_text
from megatron_mesh.plan.validate import validate_plan

SHAPE = dict(batch=1, heads=4, kv_heads=2, head_dim=8, itemsize=2)


def _kinds(S: int, docs) -> list[MaskKind]:
    return [Chunked(3, docs), Chunked(S // 2, docs), Prefix(2, docs), Prefix(5, docs),
            Mask(True, (3, 0), docs), Mask(False, (2, 1), docs)]


def _docs(S: int, cuts) -> tuple | None:
    cu = [0, *sorted(set(cuts)), S]
    return None if len(cu) == 2 else tuple(zip(cu, cu[1:]))


@settings(max_examples=40, deadline=None)
@given(S=st.integers(2, 24), data=st.data())
def test_rule_key_intervals_and_vectorised_form_agree(S, data):
    docs = _docs(S, data.draw(st.lists(st.integers(1, S - 1), max_size=3)))
    pos = np.arange(S)
    for m in _kinds(S, docs):
        dense = m.allowed(pos, pos)
        for i in range(S):
            want = [j for j in range(S) if m.allows(i, j)]
            assert [j for j in range(S) if dense[i, j]] == want, (m, i)
            assert [j for a, b in m.key_intervals(i, S) for j in range(a, b)] == want, (m, i)


def test_the_kinds_mean_what_their_docs_say():
    """chunked(4) over documents [0, 6), [6, 16): chunks from each document's start; prefix(2) over
    [0, 4), [4, 10): both ways inside the first 2 tokens, causal after (module docstrings)."""
    c = Chunked(4, ((0, 6), (6, 16)))
    assert c.key_intervals(12, 16) == ((10, 13),) and c.key_intervals(5, 16) == ((4, 6),)
    p = Prefix(2, ((0, 4), (4, 10)))
    assert [p.key_intervals(i, 10) for i in (0, 1, 5, 8)] == [((0, 2),), ((0, 2),), ((4, 6),), ((4, 9),)]
    # a document shorter than the prefix is bidirectional as a whole
    assert Prefix(8, ((0, 3), (3, 20))).key_intervals(0, 20) == ((0, 3),)


@pytest.mark.parametrize("m", [Chunked(3), Chunked(5), Prefix(0), Prefix(4), Prefix(40), Mask(True, (2, 0))])
def test_span_work_counts_the_allowed_pairs(m):
    """Each kind's closed form (and the generic one of the protocol) equals the pairs counted."""
    L = 23
    for a, b in itertools.combinations(range(L + 1), 2):
        want = sum(1 for i in range(a, b) for j in range(L) if m.allows(i, j))
        assert m.span_work(a, b, L) == want == MaskKind.span_work(m, a, b, L), (m, a, b)


def _layouts(P: int, S: int, cu, kind):
    return {"zigzag": ZigzagLayout(P, S), "balanced": balanced_layout(cu, P, mask=kind)}


@settings(max_examples=30, deadline=None)
@given(P=st.integers(1, 5), half=st.integers(1, 4), data=st.data())
def test_block_classification_is_exactly_the_mask(P, half, data):
    S = 2 * P * half
    cuts = data.draw(st.lists(st.integers(1, S - 1), max_size=3)) if S > 1 else []
    kind = data.draw(st.sampled_from([Chunked(data.draw(st.integers(1, S))), Prefix(data.draw(st.integers(1, S)))]))
    cu = [0, *sorted(set(cuts)), S]
    for layout in _layouts(P, S, cu, kind).values():
        assert_blocks_exact(kind.with_documents(tuple(zip(cu, cu[1:]))), layout)


def _settings(mode: str, P: int) -> dict:
    U = 2 if P % 2 == 0 and P > 2 else 1
    return {"mesh": dict(tile=(2, P // 2)) if P % 2 == 0 else {}, "a2a+mesh": dict(ulysses_size=U, tile=(P // U, 1)),
            "a2a+ring": dict(ulysses_size=U), "a2a+tasp": dict(ulysses_size=U)}.get(mode, {})


def _chunk_kinds(T: int) -> list[MaskKind]:
    """chunked smaller than, equal to and larger than a rank's chunk of T tokens, and prefix."""
    return [Chunked(T // 2 + 1), Chunked(T), Chunked(2 * T + 1), Prefix(T + 1)]


@pytest.mark.parametrize("P", range(1, 9))
def test_every_mode_covers_exactly_the_allowed_pairs_and_moves_less_than_causal(P):
    """Exact cover (validate_plan: each allowed pair once, forward and backward, nothing else) for
    every mode on the zigzag and the balanced layout, chunked and prefix with documents; the
    bytes never exceed the causal plan's on the same documents."""
    T = 12
    S = P * T
    cu = [0, 5, S // 2 + 3, S] if S > 12 else [0, 5, S]
    docs = tuple(zip(cu, cu[1:]))
    shape = AttentionShape(T, **SHAPE)
    for kind, mode in itertools.product(_chunk_kinds(T), MODES):
        placement = resolve(mode, P, shape, **_settings(mode, P))
        for name, layout in _layouts(P, S, cu, kind).items():
            mask = None if name == "balanced" else kind.with_documents(docs)
            plan = placement.build(shape, mask if mask is not None else kind, layout)
            validate_plan(plan)
            causal = placement.build(shape, Mask(True, None, None if name == "balanced" else docs), layout)
            got, base = plan_bytes(plan, shape), plan_bytes(causal, shape)
            if kind.causal:  # a subset of the causal pairs: never more bytes
                assert sum(b.sent for b in got) <= sum(b.sent for b in base), (mode, name, kind)


@pytest.mark.parametrize("P", range(2, 9))
def test_chunked_with_one_chunk_per_rank_moves_at_most_a_windows_halo(P):
    """chunk = S / P on the zigzag: a query sees at most chunk - 1 keys before it, as under the
    window (chunk - 1, 0); the plan moves at most that window's halo, on every rank, every mode.
    What moves: the zigzag gives rank r halves r and 2P-1-r; chunk c is halves 2c and 2c+1, so the
    rank holding half 2c+1 pulls half 2c (all of it: its last query sees it all) and returns its
    dK/dV -- half a rank's chunk, where the window also pulls into the half before that."""
    T = 8
    S = P * T
    shape = AttentionShape(T, **SHAPE)
    for mode in MODES:
        placement = resolve(mode, P, shape, **_settings(mode, P))
        chunked = plan_bytes(placement.build(shape, Chunked(S // P), None), shape)
        window = plan_bytes(placement.build(shape, Mask(True, (S // P - 1, 0)), None), shape)
        assert all(c.sent <= w.sent and c.received <= w.received for c, w in zip(chunked, window)), (mode, chunked, window)
        if mode == "ring":  # half a chunk of K and V in, its dK/dV back (fp32) on the ranks holding an odd half
            kv = 2 * (T // 2) * shape.kv_heads * shape.head_dim
            assert max(c.received for c in chunked) <= kv * shape.itemsize + kv * 4


def test_the_balanced_layout_balances_the_kinds_work():
    P, S = 8, 8 * 256
    cu = [0, 900, 1000, 1400, 1900, S]
    for kind in (Chunked(64), Prefix(300)):
        layout = balanced_layout(cu, P, mask=kind)
        units = [tuple((a, n) for _, a, n in layout.runs(r)) for r in range(P)]
        bounds = tuple(zip(cu, cu[1:]))
        total = sum(kind.span_work(0, b - a, b - a) for a, b in bounds)
        got = max_work(units, bounds, kind)
        assert got <= max_work(zigzag_runs(S, P), bounds, kind)
        assert got <= 1.05 * total / P, (kind, got, total / P)


def test_text_hash_and_pickle_tell_kinds_and_sizes_apart():
    docs = ((0, 6), (6, 16))
    kinds = [Chunked(4, docs), Chunked(5, docs), Prefix(4, docs), Prefix(5), Mask(True, (4, 0), docs)]
    for m in kinds:
        assert mask_from_text(m.text()) == m and Mask.from_text(m.text()) == m
        assert hash(mask_from_text(m.text())) == hash(m) and pickle.loads(pickle.dumps(m)) == m
    assert len({m.text() for m in kinds}) == len({hash(m) for m in kinds}) == len(kinds)
    with pytest.raises(ValueError, match="unknown mask kind 'banded'; known: causal, chunked, full, prefix"):
        mask_from_text("banded=3")


@pytest.mark.parametrize("make, match", [
    (lambda: masks.chunked(0), r"chunk size \(tokens per chunk\) must be an int > 0, got 0"),
    (lambda: masks.chunked(-3), r"chunk size \(tokens per chunk\) must be an int > 0, got -3"),
    (lambda: masks.chunked(2.5), r"chunk size must be an integer, got 2.5"),
    (lambda: masks.prefix(-1), r"prefix length \(tokens per document attending both ways\) must be an int >= 0, got -1"),
    (lambda: masks.documents([0, 5, 5, 9]), r"cu_seqlens must be integers strictly increasing from 0"),
    (lambda: masks.causal() & masks.prefix(3), r"causal & prefix=3: causal would remove prefix's bidirectional"),
    (lambda: masks.window(8) & masks.chunked(4), r"causal,window=8:0 & chunked=4: a window with chunked"),
    (lambda: masks.prefix(2) & masks.window(3, 3), r"full,window=3:3 & prefix=2: a window with prefix"),
    (lambda: masks.chunked(4) & masks.prefix(2), r"chunked=4 & prefix=2: two mask kinds other than"),
    (lambda: masks.documents([0, 4, 8]) & masks.documents([0, 3, 8]), r"two different sets of documents"),
    (lambda: masks.chunked(4) & 3, r"a mask combines with & only with another mask"),
])
def test_bad_masks_and_compositions_name_the_value(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_the_supported_compositions():
    cu = [0, 4, 8]
    docs = ((0, 4), (4, 8))
    assert masks.documents(cu) & masks.chunked(3) == masks.chunked(3) & masks.documents(cu) == Chunked(3, docs)
    assert masks.documents(cu) & masks.causal() == Mask(True, None, docs)
    assert masks.documents(cu) == Mask(False, None, docs)  # full attention inside each document
    assert masks.full() & masks.prefix(2) & masks.documents(cu) == Prefix(2, docs)
    assert masks.causal() & masks.chunked(3) == Chunked(3)
    assert masks.causal() & masks.window(4, 4) == masks.window(4) == Mask(True, (4, 0))
    assert masks.window(4, 2) & masks.window(2, 6) == Mask(False, (2, 2))
    # a chunk or a prefix covering every document is the band kind (dense plans apply)
    assert Chunked(8).normalized(8) == Mask(True) and Prefix(8).normalized(8) == Mask(False)
    assert Prefix(0, docs).normalized(8) == Mask(True, None, docs)


def test_the_planner_takes_mask_specs(capsys):
    from megatron_mesh.tools.plan_cli import main
    assert main(["--cp", "4", "--seq-len", "4096", "--heads", "8", "--kv-heads", "2", "--docs", "lognormal:512,1",
                 "--mask", "chunked:256", "--modes", "ring,tasp", "--layout", "all"]) == 0
    out = capsys.readouterr().out
    assert "chunked=256" in out and "balanced  ring" in out and "zigzag    tasp" in out
    assert "te-p2p (thd), te-a2a+p2p (thd): Transformer Engine has no chunked mask" in out
    for argv, match in [(["--mask", "chunked:0"], "chunk size (tokens per chunk) must be an int > 0"),
                        (["--mask", "sliding:4"], "must be one of chunked:N, prefix:N"),
                        (["--mask", "prefix:4", "--window", "8"], "replaces --no-causal and --window")]:
        assert main(argv) == 2  # one line, exit status 2
        err = capsys.readouterr().err
        assert match in err and err.count("\n") == 1, err


def test_vectorised_worked_example():
    """plan/maskkinds/vectorised.py's example: prefix(2) over one document of 4 tokens."""
    pos = np.arange(4)
    got = masks.prefix(2).allowed(pos, pos)
    assert got.tolist() == [[True, True, False, False], [True, True, False, False],
                            [True, True, True, False], [True, True, True, True]]
