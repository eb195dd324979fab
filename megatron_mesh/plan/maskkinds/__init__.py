"""Mask kinds: the registry (text form -> kind) and the kinds' protocol (:mod:`.base`).

Each kind lives in its own file and registers itself by the first word of its text form: the
band (causal / full attention with an optional sliding window: :class:`~megatron_mesh.plan.mask.Mask`),
:mod:`.chunked` and :mod:`.prefix`. Every kind composes with documents (a field of each). A
kind defined elsewhere (a test, a user's module) registers the same way and is then read back
from plan text.
"""

from __future__ import annotations

from .base import INF, MaskKind, check_documents
from .registry import MASK_KINDS, mask_from_text, register_mask_kind
from .band import Mask
from .chunked import Chunked
from .prefix import Prefix
from .stack import MaskStack

__all__ = ["MaskKind", "MASK_KINDS", "register_mask_kind", "mask_from_text", "INF", "check_documents", "Mask",
           "Chunked", "Prefix", "MaskStack", "work_mask"]


def work_mask(mask, causal: bool = True, window=None, documents=None) -> "MaskKind | MaskStack":
    """The mask whose work a layout balances: ``mask`` (any kind; its documents, if any, must be
    ``documents``; or the layers' :class:`MaskStack`) or the band of ``causal`` / ``window`` (the
    loose arguments; not both)."""
    if mask is None:
        return Mask(causal, tuple(window) if isinstance(window, list) else window)
    if not isinstance(mask, (MaskKind, MaskStack)):
        raise ValueError(f"mask must be a mask (megatron_mesh.masks) or the layers' MaskStack, got {mask!r}")
    if causal is not True or window is not None:
        raise ValueError(f"pass mask= or causal/window, not both: got mask {mask.text()!r} and causal={causal!r}, "
                         f"window={window!r}")
    if mask.documents is not None and documents is not None and tuple(mask.documents) != tuple(documents):
        raise ValueError(f"the mask's documents {mask.summary()!r} are not the layout's documents")
    return mask.without_documents()
