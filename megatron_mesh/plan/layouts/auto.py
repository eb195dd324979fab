"""Megatron's default CP layout: per sample the balanced layout, unless Megatron's zigzag is
priced faster for the mode that runs it (:func:`~..choice.pick_layout`; a mask causal inside
groups of its documents -- chunked attention -- is priced as those groups; under a window, full
attention, a prefix or layers of different masks (a ``MaskStack``), where the choice is not
priced, the balanced layout). Where every layer's mode computes blocks where a layout names (Mesh)
on up to 8 ranks, the owners layout (:mod:`.owners`) instead where the simulator finds the mode's
plan on it faster than on the balanced layout kept -- or, where the zigzag is kept, faster than
every plan the mode could run on it (:func:`~.owners.beats_the_zigzag`).

Example (8 GPUs of one node, 64K tokens of ``lognormal:4096,1.0``, 32/8 heads of 128 in bf16):
for ring, seed 0, the balanced layout (5.21 ms simulated against the zigzag's 8.63); for Mesh the
owners layout (4.75 ms) -- on 8 of seeds 0-9 (docs/performance.md, "Mesh's own layout").
"""

from __future__ import annotations

from functools import lru_cache

from ..choice import pick_layout
from ..layout import Layout
from .base import DEFAULT_LAYOUT, LayoutKind, Sample, get_layout_kind
from .owners import beats_the_zigzag, step_time

__all__ = ["AutoKind"]


class AutoKind(LayoutKind):
    name = DEFAULT_LAYOUT
    help = ("per sample the balanced layout, unless Megatron's zigzag is priced faster for the layers' mode (the "
            "plain modes across nodes, mostly; megatron_mesh/plan/choice.py); for Mesh on up to 8 ranks the "
            "owners layout where simulated faster")
    derived_from = ("balanced", "zigzag", "owners")

    def build(self, sample: Sample) -> Layout | None:
        return _choose(sample)[1]

    def pick(self, sample: Sample) -> str:
        return _choose(sample)[0]


@lru_cache(maxsize=16)
def _choose(sample: Sample) -> tuple[str, Layout | None]:
    """(the kind picked, its layout) for ``sample`` (one choice per sample: the batch split, the
    layers and the planner's rows ask it again)."""
    balanced, zigzag, owners = (get_layout_kind(name) for name in AutoKind.derived_from)
    layout = balanced.build(sample)
    groups = None
    if sample.mask is not None:  # priced where the mask is causal inside groups (chunks)
        groups = sample.mask.causal_groups(layout.documents())
        if groups is None:
            return balanced.name, layout
    elif not sample.causal or sample.window is not None:
        return balanced.name, layout
    if sample.shape is None:
        raise ValueError(f"--cp-layout {DEFAULT_LAYOUT} prices each sample for its mode: give the per-rank shape")
    pick = pick_layout(layout, sample.shape, sample.machine, sample.mode, sample.group, groups, sample.keep_limit)
    kept = (balanced.name, layout) if pick == balanced.name else (zigzag.name, zigzag.build(sample))
    if any(owners.runs(m) for m in {sample.mode, *sample.layer_modes}) or owners.refuses(sample):
        return kept
    # Mesh on a few ranks: the owners layout where the mode's plan on it simulates faster than on the
    # layout kept -- priced by the simulator, not choose_layout's model, which prices the query
    # owner's pulls (50-110 ms for the layout and 10-20 ms per plan at 8 ranks, in the look-ahead
    # thread). Against the zigzag, faster than every plan the mode could run there (beats_the_zigzag:
    # Mesh's tiles compete by bytes, the planner's mesh-auto row by time, ring's plan among them)
    theirs = owners.build(sample)
    seconds = step_time(sample, theirs)
    faster = seconds < step_time(sample, layout) if pick == balanced.name else beats_the_zigzag(sample, seconds)
    return (owners.name, theirs) if faster else kept
