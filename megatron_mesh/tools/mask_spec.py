"""The planner's ``--mask SPEC``: a mask kind other than causal / full / window, e.g.
``chunked:8192`` (Llama 4's chunked attention) or ``prefix:512`` (prefix-LM), which --docs
applies inside each document. ``--mask`` replaces --no-causal and --window (a window does not
compose with these kinds: :meth:`~megatron_mesh.plan.maskkinds.MaskKind.__and__`)."""

from __future__ import annotations

from ..plan.maskkinds import Chunked, MaskKind, Prefix, work_mask

__all__ = ["MASK_SPECS", "mask_kind", "cli_kind", "layouts_head", "no_te", "work_mask"]

MASK_SPECS = {"chunked": Chunked, "prefix": Prefix}
HELP = ("a mask kind instead of --no-causal / --window: chunked:SIZE (causal inside chunks of SIZE tokens, counted "
        "from each document's start) or prefix:LENGTH (each document's first LENGTH tokens both ways, the rest causal); "
        "with --docs (the auto layout row is left out: it decides for causal / full / window)")


def mask_kind(spec: str | None) -> MaskKind | None:
    """The kind of ``--mask`` ``spec`` (None: none); ValueError names the spec and what is allowed."""
    if spec is None:
        return None
    name, _, value = spec.partition(":")
    if name not in MASK_SPECS or not value.isdigit():
        raise ValueError(f"--mask {spec!r} must be one of {', '.join(f'{k}:N' for k in MASK_SPECS)} (N an integer)")
    try:
        return MASK_SPECS[name](int(value))
    except ValueError as e:
        raise ValueError(f"--mask {spec!r}: {e}") from None


def cli_kind(args) -> MaskKind | None:
    """The kind of the planner's --mask (None: none), which replaces --no-causal and --window:
    given together, a ValueError (one line)."""
    if args.mask is not None and (args.window is not None or not args.causal):
        given = "--window" if args.window is not None else "--no-causal"
        raise ValueError(f"--mask {args.mask} replaces --no-causal and --window; leave {given} out")
    return mask_kind(args.mask)


def no_te(kind: MaskKind, te_rows, skipped: list) -> list:
    """No Transformer Engine rows for ``kind`` (TE has no such mask): each said in ``skipped``."""
    skipped += [{"mode": m, "reason": f"Transformer Engine has no {kind.kind} mask"} for m in te_rows]
    return []


def layouts_head(kind: MaskKind | None, causal: bool, window, layouts, auto: str) -> tuple[MaskKind, tuple]:
    """The mask (without documents) the planner's layout rows plan -- ``kind`` (applied inside each
    document; the balanced layout balances its work) or the band of ``causal`` / ``window`` -- and
    the layouts to plan: the ``auto`` layout decides for the band only, so with a kind it is left
    out of several layouts and refused alone."""
    if kind is not None and auto in layouts:
        if tuple(layouts) == (auto,):
            raise ValueError(f"--layout {auto} decides between layouts for causal / full / window masks; with "
                             f"{kind.head_text()} compare --layout zigzag and balanced (or all)")
        layouts = tuple(name for name in layouts if name != auto)
    return work_mask(kind, causal, window), tuple(layouts)
