"""Megatron's default CP layout: per sample the balanced layout, unless Megatron's zigzag is
priced faster for the mode that runs it (:func:`~..choice.choose_layout`; a mask causal inside
groups of its documents -- chunked attention -- is priced as those groups; under a window, full
attention, a prefix or layers of different masks (a ``MaskStack``), where the choice is not
priced, the balanced layout). Where it keeps the balanced layout and every layer's mode computes
blocks where a layout names (Mesh) on up to 8 ranks, the owners layout (:mod:`.owners`) instead
where the simulator finds the mode's plan on it faster.

Example (8 GPUs of one node, 64K tokens of ``lognormal:4096,1.0``, 32/8 heads of 128 in bf16):
for ring, seed 0, the balanced layout (5.21 ms simulated against the zigzag's 8.63); for Mesh the
owners layout (4.81 ms) -- on 7 of seeds 0-9 (docs/performance.md, "Mesh's own layout").
"""

from __future__ import annotations

from functools import lru_cache

from ..choice import choose_layout
from ..layout import Layout
from .base import DEFAULT_LAYOUT, LayoutKind, Sample, get_layout_kind
from .owners import step_time

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
    pick = choose_layout(layout, sample.shape, sample.machine, sample.mode, sample.group, groups,
                         sample.keep_limit)[0]
    if pick != balanced.name:
        return zigzag.name, zigzag.build(sample)
    if any(owners.runs(m) for m in {sample.mode, *sample.layer_modes}) or owners.refuses(sample):
        return balanced.name, layout
    # Mesh on a few ranks where balance pays: the owners layout where the mode's plan on it simulates
    # faster than on the balanced layout -- priced by the simulator, not choose_layout's model, which
    # prices the query owner's pulls (50-110 ms for the layout and 10-20 ms per plan at 8 ranks, in
    # the look-ahead thread). Not against the zigzag: there Mesh's tiles compete by bytes, and the
    # planner's mesh-auto row by time, with ring's plan too -- a launch-bound step (the CPU problem
    # priced on H100s) would get the owners layout against a faster plan of the zigzag's
    theirs = owners.build(sample)
    return (owners.name, theirs) if step_time(sample, theirs) < step_time(sample, layout) else (balanced.name, layout)
