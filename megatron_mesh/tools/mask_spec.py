"""The planner's ``--mask SPEC``: a mask kind other than causal / full / window, e.g.
``chunked:8192`` (Llama 4's chunked attention) or ``prefix:512`` (prefix-LM), which --docs
applies inside each document. ``--mask`` replaces --no-causal and --window (a window does not
compose with these kinds: :meth:`~megatron_mesh.plan.maskkinds.MaskKind.__and__`)."""

from __future__ import annotations

from ..plan.maskkinds import Chunked, MaskKind, Prefix

__all__ = ["MASK_SPECS", "mask_kind", "cli_kind"]

MASK_SPECS = {"chunked": Chunked, "prefix": Prefix}
HELP = ("a mask kind instead of --no-causal / --window: chunked:SIZE (causal inside chunks of SIZE tokens, counted "
        "from each document's start) or prefix:LENGTH (each document's first LENGTH tokens both ways, the rest causal); "
        "with --docs (the auto layout then takes the balanced one: it prices causal attention only)")


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
