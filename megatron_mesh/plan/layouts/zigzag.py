"""Megatron's own CP layout: the global zigzag (:class:`~..layout.ZigzagLayout`), each sample's
documents carried by the mask."""

from __future__ import annotations

from .base import REFERENCE_LAYOUT, LayoutKind, Sample

__all__ = ["ZigzagKind"]


class ZigzagKind(LayoutKind):
    name = REFERENCE_LAYOUT
    help = "Megatron's global zigzag (every sample cut into 2P halves, rank r holding halves r and 2P-1-r)"
    per_sample = False

    def build(self, sample: Sample) -> None:
        return None  # Megatron's zigzag: the documents go with the mask
