"""Per-rank JSON lines for the side-by-side comparison (``--cp-metrics-dir DIR``).

Every rank appends to ``DIR/rank<R>.jsonl`` (written by :mod:`.telemetry`):

* one ``{"kind": "run"}`` record when a run opens the file: a directory used again holds several
  runs, and the reader keeps what the latest run stands on -- the records of earlier runs before
  the iteration it started at (a run resumed from a checkpoint continues them), its own after;
* one ``{"kind": "layer", ...}`` record per plugin layer of the rank's pipeline stage, at the first
  forward: ``layer``, ``mode``, ``cp``, ``tile`` (Mesh: ``"AxB"``), ``description``;
* one ``{"kind": "iteration", ...}`` record per training iteration: ``iteration``, ``losses``
  (Megatron's reduced losses, e.g. ``{"lm loss": 4.87}``; empty on ranks without the last
  pipeline stage), ``time_ms`` (wall time of Megatron's ``train_step``), ``bytes_sent`` /
  ``bytes_received`` (this rank's plugin attention traffic in the iteration, forward and backward),
  ``peak_memory``, ``memory_kind``, ``cp_rank`` (this rank's rank in its CP group; None if no
  plugin attention ran), ``bytes_sent_to`` (``bytes_sent`` split by receiver: ``{"<peer CP rank>":
  bytes}``, peers with nothing left out) and ``attention_work`` (the attention scores its plugin
  kernel calls computed in the forward: allowed (query, key) pairs x query heads x samples, from
  the plans the layers ran) and ``layouts`` (``{"<layout kind>": samples}`` of the iteration's
  samples where the batch split laid out documents: under ``--cp-layout auto`` the kinds it picked).

``megatron_mesh.tools.report.read_metrics`` reads them back.
"""

from __future__ import annotations

import json
import os
import re
import resource

import torch

__all__ = ["MetricsWriter", "peak_memory"]


def peak_memory() -> tuple[int, str]:
    """(bytes, what was measured): the CUDA allocator's peak, else the process's peak RSS."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated(), "cuda max allocated"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "max RSS"  # Linux reports KiB


class MetricsWriter:
    """Appends JSON records to ``<directory>/rank<rank>.jsonl``, flushed per record (a run that
    is stopped keeps what it wrote), after a ``run`` record that starts this run's. Rank 0 of a
    run of ``world`` ranks removes the files of ranks it does not have: a directory used again by
    a run of fewer ranks (CP 4, then CP 1; a resume at CP 2) was read with the earlier run's other
    ranks in it -- its bytes, modes and CP size (``tools.report.read_metrics`` reads every file)."""

    def __init__(self, directory: str, rank: int, world: int):
        os.makedirs(directory, exist_ok=True)
        if rank == 0:
            for name in os.listdir(directory):
                other = re.fullmatch(r"rank(\d+)\.jsonl", name)
                if other and int(other[1]) >= world:
                    os.remove(os.path.join(directory, name))
        self.path = os.path.join(directory, f"rank{rank}.jsonl")
        self._file = open(self.path, "a")
        self.write({"kind": "run"})

    def write(self, record: dict) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
