"""The mask kinds' registry: the first word of a mask's text form -> its kind."""

from __future__ import annotations

from .base import MaskKind, cached_hash, reduce_mask, shared_eq

__all__ = ["MASK_KINDS", "register_mask_kind", "mask_from_text"]

MASK_KINDS: dict[str, type] = {}


def register_mask_kind(*words: str):
    """Class decorator: register a mask kind under the first word(s) of its text form (the text up
    to the first ',' or '='; the first is its ``kind``), give it the cached hash and a pickle form
    without it."""
    def wrap(cls):
        if not issubclass(cls, MaskKind):
            raise TypeError(f"{cls.__name__} must subclass megatron_mesh.plan.maskkinds.MaskKind")
        for w in words or (cls.kind,):
            if w in MASK_KINDS and MASK_KINDS[w] is not cls:
                raise ValueError(f"mask kind {w!r} is registered already ({MASK_KINDS[w].__name__})")
            MASK_KINDS[w] = cls
        cls.kind = cls.kind or (words or ("",))[0]
        cls.__hash__ = cached_hash
        cls.__eq__ = shared_eq
        cls.__reduce__ = reduce_mask
        return cls
    return wrap


def mask_from_text(text: str) -> MaskKind:
    """The mask of :meth:`MaskKind.text` ``text``; ValueError names an unknown kind."""
    head, sep, docs = text.partition(",docs=")
    if sep and "," in docs:
        raise ValueError(f"mask text {text!r}: the documents come last")
    word = head.split(",")[0].split("=")[0]
    cls = MASK_KINDS.get(word)
    if cls is None:
        raise ValueError(f"mask text {text!r}: unknown mask kind {word!r}; known: {', '.join(sorted(MASK_KINDS))}")
    documents = tuple(tuple(int(x) for x in d.split(":")) for d in docs.split(";")) if sep else None
    return cls.from_head(head, documents)
