"""Transformer Engine's THD layout of packed documents (:class:`~..layout.ThdLayout`): each
document padded to a multiple of 2P and zigzag-split on its own. Megatron runs it with
``--cp-thd-packing`` (not a ``--cp-layout`` value); Transformer Engine's own modes run on it."""

from __future__ import annotations

from ..layout import ThdLayout
from .base import LayoutKind, Sample

__all__ = ["ThdKind", "thd_layout"]


def thd_layout(cu_seqlens, world_size: int) -> ThdLayout:
    """Transformer Engine's THD layout of the documents: each padded to a multiple of 2 * CP and
    zigzag-split on its own (the padding tokens attend nothing). E.g. documents of 5 and 3 tokens
    at CP 2: padded to 8 and 4, ``cu_seqlens_padded`` (0, 8, 12)."""
    lens = [b - a for a, b in zip(cu_seqlens, cu_seqlens[1:])]
    step = 2 * world_size
    padded = [0]
    for n in lens:
        padded.append(padded[-1] + -(-n // step) * step)
    return ThdLayout(world_size, tuple(padded), tuple(lens))


class ThdKind(LayoutKind):
    name = "thd"
    help = "Transformer Engine's THD (every document padded to a multiple of 2 x CP and zigzag-split on its own)"
    cp_layout = False
    megatron_flag = "--cp-thd-packing"
    transformer_engine_rows = True
    # the most ranks at which a comparison of every layout plans the plugin's modes on THD: there each
    # rank holds two halves of every document, so a plan's blocks grow as ranks^2 x documents (1M tokens
    # of 4K documents on this project's build machine: 44 s at 64 ranks, minutes at 128, hours at 256)
    plan_ranks = 64

    def build(self, sample: Sample) -> ThdLayout:
        return thd_layout(sample.cu_seqlens, sample.world_size)

    def too_large(self, sample: Sample) -> str | None:
        if sample.world_size <= self.plan_ranks:
            return None
        return (f"not planned on THD at CP {sample.world_size}: every rank holds two halves of each of the "
                f"{len(sample.cu_seqlens) - 1} documents, too many blocks to plan in reasonable time above "
                f"{self.plan_ranks} ranks")
