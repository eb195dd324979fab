"""The masks of a model's layers as one work measure (:class:`MaskStack`): what one layout, shared
by every layer of a sample, balances when the layers have different masks.

A model whose sliding-window layers alternate with full ones (gpt-oss; Megatron's ``--window-size
L,0 --window-attn-skip-freq N``) runs every layer on the same layout of a sample, so the work a
rank does in a step is the sum of its layers' works: a layout balanced for one mask leaves the
other layers' work where that mask put it. The stack's work of a span of a document is each
distinct mask's work weighted by the layers that use it; the balanced layout
(:func:`~megatron_mesh.plan.balance.balanced_layout`) fills its ranks with that sum.

Worked example: one layer causal, one with a window of 2, a document of 4 tokens -- queries 0-3
see 1, 2, 3, 4 keys causally and 1, 2, 3, 3 in the window, so
``MaskStack.of([causal, window2]).span_work(2, 4, 4) == (3 + 4) + (3 + 3) == 13``; the single
mask is no stack (``MaskStack.of([m, m])`` is ``m``: one mask's layout, whatever its layer count).
"""

from __future__ import annotations

from dataclasses import dataclass

from .base import MaskKind

__all__ = ["MaskStack"]


@dataclass(frozen=True)
class MaskStack:
    """Distinct masks without documents, each with the number of layers that use it (``layers``,
    in first-use order): not a mask (it allows no pair), the work a layout of every layer
    balances. Build it with :meth:`of`."""

    layers: tuple[tuple[MaskKind, int], ...]
    documents = None  # a layout's work measure: the documents are the layout's

    def __post_init__(self) -> None:
        if len(self.layers) < 2:
            raise ValueError(f"a mask stack holds at least two different masks, got {len(self.layers)} (pass the one "
                             "mask itself)")
        for mask, count in self.layers:
            if not isinstance(mask, MaskKind) or mask.documents is not None:
                raise ValueError(f"a mask stack's masks are masks without documents (the layout's are theirs), got "
                                 f"{mask!r}")
            if not isinstance(count, int) or isinstance(count, bool) or count < 1:
                raise ValueError(f"a mask stack's layer count must be an int >= 1, got {count!r} for "
                                 f"{mask.head_text()}")

    @classmethod
    def of(cls, masks) -> "MaskKind | MaskStack":
        """The work of layers with ``masks`` (one per layer, in layer order; documents dropped):
        the one mask itself when every layer has it (its layout unchanged), else the stack of
        the distinct masks with their layer counts."""
        counts: dict[MaskKind, int] = {}
        for mask in masks:
            if not isinstance(mask, MaskKind):
                raise ValueError(f"a layer's mask must be a mask (megatron_mesh.masks), got {mask!r}")
            key = mask.without_documents()
            counts[key] = counts.get(key, 0) + 1
        if not counts:
            raise ValueError("a mask stack needs the masks of one layer at least, got none")
        if len(counts) == 1:
            return next(iter(counts))
        return cls(tuple(counts.items()))

    def without_documents(self) -> "MaskStack":
        return self

    def span_work(self, a: int, b: int, doc_len: int) -> int:
        """Every layer's allowed pairs of the queries [a, b) of a document of ``doc_len`` tokens."""
        return sum(count * mask.span_work(a, b, doc_len) for mask, count in self.layers)

    def group_spans(self, doc_len: int) -> list[tuple[int, int]]:
        """The spans that are groups under every mask (a boundary of all of them): no layer's
        query of one attends a key of another."""
        ends = None
        for mask, _ in self.layers:
            got = {b for _, b in mask.group_spans(doc_len)}
            ends = got if ends is None else ends & got
        cuts = sorted(ends)
        return list(zip([0] + cuts[:-1], cuts))

    def causal_groups(self, bounds) -> list[tuple[int, int]] | None:
        """The layers' causal groups where every mask has the same (:meth:`MaskKind.causal_groups`),
        else None (no single causal mask to price the layout choice by)."""
        got = [mask.causal_groups(bounds) for mask, _ in self.layers]
        return got[0] if all(g is not None and g == got[0] for g in got) else None

    def head_text(self) -> str:
        """E.g. ``causal,window=4096:0*6+causal*6`` (each mask's text and its layers)."""
        return "+".join(f"{mask.head_text()}*{count}" for mask, count in self.layers)

    text = summary = head_text
