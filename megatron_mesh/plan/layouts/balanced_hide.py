"""The balanced layout whose Ulysses groups also set apart documents they run first and last, to
hide more of their all-to-all (``balanced_layout(hide=True)``; for the plain modes it is the
balanced layout). Where it pays: the planner compares it (``--layout all``)."""

from __future__ import annotations

from .balanced import BalancedKind

__all__ = ["BalancedHideKind"]


class BalancedHideKind(BalancedKind):
    name = "balanced-hide"
    help = ("the balanced layout whose Ulysses groups (a2a+*) run some documents first and last to hide the "
            "all-to-all (megatron-mesh-plan --layout all says when it pays)")
    hide = True
    varies = BalancedKind.name
