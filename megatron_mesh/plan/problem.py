"""One problem, normalised once: the mask and the layout of an attention call over a CP group.

Every builder, the public API and the planner call :func:`normalize` -- nobody else decides
what a mask means on a layout. Rules:

* the layout defaults to Megatron's zigzag over the group (a zigzag seen in span-u chunks, what
  a Ulysses inner plan sees, *is* the zigzag over P/u ranks);
* a layout that defines documents (Transformer Engine's THD layout, a document-aware layout)
  brings them to the mask: the mask's documents are the layout's;
* the mask is written in its simplest form over the sequence (:meth:`Mask.normalized`);
* :func:`is_dense` -- plain causal or full attention on the zigzag -- is when the ring
  algorithms move whole chunks around rings; anything else is a mask-aware plan.

Example: ``normalize(4, shape, Mask(window=(10**6, 0)), None)`` over 64 tokens gives the plain
causal mask on ``ZigzagLayout(4, 64)`` (a window longer than the sequence cannot bite), so
``is_dense`` holds and Mesh runs its dense schedule.
"""

from __future__ import annotations

from .layout import Layout, SpanLayout, ZigzagLayout
from .mask import Mask
from .sel import merge_runs
from .shape import AttentionShape

__all__ = ["normalize", "is_dense"]


def normalize(world_size: int, shape: AttentionShape, mask: Mask | None = None, layout: Layout | None = None
              ) -> tuple[Mask, Layout]:
    """(mask, layout) of one call, checked against the group and the shape (see the module
    docstring); ValueError names what does not fit."""
    mask = Mask() if mask is None else mask
    if not isinstance(mask, Mask):
        raise ValueError(f"mask must be a megatron_mesh.plan.Mask, got {type(mask).__name__}")
    if layout is None or (isinstance(layout, SpanLayout) and type(layout.base) is ZigzagLayout):
        layout = ZigzagLayout(world_size, world_size * shape.seq_local)
    if not isinstance(layout, Layout):
        raise ValueError(f"layout must be a megatron_mesh.plan.Layout (a subclass: runs, documents, text, and the "
                         f"members it declares with defaults), got {type(layout).__name__}")
    if layout.world_size != world_size or layout.seq_local != shape.seq_local:
        raise ValueError(f"layout over {layout.world_size} ranks x {layout.seq_local} tokens does not match the "
                         f"CP size {world_size} and local sequence length {shape.seq_local}")
    documents = layout.documents()
    if documents is not None:
        if mask.documents is not None and mask.documents != tuple(documents):
            raise ValueError("the layout defines the documents; the mask brings others: pass the documents once "
                             "(the layout's)")
        mask = Mask(mask.causal, mask.window, tuple(documents))
    mask = mask.normalized(layout.seq_len)
    if mask.is_dense and not isinstance(layout, ZigzagLayout) and _is_zigzag(layout):
        layout = ZigzagLayout(world_size, layout.seq_len)  # e.g. the balanced layout of one document
    return mask, layout


def _merged(runs) -> list[tuple[int, int]]:
    """(global start, length) of a layout's ``runs`` in local order, adjacent runs joined."""
    return merge_runs((start, n) for _, start, n in runs)


def _is_zigzag(layout: Layout) -> bool:
    """Whether ``layout`` puts every rank's tokens where Megatron's zigzag does, in the same local
    order: then it is the zigzag, and a dense mask gets the dense ring schedules (a layout of one
    document spanning the sequence is one)."""
    P, S = layout.world_size, layout.seq_len
    if S % (2 * P):
        return False
    zigzag = ZigzagLayout(P, S)
    return all(_merged(layout.runs(r)) == _merged(zigzag.runs(r)) for r in range(P))


def is_dense(mask: Mask, layout: Layout) -> bool:
    """Plain causal or full attention on Megatron's zigzag: the dense ring schedules apply."""
    return mask.is_dense and isinstance(layout, ZigzagLayout)
