"""Megatron's default CP layout: per sample the balanced layout, unless Megatron's zigzag is
priced faster for the mode that runs it (:func:`~..choice.choose_layout`; a mask causal inside
groups of its documents -- chunked attention -- is priced as those groups; under a window, full
attention, a prefix or layers of different masks (a ``MaskStack``), where the choice is not
priced, the balanced layout)."""

from __future__ import annotations

from ..choice import choose_layout
from ..layout import Layout
from .base import DEFAULT_LAYOUT, LayoutKind, Sample, get_layout_kind

__all__ = ["AutoKind"]


class AutoKind(LayoutKind):
    name = DEFAULT_LAYOUT
    help = ("per sample the balanced layout, unless Megatron's zigzag is priced faster for the layers' mode (the "
            "plain modes across nodes, mostly; megatron_mesh/plan/choice.py)")
    derived_from = ("balanced", "zigzag")

    def _choose(self, sample: Sample) -> tuple[str, Layout | None]:
        balanced, zigzag = (get_layout_kind(name) for name in self.derived_from)
        layout = balanced.build(sample)
        groups = None
        if sample.mask is not None:  # priced where the mask is causal inside groups (chunks)
            groups = sample.mask.causal_groups(layout.documents())
            if groups is None:
                return balanced.name, layout
        elif not sample.causal or sample.window is not None:
            return balanced.name, layout
        if sample.shape is None:
            raise ValueError(f"--cp-layout {self.name} prices each sample for its mode: give the per-rank shape")
        pick = choose_layout(layout, sample.shape, sample.machine, sample.mode, sample.group, groups,
                             sample.keep_limit)[0]
        return (balanced.name, layout) if pick == balanced.name else (zigzag.name, zigzag.build(sample))

    def build(self, sample: Sample) -> Layout | None:
        return self._choose(sample)[1]

    def pick(self, sample: Sample) -> str:
        return self._choose(sample)[0]
