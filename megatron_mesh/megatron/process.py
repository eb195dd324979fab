"""What one plugin process remembers of its own run, in one object: :data:`PROCESS`.

Start-up (:mod:`.bootstrap`), the entry scripts and the error paths (:mod:`.errors`) set it, the
batch split and the layers (:mod:`.batch_layout`) read it: whether start-up paused the garbage
collector, the forking process while forked children must die with it, the argument namespaces
already checked, whether the process is stopping with its own message or has finished its run
(the watcher of the other nodes reads those two), where the running script's batches carry the
documents (the entry scripts' flags) and the channel from ``get_batch`` to the layers (the
micro-batch being fed to the model, the rotary embeddings that follow its layout, the layouts its
samples ran on). The functions
that test code drives take a :class:`ProcessState` (default :data:`PROCESS`), so a test passes its
own instead of patching these. Nothing here imports torch: it runs before the first import.

(The process's CP groups are :data:`.groups.PROCESS_GROUPS`: made with torch, which this module
must not import.)
"""

from __future__ import annotations

import collections
import threading
import weakref
from dataclasses import dataclass, field
from typing import Optional

__all__ = ["ProcessState", "PROCESS"]


@dataclass
class ProcessState:
    """One process's start-up, exit and batch state (see the module docstring)."""

    gc_paused: bool = False  # pause_gc turned the collector off (resume_gc turns it on again, once)
    fork_parent: int = 0  # while os.fork runs from the main thread of a rank: its pid (bootstrap.die_with_parent)
    at_fork_registered: bool = False  # the at-fork hooks are registered (once per process)
    checked: set[int] = field(default_factory=set)  # id() of the argument namespaces already checked
    failing: threading.Event = field(default_factory=threading.Event)  # stopping with its own message: it wins
    exiting: threading.Event = field(default_factory=threading.Event)  # its run has finished: the watcher stops
    # the watcher has read another node's failure and says it: this process ends with that line
    heard: threading.Event = field(default_factory=threading.Event)
    # True in megatron_mesh's own entry script, whose batches carry document boundaries to the
    # plugin layers (--reset-attention-mask, --cp-thd-packing); other scripts' batches do not
    entry_packs_documents: bool = False
    # True under run_script: batch_layout takes the documents of --reset-attention-mask from the
    # script's batches (position ids or end-of-document tokens) for the layers
    batch_documents: bool = False
    # the micro-batch about to be fed to the model, a batch_layout.BatchLayout (not imported here:
    # it imports torch) -- batch_layout.set_current / current: get_batch sets it; Megatron's
    # schedules run its forward -- and any recomputation -- before the next one
    batch: Optional[object] = None
    # at pipeline parallelism > 1: the document boundaries of the micro-batch whose forward step
    # runs, as the first stage shared them with every stage (pipeline.py); the batch split takes
    # them (a stage's batch may carry no tokens), the stages without a batch their layout
    pipeline_rows: Optional[tuple] = None
    # pipeline.py: the step whose documents the stages share (its micro-batches' documents and which
    # forward step's output was whose), while its schedule runs; None outside
    pipeline_step: Optional[object] = None
    stages_nodes_checked: bool = False  # pipeline.py: the stages' CP groups span nodes alike (checked once)
    # the layout kinds the samples split since telemetry last read them ran on, {name: samples}
    # (batch_layout.split_batch counts, telemetry.Telemetry.after_iteration logs and records them)
    layout_kinds: collections.Counter = field(default_factory=collections.Counter)
    # the rotary embeddings that follow the batch's layout (batch_layout.follow_layout), weakly
    following: "weakref.WeakSet" = field(default_factory=weakref.WeakSet)


PROCESS = ProcessState()
