"""Megatron's ``--window-size LEFT,RIGHT`` as the plugin's window: the one check that the training
start-up (:mod:`megatron_mesh.megatron.checks`) and the planner's prediction for a config
(:mod:`megatron_mesh.tools.predict`) share, so a window one refuses the other refuses too.

Megatron counts each side in tokens, -1 meaning unlimited; the plugin's window
(:class:`~megatron_mesh.plan.mask.Mask`'s) is (left, right) with None for unlimited. The plugin's
GPT layers are causal: no later key is attended, so RIGHT must be 0 (or -1).

Example: ``4096,0`` -> (4096, 0); ``-1,0`` -> (None, 0) (no window at all, causal); ``-5,0``
(LEFT below -1), ``5`` (one value) and, on causal layers, ``16,4`` (a right side) are refused.
"""

from __future__ import annotations

from .units import as_int

__all__ = ["megatron_window"]


def megatron_window(window_size, causal: bool = False) -> tuple | None:
    """Megatron's ``window_size`` (a tuple of ints, as its parser gives it) as the plugin's window
    ((left, right), None meaning unlimited), or None for no ``window_size``. ValueError naming
    ``--window-size`` and what is allowed: two sides, each an integer >= -1, and on ``causal``
    layers RIGHT 0 or -1."""
    if window_size is None:
        return None
    given = tuple(window_size)
    text = ",".join(str(w) for w in given)
    if len(given) != 2:
        raise ValueError(f"--window-size {text}: give two values LEFT,RIGHT (keys before and after a query; -1: "
                         "unlimited), e.g. --window-size 4096,0")
    for side, value in zip(("LEFT", "RIGHT"), given):
        if as_int(value) is None or value < -1:
            raise ValueError(f"--window-size {text}: {side} {value} is not allowed; each side is a number of tokens "
                             ">= 0, or -1 (unlimited)")
    left, right = (as_int(v) for v in given)
    if causal and right not in (-1, 0):
        raise ValueError(f"--window-size {text}: the plugin's causal layers attend no later key, so the right side "
                         "must be 0 (or -1, unlimited)")
    return (None if left < 0 else left, None if right < 0 else right)
