"""Large masked blocks run as mask pieces (runtime/masks.py): the worked examples of the module
and of mask_pieces, each piece's kernel mask against the mask rule pair by pair, every allowed pair
in exactly one call, and pieced forward/backward equal to one dense masked kernel call in fp64
(documents, windows, padding, zigzag runs)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_mesh.kernels import BlockMask, MathKernel, TorchAttentionKernel
from megatron_mesh.plan import Mask
from megatron_mesh.plan.mask import BlockKind, call_groups, cut_runs, mask_pieces
from megatron_mesh.runtime.masks import PIECE_ENV, PiecedMask, _pieced, block_backward, block_forward, mask_piece

CPU = torch.device("cpu")


def _positions(runs):
    return torch.cat([torch.arange(a, a + n) for a, n in runs])


def test_worked_example_of_the_module_docstring():
    """4096 x 4096 causal block, window 512, documents [0, 1000) and [1000, 4096), pieces of 512:
    each document cut apart and into pieces of 512 from its start -- 9 causal diagonal pieces, 7
    masked by the window's edge just below them, none across the document edge -- 16 pieces; a
    variable-length kernel runs the first document's last diagonal piece and the second's first,
    which follow each other, in one call: 15 calls."""
    mask = Mask.from_cu_seqlens([0, 1000, 4096], 4096, True, (512, 0)).normalized(4096)
    pieced = _pieced(mask, ((0, 4096),), ((0, 4096),), 512, CPU)
    starts = [0, 512] + list(range(1000, 4096, 512))
    diagonal = {(a, min(a + 512, 1000 if a < 1000 else 4096)) for a in starts}
    assert len(pieced.pieces) == 16
    assert {t.rows for t in pieced.pieces if t.mask.kind == "causal"} == diagonal
    assert all(t.rows == t.cols for t in pieced.pieces if t.mask.kind == "causal")
    masked = [t for t in pieced.pieces if t.mask.kind == "masked"]
    assert {t.cols for t in masked} == diagonal - {(512, 1000), (4072, 4096)}  # the window's edge below each
    assert all(t.rows[0] == t.cols[1] for t in masked)
    assert all(not (t.rows[0] < 1000 < t.rows[1] or t.cols[0] < 1000 < t.cols[1]) for t in pieced.pieces)
    assert max(t.mask.allowed.numel() for t in masked) == 512 * 512
    assert len(pieced.groups("varlen")) == 15 and len(pieced.groups("piece")) == 16


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_piece_mask_agrees_with_the_rule(data):
    """Every piece's kernel mask against the rule pair by pair (:meth:`Mask.allows`, one pair at a
    time): no piece = no allowed pair; full = all; causal = exactly j <= i on identical ranges;
    masked = the allowed matrix itself; with pieces as large as the block, one piece per pair of
    document runs (the block's runs are cut where a document ends), together covering every
    allowed pair once."""
    S = data.draw(st.integers(8, 40))
    cuts = sorted(data.draw(st.sets(st.integers(1, S - 1), max_size=4)))
    gap = data.draw(st.booleans())  # padding after each document (THD-like)
    docs = [(a, b - (1 if gap and b - a > 1 else 0)) for a, b in zip([0] + cuts, cuts + [S])]
    causal = data.draw(st.booleans())
    left = data.draw(st.one_of(st.none(), st.integers(0, S)))
    right = 0 if causal else data.draw(st.one_of(st.none(), st.integers(0, S)))
    mask = Mask(causal, (left, right), tuple(docs)).normalized(S)
    qa, ka = data.draw(st.integers(0, S - 1)), data.draw(st.integers(0, S - 1))
    n, m = data.draw(st.integers(1, S - qa)), data.draw(st.integers(1, S - ka))
    if data.draw(st.booleans()):
        ka, m = qa, n
    allowed = torch.tensor([[mask.allows(i, j) for j in range(ka, ka + m)] for i in range(qa, qa + n)])
    pieces = _pieced(mask, ((qa, n),), ((ka, m),), max(n, m), CPU).pieces
    assert [kind for kind, _, _ in mask_pieces(mask, ((qa, n),), ((ka, m),), max(n, m))] == \
        [p.mask.kind for p in pieces]
    covered = torch.zeros(n, m, dtype=torch.int64)
    for got in pieces:
        (r0, r1), (c0, c1) = got.rows, got.cols
        sub = allowed[r0:r1, c0:c1]
        if got.mask.kind == "full":
            assert sub.all()
            covered[r0:r1, c0:c1] += 1
        elif got.mask.kind == "causal":
            assert (qa + r0, r1 - r0) == (ka + c0, c1 - c0)
            assert torch.equal(sub, torch.tril(torch.ones(r1 - r0, r1 - r0, dtype=torch.bool)))
            covered[r0:r1, c0:c1] += sub
        else:
            assert torch.equal(got.mask.allowed, sub)
            covered[r0:r1, c0:c1] += sub
    assert torch.equal(covered, allowed.to(torch.int64))  # every allowed pair in exactly one piece


def _problem(seed: int, runs_q, runs_k, mask: Mask, heads=4, kv_heads=2, d=8):
    g = torch.Generator().manual_seed(seed)
    sq, sk = sum(n for _, n in runs_q), sum(n for _, n in runs_k)
    q = torch.randn(2, heads, sq, d, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, kv_heads, sk, d, generator=g, dtype=torch.float64) for _ in range(2))
    dout = torch.randn(2, heads, sq, d, generator=g, dtype=torch.float64)
    dense = BlockMask("masked", mask.allowed(_positions(runs_q), _positions(runs_k)))
    return q, k, v, dout, dense


def test_pieced_block_equals_one_dense_masked_call():
    """A zigzag-like block (two query runs, two key runs of another chunk and this one) under
    documents with padding gaps + a window, pieces of 3, 5, 7 and 64 tokens (runs cut unevenly):
    out, lse and the gradients given the rows' statistics equal one dense masked call, with
    torch's CPU kernel and the math kernel, fp64."""
    S = 96
    mask = Mask(True, (11, 0), ((0, 9), (9, 30), (33, 60), (60, 61), (64, 96))).normalized(S)
    runs_q = ((12, 12), (72, 12))
    runs_k = ((0, 12), (84, 12), (12, 12), (72, 12))
    for kernel in (TorchAttentionKernel("cpu"), MathKernel()):
        q, k, v, dout, dense = _problem(0, runs_q, runs_k, mask)
        want_out, want_lse = kernel.forward(q, k, v, mask=dense, scale=0.3)
        delta = (dout * want_out).sum(-1)
        want = kernel.backward(dout, q, k, v, want_lse, delta, mask=dense, scale=0.3)
        for piece in (3, 5, 7, 64):
            pieced = _pieced(mask, runs_q, runs_k, piece, CPU)
            assert isinstance(pieced, PiecedMask) and pieced.pieces
            out, lse = block_forward(kernel, q, k, v, pieced, 0.3, torch.float64)
            torch.testing.assert_close(out, want_out.to(out.dtype), rtol=1e-10, atol=1e-10)
            torch.testing.assert_close(lse, want_lse.to(lse.dtype), rtol=1e-10, atol=1e-10)
            got = block_backward(kernel, dout, q, k, v, want_lse, delta, pieced, 0.3, torch.float64)
            for name, a, b in zip(("dq", "dk", "dv"), got, want):
                torch.testing.assert_close(a, b.to(a.dtype), rtol=1e-10, atol=1e-10, msg=f"{kernel.name} {piece} {name}")


def test_pieces_cut_the_buffer_across_runs():
    """Pieces are consecutive buffer tokens (a piece may span runs): many short documents make few
    kernel calls."""
    assert cut_runs(((10, 5), (40, 3)), 2) == [(0, ((10, 2),), 2), (2, ((12, 2),), 2), (4, ((14, 1), (40, 1)), 2),
                                               (6, ((41, 2),), 2)]
    runs = tuple((16 * d, 1) for d in range(2000))  # THD-like: one token of each of 2000 padded documents
    mask = Mask(True, (None, 0), tuple((16 * d, 16 * d + 3) for d in range(2000))).normalized(32000)
    # each token sees only itself: the 4 diagonal pieces (512, 512, 512, 464 tokens), one masked call each
    assert mask_pieces(mask, runs, runs, 512) == [(BlockKind.MASKED, (r, min(r + 512, 2000)), (r, min(r + 512, 2000)))
                                                  for r in range(0, 2000, 512)]


def test_piece_setting(monkeypatch):
    monkeypatch.delenv(PIECE_ENV, raising=False)
    assert mask_piece(CPU) == 512 and mask_piece(torch.device("cuda", 0)) == 2048
    monkeypatch.setenv(PIECE_ENV, "64")
    assert mask_piece(CPU) == 64
    for bad in ("0", "x"):
        monkeypatch.setenv(PIECE_ENV, bad)
        with pytest.raises(ValueError, match=f"{PIECE_ENV} must be a positive integer, got '{bad}'"):
            mask_piece(CPU)


def test_worked_example_of_mask_pieces():
    """mask_pieces' docstring: the zigzag portion [0, 1000) + [3000, 4000) of a document against the
    runs [1000, 3000) is one FULL call of 1000 x 2000 (the front run sees none of it); against
    itself one CAUSAL call of 2000 x 2000 (positions increase along the buffer: the lower triangle
    is exactly the allowed pairs), where cutting by runs made three (causal front, full back x
    front, causal back). A window that cuts inside the rectangle keeps the three (a causal call
    cannot express it), and so does a kernel told to cut every run apart."""
    mask = Mask(True, None, ((0, 4000),)).normalized(4000)
    q = ((0, 1000), (3000, 1000))
    assert mask_pieces(mask, q, ((1000, 1000), (2000, 1000)), 2048) == [(BlockKind.FULL, (1000, 2000), (0, 2000))]
    assert mask_pieces(mask, q, q, 2048) == [(BlockKind.CAUSAL, (0, 2000), (0, 2000))]
    # two documents side by side, each of two zigzag portions: one causal call each, packed together
    # by a variable-length call (call_groups)
    two = Mask(True, None, ((0, 4000), (4000, 8000))).normalized(8000)
    q2 = q + ((4000, 1000), (7000, 1000))
    assert mask_pieces(two, q2, q2, 2048) == [(BlockKind.CAUSAL, (0, 2000), (0, 2000)),
                                              (BlockKind.CAUSAL, (2000, 4000), (2000, 4000))]
    assert call_groups(mask_pieces(two, q2, q2, 2048)) == [(0, 1)]
    # full calls one above the other on the same columns are one call: two query runs that both
    # see all of an earlier key run (the later query run also sees a second one)
    assert mask_pieces(mask, ((2000, 500), (3000, 500)), ((0, 1000), (2600, 300)), 2048) == \
        [(BlockKind.FULL, (0, 1000), (0, 1000)), (BlockKind.FULL, (500, 1000), (1000, 1300))]
    windowed = Mask(True, (2500, 0), ((0, 4000),)).normalized(4000)
    assert [kind for kind, _, _ in mask_pieces(windowed, q, q, 2048)] == \
        [BlockKind.CAUSAL, BlockKind.MASKED, BlockKind.CAUSAL]
    # full pieces side by side on the same rows are one call, however long: the back run against
    # three earlier runs that do not continue each other
    k = ((0, 600), (1200, 600), (2400, 600))
    assert mask_pieces(mask, ((3000, 1000),), k, 512) == [(BlockKind.FULL, (0, 1000), (0, 1800))]


@settings(max_examples=80, deadline=None)
@given(st.data())
def test_mask_pieces_cover_every_allowed_pair_once(data):
    """Buffers of several runs (in any order, some continuing each other, some long, some short),
    documents, windows, any piece size: the calls are disjoint, cover every allowed pair and no
    other computed pair is allowed-by-accident -- a full call is all allowed, a causal one exactly
    its lower triangle on identical positions, a masked one at most ``piece`` tokens a side."""
    S = data.draw(st.integers(8, 64))
    cuts = sorted(data.draw(st.sets(st.integers(1, S - 1), max_size=4)))
    docs = tuple(zip([0] + cuts, cuts + [S]))
    causal = data.draw(st.booleans())
    left = data.draw(st.one_of(st.none(), st.integers(0, S)))
    mask = Mask(causal, (left, 0 if causal else data.draw(st.one_of(st.none(), st.integers(0, S)))),
                docs).normalized(S)

    def runs():
        bounds = sorted(data.draw(st.sets(st.integers(1, S - 1), max_size=6)))
        spans = [(a, b - a) for a, b in zip([0] + bounds, bounds + [S])]
        keep = data.draw(st.lists(st.sampled_from(range(len(spans))), min_size=1, max_size=len(spans), unique=True))
        return tuple(spans[i] for i in keep)

    q_runs, k_runs = runs(), (runs() if data.draw(st.booleans()) else None)
    k_runs = q_runs if k_runs is None else k_runs
    piece = data.draw(st.integers(1, 40))
    allowed = mask.allowed(_positions(q_runs), _positions(k_runs))
    covered = torch.zeros_like(allowed, dtype=torch.int64)
    for kind, (r0, r1), (c0, c1) in mask_pieces(mask, q_runs, k_runs, piece):
        sub = allowed[r0:r1, c0:c1]
        if kind == BlockKind.FULL:
            assert sub.all()
        elif kind == BlockKind.CAUSAL:
            assert torch.equal(_positions(q_runs)[r0:r1], _positions(k_runs)[c0:c1])
            assert torch.equal(sub, torch.tril(torch.ones_like(sub)))
        else:
            assert r1 - r0 <= piece and c1 - c0 <= piece
        covered[r0:r1, c0:c1] += 1
    assert covered.max() <= 1, "two calls compute the same pair"
    assert torch.equal(covered.bool() & allowed, allowed), "an allowed pair is in no call"


def test_masks_on_the_meta_device_are_the_cpu_masks_moved():
    """Block masks for meta tensors (shapes only: scripts/count_host_ops.py --bytes) are made on
    the CPU in the meta device's mask pieces and moved: the same pieces and shapes, and each
    piece's empty rows, which a meta tensor could not find out, carried over."""
    from megatron_mesh.plan import AttentionShape, resolve
    from megatron_mesh.plan.ir import Attend
    from megatron_mesh.runtime.inputs import attention_mask
    from megatron_mesh.runtime.masks import block_mask

    shape = AttentionShape(40, 1, 2, 2, 8, 4)
    mask, layout = attention_mask(2, shape, causal=True, cu_seqlens=[0, 7, 33, 50, 80], window=(5, 0))
    plan = resolve("ring", 2, shape).build(shape, mask, layout)
    masked = [op for r in range(2) for op in plan.rank(r).ops("forward")
              if isinstance(op, Attend) and op.mask == BlockKind.MASKED]
    assert masked
    piece = mask_piece(torch.device("meta"))
    for op in masked:
        cpu, meta = block_mask(plan, op, torch.device("cpu"), piece), block_mask(plan, op, torch.device("meta"))
        cpu_pieces = cpu.pieces if isinstance(cpu, PiecedMask) else [cpu]
        meta_pieces = meta.pieces if isinstance(meta, PiecedMask) else [meta]
        assert len(cpu_pieces) == len(meta_pieces)
        for a, b in zip(cpu_pieces, meta_pieces):
            ma, mb = getattr(a, "mask", a), getattr(b, "mask", b)
            assert getattr(a, "rows", None) == getattr(b, "rows", None) and ma.kind == mb.kind
            if ma.allowed is not None:
                assert mb.allowed.device.type == "meta" and mb.allowed.shape == ma.allowed.shape
                empty = ma.empty_rows()
                assert (mb.empty_rows() is None) == (empty is None)
                if empty is not None:
                    assert mb.empty_rows().shape == empty.shape
