"""The host's time per torch op the simulator prices (``Topology.host_op_time``; per view,
``Topology.host_view_time``), and where the numbers come from.

The default is read from ``host_cost.json`` next to this module: written from a GPU measurement
(``scripts/gpu_check.sh`` writes one of the same form, ``host_cost.json`` in its output folder,
from ``scripts/bench_kernels.py``'s one-rank-alone runs: host time over the torch ops the rank
dispatched; copy it here to make it the planner's default). Without the file (an install that
left it out) the number below, from the same measurement. ``megatron-mesh-plan --host-op-us``
overrides it with a number or a result file (:func:`host_op_us`).

A view (a slice, ``narrow``, ``view``: no device work) costs the host far less than an op that
launches a kernel or a point-to-point call: 3 us (``host_view_us``; ``--host-view-us``). Fitted
on the stop-46 H200 runs (docs/performance.md, "Assumptions"): ten rows of host time per step
against that executor's counts of non-view ops and views, with views at 3 us the ops fit 22-23 us
and the rows within 0.70-1.27x, where one price for every op, views included, was 1.07-2.48x
(the packed documents' rows, whose ops are mostly views, 2.3-2.5x); on this project's CPU
machine the executor's views take 3.1 us against 42-47 us per other op.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

__all__ = ["HOST_OP_TIME", "HOST_VIEW_TIME", "HOST_OP_SOURCE", "host_costs", "host_op_us", "DEFAULT_FILE"]

DEFAULT_FILE = Path(__file__).with_name("host_cost.json")
_BUILT_IN = (23.0, "H200, docs/performance.md stop 46: ring 1x8 forward at 4K tokens per rank, 2.93 ms / 129 ops")
_VIEW_US = 3.0  # without the file: a view's host time (the module docstring)


def host_costs(source) -> tuple[float, float | None, str]:
    """(us per torch op, us per view or None, where they come from) of ``source``: a number (the
    op's alone), or a JSON file -- a ``host_cost.json`` (its ``host_view_us`` too, where it has
    one), or a ``bench_kernels.py`` / ``bench_masks.py`` result (``--json``), whose
    ``meta.host_op_us`` its one-rank-alone runs measured. ValueError naming the value otherwise."""
    try:
        value = float(source)
    except (TypeError, ValueError):
        value = None
    if value is not None:
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"host cost per op must be a finite number of us >= 0 or a result file, got {source!r}")
        return value, None, "given"
    path = Path(source)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"host cost per op: {source!r} is neither a number of us nor a readable JSON file ({e})") \
            from None
    found = data.get("host_op_us", (data.get("meta") or {}).get("host_op_us")) if isinstance(data, dict) else None
    if not isinstance(found, (int, float)) or not math.isfinite(found) or found < 0:
        raise ValueError(f"host cost per op: {source!r} has no 'host_op_us' (top level, or under 'meta' in a "
                         f"bench_kernels.py / bench_masks.py result): got {found!r}")
    view = data.get("host_view_us")
    if view is not None and (not isinstance(view, (int, float)) or not math.isfinite(view) or view < 0):
        raise ValueError(f"host cost per view: {source!r} has 'host_view_us' {view!r}, not a finite number of us >= 0")
    return (float(found), None if view is None else float(view),
            str(data.get("source") or (data.get("meta") or {}).get("host_op_source") or path))


def host_op_us(source) -> tuple[float, str]:
    """(us per torch op, where it comes from) of ``source`` (:func:`host_costs`)."""
    op, _, where = host_costs(source)
    return op, where


def _default() -> tuple[float, str, float]:
    if DEFAULT_FILE.exists():
        op, view, where = host_costs(DEFAULT_FILE)
        return op, where, _VIEW_US if view is None else view
    return (*_BUILT_IN, _VIEW_US)


_US, HOST_OP_SOURCE, _VIEW = _default()
HOST_OP_TIME = _US * 1e-6  # seconds per torch op that is not a view (a launch, a point-to-point call)
HOST_VIEW_TIME = _VIEW * 1e-6  # seconds per view
