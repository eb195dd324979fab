"""A work-balanced, document-aware CP layout for packed documents (:func:`balanced_layout`).

Megatron's zigzag balances causal work for one sequence; packed documents of different lengths
break it (a rank whose halves fall into long documents does several times the mean). This layout
assigns every token to a rank from the documents themselves:

* every rank holds exactly S / P tokens (Megatron shards activations evenly);
* per-rank work -- the (query, key) pairs the mask allows to the rank's query tokens, window
  included; for layers with different masks sharing the layout, their sum
  (:class:`~.maskkinds.MaskStack`) -- is balanced;
* a document that fits is kept whole on one rank: it needs no CP traffic at all; a long one is cut
  into *zigzag portions* (portion i = its halves i and 2k-1-i of 2k, so every portion has the same work),
  and portions go to consecutive ranks (inside a node where they fit), so the modes' own algorithms
  run over the few ranks that share it;
* it is deterministic: every rank derives the same layout from the same boundaries.

Portions -- whole documents and the zigzag portions of the long ones -- go into the ranks' bins by
the greedy fill of :mod:`.fill` (one pass, O(portions log portions); its docstring has the algorithm
and a worked example). Where Megatron's zigzag gives the busiest rank (Ulysses
group) less work, the layout is the zigzag's tokens instead: at a few tokens per rank the portions
cannot be cut finely enough (documents [0, 31) and [31, 32) on 8 ranks of 4 tokens: the fill's
busiest rank does 1.22x the mean, the zigzag's 1.06x), and with one document over nearly the whole
sequence the zigzag is the better cut of it (1.004x against 1.01-1.02x, at any length).

Worked example (P = 2, 16 tokens, causal, documents [0, 8), [8, 12), [12, 16): work 36, 10 and
10, mean 28 per rank). Megatron's zigzag gives rank 0 positions 0-3 and 12-15 (work 20) and rank 1
4-11 (work 36: 1.29x the mean). Here the first document (work 36 > 0.25 x 28) is cut into two
zigzag portions, its quarters {0, 1} + {6, 7} and {2, 3} + {4, 5} (work 18 each), the short ones
stay whole::

    rank 0: [0, 1, 6, 7, 8, 9, 10, 11]     work 18 + 10 = 28
    rank 1: [2, 3, 4, 5, 12, 13, 14, 15]   work 18 + 10 = 28

(``tests/plan/test_balance.py`` pins it); only the first document's portions meet in an attention block.

With ``ranks_per_node`` M (a CP group over nodes of M consecutive ranks) the same fill runs
twice: over the P / M nodes (M * S / P tokens each; for the plain modes in portions of at most
``node_portion_work`` of a node's work: :mod:`.tunables`), then over the ranks of each node with
that node's portions -- a document whose work fits a node's portions (half a node's work for the plain modes,
a whole node's for the Ulysses groups) stays inside one node, so its transfers use the node's
fast links (at 256 GPUs, 32 x 8, 1M tokens of lognormal documents of mean 4096: 50 of 266
documents cross a node instead of 169).

With ``group`` U > 1 (a Ulysses hybrid of degree U) the balance is made over P / U groups of U * S
/ P tokens -- the all-to-all gathers a group's tokens, so only the groups' work matters. A group's
tokens form sets (:data:`SETS`): those of the documents that cross into another group (their
blocks with other groups' keys come last) and the rest. Each of its U ranks gets 1/U of each set
(its share of the crossing tokens first), so the hybrid's all-to-all runs as balanced rounds,
one per set (:mod:`.hybrid`); the group's span chunk holds the crossing set first, then the rest,
each sorted (:meth:`BalancedLayout.runs`). With ``hide`` the rest is three sets: inside
documents the group runs first, while the crossing tokens' round arrives, the others, and inside
documents it runs last, while the crossing rows go home -- each the fewest tokens with the pairs
to hide that round (:data:`FIRST_PAIRS`, :data:`LAST_PAIRS`). It pays where the inside
documents' work is not needed to hide the inner plan's rounds (at 256 GPUs, 1M tokens: 3.05 ->
2.98 ms with documents of mean 4096 (seed 0; over seeds 0-4 it loses, 3.67 -> 4.19 ms on
average), 13.2 -> 14.2 ms of mean 16384): the planner compares "balanced" and "balanced-hide"
(``--samples`` over several samples).
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from operator import index

from .docwork import document_work, max_work, zigzag_runs
from .fill import Portion, fill_bins, portion_runs
from .layout import Layout, match_text, register_layout
from .maskkinds import work_mask
from .sel import merge_runs
from .tunables import TUNABLES

__all__ = ["BalancedLayout", "balanced_layout", "document_work", "FIRST_PAIRS", "LAST_PAIRS", "SETS"]

# a Ulysses group's all-to-all sets (_group_sets), in the order its span chunk holds them: the
# documents that cross into another group; the documents wholly inside it run first (while the
# crossing ones' round arrives), the other inside ones, and those run last (while the crossing
# rows go home)
SETS = ("crossing", "first", "inside", "last")
# the first and last documents' size: (query, key) pairs of them per crossing token of the group,
# enough to hide the crossing tokens' gather / return on the default machine (docs/performance.md,
# GQA 32/8 of 128 in bf16, U 8). A rank receives 7/8 of the group's crossing tokens of its head
# slice: q, k and v, 1.5 KiB a token, 3.0 ns at 450 GB/s: ~580 pairs at 2 K FLOPs a pair forward
# and 400 TFLOP/s. It returns their output, 1 KiB a token: ~390 pairs (the backward gathers dy and
# returns dQ and dK/dV against 2.5x the FLOPs a pair: less)
FIRST_PAIRS = 580
LAST_PAIRS = 400


def _take_tokens(flat: list, need: int) -> list:
    """The first ``need`` tokens of the runs ``flat`` (consumed from it)."""
    mine = []
    while need:
        s, n = flat[0]
        take = min(n, need)
        mine.append((s, take))
        need -= take
        if take == n:
            flat.pop(0)
        else:
            flat[0] = (s + take, n - take)
    return mine


def _group_sets(runs, bounds, hide: bool, starts: list[int]) -> tuple[list, list, list, list]:
    """A Ulysses group's tokens (runs of global positions) as its all-to-all sets (:data:`SETS`),
    each sorted: the tokens of documents that cross into another group (their blocks with other
    groups' keys come last), then three sets of the documents wholly inside the group -- those
    run first, the others, those run last. With ``hide``, the last documents: the fewest tokens
    of them with :data:`LAST_PAIRS` causal pairs per crossing token (:func:`_fewest_tokens`), the
    first ones likewise from the rest with :data:`FIRST_PAIRS` (none when no document crosses);
    without, none (every inside document in the middle set). ``starts``: the documents' starts
    (found once per layout, not once per group: a million documents over 512 groups)."""
    cut = []  # the runs cut at document boundaries: (start, length, document)
    for s, n in runs:
        p = s
        while p < s + n:
            d = bisect.bisect_right(starts, p) - 1
            e = min(bounds[d][1], s + n)
            cut.append((p, e - p, d))
            p = e
    held: dict[int, int] = {}
    for _, n, d in cut:
        held[d] = held.get(d, 0) + n
    crossing = {d for d, n in held.items() if n < bounds[d][1] - bounds[d][0]}
    across = sum(held[d] for d in crossing) if hide else 0
    last = _fewest_tokens(sorted((held[d], d) for d in held if d not in crossing), LAST_PAIRS * across)
    first = _fewest_tokens(sorted((held[d], d) for d in held if d not in crossing | last), FIRST_PAIRS * across)
    sets = (crossing, first, None, last)
    which = {d: j for j, docs in enumerate(sets) if docs for d in docs}
    return tuple([(p, n) for p, n, d in cut if which.get(d, 2) == j] for j in range(len(SETS)))


def _fewest_tokens(inside, need: float) -> set[int]:
    """Documents of ``inside`` ((tokens, document), ascending) with at least ``need`` causal
    pairs in the fewest tokens (their return or gather stays exposed). Candidates: the longest
    documents below the need, one after another, each completed by the shortest other one that
    reaches it; when nothing reaches it, the longest document (it hides the most a token)."""
    if not need or not inside:
        return set()
    pairs = [n * (n + 1) // 2 for n, _ in inside]
    best, best_tokens = {inside[-1][1]}, None
    chosen, tokens, got = [], 0, 0
    for i in range(len(inside) - 1, -1, -1):
        # the shortest document not chosen that completes the need (the list ascends, so do pairs)
        j = bisect.bisect_left(pairs, need - got, 0, i + 1)
        if j <= i and (best_tokens is None or tokens + inside[j][0] < best_tokens):
            best, best_tokens = {*chosen, inside[j][1]}, tokens + inside[j][0]
        if got + pairs[i] >= need:
            continue  # document i alone completes it: the candidate above is at least as short
        chosen.append(inside[i][1])
        tokens, got = tokens + inside[i][0], got + pairs[i]
    return best


def _shares(sizes, group: int, local: int, rest: int) -> list[list[int]]:
    """Each of ``group`` ranks' tokens of each set (``sizes``, summing to ``group`` x ``local``):
    1/group of each set within one token, set ``rest`` taking what makes every rank's total
    ``local`` (within as many tokens as there are sets); when that set is too small for it, the
    remainders of all sets go round the ranks instead (every set within one token)."""
    out = []
    for x in range(group):
        share = [n * (x + 1) // group - n * x // group for n in sizes]
        share[rest] += local - sum(share)
        out.append(share)
    if min(min(s) for s in out) >= 0:
        return out
    out = [[n // group for n in sizes] for _ in range(group)]
    at = 0
    for j, n in enumerate(sizes):
        for i in range(n % group):
            out[(at + i) % group][j] += 1
        at += n % group
    return out


def _check_bounds(cu_seqlens, world_size: int, group: int) -> tuple[tuple[int, int], ...]:
    try:
        given = list(cu_seqlens)  # once: a generator is read one time only
    except TypeError:
        raise ValueError(f"cu_seqlens must be a sequence of integers, got {cu_seqlens!r}") from None
    try:
        cu = [index(c) for c in given]
    except TypeError:
        raise ValueError(f"cu_seqlens must hold integers, got {given!r}") from None
    except RuntimeError as e:  # a tensor whose values cannot be read: on the meta device (shapes only)
        raise ValueError(f"cu_seqlens must hold integers that can be read here, got {cu_seqlens!r} ({e}): pass the "
                         "document boundaries on the CPU or a device that holds their values") from None
    if any(isinstance(c, bool) for c in given):
        raise ValueError(f"cu_seqlens must hold integers, got {given!r}")
    if len(cu) < 2 or cu[0] != 0 or any(b <= a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"cu_seqlens must be strictly increasing from 0 (every document at least one token), got "
                         f"{cu!r}")
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    if not isinstance(group, int) or isinstance(group, bool) or group < 1 or world_size % group:
        raise ValueError(f"group (the Ulysses degree) must be a positive divisor of world_size {world_size}, got "
                         f"{group!r}")
    S = cu[-1]
    if S % (2 * world_size):
        raise ValueError(f"the sequence of {S} tokens (cu_seqlens[-1]) must split into {world_size} ranks of equal, "
                         f"even token counts: S divisible by 2 x the CP size ({2 * world_size})")
    return tuple(zip(cu, cu[1:]))


def _check_nodes(world_size: int, group: int, ranks_per_node) -> int:
    """Nodes of ``ranks_per_node`` consecutive ranks (1 when None: no node level)."""
    if ranks_per_node is None:
        return 1
    if not isinstance(ranks_per_node, int) or isinstance(ranks_per_node, bool) or ranks_per_node < 1 or \
            world_size % ranks_per_node or ranks_per_node % group:
        raise ValueError(f"ranks_per_node must be None or a positive divisor of world_size {world_size} that the "
                         f"group {group} divides, got {ranks_per_node!r}")
    return world_size // ranks_per_node


def balanced_layout(cu_seqlens, world_size: int, *, causal: bool = True, window=None, mask=None, group: int = 1,
                    ranks_per_node: int | None = None, portion_work: float = TUNABLES.portion_work,
                    node_portion_work: float | None = None, hide: bool = False) -> "BalancedLayout":
    """The work-balanced, document-aware layout of the documents ``cu_seqlens`` (0 = c0 < c1 <
    ... < cn = S, S divisible by 2 x the CP size ``world_size``: equal, even token counts per rank) under a causal (or full) mask with
    ``window`` (left, right), or under ``mask`` (any mask kind, e.g. ``masks.chunked(8192)``: its work
    is what the layout balances; its documents, if any, must be these; or a
    :class:`~.maskkinds.MaskStack` of the layers' masks: their summed work) -- see the module docstring.
    ``group``: balance over world_size / group groups of ranks (a Ulysses hybrid of that degree).
    ``ranks_per_node``: the CP group spans nodes of that many consecutive ranks -- balance the nodes first, then the ranks (groups) inside
    each node, so a document whose work fits a node's portions stays inside one (its transfers stay on
    the node's links). ``portion_work`` / ``node_portion_work``: the largest portion, in units of a rank's
    (group's) / a node's mean work (default :class:`~.tunables.Tunables`' ``portion_work``; for the
    node pass its ``node_portion_work`` with group 1, else ``portion_work``). ``hide`` (with ``group`` > 1):
    each group also sets apart documents inside it that its ranks run first and last, hiding the
    all-to-all of the documents that cross into other groups (:func:`_group_sets`, the hybrids'
    four rounds); the planner says where it pays. ValueError names a bad input."""
    bounds = _check_bounds(cu_seqlens, world_size, group)
    if not isinstance(hide, bool):
        raise ValueError(f"hide must be True or False, got {hide!r}")
    if hide and group == 1:  # as BalancedLayout: a hide asked for and not given would be a silent change
        raise ValueError("hide applies to the Ulysses groups of a layout balanced per group (group > 1), got group 1")
    mask = work_mask(mask, causal, window, bounds)
    given = {"portion_work": portion_work,
             **({} if node_portion_work is None else {"node_portion_work": node_portion_work})}
    for name, v in given.items():
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v <= 0:
            raise ValueError(f"{name} must be a positive number (the largest portion in units of the mean work), "
                             f"got {v!r}")
    S = bounds[-1][1]
    units = world_size // group  # the balanced units: ranks, or Ulysses groups of ``group`` ranks
    nodes = _check_nodes(world_size, group, ranks_per_node)
    # a document's groups (chunked attention's chunks) are independent units: a portion never
    # has to carry a group's neighbours to keep its work
    docs = [Portion(d, a, b - a, [g], mask) for d, (a, b) in enumerate(bounds) for g in mask.group_spans(b - a)]
    if nodes in (1, units):
        filled = fill_bins(docs, units, S // units, mask, portion_work)
    else:  # nodes first (a document stays inside one node when its work fits), then the units of each node
        node_work = node_portion_work if node_portion_work is not None else \
            TUNABLES.node_portion_work if group == 1 else portion_work
        filled = [unit for node in fill_bins(docs, nodes, S // nodes, mask, node_work)
                  for unit in fill_bins(node, units // nodes, S // units, mask, portion_work)]
    per_bin = [portion_runs(got) for got in filled]
    zigzag = zigzag_runs(S, units)
    if max_work(zigzag, bounds, mask) < max_work(per_bin, bounds, mask):
        per_bin = zigzag  # a few tokens per unit: the fill could not cut finely enough (module docstring)
    ranks: list[tuple[tuple[int, int], ...]] = []
    local = S // world_size
    starts = [a for a, _ in bounds] if group > 1 else []
    for runs in per_bin:
        if group == 1:
            ranks.append(tuple(runs))
            continue
        # a Ulysses group's all-to-all sets, each shared out evenly over its ranks (every rank
        # sends and receives 1/U of each all-to-all round)
        sets = _group_sets(runs, bounds, hide, starts)
        for share in _shares([sum(n for _, n in x) for x in sets], group, local, SETS.index("inside")):
            ranks.append(tuple(merge_runs([run for j, x in enumerate(sets) for run in _take_tokens(x, share[j])])))
    return BalancedLayout(world_size, tuple(ranks), bounds, group, hide)


@register_layout("balanced")
@dataclass(frozen=True)
class BalancedLayout(Layout):
    """A layout given by each rank's runs of global positions (in local order) and the documents
    -- what :func:`balanced_layout` computes. ``group``: the Ulysses degree it was balanced for
    (span-``group`` chunks are its balanced units; any span works).

    ``owners``: ((i, j, h), ...) -- rank h computes the block of rank i's queries and rank j's
    keys (i != j; blocks not named: the query owner i). A layout whose balance rests on where its
    blocks are computed names them here (``scripts/search_layout.py`` finds such layouts, and
    :func:`~.balance_owners.owners_layout` builds them for up to 8 ranks: long documents in
    contiguous portions, each pair of portions computed on one of its two ranks); Mesh's
    plans compute each block where the layout says, and the other modes, whose identity is the
    query owner (ring, TASP) or a Ulysses group, refuse such a layout instead of running it
    unbalanced. Worked example (P = 3, one document of 12 tokens, rank r holds [4r, 4r + 4)): the
    query owner gives ranks 0, 1 and 2 the work 10, 26 and 42 (each portion's own 10 pairs, and 16
    per earlier portion); ``owners=((2, 0, 0),)`` has rank 0 compute rank 2's queries against its own
    keys -- 26 each, and every rank takes part in two blocks, whose transfers are one portion each
    (rank 0's K/V to rank 1, rank 1's to rank 2, rank 2's Q to rank 0)."""

    world_size: int
    rank_runs: tuple[tuple[tuple[int, int], ...], ...]
    docs: tuple[tuple[int, int], ...]
    group: int = 1
    hide: bool = False
    owners: tuple[tuple[int, int, int], ...] = ()

    def __post_init__(self) -> None:
        for name, v in (("world_size", self.world_size), ("group", self.group)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if self.world_size % self.group:
            raise ValueError(f"group {self.group} must divide world_size {self.world_size}")
        if not isinstance(self.hide, bool):
            raise ValueError(f"hide must be True or False, got {self.hide!r}")
        if self.hide and self.group == 1:
            raise ValueError("hide applies to the Ulysses groups of a layout balanced per group (group > 1), got group 1")
        if len(self.rank_runs) != self.world_size:
            raise ValueError(f"{len(self.rank_runs)} ranks' runs for world_size {self.world_size}")
        counts = {sum(n for _, n in r) for r in self.rank_runs}
        if len(counts) != 1:
            raise ValueError(f"every rank must hold the same number of tokens, got {sorted(counts)}")
        covered = sorted(p for r in self.rank_runs for p in r)
        pos = 0
        for s, n in covered:
            if s != pos or n < 1:
                raise ValueError(f"the ranks' runs must cover positions 0..S-1 exactly once; gap or overlap at {pos}")
            pos += n
        if not self.docs:  # no documents: every token would attend nothing (an all-zero output)
            raise ValueError(f"documents must cover positions 0..{pos - 1} in order (one document: ((0, {pos}),)), got "
                             "none")
        end = 0  # the documents: in order, disjoint, and exactly the runs' S tokens
        for a, b in self.docs:
            if a != end or b <= a:
                raise ValueError(f"documents {self.docs!r} must cover positions 0..{pos - 1} in order, each at least "
                                 f"one token")
            end = b
        if end != pos:
            raise ValueError(f"documents {self.docs!r} cover {end} tokens, the ranks' runs {pos}")
        if self.owners and self.group != 1:
            raise ValueError(f"owners name the ranks of plain modes' blocks; this layout is balanced for Ulysses groups "
                             f"of {self.group} (group must be 1)")
        P, seen = self.world_size, set()
        for t in self.owners:
            if (not isinstance(t, tuple) or len(t) != 3
                    or any(isinstance(x, bool) or not isinstance(x, int) or not 0 <= x < P for x in t)):
                raise ValueError(f"each owner must be (query rank, key rank, computing rank) of ranks 0..{P - 1}, got {t!r}")
            if t[0] == t[1] or t[:2] in seen:
                raise ValueError(f"owners must name each block (i, j) of two different ranks at most once, got {t!r}")
            seen.add(t[:2])

    def owner(self, i: int, j: int) -> int:
        """The rank that computes the block of rank i's queries and rank j's keys (``owners``,
        else i)."""
        table = self.__dict__.get("_owner_table")
        if table is None:
            table = self.__dict__["_owner_table"] = {(a, b): h for a, b, h in self.owners}
        return table.get((i, j), i)

    @property
    def seq_len(self) -> int:
        return self.docs[-1][1]

    @property
    def seq_local(self) -> int:
        return sum(n for _, n in self.rank_runs[0])

    def runs(self, chunk: int, span: int = 1) -> tuple[tuple[int, int, int], ...]:
        """Rank ``chunk``'s runs (span 1), or those of ranks chunk*span .. chunk*span+span-1 in
        rank order (what a Ulysses group of ``span`` ranks gathers). The group this layout was
        balanced for (span = ``group`` > 1) holds its tokens in all-to-all set order instead: the
        documents that cross into another group, then the rest, each sorted (one contiguous
        segment per set, whichever of its ranks sent the tokens)."""
        if span < 1 or self.world_size % span or not 0 <= chunk < self.world_size // span:
            raise ValueError(f"chunk {chunk} of span {span} does not exist over CP size {self.world_size}")
        if span > 1 and span == self.group:
            return self._set_order(chunk)[0]
        out, local = [], 0
        for r in range(chunk * span, (chunk + 1) * span):
            for s, n in self.rank_runs[r]:
                out.append((local, s, n))
                local += n
        return tuple(out)

    def _set_order(self, chunk: int) -> tuple[tuple[tuple[int, int, int], ...], tuple[int, ...]]:
        """Group ``chunk``'s runs in all-to-all set order, and each set's token count (cached: the
        hybrids ask for them per rank)."""
        cache = self.__dict__.setdefault("_sets", {})
        got = cache.get(chunk)
        if got is None:
            U = self.group
            starts = self.__dict__.get("_starts")
            if starts is None:
                starts = self.__dict__["_starts"] = [a for a, _ in self.docs]
            sets = _group_sets(merge_runs(sorted(run for r in range(chunk * U, (chunk + 1) * U)
                                                 for run in self.rank_runs[r])), self.docs, self.hide, starts)
            out, local = [], 0
            for runs in sets:
                for s, n in merge_runs(runs):
                    out.append((local, s, n))
                    local += n
            got = cache[chunk] = (tuple(out), tuple(sum(n for _, n in x) for x in sets))
        return got

    def set_tokens(self, chunk: int) -> tuple[int, ...]:
        """Tokens of Ulysses group ``chunk`` (span ``group``) in each all-to-all set (:data:`SETS`),
        in the order its span chunk holds them: the rounds of a hybrid's all-to-all (:mod:`.hybrid`).
        ValueError for a layout not balanced per group (group 1) or a group that does not exist."""
        groups = self.world_size // self.group
        if self.group == 1:
            raise ValueError("set_tokens applies to a layout balanced per Ulysses group (group > 1); this one has "
                             "group 1")
        if isinstance(chunk, bool) or not isinstance(chunk, int) or not 0 <= chunk < groups:
            raise ValueError(f"group {chunk!r} does not exist: this layout has groups 0..{groups - 1} of {self.group} "
                             "ranks")
        return self._set_order(chunk)[1]

    def documents(self) -> tuple[tuple[int, int], ...]:
        return self.docs

    def text(self) -> str:
        docs = ",".join(str(b) for _, b in self.docs)
        ranks = ";".join(",".join(f"{s}+{n}" for s, n in r) for r in self.rank_runs)
        owners = f" owners={','.join(f'{i}>{j}:{h}' for i, j, h in self.owners)}" if self.owners else ""
        return f"balanced P={self.world_size} U={self.group}{' hide' if self.hide else ''} cu=0,{docs} runs={ranks}{owners}"

    @classmethod
    def parse(cls, rest: str) -> "BalancedLayout":
        example = "balanced P=2 U=1 cu=0,4,8 runs=0+4;4+4"
        m = match_text(r"^P=(\d+) U=(\d+)( hide)? cu=(\d+(?:,\d+)*) runs=(\d+\+\d+(?:[,;]\d+\+\d+)*)"
                       r"(?: owners=(\d+>\d+:\d+(?:,\d+>\d+:\d+)*))?$", rest, example)
        cu = [int(x) for x in m.group(4).split(",")]
        runs = tuple(tuple((int(s), int(n)) for s, n in (x.split("+") for x in r.split(",")))
                     for r in m.group(5).split(";"))
        owners = tuple(tuple(int(v) for v in x.replace(">", ":").split(":")) for x in m.group(6).split(",")) \
            if m.group(6) else ()
        return cls(int(m.group(1)), runs, tuple(zip(cu, cu[1:])), int(m.group(2)), m.group(3) is not None, owners)
