"""Masked and hybrid distributed cases, run inside spawned gloo process groups (see
megatron_mesh.comm.spawn): every rank runs the public API on its shard, forward and backward, and
returns a :class:`Record`; pytest asserts on the records.

The reference is dense fp64 attention over the global sequence with the same mask, built from
the mask's rule (:func:`megatron_mesh.kernels.dense_mask`), never from a plan.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from helpers import tolerance

import megatron_mesh as mm
from megatron_mesh.comm.torch_dist import TorchDistCommunicator
from megatron_mesh.kernels import reference_attention
from megatron_mesh.plan import AttentionShape, Mask, ThdLayout, plan_bytes, tile_shapes
from megatron_mesh.plan.balance import BalancedLayout
from megatron_mesh.plan.hostops import side_by_side, wire_copies
from megatron_mesh.plan.ir import Post
from megatron_mesh.runtime.api import prepare

@dataclass(frozen=True)
class Case:
    """One call: ``mode`` with ``settings`` over ``world`` ranks; the mask from ``causal``,
    ``window``, ``cu_seqlens`` (zigzag) or ``thd`` = (cu_seqlens_padded, seq_lens)."""

    world: int
    mode: str
    settings: tuple = ()
    heads: int = 4
    kv_heads: int = 2
    dtype: torch.dtype = torch.float32
    causal: bool = True
    window: tuple | None = None
    cu_seqlens: tuple | None = None
    thd: tuple | None = None
    balanced: int = 0  # > 0: the documents cu_seqlens on balanced_layout(..., group=balanced)
    hide: bool = False  # and hide=True: the hybrids' first and last documents (four all-to-all rounds)
    owners: int = 0  # > 0: the documents cu_seqlens on ranks of contiguous tokens, each block computed where a
    # random map of this seed names (BalancedLayout.owners: either of its two ranks or another)
    built: bool = False  # True: the documents cu_seqlens on the layout plan/balance_owners.owners_layout builds
    seq_local: int = 8
    batch: int = 1
    head_dim: int = 16
    v_head_dim: int | None = None  # None: head_dim (MLA's differ)
    sink: str = ""  # attention sinks: "" none, "fixed" (off-by-one: zeros), "learnable" (their gradient checked)
    memory: tuple = ()  # the memory layouts (MEMORY) of q, k, v and dout; () all contiguous

    def label(self) -> str:
        st = " ".join(f"{k}={v}" for k, v in self.settings)
        mask = "causal" if self.causal else "full"
        if self.window:
            mask += f" window={self.window}"
        if self.cu_seqlens:
            mask += f" docs={list(self.cu_seqlens)}"
        if self.thd:
            mask += f" thd={list(self.thd[0])}/{list(self.thd[1])}"
        if self.balanced:
            mask += f" balanced (group {self.balanced}{', hide' if self.hide else ''})"
        if self.owners:
            mask += f" contiguous ranks, block owners of seed {self.owners}"
        if self.built:
            mask += " owners_layout"
        if self.v_head_dim not in (None, self.head_dim):
            mask += f" head dims {self.head_dim}/{self.v_head_dim}"
        if self.sink:
            mask += f" {self.sink} sinks"
        if self.memory:
            mask += " memory " + "/".join(self.memory)
        return (f"P={self.world} {self.mode} {st} heads={self.heads}/{self.kv_heads} {str(self.dtype)[6:]} "
                f"{mask}").replace("  ", " ")


@dataclass
class Record:
    case: str
    ratios: dict = field(default_factory=dict)  # error / (atol + rtol * |want|): <= 1 is within tolerance
    abs_err: dict = field(default_factory=dict)
    sent: int = 0
    received: int = 0
    planned: tuple = (0, 0)
    dtype: str = ""
    offset_grad: tuple = ()  # this rank's share of d softmax_offset (learnable sinks)
    offset_grad_want: tuple = ()  # the dense reference's whole gradient
    inputs_written: bool = False  # the call wrote into the caller's q, k, v or dout
    # a hybrid's all-to-all rounds: (made, planned), each (all_to_all_single calls, rounds that packed
    # their sends, that unpacked their receives)
    collectives: tuple = ((0, 0, 0), (0, 0, 0))


# -- memory layouts of an input (the strides sweep): the same [s, b, h, d] values in other memory ---------
def _fused_qkv(x: torch.Tensor) -> torch.Tensor:
    """x as the middle third of a fused [s, b, h, 3, d] projection (a QKV split view: head_dim stride 1)."""
    buf = x.new_zeros(*x.shape[:-1], 3, x.shape[-1])
    buf[..., 1, :] = x
    return buf[..., 1, :]


def _every_other(x: torch.Tensor) -> torch.Tensor:
    """x as every other element of a buffer twice as wide (``buf[..., ::2]``: head_dim stride 2)."""
    buf = x.new_zeros(*x.shape[:-1], 2 * x.shape[-1])
    buf[..., ::2] = x
    return buf[..., ::2]


def _stored(*order: int):
    """x stored with its dims in ``order`` (outermost first), seen as [s, b, h, d] again."""
    back = tuple(order.index(i) for i in range(4))
    return lambda x: x.permute(*order).contiguous().permute(*back)


# name -> (what the global values become (None: unchanged), the local tensor in this memory). The
# expanded ones repeat one head / one element of head_dim with stride 0, so their values repeat too.
MEMORY = {
    "contiguous": (None, lambda x: x),
    "fused-qkv": (None, _fused_qkv),
    "bhsd": (None, _stored(1, 2, 0, 3)),  # a [b, h, s, d] tensor permuted to [s, b, h, d]
    "step-2": (None, _every_other),
    "sbdh": (None, _stored(0, 1, 3, 2)),  # a projection stored [d, h]: x.view(s, b, d, h).transpose(2, 3)
    "dhbs": (None, _stored(3, 2, 1, 0)),  # every dim permuted
    "expand-heads": (lambda x: x[:, :, :1].expand_as(x), lambda x: x[:, :, :1].expand(x.shape)),
    "expand-dim": (lambda x: x[..., :1].expand_as(x), lambda x: x[..., :1].expand(x.shape)),
}


def _layout(c: Case):
    if c.built:
        from megatron_mesh.plan.balance_owners import owners_layout

        itemsize = torch.tensor([], dtype=c.dtype).element_size()
        return owners_layout(c.cu_seqlens, c.world, AttentionShape(c.seq_local, c.batch, c.heads, c.kv_heads,
                                                                    c.head_dim, itemsize))
    if c.owners:
        import random

        rng = random.Random(c.owners)
        owners = tuple((i, j, rng.randrange(c.world)) for i in range(c.world) for j in range(c.world)
                       if i != j and rng.random() < 0.7)
        runs = tuple(((r * c.seq_local, c.seq_local),) for r in range(c.world))
        return BalancedLayout(c.world, runs, tuple(zip(c.cu_seqlens, c.cu_seqlens[1:])), owners=owners)
    if c.balanced:
        return mm.balanced_layout(c.cu_seqlens, c.world, causal=c.causal, window=c.window, group=c.balanced,
                                  hide=c.hide)
    return None if c.thd is None else ThdLayout(c.world, c.thd[0], c.thd[1])


def _mask(c: Case, seq_len: int, layout) -> Mask:
    if layout is not None:
        return Mask(c.causal, c.window, layout.documents()).normalized(seq_len)
    if c.cu_seqlens is not None:
        return Mask.from_cu_seqlens(c.cu_seqlens, seq_len, c.causal, c.window)
    return Mask(c.causal, c.window).normalized(seq_len)


_ULYSSES_GROUPS: dict = {}  # a Ulysses group's global ranks -> its process group (made_ulysses_groups)


def make_ulysses_groups(world: int, phases) -> None:
    """Every Ulysses group (U = 2, 3, 4 consecutive ranks) of every group of ``phases``' CP groups,
    made by every rank of the spawn in one order before the cases run -- ``new_group`` is
    collective over the world, and a group made by its members alone would put their group
    counters out of step with the other ranks'."""
    import torch.distributed as dist

    for sizes in phases:
        start = 0
        for size in sizes:
            for U in (2, 3, 4):
                if size % U or size < 3:
                    continue
                for first in range(start, start + size, U):
                    ranks = tuple(range(first, first + U))
                    if ranks not in _ULYSSES_GROUPS:
                        _ULYSSES_GROUPS[ranks] = dist.new_group(list(ranks))
            start += size
    assert all(max(r) < world for r in _ULYSSES_GROUPS), (world, sorted(_ULYSSES_GROUPS))


def ulysses_communicator(group, U: int) -> TorchDistCommunicator:
    """The transport Megatron's process groups give a hybrid of degree ``U`` over ``group``
    (:class:`~megatron_mesh.megatron.groups.CPGroups`): each Ulysses peer routed through the
    process group of its U consecutive CP ranks (made by :func:`make_ulysses_groups`), so an
    all-to-all round is one collective call."""
    import torch.distributed as dist

    ranks = tuple(dist.get_process_group_ranks(group))
    me = ranks.index(dist.get_rank())
    first = me - me % U
    members = tuple(ranks[first:first + U])
    sub = _ULYSSES_GROUPS[members]
    return TorchDistCommunicator(group, routes={p: sub for p in range(first, first + U) if p != me})


def _reference(c: Case, S: int, layout, inputs, sink, group) -> tuple:
    """(out, dQ, dK, dV, d sink or None) of dense fp64 attention over the whole sequence. Every rank
    of a group has the same inputs (one seed), so the group's first rank computes it and the others
    receive it (exact: fp64 values copied): on 2 cores, eight ranks each computing an S x S
    reference (the CPU problem's 2,048 tokens) cost more than the cases' own calls."""
    import torch.distributed as dist

    shared = group is not None and dist.is_initialized() and dist.get_world_size(group) > 1
    Q, K, V, dO = inputs
    out_shape = (*Q.shape[:3], V.shape[-1])
    if not shared or dist.get_rank(group) == 0:
        Qr, Kr, Vr = (x.clone().requires_grad_() for x in (Q, K, V))
        ref = reference_attention(Qr, Kr, Vr, mask=_mask(c, S, layout), softmax_offset=sink)
        ref.backward(dO)
        grads = [Qr.grad, Kr.grad, Vr.grad] + ([sink.grad] if c.sink == "learnable" else [])
        got = [t.contiguous() for t in (ref.detach(), *grads)]
    else:
        shapes = [out_shape, Q.shape, K.shape, V.shape] + ([sink.shape] if c.sink == "learnable" else [])
        got = [torch.empty(shape, dtype=torch.float64) for shape in shapes]
    if shared:
        for t in got:
            dist.broadcast(t, src=dist.get_global_rank(group, 0), group=group)
    return (*got[:4], got[4] if len(got) > 4 else None)


def run(rank: int, c: Case, group, comm=None) -> Record:
    """Case ``c`` on this rank of ``group`` (or of the communicator ``comm``: in-process ranks)."""
    layout = _layout(c)
    S = c.world * c.seq_local if layout is None else layout.seq_len
    g = torch.Generator().manual_seed(S * 31 + c.heads)
    f64, dv = torch.float64, c.v_head_dim or c.head_dim
    Q = torch.randn(S, c.batch, c.heads, c.head_dim, generator=g, dtype=f64)
    K = torch.randn(S, c.batch, c.kv_heads, c.head_dim, generator=g, dtype=f64)
    V = torch.randn(S, c.batch, c.kv_heads, dv, generator=g, dtype=f64)
    dO = torch.randn(S, c.batch, c.heads, dv, generator=g, dtype=f64)
    sink = None if not c.sink else torch.zeros(c.heads, dtype=f64) if c.sink == "fixed" else \
        torch.randn(c.heads, generator=g, dtype=f64).requires_grad_()
    memory = [MEMORY[name] for name in c.memory] or [MEMORY["contiguous"]] * 4
    raw = (Q, K, V, dO)
    Q, K, V, dO = (x if values is None else values(x).contiguous() for x, (values, _) in zip(raw, memory))
    ref, dQ, dK, dV, d_sink = _reference(c, S, layout, (Q, K, V, dO), sink, group)
    shard = (lambda x: mm.zigzag_shard(x, rank, c.world)) if layout is None else (
        lambda x: mm.layout_shard(x, rank, layout))
    # the caller's tensors as they lie in memory (detached: the call gets exactly these strides); an
    # expanded one is a view of the raw values, whose neighbours in memory differ from what it repeats
    q, k, v, do = (lay(shard(x).to(c.dtype)).detach() for x, (_, lay) in zip(raw, memory))
    for x in (q, k, v):
        x.requires_grad_()
    offset = None if sink is None else sink.detach().to(c.dtype).requires_grad_(c.sink == "learnable")
    versions = [x._version for x in (q, k, v, do)]
    documents = list(c.cu_seqlens) if c.cu_seqlens and not (c.balanced or c.owners or c.built) else None  # the layout's own
    U = dict(c.settings).get("ulysses_size", 1)
    if comm is None and group is not None and U == c.world > 1:
        comm = TorchDistCommunicator(group)  # the API's own transport: a round over its whole group is one collective
    elif comm is None and group is not None and U > 1 and _ULYSSES_GROUPS:
        # the transport Megatron's groups give a hybrid (collectives), where this spawn made its groups
        # (all_cases; the strides part's spawn has none: the API's point-to-point transport)
        comm = ulysses_communicator(group, U)
    kw = dict(causal=c.causal, window=c.window, cu_seqlens=documents, layout=layout, comm=comm, **dict(c.settings))
    kinds = ("all_to_all_single", "all_to_all pack", "all_to_all unpack")
    before = [comm.calls[k] for k in kinds] if isinstance(comm, TorchDistCommunicator) else None
    with mm.comm_counter() as counter:
        out = mm.attention(q, k, v, mode=c.mode, group=group, softmax_offset=offset, **kw)
        out.backward(do)
    # the bytes of the same call's plan without sinks: a sink adds none
    plan = prepare(q.detach(), k.detach(), v.detach(), mode=c.mode, group=group, **kw).plan
    shape = AttentionShape(q.shape[0], c.batch, c.heads, c.kv_heads, c.head_dim, q.element_size(), dv)
    planned = plan_bytes(plan, shape)[rank]
    atol, rtol = tolerance(c.dtype, c.heads, c.kv_heads)
    rec = Record(c.label(), sent=counter.bytes_sent, received=counter.bytes_received,
                 planned=(planned.sent, planned.received), dtype=str(c.dtype),
                 inputs_written=[x._version for x in (q, k, v, do)] != versions)
    if isinstance(comm, TorchDistCommunicator):
        # (calls, rounds that packed their sends, that unpacked their receives): made and planned
        # (hostops.wire_copies: the host model's and the simulator's rule)
        planned = [0, 0, 0]
        for d in ("forward", "backward"):
            ops = plan.rank(rank).ops(d)
            runs = side_by_side(plan, rank, d, (c.heads, c.kv_heads))
            for op in ops:
                if type(op) is Post and op.group:
                    planned = [a + b for a, b in zip(planned, (1, *wire_copies(op, runs)))]
        rec.collectives = (tuple(comm.calls[k] - b for k, b in zip(kinds, before)), tuple(planned))
    if c.sink == "learnable":
        rec.offset_grad, rec.offset_grad_want = tuple(offset.grad.double().tolist()), tuple(d_sink.tolist())
    for name, got, want in (("out", out, ref), ("dq", q.grad, dQ), ("dk", k.grad, dK), ("dv", v.grad, dV)):
        want = shard(want)
        if got.shape != want.shape or got.dtype != c.dtype:
            raise AssertionError(f"{c.label()}: {name} is {tuple(got.shape)} {got.dtype}, want {tuple(want.shape)}")
        err = (got.double() - want).abs()
        rec.abs_err[name] = err.max().item()
        rec.ratios[name] = (err / (atol + rtol * want.abs())).max().item()
    return rec


# -- the grids -------------------------------------------------------------------------------------------
COMBOS = [(4, 4, torch.float32), (4, 2, torch.bfloat16), (4, 1, torch.float32), (4, 2, torch.float32),
          (4, 4, torch.bfloat16), (4, 1, torch.bfloat16)]  # MHA / GQA / MQA x fp32 / bf16


def zigzag_masks(world: int, T: int) -> list[dict]:
    """Documents shorter than a half-chunk, crossing chunk and rank boundaries, many one-token
    documents; windows of one token, less than a half-chunk, several chunks; causal and full."""
    S, h = world * T, T // 2
    short = tuple(range(0, S, max(1, h // 2 + 1))) + (S,)
    cross = tuple(sorted({0, S} | {x for x in (3, h + 1, 3 * h + 2, S - 1) if 0 < x < S}))
    return [dict(cu_seqlens=short), dict(cu_seqlens=cross), dict(cu_seqlens=tuple(range(S + 1))),
            dict(window=(1, 0)), dict(window=(max(1, h // 2), 0)), dict(window=(3 * T, 0)),
            dict(causal=False, window=(2, 3)), dict(causal=False, cu_seqlens=cross),
            dict(cu_seqlens=cross, window=(2, 0))]


def _placements(world: int):
    yield "ring", ()
    for t in tile_shapes(world):
        if t != (1, world):
            yield "mesh", (("tile", t), ("contiguous", "q"))
    yield "tasp", ()
    if world >= 4 and world % 2 == 0:
        yield "tasp", (("ranks_per_node", 2),)


def masked_grid(rank: int, world: int, group=None) -> list[Record]:
    """Every mode (ring, each Mesh tile, TASP, TASP over emulated 2-GPU nodes) x three of the
    masks (rotating, so every mask meets every mode family across the CP sizes) x a rotating
    head layout and dtype; plus the THD layout at P <= 4."""
    T = 2 * max(world - 1, 3)
    masks = zigzag_masks(world, T)
    out, n = [], world
    for mode, settings in _placements(world):
        for _ in range(3):
            heads, kv, dtype = COMBOS[n % len(COMBOS)]
            out.append(run(rank, Case(world, mode, settings, heads, kv, dtype, seq_local=T, **masks[n % len(masks)]),
                           group))
            n += 1
    if world <= 4:
        lens = (2 * world * 2, 2 * world, 2 * world * 3)
        cu = tuple(itertools.accumulate(lens, initial=0))
        thd = (cu, (lens[0] - 1, lens[1], 2))
        for i, (mode, settings) in enumerate((("ring", ()), ("mesh", (("tile", "auto"),)), ("tasp", ()))):
            heads, kv, dtype = COMBOS[i]
            window = (2, 0) if i == 1 else None
            out.append(run(rank, Case(world, mode, settings, heads, kv, dtype, window=window, thd=thd,
                                      seq_local=sum(lens) // world), group))
    return out


def halo_cases(rank: int, world: int, group=None) -> list[Record]:
    """P = 8, a window of one half-chunk: every mode; and documents = the zigzag halves (nothing
    crosses a rank)."""
    T = 16
    h = T // 2
    out = []
    for mode, settings in _placements(world):
        out.append(run(rank, Case(world, mode, settings, 4, 4, torch.bfloat16, window=(h, 0), seq_local=T), group))
        halves = tuple(range(0, world * T + 1, h))
        out.append(run(rank, Case(world, mode, settings, 4, 2, torch.float32, cu_seqlens=halves, seq_local=T), group))
    return out


def hybrid_grid(rank: int, world: int, group=None) -> list[Record]:
    """Every (U, M) with U * M = world from {(2,2), (2,3), (3,2), (2,4), (4,2)}: inner Mesh of every
    tile, inner TASP and ring, x three rotating (heads, dtype, causal) combinations covering MHA,
    GQA, KV heads fewer than U, MQA, causal and full, fp32 and bf16."""
    out, n = [], 0
    for U in (2, 3, 4):
        if world % U or (U, world // U) not in ((2, 2), (2, 3), (3, 2), (2, 4), (4, 2)):
            continue
        M = world // U
        heads_options = [(2 * U, 2 * U), (2 * U, U), (2 * U, 1)] + ([(2 * U, 2)] if U == 4 else [])
        inners = [("a2a+mesh", (("tile", t), ("contiguous", "q"))) for t in tile_shapes(M)]
        inners += [("a2a+ring", ()), ("a2a+tasp", ())]
        for mode, settings in inners:
            for _ in range(3):
                heads, kv = heads_options[n % len(heads_options)]
                dtype = (torch.float32, torch.bfloat16)[(n // 2) % 2]
                causal = n % 3 != 2
                out.append(run(rank, Case(world, mode, (("ulysses_size", U),) + settings, heads, kv, dtype,
                                          causal=causal, seq_local=8), group))
                n += 1
    return out


def balanced_documents(world: int, T: int, variant: int) -> tuple:
    """Documents for the balanced layout: one-token documents, one document, documents longer than
    S / P, a mix (deterministic per variant)."""
    import random

    S = world * T
    if variant % 4 == 0:
        return (0, S)
    if variant % 4 == 1:
        return tuple(range(0, S, 1 if world < 4 else 2)) + (S,)
    rng = random.Random(variant * 101 + world)
    cu = [0]
    while cu[-1] < S:
        cu.append(min(S, cu[-1] + (rng.randint(1, 3) if variant % 4 == 2 else rng.randint(1, 3 * T))))
    return tuple(cu)


def cpu_problem_samples() -> list[tuple]:
    """Seeds 0-2 of the CPU problem of docs/performance.md (8 ranks, 64K tokens of
    lognormal:4096,1.0) scaled by 1/32: 2K tokens of lognormal:128,1.0 (the sizes of a document
    relative to a rank's tokens are the same)."""
    from megatron_mesh.tools.plan_args import document_bounds

    return [tuple(document_bounds("lognormal:128,1.0", 2048, seed)) for seed in range(3)]


def balanced_grid(rank: int, world: int, group=None) -> list[Record]:
    """The work-balanced layout (issue 19): every plan-based mode on it -- ring, Mesh (auto and a
    2-row tile), TASP, and at even CP sizes the hybrids on a layout balanced per Ulysses group
    (every other case with its first and last documents set apart: hide; at P = 4 also one
    group of all P ranks) -- under four document
    sets and windows, MHA / GQA / MQA, fp32 and bf16; and Mesh on a layout that names its blocks'
    owners (contiguous ranks, random owners: query rank, key rank or a third; one document over
    every rank, and documents longer than a rank); at P = 8 the CPU problem's scaled samples on the
    balanced layout (ring, TASP) and on the layout plan/balance_owners.py builds (Mesh)."""
    T = 2 * max(world, 3)
    out, n = [], 0
    modes = [("ring", (), 0), ("mesh", (("tile", "auto"),), 0), ("tasp", (), 0)]
    two_rows = next((t for t in tile_shapes(world) if t[0] == 2), None)
    if two_rows:
        modes.append(("mesh", (("tile", two_rows),), 0))
    if world % 2 == 0 and world > 2:
        modes += [("a2a+ring", (("ulysses_size", 2),), 2), ("a2a+mesh", (("ulysses_size", 2),), 2),
                  ("a2a+tasp", (("ulysses_size", 2),), 2)]
    if world == 4:  # one Ulysses group of every rank (on the balanced layout: `auto` keeps the zigzag there)
        modes.append(("a2a+tasp", (("ulysses_size", world),), world))
    for mode, settings, group_size in modes:
        for _ in range(2):
            heads, kv, dtype = COMBOS[n % len(COMBOS)]
            window = (None, (2, 0), (T, 0))[n % 3]
            out.append(run(rank, Case(world, mode, settings, heads, kv, dtype, window=window, seq_local=T,
                                      cu_seqlens=balanced_documents(world, T, n), balanced=group_size or 1,
                                      hide=group_size > 1 and n % 2 == 0), group))
            n += 1
    for seed in (1, 2) if world > 1 else ():
        heads, kv, dtype = COMBOS[n % len(COMBOS)]
        out.append(run(rank, Case(world, "mesh", (), heads, kv, dtype, window=(None, (T, 0))[seed - 1], seq_local=T,
                                  cu_seqlens=balanced_documents(world, T, (4, 7)[seed - 1]), owners=seed * 10 + world),
                       group))
        n += 1
    if world == 8:  # the CPU problem's samples (scaled), the shape of docs/performance.md: 2 heads of 32, fp32
        for seed, cu in enumerate(cpu_problem_samples()):
            # one plain mode per sample on the balanced layout (the grid above runs each on it; a
            # sample's run costs ~3.5 s on 2 cores)
            mode = ("ring", "tasp", "ring")[seed]
            out.append(run(rank, Case(8, mode, (), 2, 2, torch.float32, seq_local=256, head_dim=32, cu_seqlens=cu,
                                      balanced=1), group))
            # and Mesh on the layout whose blocks' owners plan/balance_owners.py chose
            out.append(run(rank, Case(8, "mesh", (), 2, 2, torch.float32, seq_local=256, head_dim=32, cu_seqlens=cu,
                                      built=True), group))
    return out


def strides_cases(world: int, memories: int = len(MEMORY)) -> list[Case]:
    """The strides sweep: ring, every Mesh tile, TASP and (at even P > 2) the three hybrids, each
    without documents, with documents on Megatron's zigzag and on the balanced layout, its inputs in
    ``memories`` of the memory layouts (:data:`MEMORY`): case i gives q the i-th, k the next, v the
    one after and dout the one after that, so that over len(MEMORY) cases each input meets each
    layout; fewer ``memories`` start each mode and mask at another layout. Heads (MHA / GQA / MQA)
    and dtype (fp64 / fp32 / bf16) rotate."""
    T = 2 * max(world, 3)
    names, combos = list(MEMORY), [(4, 4, torch.float64), (4, 2, torch.float32), (4, 1, torch.bfloat16)]
    modes = [("ring", (), 1), ("tasp", (), 1)]
    modes += [("mesh", (("tile", t),), 1) for t in tile_shapes(world) if t != (1, world)]
    if world % 2 == 0 and world > 2:
        modes += [(f"a2a+{inner}", (("ulysses_size", 2),), 2) for inner in ("ring", "mesh", "tasp")]
    docs = balanced_documents(world, T, 3)
    out, n = [], 0
    for mode, settings, group_size in modes:
        for masked in ({}, dict(cu_seqlens=docs), dict(cu_seqlens=docs, balanced=group_size)):
            for i in range(memories):
                memory = tuple(names[(n + i + j) % len(names)] for j in range(4))
                heads, kv, dtype = combos[(n + i) % len(combos)]
                out.append(Case(world, mode, settings, heads, kv, dtype, seq_local=T, memory=memory, **masked))
            n += 1
    return out


def strides_grid(rank: int, world: int, group=None) -> list[Record]:
    """The strides sweep (:func:`strides_cases`) on a gloo group: one set of memory layouts per mode
    and mask, each input in another (the in-process test runs every layout on every input)."""
    return [run(rank, c, group) for c in strides_cases(world, memories=1)]


def sink_grid(rank: int, world: int, group=None) -> list[Record]:
    """Attention sinks (learnable: each rank's share of the offset's gradient, summed over the
    group on the pytest side; off-by-one: fixed zeros) and value head dims other than the
    query/key one (12 / 8: MLA's 192 / 128 scaled down) in every mode -- ring, a Mesh tile (2-D
    where P has one), TASP and, at even CP sizes, the three hybrids (U = 2) -- one case each,
    rotating over the CP sizes the mask (none, a window, documents with a window on the balanced
    layout, full attention over documents), MHA / GQA / MQA, fp32 / bf16, the sink kind and the
    head dims, so that across the sizes every mode meets each of them."""
    T = 2 * max(world, 3)
    S = world * T
    docs = tuple(sorted({0, S} | {x for x in (3, T + 1, S - 2) if 0 < x < S}))
    tile = next((t for t in tile_shapes(world) if 1 < t[0] < world), (1, world))
    modes = [("ring", ()), ("mesh", (("tile", tile),)), ("tasp", ())]
    if world % 2 == 0:
        modes += [(m, (("ulysses_size", 2),)) for m in ("a2a+ring", "a2a+mesh", "a2a+tasp")]
    masks = [{}, dict(window=(3, 0)), dict(cu_seqlens=docs, window=(T, 0), balanced=1),
             dict(causal=False, cu_seqlens=docs)]
    out = []
    for i, (mode, settings) in enumerate(modes):
        n = world + i
        mask = dict(masks[(n + world // 2) % len(masks)])
        if mask.get("balanced") and mode.startswith("a2a"):  # balanced per Ulysses group; from P = 4 its first and
            mask.update(balanced=2, hide=world > 2)  # last documents apart: rows finished (and sunk) at two times
        kv = (4, 2, 1)[(world // 2 + i) % 3]  # MHA, GQA, MQA
        dtype = (torch.float32, torch.bfloat16)[(world + i + world // 2 + i // 3) % 2]
        dims = dict(head_dim=12, v_head_dim=8) if (world // 2 + i) % 2 else {}
        out.append(run(rank, Case(world, mode, settings, 4, kv, dtype, seq_local=T, batch=2,
                                  sink="fixed" if n % 3 == 0 else "learnable", **dims, **mask), group))
    return out


def all_cases(rank: int, world: int) -> dict:
    """Everything in one 8-rank spawn; the hostile API cases (api_cases) last, because they
    destroy and re-create the default process group."""
    import api_cases
    from cases import in_subgroups

    from cases import PHASES

    make_ulysses_groups(world, PHASES)  # the hybrids' transport (every phase below uses these groups' sizes)
    out = {"masked": in_subgroups(rank, world, masked_grid),
           "halo": in_subgroups(rank, world, halo_cases, phases=((8,),)),
           "hybrid": in_subgroups(rank, world, hybrid_grid, phases=((8,), (6, 2), (4, 4))),
           "balanced": in_subgroups(rank, world, balanced_grid),
           # one group per CP size (the group's ranks' shares of the sinks' gradient are summed)
           "sinks": in_subgroups(rank, world, sink_grid, phases=((8,), (7, 1), (6, 2), (5, 3), (4,)))}
    out["hostile"] = api_cases.hostile(rank, world)
    return out


# -- mask kinds (chunked, prefix) ----------------------------------------------------------------------
def kinds(T: int) -> list:
    """chunked smaller than, equal to and larger than a rank's chunk of T tokens; prefix."""
    return [mm.masks.chunked(T // 2 + 1), mm.masks.chunked(T), mm.masks.chunked(2 * T + 1), mm.masks.prefix(T + 1)]


def kind_settings(mode: str, world: int) -> dict:
    """Every mode at any P: a 2-row Mesh tile where P is even, hybrids of degree 2 at even P > 2
    (1 otherwise: the inner mode over every rank)."""
    U = 2 if world % 2 == 0 and world > 2 else 1
    return {"mesh": dict(tile=(2, world // 2)) if world % 2 == 0 else {},
            "a2a+mesh": dict(ulysses_size=U, tile=(world // U, 1)), "a2a+ring": dict(ulysses_size=U),
            "a2a+tasp": dict(ulysses_size=U)}.get(mode, {})


def kind_problem(world: int, T: int, kind, heads: str, balanced: bool, seed: int = 0, dtype=torch.float32):
    """A problem of ``kind`` with three documents (one crossing ranks) on the zigzag or balanced layout."""
    import cases
    S = world * T
    return cases.Problem(world, *cases.HEADS[heads], True, dtype, seq_local=T, cu_seqlens=(0, 5, S // 2 + 3, S),
                         seed=seed, kind=kind, balanced=balanced)


def kinds_grid(rank: int, world: int, group=None) -> list:
    """Chunked and prefix with documents on a real gloo group: every mode, zigzag and balanced,
    rotating the kinds and MHA / GQA / MQA (the in-process breadth: test_mask_kinds_numerics.py)."""
    import cases
    from megatron_mesh.plan import MODES, resolve
    T, out = 12, []
    for i, mode in enumerate(MODES):
        for balanced in (False, True):
            kind = kinds(T)[(i + balanced + world) % 4]
            p = kind_problem(world, T, kind, ("MHA", "GQA", "MQA")[(i + world) % 3], balanced, seed=i)
            settings = kind_settings(mode, world)
            plan = resolve(mode, world, p.shape, **settings).build(p.shape, p.mask if p.layout is None else p.kind,
                                                                   p.layout)
            out.append(cases.measure(rank, p, f"{mode} {kind.head_text()} balanced={balanced}", lambda q, k, v: mm.attention(
                q, k, v, mode=mode, group=group, **p.mask_args(), **settings), plan=plan))
    return out
