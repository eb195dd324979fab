"""The default CP layout of one sample of packed documents: the balanced layout, unless Megatron's
zigzag is predicted faster for the mode that runs it (``--cp-layout auto``; ``choose_layout``).

The balanced layout (:mod:`.balance`) balances each rank's work, but cuts a long document into
portions over several ranks, each portion a few runs, and each portion reads the keys of the
portions before it. Its plans send more (at 256 GPUs ring sends 448 MiB per layer from the busiest
rank on it against 321 MiB on the zigzag) and issue more torch ops (every run multiplies the kernel
calls, merges and row ranges of every block over it: 3-5x the zigzag's at 256 GPUs, 42.37 against
10.99 ms for ring with the host at 23 us per op). Where the work decides the step (one node, the
Ulysses hybrids on long documents) it is up to 2.2x faster. This module prices both layouts for the mode in
microseconds of pure Python and keeps the cheaper, so a user never gets a slower step than
Megatron's own layout would give.

**The price** (:func:`layout_cost`), per direction, on the machine of ``topo``: the slowest of

* compute: the busiest unit's allowed pairs at the machine's attention rate (a unit is a rank,
  or a Ulysses group of U ranks for a hybrid, whose ranks each compute 1/U of the heads);
* communication: the busiest unit's rounds -- the pulls the mask-aware plans make (:mod:`.sparse`:
  every unit receives, from each holder, the tokens of a document before its last row there; K/V
  in the forward, kept for the backward as far as they fit in the keep limit x its own Q, K and V
  (the pulls it reads first), the rest pulled again; dK/dV partials back): for ring and Mesh one round per shift of the ring, in which a unit
  sends to one peer and receives from another, each transfer its link's latency + bytes /
  bandwidth; for TASP, which pulls from every peer at once, per link class the latency of up to
  ``TUNABLES.burst_groups`` (:mod:`.tunables`) rounds + the busier direction's bytes / bandwidth;
* host: the busiest unit's torch ops at ``topo.host_op_time`` each and its views at
  ``topo.host_view_time`` (:func:`_host_ops`: per peer it pulls from and per peer pulling from
  it, per extra run of a document, per call its short runs are packed into, and a hybrid's
  all-to-all; :data:`HOST_OPS`, fitted to the plans' counts); nothing where the host is free
  (``host_op_time`` 0).

It prices what a plan adds on top of its pairs only roughly (a kernel call per mask piece of its
remote blocks, the merge of their partial results, :mod:`.costs`' rates): it ranks the two
layouts, it does not predict the simulator's time; where transfers set the balanced layout's
price, it keeps it only :data:`COMM_MARGIN` cheaper. At 256 GPUs (lognormal:4096, seed 0; the
host priced) it gives ring 11.4 ms on the zigzag and 18.2 on the balanced layout (the simulator:
10.9 and 16.7), TASP 11.0 and 18.2 (11.5 and 14.0), a2a+tasp U 8 7.7 and 6.4 (7.9 and 5.8); on
lognormal:16384 ring 50.4 and 73.0 (48.6 and 69.6), a2a+tasp U 8 37.1 and 16.0 (34.0 and 15.9),
and keeps the balanced layout for the hybrid.
Checked against the simulator on 240 rows (seeds 0-9, 8 and 256 GPUs, both host settings at 8)
the layout it keeps is never slower than the zigzag (docs/performance.md, the per-seed tables).
:func:`pick_layout` (the data loader's) makes the same pick without pricing what cannot change it:
at 256 ranks (1M tokens) 13-32 ms of Python, the balanced layout's pulls on 16K-token documents
(8-27K pairs of ranks) the most, and 66-85 ms where one document holds a third of the tokens and
every pair of ranks pulls -- there a lower bound of the ring shifts' rounds decides without walking
them (docs/performance.md, "Build time with the choice"); the pair-level parts
(:mod:`.layout_pulls`) loop once per pair of ranks, and the tests check them against their plain
forms. Where a rank's attention takes less than :data:`MIN_COMPUTE_LAUNCHES` kernel launches the
zigzag is kept: such a step is bound by launches and latencies, which the price leaves out.

Worked example (P = 2 ranks of one node, 32/8 heads of 128 in bf16, documents of 32K, 16K and 16K
tokens): the zigzag gives rank 0 the first 16K tokens and the last document (268M pairs), rank 1
the middle (537M pairs: 1.33x the mean), the balanced layout each rank 403M pairs -- the first
document in two zigzag portions, the others whole. Both pull 8-16K tokens of the first document
over NVLink (0.15 ms forward), so the compute decides: 16.9 + 41.7 ms against 22.5 + 55.6 ms,
and the balanced layout is kept (``tests/plan/test_choice.py``).

The choice is a function of the sample's documents and the settings every rank shares (CP
size, mode, Ulysses degree, heads, dtype, machine), so all ranks make the same one.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

from .balance import BalancedLayout
from .hybrid import inner_shape
from .layout import Layout, ZigzagLayout
from .layout_pulls import _document_pieces, _overheads, _portions, _Rounds, _sums_of, _work_and_pulls
from .modes import get_mode
from .shape import AttentionShape
from .simulate import BACKWARD_FLOPS
from .sparse_needs import KEEP_LIMIT
from .topology import Topology

__all__ = ["LayoutCost", "layout_cost", "choose_layout", "pick_layout", "burst_rounds", "MIN_COMPUTE_LAUNCHES", "COMM_MARGIN"]

# the zigzag keeps a sample whose busiest rank's forward attention on it takes less than this many
# kernel launches (100 us on the default machine): such a step is bound by launches and round
# latencies -- the CPU problem priced on H100s (8 ranks, 64K tokens, 2 heads of 32: 18-90 us), where
# the balanced layout's extra kernel calls made ring 1-60 % slower than on the zigzag
MIN_COMPUTE_LAUNCHES = 20
# a balanced layout priced by its transfers (communication above compute in a direction) is kept
# only where it is priced this much below the zigzag: at 256 GPUs TASP on 16K-token documents
# (seed 3) was priced 8 % cheaper on it and simulated 14 % slower; the rows it keeps at 256 GPUs
# were priced 16-20 % cheaper and simulated 3-15 % faster
COMM_MARGIN = 0.10
# the share of the lesser of a direction's compute and host time that adds to the slower: the host's
# ops and the device's work overlap, but not wholly -- a block's calls and merges bunch, and the
# device waits for them while the host is on average ahead. On the per-seed rows (8 GPUs, and 256
# GPUs x two mixes; docs/performance.md) with 0 the layout kept was 3-5 % slower than the zigzag
# on 2 of the 50 rows at 8 GPUs (their host 0.6-1.0x their compute), with 0.2 on none, with 0.25
# and more it kept the zigzag on more rows where the balanced layout was 5-25 % faster
HOST_STALL = 0.2
# The host's torch ops per unit and direction, each as (ops, views) -- the ops a launch or a
# point-to-point call each (``Topology.host_op_time``), the views far cheaper (``host_view_time``) --
# read off a layout's portions (:func:`_host_ops`): terms of the executor's count that :mod:`.hostops`
# makes of a plan, each kind fitted by non-negative least squares to the count of the busiest quarter
# of the units on both layouts: ring at 8 ranks (64K tokens, ``lognormal:4096`` seeds 0-9; three
# mixes of short documents) and 256 ranks (1M tokens, seeds 0-1), a2a+tasp U 2 / 4 at 8 ranks and
# U 2 / 4 / 8 at 256 (each set of plans weighted alike). The busiest unit's priced host time is
# 0.73-1.56x its plan's (op 23 us, view 3 us; ``tests/plan/test_choice.py``), where the layouts differ
# 2-5x: the balanced layout cuts long documents into portions over many ranks, each portion a few runs,
# and every run multiplies the kernel calls, merges and row ranges -- mostly views -- of every block
# over it. It ranks layouts; the simulator's per-seed rows are the check (the layout kept is never
# slower than the zigzag, docs/performance.md).
HOST_OPS = {  # term: ((forward ops, views), (backward ops, views))
    "fixed": ((2.4, 5.2), (0.0, 5.2)),    # the inputs' and results' views and casts, the last queued writes
    "pulled": ((3.1, 3.0), (5.7, 7.9)),   # per peer the unit pulls from: its block's call and merge, the
                                          # receive (backward: the block's backward call with its views, the
                                          # queued dQ and dK/dV writes)
    "pulling": ((1.0, 2.0), (2.5, 5.5)),  # per peer pulling from the unit: the send (backward: K/V again, the
                                          # dK/dV partials received and added)
    "split": ((5.6, 23.6), (3.0, 36.9)),  # per run of a document beyond its first on the unit (a zigzag
                                          # portion's front and back): the blocks over it in more calls,
                                          # merges and row ranges
    "short": ((3.0, 10.9), (2.9, 16.3)),  # per masked call of runs too short to be a segment of their own
                                          # (mask.py's _segments, :func:`_packed_calls`): its allowed matrix
                                          # and views, and the calls with its neighbours
}
# a Ulysses hybrid's all-to-all, per direction: (ops per unit, views per group member) -- its rounds,
# one collective call each (``Post.group``), and its copies into and out of the group's buffers, in
# one round or, on a layout balanced for the groups, in rounds by document set (:mod:`.hybrid_sets`).
# Fitted, the terms above kept, to what the plans' counts leave over them on the busiest quarter of
# units (a2a+tasp, U 2 / 4 at 8 ranks, seeds 0-9; each U one point): the calls do not grow with U,
# the copies' views do. At 256 ranks the terms above overprice the inner plans (what is left over
# them there is 20-60 ops less), so the all-to-all of a layout balanced for the groups is priced
# high there, at U 8 by ~10 ops a direction against the zigzag's (docs/performance.md)
A2A_OPS = {False: ((11.5, 21.0), (16.8, 19.4)), True: ((21.2, 32.7), (29.7, 29.7))}


@dataclass(frozen=True)
class LayoutCost:
    """A layout's price for one mode (seconds): per direction the busiest unit's compute,
    communication and host (its torch ops and views, :func:`_host_ops`), and the total, each
    direction the slowest of the three and a share of the lesser of compute and host
    (:data:`HOST_STALL`); ``attention``: the busiest unit's forward attention alone (its pairs at
    the machine's rate)."""

    forward_compute: float
    backward_compute: float
    forward_comm: float
    backward_comm: float
    attention: float = 0.0
    forward_host: float = 0.0
    backward_host: float = 0.0

    @property
    def total(self) -> float:
        return (_direction(self.forward_compute, self.forward_comm, self.forward_host)
                + _direction(self.backward_compute, self.backward_comm, self.backward_host))

    @property
    def comm_bound(self) -> bool:
        """Its transfers set the price in a direction (above the compute and the host)."""
        return (self.forward_comm > max(self.forward_compute, self.forward_host)
                or self.backward_comm > max(self.backward_compute, self.backward_host))


def _direction(compute: float, comm: float, host: float) -> float:
    """A direction's price: the slowest of its compute, communication and host, and
    :data:`HOST_STALL` of the lesser of compute and host."""
    return max(compute, comm, host) + HOST_STALL * min(compute, host)


def burst_rounds(mode: str) -> bool:
    """Whether ``mode`` (or a hybrid's inner mode) pulls over every link at once (TASP), rather
    than one ring shift per round (ring, Mesh)."""
    return get_mode(mode).burst_rounds


def _packed_calls(layout: Layout, units: int, span: int, docs, piece: int) -> list[int]:
    """Per unit, the masked kernel calls its runs too short to be a segment of their own take: as
    :func:`~.mask.mask_pieces` cuts a buffer (mask.py's ``_segments``), runs of documents shorter
    than ``piece // 16`` tokens that follow each other in the unit's buffer are packed into
    segments of at most ``piece`` tokens, a call each (2,000 documents of ~32 tokens over 8 ranks:
    4 calls a rank, not 250)."""
    starts, short = [a for a, _ in docs], max(1, piece // 16)
    calls = [0] * units
    for u in range(units):
        group = 0  # tokens of the short runs since the last long one
        for _, pos, stop in _document_pieces(layout, u, span, docs, starts):
            if stop - pos < short:
                group += stop - pos
            elif group:
                calls[u] += -(-group // piece)
                group = 0
        calls[u] += -(-group // piece)
    return calls


def _host_ops(portions, pulled: list[int], pulling: list[int], units: int, ulysses: int, sets: bool,
              packed: list[int]) -> tuple[list[tuple[float, float]], list[tuple[float, float]]]:
    """Per unit, the (ops, views) its host issues in the forward and in the backward (:data:`HOST_OPS`,
    :data:`A2A_OPS`): what the plans of :mod:`.sparse` issue for its pulls (``pulled``: how many
    units it pulls from), its peers' pulls from it (``pulling``: how many pull from it), its runs of
    documents and ``packed``, its calls of short runs (:func:`_packed_calls`);
    ``sets``: the hybrid's all-to-all goes in rounds by document set (a layout balanced for its
    groups).

    Worked example (the module docstring's: P = 2, documents of 32K, 16K and 16K tokens): on the
    balanced layout rank 0 holds the first document's quarters [0, 8K) and [24K, 32K) -- two runs,
    one beyond the first -- and pulls from rank 1, which pulls from it: 2.4 + 3.1 + 1.0 + 5.6 =
    12.1 ops and 5.2 + 3.0 + 2.0 + 23.6 = 33.8 views forward (0.38 ms at 23 us an op and 3 us a
    view), 11.2 ops and 55.5 views backward (0.42 ms), against 58.6 ms of compute: the compute
    decides; on the zigzag rank 1 pulls from rank 0, one run each (``tests/plan/test_choice.py``)."""
    split = [0] * units
    for holders in portions.values():
        for u, runs in holders.items():
            split[u] += len(runs) - 1
    c = HOST_OPS
    counts = {"pulled": pulled, "pulling": pulling, "split": split, "short": packed}

    def direction(d: int) -> list[tuple[float, float]]:
        # the all-to-all: its rounds' calls (one collective each) and copies' launches per unit, its
        # copies' views per group member
        a2a = (A2A_OPS[sets][d][0], A2A_OPS[sets][d][1] * ulysses) if ulysses > 1 else (0.0, 0.0)
        return [tuple(c["fixed"][d][k] + a2a[k] + sum(c[t][d][k] * n[u] for t, n in counts.items())
                      for k in (0, 1)) for u in range(units)]
    return direction(0), direction(1)


def _host_seconds(per_unit, topo: Topology) -> float:
    """The busiest unit's host time: its ops at ``topo.host_op_time``, its views at ``host_view_time``,
    less the host's lead (``topo.host_lead``: what it issued before the direction began)."""
    busiest = max(ops * topo.host_op_time + views * topo.host_view_time for ops, views in per_unit)
    return max(0.0, busiest - topo.host_lead)


def layout_cost(layout: Layout, docs, shape: AttentionShape, topo: Topology, mode: str,
                ulysses: int = 1, keep_limit: float = KEEP_LIMIT) -> LayoutCost:
    """The price (module docstring) of running ``mode`` (a registered mode's name; a hybrid
    ``a2a+...`` with all-to-all degree ``ulysses``) on ``layout`` for the causal documents
    ``docs`` ((start, stop), ...), ``shape`` per rank, its ranks keeping what they pulled for the
    backward up to ``keep_limit`` x their own Q, K and V (:func:`~.sparse_needs.keep_limit_of`)."""
    return _price_parts(layout, docs, shape, topo, mode, ulysses, keep_limit)[1]()


def _price_parts(layout: Layout, docs, shape: AttentionShape, topo: Topology, mode: str, ulysses: int,
                 keep_limit: float) -> tuple[LayoutCost, Callable[[bool], LayoutCost]]:
    """(:func:`layout_cost` with the communication at 0 -- a floor under the price's ``total``, without
    its most costly part; its ``comm_bound`` means nothing --, a function giving the whole price, or
    with ``False`` the price with the communication at a lower bound of it: :meth:`~.layout_pulls._Rounds.bound`)."""
    units = layout.world_size // ulysses
    sub = inner_shape(shape, ulysses) if ulysses > 1 else shape
    portions = _portions(layout, units, ulysses, docs)
    work, pulls = _work_and_pulls(portions, docs, units)
    pair = 4.0 * sub.batch * sub.heads * sub.head_dim / topo.attention_flops
    sums = _sums_of(pulls, units, sub, topo, ulysses, keep_limit)
    extra_f, extra_b = _overheads(sums, sub, topo)
    host_f, host_b = (_host_seconds(d, topo) for d in _host_ops(
        portions, sums.peers_pulled, sums.peers_pulling, units, ulysses, ulysses > 1 and layout.group == ulysses,
        _packed_calls(layout, units, ulysses, docs, topo.mask_piece))) if topo.host_priced else (0.0, 0.0)
    floor = LayoutCost(max(w * pair + x for w, x in zip(work, extra_f)),
                       max(w * pair * BACKWARD_FLOPS + x for w, x in zip(work, extra_b)), 0.0, 0.0,
                       max(work) * pair, host_f, host_b)
    rounds = []  # made on the first call: what the transfers need of the sums is counted then

    def priced(exact: bool = True) -> LayoutCost:
        if not rounds:
            rounds.append(_Rounds(sums, sub, topo, burst_rounds(mode)))
        forward, backward = rounds[0].exact() if exact else rounds[0].bound()
        return replace(floor, forward_comm=forward, backward_comm=backward)
    return floor, priced


def choose_layout(balanced: BalancedLayout, shape: AttentionShape, topo: Topology, mode: str,
                  ulysses: int = 1, documents=None, keep_limit: float = KEEP_LIMIT
                  ) -> tuple[str, LayoutCost, LayoutCost]:
    """"balanced" or "zigzag" for one sample: the balanced layout ``balanced`` (its documents the
    sample's, causal without a window) unless the zigzag costs less for ``mode`` (a tie keeps
    the balanced layout); with both prices (balanced, zigzag). One Ulysses group over the CP group
    computes every token of its heads whatever the layout: the zigzag is kept there. ``documents``:
    the causal documents to price (default the layout's; chunked attention's: ``MaskKind.causal_groups``).
    ``keep_limit``: what the backward keeps. :func:`pick_layout`: the same pick, sooner."""
    docs = balanced.documents() if documents is None else list(documents)
    zigzag = ZigzagLayout(balanced.world_size, balanced.seq_len)
    mine = layout_cost(balanced, docs, shape, topo, mode, ulysses, keep_limit)
    theirs = layout_cost(zigzag, docs, shape, topo, mode, ulysses, keep_limit)
    return _pick(mine, theirs, topo, ulysses == balanced.world_size), mine, theirs


def pick_layout(balanced: BalancedLayout, shape: AttentionShape, topo: Topology, mode: str,
                ulysses: int = 1, documents=None, keep_limit: float = KEEP_LIMIT) -> str:
    """:func:`choose_layout`'s pick (the data loader's, per sample) without pricing what cannot change
    it: the zigzag first; then the balanced layout's compute and host, and its transfers at a lower
    bound (per unit sums, :meth:`~.layout_pulls._Rounds.bound`: for TASP the price itself); its ring
    shifts' rounds walked (its costliest part: 3-4x the zigzag's pairs of ranks at 256, every pair
    where one document lies on every rank) only where neither already costs more than the zigzag
    (``tests/plan/test_choice.py`` checks the pick against :func:`choose_layout`'s)."""
    P = balanced.world_size
    if ulysses == P:
        burst_rounds(mode), inner_shape(shape, ulysses)  # what the prices would refuse, refused
        return "zigzag"
    docs = balanced.documents() if documents is None else list(documents)
    theirs = layout_cost(ZigzagLayout(P, balanced.seq_len), docs, shape, topo, mode, ulysses, keep_limit)
    if _small(theirs, topo):
        return "zigzag"
    floor, priced = _price_parts(balanced, docs, shape, topo, mode, ulysses, keep_limit)
    if floor.total > theirs.total or not _balanced_may_win(priced(False), theirs, topo, False, lower=True):
        return "zigzag"
    return _pick(priced(), theirs, topo, False)


def _small(theirs: LayoutCost, topo: Topology) -> bool:
    """The busiest rank computes for less than a few launches (module docstring): balance buys nothing."""
    return theirs.attention < MIN_COMPUTE_LAUNCHES * topo.kernel_latency


def _pick(mine: LayoutCost, theirs: LayoutCost, topo: Topology, one_group: bool) -> str:
    """The layout kept, from the balanced layout's price ``mine`` and the zigzag's ``theirs``."""
    return "balanced" if _balanced_may_win(mine, theirs, topo, one_group) else "zigzag"


def _balanced_may_win(mine: LayoutCost, theirs: LayoutCost, topo: Topology, one_group: bool,
                      lower: bool = False) -> bool:
    """Whether the balanced layout, priced ``mine``, is kept against the zigzag's ``theirs``;
    ``lower``: ``mine`` is a lower bound of its price (its sums added in another order), and False
    means the balanced layout loses by more than rounding."""
    if one_group:
        # one Ulysses group: the layouts differ only in its kernel calls (the balanced layout's fewer: 0.04-0.15 %
        # at 8 GPUs) and its all-to-all -- the zigzag's sends dQ home while the dK/dV partials are made, the
        # balanced layout's sends both at once and copies last: 1-2 % slower (docs/performance.md)
        return False
    # where its transfers set the balanced layout's price, the price is least sure (the plans'
    # rounds wait on their peers): it has to win by COMM_MARGIN
    cheaper = mine.total <= theirs.total * (1 - COMM_MARGIN if mine.comm_bound else 1) * (1 + 1e-9 if lower else 1)
    return not _small(theirs, topo) and cheaper
