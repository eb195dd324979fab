"""The work-balanced, document-aware layout (:func:`~..balance.balanced_layout`): per sample,
every rank (Ulysses group) the same attention work, short documents whole on one rank, nodes
first when the CP group spans nodes."""

from __future__ import annotations

from functools import lru_cache

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
        return _balanced(sample.cu_seqlens, sample.world_size, sample.head, sample.group,
                         n if n and n % sample.group == 0 else None, self.hide and sample.group > 1)


@lru_cache(maxsize=4)
def _balanced(cu_seqlens: tuple, world_size: int, head, group: int, ranks_per_node, hide: bool):
    """One balanced layout, built once for the modes that run on it (the planner prices every mode of
    a sample, and ``auto`` each mode's choice, on it: a million 1-token documents take seconds);
    ``head``: the sample's mask without documents (:attr:`Sample.head`)."""
    return balanced_layout(cu_seqlens, world_size, mask=head, group=group, ranks_per_node=ranks_per_node, hide=hide)
