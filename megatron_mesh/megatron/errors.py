"""Stopping a (possibly distributed) start-up with one message: :func:`fail`, shared by the
start-up machinery (:mod:`.bootstrap`) and Megatron's argument parser (:func:`.args.add_args`
routes its errors here), so that every bad setting reads the same: one line from the first rank
of each node (rank 0 on one node), status 2 on every rank."""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Iterator, NoReturn

__all__ = ["fail", "one_line_for", "FAIL_GRACE_S", "STARTUP_ERROR_STATUS"]

# every rank's exit status after fail(): the launcher knows by it that the failure is explained
STARTUP_ERROR_STATUS = 2
FAIL_GRACE_S = 10.0  # how long the other ranks of a failed start-up wait for their node's first rank to print


def fail(message: str, *, at_once: bool = False) -> NoReturn:
    """Stop a (possibly distributed) start-up: the first rank of each node (rank 0 on one node)
    prints ``message`` once -- every node's log says why --, every rank exits
    :data:`STARTUP_ERROR_STATUS` (2). ``at_once``: exit without Python's shutdown (``os._exit``),
    for a process that has started its process groups: their threads, torn down by the shutdown,
    can abort it ("terminate called without an active exception", status 134)."""
    if int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0"))) == 0:
        print(f"megatron_mesh: error: {message}", file=sys.stderr, flush=True)
    elif "TORCHELASTIC_RUN_ID" in os.environ:
        # torchrun stops every rank when the first one exits: give the node's first rank the time
        # to print (its exit ends this wait too)
        import time

        time.sleep(FAIL_GRACE_S)
    if at_once:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(STARTUP_ERROR_STATUS)
    raise SystemExit(STARTUP_ERROR_STATUS)


@contextlib.contextmanager
def one_line_for(*errors: type) -> Iterator[None]:
    """Turn ``errors`` raised inside into :func:`fail` (at once: the process groups exist): for
    errors every rank raises alike that name what the user must change (ranks started with
    different settings), one line per node instead of a traceback per rank."""
    try:
        yield
    except errors as e:
        fail(str(e), at_once=True)
