"""The work-balanced, document-aware layout (:func:`~..balance.balanced_layout`): per sample,
every rank (Ulysses group) the same attention work, short documents whole on one rank, nodes
first when the CP group spans nodes."""

from __future__ import annotations

from ..balance import BalancedLayout, balanced_layout
from .base import LayoutKind, Sample

__all__ = ["BalancedKind"]


class BalancedKind(LayoutKind):
    name = "balanced"
    help = ("each sample's own work-balanced, document-aware layout (short documents whole on one rank, long "
            "ones in zigzag portions over a few ranks)")
    hide = False  # its Ulysses groups also set apart documents run first and last (balanced_hide.py)

    def build(self, sample: Sample) -> BalancedLayout:
        """Balanced per Ulysses group of the sample's mode, nodes first where the nodes hold whole
        groups (else the group level decides alone)."""
        n = sample.ranks_per_node
        return balanced_layout(sample.cu_seqlens, sample.world_size, causal=sample.causal, window=sample.window,
                               group=sample.group, ranks_per_node=n if n and n % sample.group == 0 else None,
                               hide=self.hide and sample.group > 1)
