"""Mesh's own layout of packed documents: the balanced layout that also names the rank computing each
block (:func:`~..balance_owners.owners_layout`, ``BalancedLayout.owners``), for up to 8 ranks.

Under the query owner every holder of a document's later rows pulls its earlier tokens, so even
perfectly balanced the busiest rank sends 1.3-1.5x the query-owner bound; computing a block at its
key/value end where that ships fewer bytes goes below it (:mod:`..balance_owners`). Only Mesh
computes blocks where a layout names (``Mode.takes_block_owners``): ring and TASP are their query
owner by definition and refuse such a layout. The builder cannot lay out every sample (work above
1.05x the mean on 5 of 40 samples of the CPU problem's mix, more than 6 long documents, or none):
``auto`` -- Megatron's default -- runs it where it lays out a sample and the simulator finds the
layers' Mesh faster on it (:func:`step_time`); ``--cp-layout owners`` (comparisons, tests) raises
on such a sample, naming why; the planner shows its rows (``--layout owners``).

Example: documents of 12, 4, 4 and 4 tokens on 3 ranks of 8 (the worked example of
:mod:`..balance_owners`): the long document in portions of 4 on every rank, each rank beside one
short document and computing one of the long document's three blocks: work 36 pairs on each rank,
where the query owner computes 20, 36 and 52.
"""

from __future__ import annotations

import math
from dataclasses import fields, replace
from functools import lru_cache

from ..balance import BalancedLayout
from ..balance_owners import MAX_RANKS, owners_layout
from ..layout import Layout
from ..mask import documents_of
from ..modes import MODES, get_mode, resolve
from ..shape import AttentionShape
from ..simulate import simulate
from .base import LayoutKind, Sample, SampleLayoutError

__all__ = ["OwnersKind", "step_time", "beats_the_zigzag"]


class OwnersKind(LayoutKind):
    name = "owners"
    help = (f"Mesh only, up to {MAX_RANKS} ranks, causal documents: the balanced layout that also names the rank "
            "computing each block (fewer bytes than the query owner); raises on a sample it cannot balance -- auto "
            "uses it where it can and is faster")
    every_sample = False  # the builder cannot balance every sample (module docstring)

    def runs(self, mode: str) -> str | None:
        m = MODES.get(mode)
        if m is not None and m.takes_block_owners:
            return None
        takers = ", ".join(n for n, x in MODES.items() if x.takes_block_owners)
        return (f"the {self.name} layout names other ranks than the query's owner for some blocks: {takers} "
                f"computes them there, not {mode}")

    def refuses(self, sample: Sample, *, build: bool = True) -> str | None:
        why = _unfit(sample)
        if why is None and build:
            try:
                _layout(sample)
            except ValueError as e:  # the builder's own reason: it cannot balance these documents
                return str(e)
        return why

    def build(self, sample: Sample) -> BalancedLayout:
        why = _unfit(sample)
        if why is not None:
            raise ValueError(f"{self.flag}: {why}")
        try:
            return _layout(sample)
        except ValueError as e:  # the documents: say which sample, and what lays out every one
            cu = sample.cu_seqlens
            lengths = [b - a for a, b in zip(cu, cu[1:])]
            raise SampleLayoutError(f"{self.flag}: no layout of a sample of {len(lengths)} documents (longest {max(lengths)} "
                             f"of {cu[-1]} tokens) over {sample.world_size} ranks: {e}; --cp-layout balanced lays out "
                             "every sample, --cp-layout auto uses this one where it lays a sample out and Mesh runs "
                             "faster on it") from None


def _unfit(sample: Sample) -> str | None:
    """Why the builder does not apply to ``sample`` at all (its documents aside)."""
    P, S = sample.world_size, sample.cu_seqlens[-1]
    if not 2 <= P <= MAX_RANKS:
        return f"built for 2 to {MAX_RANKS} CP ranks (its cost grows with the pairs of ranks), got {P}"
    if sample.group != 1:
        return f"names the ranks of plain modes' blocks, not of Ulysses groups (U {sample.group})"
    if sample.mask is not None or not sample.causal or sample.window is not None:
        got = f"mask {sample.mask.head_text()}" if sample.mask is not None else \
            f"causal {sample.causal}, window {sample.window}"
        return f"built for causal documents without a window or another mask kind, got {got}"
    if sample.shape is None:
        return "needs the per-rank shape (its bytes decide the layout)"
    if S % P:
        return f"the sample's {S} tokens do not divide over {P} ranks"
    return None


def _layout(sample: Sample) -> BalancedLayout:
    P = sample.world_size
    return _owners(sample.cu_seqlens, P, replace(sample.shape, seq_local=sample.cu_seqlens[-1] // P), sample.keep_limit)


@lru_cache(maxsize=8)
def _owners(cu_seqlens: tuple, world_size: int, shape: AttentionShape, keep_limit: float) -> BalancedLayout:
    # one build per sample for the batch split, the layers and the choice (50-110 ms at 8 ranks)
    return owners_layout(cu_seqlens, world_size, shape, keep_limit=keep_limit)


def _options(sample: Sample) -> dict:
    """The options a sample's mode is planned with: the layers' (``sample.options``), else a
    backward keeping what the sample's ``keep_limit`` says."""
    if sample.options:
        return dict(sample.options)
    return dict(backward_chunks="keep") if math.isinf(sample.keep_limit) else \
        dict(backward_chunks="auto", backward_keep_limit=sample.keep_limit)


def step_time(sample: Sample, layout: Layout | None) -> float:
    """Simulated forward + backward seconds of ``sample.mode``'s plan of ``sample`` on ``layout``
    (None: Megatron's zigzag) on the sample's machine, with the sample's ``options`` (those the mode
    takes; without any, its backward keeping what the sample's ``keep_limit`` says) -- what the
    planner's rows report."""
    P = sample.world_size
    S = sample.cu_seqlens[-1]
    shape = replace(sample.shape, seq_local=S // P)
    takes = {f.name for f in fields(get_mode(sample.mode).Options)}
    settings = {k: v for k, v in _options(sample).items() if k in takes}
    topo = sample.machine
    placement = resolve(sample.mode, P, shape, topo, ranks_per_node=sample.ranks_per_node, **settings)
    mask = sample.head
    if layout is None or layout.documents() is None:
        mask = mask.with_documents(documents_of(sample.cu_seqlens, S)).normalized(S)
    return simulate(placement.build(shape, mask, layout, topology=topo), shape, topo).time


def beats_the_zigzag(sample: Sample, seconds: float) -> bool:
    """Whether a plan of ``seconds`` is faster than every plan ``sample.mode`` could run on Megatron's
    zigzag: its planner candidates (Mesh: each tile) and those of the modes competing for its planner
    row (ring's query-owner plan), each with the sample's options and the candidate's own (its tile).
    The query owner's first -- the fastest on most samples -- each simulated in turn (10-20 ms at 8
    ranks), stopping at the first that is not slower. Conservative on purpose: Megatron runs one of
    them (Mesh's ``auto`` tile picks by bytes), and a layout faster than all is faster than it and
    than the planner's fastest row of the zigzag, which then agrees with the choice."""
    mode = get_mode(sample.mode)
    P, shape, topo = sample.world_size, sample.shape, sample.machine
    for name in (*mode.auto_pool, mode.name):
        m = get_mode(name)
        defaults = m.Options()
        for p in m.candidates(P, replace(shape, seq_local=sample.cu_seqlens[-1] // P), topo):
            own = {f.name: getattr(p.options, f.name) for f in fields(p.options)
                   if getattr(p.options, f.name) != getattr(defaults, f.name)}
            options = {**_options(sample), **own}
            if step_time(replace(sample, mode=name, options=tuple(options.items())), None) <= seconds:
                return False
    return True
