"""Prefix-LM attention: inside each document, the first ``length`` tokens attend each other both
ways; every later token attends causally (the prefix and the tokens before it).

A document shorter than ``length`` is bidirectional as a whole (its prefix is all of it), as
flex attention's ``prefix_lm`` mask means it: packed samples of varying lengths under one prefix
length (an image or instruction prefix) then never fail on their shortest document. ``length``
0 is causal attention, a prefix covering the longest document full attention
(:meth:`Prefix.normalized` gives the band kind for both).

Each document is one group with two parts (:mod:`.base`): 0 the prefix, 1 the rest; pair bands
(0, 0) both ways, (0, 1) none, (1, *) causal. Worked example: length 2, documents [0, 4) and
[4, 10): query 1 attends keys [0, 2), query 5 keys [4, 6), query 8 keys [4, 9).
"""

from __future__ import annotations

from dataclasses import dataclass

from .registry import register_mask_kind
from .band import Mask
from .base import INF, NONE_BAND, MaskKind, check_count, check_documents, int_head

__all__ = ["Prefix"]


@register_mask_kind("prefix")
@dataclass(frozen=True)
class Prefix(MaskKind):
    """Bidirectional inside each document's first ``length`` tokens, causal after them."""

    length: int
    documents: tuple | None = None

    def __post_init__(self) -> None:
        check_count(self.length, 0, "prefix length (tokens per document attending both ways)")
        object.__setattr__(self, "documents", check_documents(self.documents))

    def parts(self, doc_len, lo, hi):
        p = min(self.length, doc_len)
        out = []
        if lo < p:
            out.append((lo, min(hi, p), 0, 0))
        if hi > p:
            out.append((max(lo, p), hi, 0, 1))
        return out

    def pair_band(self, qpart: int, kpart: int) -> tuple[float, float]:
        if qpart == 0:
            return (-INF, INF) if kpart == 0 else NONE_BAND
        return 0, INF

    def reach(self, doc_len, rel):
        return 0, max(min(self.length, doc_len), rel + 1)

    def span_work(self, a: int, b: int, doc_len: int) -> int:
        """Closed form: a prefix query sees the prefix, a later query t the t + 1 keys up to it."""
        p = min(self.length, doc_len)
        inside = max(0, min(b, p) - a)
        x, y = max(a, p), b
        return inside * p + (max(0, y * (y + 1) - x * (x + 1)) // 2 if y > x else 0)

    def normalized(self, seq_len: int) -> MaskKind:
        if self.length == 0 or self.length >= self.longest(seq_len):
            return Mask(self.length == 0, None, self.documents).normalized(seq_len)
        return super().normalized(seq_len)

    def head_text(self) -> str:
        return f"prefix={self.length}"

    @classmethod
    def from_head(cls, head: str, documents) -> "Prefix":
        return cls(int_head(head, "prefix"), documents)
