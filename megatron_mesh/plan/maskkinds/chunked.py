"""Chunked local attention (Llama 4): a query attends the keys of its own chunk of ``size``
tokens, causally; chunks are counted from each document's start (from 0 without documents).

Each chunk is a group of its own (:mod:`.base`): blocks of two chunks are empty, so a plan moves
only the tokens of chunks that span two ranks, like a window's halo. Worked example: size 4,
documents [0, 6) and [6, 16): the chunks are [0, 4), [4, 6), [6, 10), [10, 14), [14, 16); query 12
attends keys [10, 13).

Chunk size >= the longest document is plain causal attention (:meth:`Chunked.normalized` gives the
band kind, whose dense plans then apply).
"""

from __future__ import annotations

from dataclasses import dataclass

from .registry import register_mask_kind
from .band import Mask
from .base import INF, MaskKind, check_count, check_documents, int_head

__all__ = ["Chunked"]


@register_mask_kind("chunked")
@dataclass(frozen=True)
class Chunked(MaskKind):
    """Causal attention inside chunks of ``size`` tokens (see the module docstring)."""

    size: int
    documents: tuple | None = None
    causal = True

    def __post_init__(self) -> None:
        check_count(self.size, 1, "chunked attention's chunk size (tokens per chunk)")
        object.__setattr__(self, "documents", check_documents(self.documents))

    def parts(self, doc_len, lo, hi):
        s = self.size
        return tuple((max(lo, c * s), min(hi, (c + 1) * s), c * s, 0) for c in range(lo // s, (hi - 1) // s + 1))

    def pair_band(self, qpart: int, kpart: int) -> tuple[float, float]:
        return 0, INF  # causal inside the chunk

    def reach(self, doc_len, rel):
        return rel - rel % self.size, rel + 1

    def span_work(self, a: int, b: int, doc_len: int) -> int:
        """Closed form: query t sees t - (its chunk's start) + 1 keys."""
        total, s = 0, self.size
        for c in range(a // s, (b - 1) // s + 1 if b > a else a // s):
            x, y = max(a, c * s) - c * s, min(b, (c + 1) * s) - c * s  # chunk-relative queries [x, y)
            total += (y * (y + 1) - x * (x + 1)) // 2
        return total

    def normalized(self, seq_len: int) -> MaskKind:
        if self.size >= self.longest(seq_len):
            return Mask(True, None, self.documents).normalized(seq_len)
        return super().normalized(seq_len)

    def head_text(self) -> str:
        return f"chunked={self.size}"

    @classmethod
    def from_head(cls, head: str, documents) -> "Chunked":
        return cls(int_head(head, "chunked"), documents)
