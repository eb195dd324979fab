"""Per-iteration metrics for the side-by-side comparison: attention bytes and peak memory.

Enabled by ``MEGATRON_MESH_METRICS=<dir>``: every rank appends JSON lines to ``<dir>/rank<R>.jsonl``
with the cumulative plugin bytes (``comm.base.total_bytes``) and the peak memory seen so far,
once at the start of each iteration's first micro-batch and once at exit. The bytes of
iteration i are the growth between its record and the next one. Megatron's own log gives the loss
and the time per iteration; ``megatron_mesh.report`` joins the two.
"""

from __future__ import annotations

import atexit
import json
import os
import resource

import torch

from ..comm.base import total_bytes

__all__ = ["record_iteration"]

_state = {"last": None, "file": None}


def _peak_memory_bytes() -> tuple[int, str]:
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated(), "cuda max allocated"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "max RSS"  # Linux reports KiB


def _write(iteration: int) -> None:
    sent, received = total_bytes()
    peak, what = _peak_memory_bytes()
    rec = {"iteration": iteration, "bytes_sent": sent, "bytes_received": received, "peak_memory": peak,
           "memory_kind": what}
    _state["file"].write(json.dumps(rec) + "\n")
    _state["file"].flush()


def record_iteration(iteration: int) -> None:
    """Call at the start of every micro-batch; writes once per iteration (no-op unless enabled)."""
    out_dir = os.environ.get("MEGATRON_MESH_METRICS")
    if not out_dir or iteration == _state["last"]:
        return
    if _state["file"] is None:
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        os.makedirs(out_dir, exist_ok=True)
        _state["file"] = open(os.path.join(out_dir, f"rank{rank}.jsonl"), "a")
        atexit.register(lambda: _write(-1))  # the last iteration ends at exit
    _state["last"] = iteration
    _write(iteration)
