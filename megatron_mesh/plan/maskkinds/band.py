"""The band kind: causal or full attention with an optional sliding window, inside documents.

Query token i may attend key token j iff both are in the same document, j <= i when ``causal``,
and i - j <= left and j - i <= right for a window (left, right) (flash-attn / Megatron
convention; None = unlimited). Inside a document the allowed pairs are the band
lo <= i - j <= hi (lo = 0 if causal else -right, hi = left): one group, one part
(:mod:`.base`). Dense causal attention is the special case "one document, no window".
"""

from __future__ import annotations

from dataclasses import dataclass

from ..docwork import document_work
from .base import INF, MaskKind, check_documents
from .registry import mask_from_text, register_mask_kind

__all__ = ["Mask", "documents_of"]


@register_mask_kind("causal", "full")
@dataclass(frozen=True)
class Mask(MaskKind):
    """The band kind (see the module docstring): causal or full attention with an optional
    sliding window, inside ``documents`` (sorted, disjoint (start, stop) intervals of global
    positions; None: the whole sequence is one document); ``window``: (left, right), each an int
    >= 0 or None (unlimited). The other kinds: :mod:`.maskkinds`."""

    causal: bool = True
    window: tuple = (None, None)
    documents: tuple | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.causal, bool):
            raise ValueError(f"causal must be True or False, got {self.causal!r}")
        w = self.window
        if w is None:
            object.__setattr__(self, "window", (None, None))
            w = self.window
        if not isinstance(w, tuple) or len(w) != 2:
            raise ValueError(f"window must be (left, right) with ints >= 0 or None, got {w!r}")
        for side, v in zip(("left", "right"), w):
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
                raise ValueError(f"window {side} must be an int >= 0 or None (unlimited), got {v!r}")
        if self.causal and w[1] not in (None, 0):
            raise ValueError(f"window right {w[1]} > 0 with causal attention: a causal query never sees a later "
                             "key, so right must be 0 or None")
        if self.causal and w[1] is None:
            object.__setattr__(self, "window", (w[0], 0))
        object.__setattr__(self, "documents", check_documents(self.documents))

    # -- construction ----------------------------------------------------------------------------
    @classmethod
    def from_cu_seqlens(cls, cu_seqlens, seq_len: int, causal: bool = True, window=None) -> "Mask":
        """Documents of a packed sequence of ``seq_len`` tokens from their boundaries
        (``cu_seqlens``: 0 = c0 < c1 < ... < cn = seq_len; Megatron's global zigzag layout)."""
        return cls(causal, window, documents_of(cu_seqlens, seq_len)).normalized(seq_len)

    def normalized(self, seq_len: int) -> "Mask":
        """The same mask in its simplest form over a sequence of ``seq_len`` tokens: one document
        covering everything is no document; a window that cannot bite is no window."""
        docs = self.documents
        if docs is not None and docs == ((0, seq_len),):
            docs = None
        left, right = self.window
        longest = seq_len if docs is None else max((b - a for a, b in docs), default=0)
        if left is not None and left >= longest - 1:
            left = None
        if right is not None and not self.causal and right >= longest - 1:
            right = None
        if self.causal:
            right = 0
        return Mask(self.causal, (left, right), docs)

    @property
    def is_dense(self) -> bool:
        """Plain causal or full attention (no documents, no window): the zigzag rule applies."""
        return self.documents is None and self.window[0] is None and (self.causal or self.window[1] is None)

    # -- the rule ----------------------------------------------------------------------------------
    def band(self) -> tuple[float, float]:
        """Allowed range of i - j inside one document: [lo, hi]."""
        left, right = self.window
        lo = 0 if self.causal else (-right if right is not None else -INF)
        hi = left if left is not None else INF
        return lo, hi

    def parts(self, doc_len, lo, hi):
        return ((lo, hi, 0, 0),)  # one group, one part: the document

    def pair_band(self, qpart: int, kpart: int) -> tuple[float, float]:
        return self.band()

    def reach(self, doc_len, rel):
        lo, hi = self.band()
        return rel - hi, rel - lo + 1

    def span_work(self, a: int, b: int, doc_len: int) -> int:
        return document_work(a, b, doc_len, self.causal, self.window)

    # -- text --------------------------------------------------------------------------------------
    def head_text(self) -> str:
        """``causal`` / ``full``, then the window if one bites, e.g. ``causal,window=128:0``."""
        parts = ["causal" if self.causal else "full"]
        if self.window != (None, 0 if self.causal else None):
            l, r = self.window
            parts.append(f"window={'-' if l is None else l}:{'-' if r is None else r}")
        return ",".join(parts)

    @classmethod
    def from_head(cls, head: str, documents) -> "Mask":
        parts = head.split(",")
        causal, window = parts[0] == "causal", None
        for p in parts[1:]:
            name, _, val = p.partition("=")
            if name != "window":
                raise ValueError(f"unknown mask field {name!r} in {head!r}")
            l, r = val.split(":")
            window = (None if l == "-" else int(l), None if r == "-" else int(r))
        return cls(causal, window, documents)

    @staticmethod
    def from_text(text: str) -> MaskKind:
        """Any registered kind's mask from its :meth:`~.maskkinds.MaskKind.text`."""
        return mask_from_text(text)

    # -- composition (``&``, :meth:`~.base.MaskKind.__and__`) -----------------------------------------
    is_band = True

    def band_and(self, other: "Mask") -> "Mask":
        """The pairs both bands allow: the narrower band on each side."""
        lo = max(self.band()[0], other.band()[0])  # a band's lo is 0 (causal) or -right <= 0
        hi = min(self.band()[1], other.band()[1])
        causal = lo >= 0
        return Mask(causal, (None if hi == INF else int(hi), 0 if causal else (None if lo == -INF else int(-lo))))


def documents_of(cu_seqlens, seq_len: int) -> tuple[tuple[int, int], ...]:
    """The (start, stop) documents of boundaries ``cu_seqlens`` (0 = c0 < ... < cn = seq_len)."""
    cu = [int(c) for c in cu_seqlens]
    if len(cu) < 2 or cu[0] != 0 or cu[-1] != seq_len or any(b <= a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"cu_seqlens must be strictly increasing from 0 to the global sequence length "
                         f"{seq_len}, got {cu_seqlens!r}")
    return tuple(zip(cu, cu[1:]))
