"""The mask protocol: what every mask kind answers, built from two facts a kind gives.

A mask says which (query i, key j) pairs of the global sequence attend. Every kind here works
inside *documents* (sorted, disjoint intervals of positions; None: the whole sequence is one;
a position in none is padding and attends nothing) and, inside one document, gives:

* :meth:`MaskKind.parts` -- the document cut into *pieces* [a, b) (document-relative), each with a
  *group* (a sub-document: a query attends only keys of its own group; identified by a position
  inside it, e.g. the group's first token) and a *part* (a small int);
* :meth:`MaskKind.pair_band` -- for a query piece of part ``qp`` and a key piece of part ``kp`` of
  one group, the band [lo, hi] of i - j the pairs must fall in (lo > hi: none).

Everything else is derived here, once, for every kind: the rule for one pair (:meth:`allows`),
vectorised (:meth:`allowed`, the runtime's masked kernel calls and the dense reference), the
key intervals of a query (:meth:`key_intervals`, the validator's exact cover), the pieces of a
buffer's position runs (:meth:`split`, block classification: a pair of pieces keeps none, all or
some of its pairs, decided from the band's corners), the work of a span of a document
(:meth:`span_work`, the balanced layout) and the text form (plan text, agreement).

Worked example -- ``prefix(2)`` over documents [0, 4) and [4, 10): document [4, 10) is one group
with parts 0 = [0, 2) (the prefix) and 1 = [2, 6); pair_band(0, 0) = (-inf, inf) (both ways),
(0, 1) = none (a prefix query never sees a later key), (1, 0) and (1, 1) = (0, inf) (causal). So
query 5 attends keys [4, 6) and query 8 keys [4, 9): ``key_intervals(8, 10) == ((4, 9),)``.

A new kind is a frozen dataclass subclass with a ``documents`` field, registered with
:func:`megatron_mesh.plan.maskkinds.register_mask_kind` (its text's first word names it).
"""

from __future__ import annotations

import dataclasses
from bisect import bisect_right
from typing import ClassVar, Iterable

from ..sel import union_intervals
from .pairs import INF, band_pairs
from .vectorised import allowed

NONE_BAND = (1, 0)  # lo > hi: no pair of the two pieces attends


class MaskKind:
    """Base of every mask kind (see the module docstring). Subclasses are frozen dataclasses with a
    ``documents`` field and implement :meth:`parts`, :meth:`pair_band` and :meth:`head_text`."""

    kind: ClassVar[str] = ""  # the first word of the text form
    documents: tuple | None = None

    # -- what a kind gives -------------------------------------------------------------------------
    def parts(self, doc_len: float, lo: int, hi: int) -> Iterable[tuple[int, int, int, int]]:
        """(a, b, group, part) pieces covering [lo, hi) of a document of ``doc_len`` tokens (INF:
        no documents), in order; ``group`` a document-relative position inside the group."""
        raise NotImplementedError

    def pair_band(self, qpart: int, kpart: int) -> tuple[float, float]:
        """[lo, hi] of i - j allowed between a query piece of ``qpart`` and a key piece of ``kpart``."""
        raise NotImplementedError

    def head_text(self) -> str:
        """The kind's text without the documents, e.g. ``chunked=8``."""
        raise NotImplementedError

    @classmethod
    def from_head(cls, head: str, documents) -> "MaskKind":
        """The mask of :meth:`head_text` ``head`` with ``documents``."""
        raise NotImplementedError

    def reach(self, doc_len: float, rel: int) -> tuple[float, float]:
        """Document-relative [a, b) holding every key query ``rel`` may attend (a kind narrows it to
        keep :meth:`key_intervals` short; the default is the whole document)."""
        return 0, doc_len

    def span_work(self, a: int, b: int, doc_len: int) -> int:
        """Allowed (query, key) pairs of the queries [a, b) of a document of ``doc_len`` tokens
        (document-relative). Generic: the band's pairs of every (query piece, key piece) of a
        group; a kind may give a closed form."""
        by_group: dict = {}
        for ka, kb, g, kp in self.parts(doc_len, 0, doc_len):
            by_group.setdefault(g, []).append((ka, kb, kp))
        total = 0
        for qa, qb, g, qp in self.parts(doc_len, a, b):
            for ka, kb, kp in by_group.get(g, ()):
                total += band_pairs(qa, qb - qa, ka, kb - ka, *self.pair_band(qp, kp))
        return total

    # -- derived ---------------------------------------------------------------------------------
    causal: ClassVar[bool] = False  # every allowed pair has j <= i (kinds that are say so)
    window: ClassVar[tuple] = (None, None)
    is_dense: ClassVar[bool] = False  # plain causal / full: only the band kind can be

    def with_documents(self, documents) -> "MaskKind":
        return dataclasses.replace(self, documents=None if documents is None else tuple(documents))

    def without_documents(self) -> "MaskKind":
        return self.with_documents(None)

    def normalized(self, seq_len: int) -> "MaskKind":
        """The same mask in its simplest form over ``seq_len`` tokens (one document covering
        everything is no document)."""
        if self.documents is not None and self.documents == ((0, seq_len),):
            return self.with_documents(None)
        return self

    def group_spans(self, doc_len: int) -> list[tuple[int, int]]:
        """Document-relative [a, b) of each group of a document of ``doc_len`` tokens, in order:
        no query of one group attends a key of another, so the balanced layout places each as a
        unit of its own (``chunked(4)`` on 10 tokens: [0, 4), [4, 8), [8, 10)). Groups whose
        extents overlap (a kind whose groups interleave) give the whole document."""
        spans: dict = {}
        for a, b, g, _ in self.parts(doc_len, 0, doc_len):
            lo, hi = spans.get(g, (a, b))
            spans[g] = (min(lo, a), max(hi, b))
        out = sorted(spans.values())
        if any(x[1] > y[0] for x, y in zip(out, out[1:])):
            return [(0, doc_len)]
        return out

    def causal_groups(self, bounds) -> list[tuple[int, int]] | None:
        """The mask as causal documents, where it is one: the groups ((start, stop) of global
        positions) of the documents ``bounds`` when every allowed pair of a group is exactly
        causal (band [0, inf) between all its parts) -- the band kind without a window gives the
        documents, ``chunked(c)`` each document's chunks; None for any other mask (a window,
        full attention, a prefix). What the layout choice prices (:mod:`..choice`)."""
        out = []
        for start, stop in bounds:
            parts = {p for *_, p in self.parts(stop - start, 0, stop - start)}
            if any(self.pair_band(q, k) != (0, INF) for q in parts for k in parts):
                return None
            out += [(start + a, start + b) for a, b in self.group_spans(stop - start)]
        return out

    def longest(self, seq_len: int) -> int:
        return seq_len if self.documents is None else max((b - a for a, b in self.documents), default=0)

    def document(self, pos: int) -> tuple[int, float] | None:
        """The (start, stop) of the document holding ``pos`` (None: padding)."""
        if self.documents is None:
            return (0, INF)
        i = bisect_right(self.documents, (pos, INF)) - 1
        if i >= 0 and self.documents[i][0] <= pos < self.documents[i][1]:
            return self.documents[i]
        return None

    def _piece(self, pos: int):
        """(document start, its length, (a, b, group, part) of the piece holding ``pos``) or None."""
        doc = self.document(pos)
        if doc is None:
            return None
        start, stop = doc
        rel = pos - start
        return start, stop - start, next(iter(self.parts(stop - start, rel, rel + 1)))

    def allows(self, i: int, j: int) -> bool:
        """The rule for one pair: query ``i`` attends key ``j``."""
        qi, kj = self._piece(i), self._piece(j)
        if qi is None or kj is None or qi[0] != kj[0] or qi[2][2] != kj[2][2]:
            return False
        lo, hi = self.pair_band(qi[2][3], kj[2][3])
        return lo <= i - j <= hi

    def key_intervals(self, i: int, seq_len: int) -> tuple[tuple[int, int], ...]:
        """The keys query ``i`` may attend, as sorted disjoint [lo, hi) intervals (empty: none)."""
        got = self._piece(i)
        if got is None:
            return ()
        start, length, (_, _, group, qp) = got
        rel = i - start
        a, b = self.reach(length, rel)
        a, b = int(max(0, a)), int(min(length, seq_len - start, b))
        out = []
        for ka, kb, g, kp in (self.parts(length, a, b) if a < b else ()):
            lo, hi = self.pair_band(qp, kp)
            x, y = max(ka, rel - hi), min(kb, rel - lo + 1)
            if g == group and x < y:
                out.append((int(start + x), int(start + y)))
        return tuple(tuple(iv) for iv in union_intervals(out))

    def split(self, runs) -> list[tuple[int, int, int, int | None, int]]:
        """(local offset, global start, length, group, part) of position ``runs`` ((start,
        length), buffer order) cut into pieces; ``group`` is global (None: padding)."""
        out, local, docs = [], 0, self.documents
        for start, length in runs:
            pos, end = start, start + length
            while pos < end:
                i = -1 if docs is None else bisect_right(docs, (pos, INF)) - 1
                if docs is None or (i >= 0 and pos < docs[i][1]):
                    d0, d1 = (0, INF) if docs is None else docs[i]
                    stop = min(end, d1)
                    for a, b, g, part in self.parts(d1 - d0, pos - d0, stop - d0):
                        out.append((local + d0 + a - start, d0 + a, b - a, d0 + g, part))
                else:  # padding up to the next document
                    stop = min(end, docs[i + 1][0]) if i + 1 < len(docs) else end
                    out.append((local + pos - start, pos, stop - pos, None, 0))
                pos = stop
            local += length
        return out

    def split_layout(self, runs) -> list[tuple[int, int, int, int, int]]:
        """A rank's layout runs (local, start, n) as :meth:`split`'s pieces, padding left out."""
        return [(local + off, a, m, g, part) for local, start, n in runs
                for off, a, m, g, part in self.split(((start, n),)) if g is not None]

    def allowed(self, q_pos, k_pos):
        """The rule, vectorised: [len(q_pos), len(k_pos)] booleans, entry (a, b) = query
        ``q_pos[a]`` attends key ``k_pos[b]``, for 1-D integer arrays of any library with
        broadcasting arithmetic and comparisons (:func:`.vectorised.allowed`)."""
        return allowed(self, q_pos, k_pos)

    # -- text ------------------------------------------------------------------------------------
    def text(self) -> str:
        """Compact text: the head and the documents, e.g. ``chunked=8,docs=0:6;6:16``."""
        docs = "" if self.documents is None else ",docs=" + ";".join(f"{a}:{b}" for a, b in self.documents)
        return self.head_text() + docs

    def summary(self) -> str:
        """Short human text: the text form, with documents counted instead of listed."""
        if self.documents is None or len(self.documents) <= 4:
            return self.text()
        lens = [b - a for a, b in self.documents]
        return f"{self.head_text()},{len(lens)} documents of {min(lens)}-{max(lens)} (mean " \
               f"{sum(lens) / len(lens):.0f}) tokens"

    # -- composition: ``a & b``, the pairs both allow --------------------------------------------
    is_band: ClassVar[bool] = False  # the band kind (causal / full / window) is the one that intersects

    def __and__(self, other: "MaskKind") -> "MaskKind":
        """The pairs both masks allow (:func:`intersect`: the supported compositions)."""
        return intersect(self, other)


def intersect(self: MaskKind, other: MaskKind) -> MaskKind:  # MaskKind.__and__
    """Supported (flex attention's ``and_masks`` on these): documents & any kind (the kind inside
    each document; ``documents(cu)`` alone is full attention inside each); band & band (the
    narrower band: ``causal() & window(64, 64)`` is ``window(64)``); full & any kind; causal &
    a causal kind (chunked). Refused, naming both: two different sets of documents, a window with
    another kind, causal & a kind with bidirectional pairs (prefix: it is causal after the prefix
    already), two kinds other than the band (chunked & prefix)."""
    if not isinstance(other, MaskKind):
        raise ValueError(f"a mask combines with & only with another mask (megatron_mesh.masks), got {other!r}")
    if self.documents is not None and other.documents is not None and self.documents != other.documents:
        raise ValueError(f"{self.summary()} & {other.summary()}: two different sets of documents; pass them once")
    docs = self.documents if self.documents is not None else other.documents
    a, b = self.without_documents(), other.without_documents()
    if a.is_band and b.is_band:
        return a.band_and(b).with_documents(docs)
    if b.is_band:
        a, b = b, a
    supported = ("supported: documents & any kind, causal/full/window & each other, full or causal & chunked, "
                 "full & prefix")
    if not a.is_band:
        raise ValueError(f"{a.head_text()} & {b.head_text()}: two mask kinds other than causal/full/window do "
                         f"not combine ({supported})")
    if a.window[0] is not None or (not a.causal and a.window[1] is not None):
        raise ValueError(f"{a.head_text()} & {b.head_text()}: a window with {b.kind} attention is not supported "
                         f"({supported})")
    if a.causal and not b.causal:
        raise ValueError(f"{a.head_text()} & {b.head_text()}: causal would remove {b.kind}'s bidirectional pairs; "
                         f"{b.kind} is causal where it should be already: leave causal() out")
    return b.with_documents(docs)


def cached_hash(self) -> int:
    """A mask's hash, computed once: masks key the planner's caches and hashing thousands of
    documents on every lookup would dominate."""
    h = self.__dict__.get("_hash")
    if h is None:
        h = hash((type(self).__name__, self.head_text(), self.documents))
        object.__setattr__(self, "_hash", h)
    return h


def shared_eq(self, other) -> bool:
    """Equal masks built apart hold equal, distinct document tuples, and every cache lookup compared
    them element by element (a million 1-token documents: seconds per plan); once found equal they
    share one tuple, so the next comparison is an identity check."""
    if self is other:
        return True
    if type(other) is not type(self):
        return NotImplemented
    if hash(self) != hash(other):
        return False
    if any(getattr(self, f.name) != getattr(other, f.name) for f in dataclasses.fields(self) if f.name != "documents"):
        return False
    if self.documents is not other.documents:
        if self.documents != other.documents:
            return False
        object.__setattr__(other, "documents", self.documents)
    return True


def reduce_mask(self):
    """Pickles without the cached hash (hash(None) differs between processes)."""
    return (type(self), tuple(getattr(self, f.name) for f in dataclasses.fields(self)))


def int_head(head: str, name: str) -> int:
    """The N of a kind's head text ``name=N`` (one int parameter), or a ValueError naming the form."""
    word, _, value = head.partition("=")
    if word != name or not value.isdigit():
        raise ValueError(f"{name} mask text must be '{name}=N' (N an integer >= 0), got {head!r}")
    return int(value)


def check_count(value, least: int, what: str) -> None:
    """A kind's size parameter: an int >= ``least`` (not a bool), or a ValueError naming it."""
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        raise ValueError(f"{what} must be an int {'> 0' if least == 1 else f'>= {least}'}, got {value!r}")


def check_documents(documents) -> tuple | None:
    """``documents`` as sorted, disjoint, non-empty (start, stop) int pairs, or a ValueError."""
    if documents is None:
        return None
    docs = tuple((int(a), int(b)) for a, b in documents)
    prev = None
    for a, b in docs:
        if not a < b or (prev is not None and a < prev):
            raise ValueError(f"documents must be sorted, non-empty, disjoint (start, stop) intervals, got {documents!r}")
        prev = b
    return docs
