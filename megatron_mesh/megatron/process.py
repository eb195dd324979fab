"""What one plugin process remembers of its own start and end, in one object: :data:`PROCESS`.

Start-up (:mod:`.bootstrap`) and the error paths (:mod:`.errors`) read and set it: whether
start-up paused the garbage collector, the forking process while forked children must die with
it, the argument namespaces already checked, and whether the process is stopping with its own
message or has finished its run (the watcher of the other nodes reads those two). The functions
that test code drives take a :class:`ProcessState` (default :data:`PROCESS`), so a test passes its
own instead of patching these. Nothing here imports torch: it runs before the first import.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

__all__ = ["ProcessState", "PROCESS"]


@dataclass
class ProcessState:
    """One process's start-up and exit state (see the module docstring)."""

    gc_paused: bool = False  # pause_gc turned the collector off (resume_gc turns it on again, once)
    fork_parent: list[int] = field(default_factory=list)  # inside forked_children_die_with_this_process
    at_fork_registered: bool = False  # the after-fork hook is registered (once per process)
    checked: set[int] = field(default_factory=set)  # id() of the argument namespaces already checked
    failing: threading.Event = field(default_factory=threading.Event)  # stopping with its own message: it wins
    exiting: threading.Event = field(default_factory=threading.Event)  # its run has finished: the watcher stops


PROCESS = ProcessState()
