"""Stopping a (possibly distributed) start-up with one message: :func:`fail`, shared by the
start-up machinery (:mod:`.bootstrap`) and Megatron's argument parser (:func:`.args.add_args`
routes its errors here), so that every bad setting reads the same: one line from rank 0, status
2 on every rank."""

from __future__ import annotations

import os
import sys
from typing import NoReturn

__all__ = ["fail", "FAIL_GRACE_S", "STARTUP_ERROR_STATUS"]

# every rank's exit status after fail(): the launcher knows by it that the failure is explained
STARTUP_ERROR_STATUS = 2
FAIL_GRACE_S = 10.0  # how long the other ranks of a failed start-up wait for rank 0's message


def fail(message: str) -> NoReturn:
    """Stop a (possibly distributed) start-up: rank 0 prints ``message`` once, every rank exits
    :data:`STARTUP_ERROR_STATUS` (2)."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"megatron_mesh: error: {message}", file=sys.stderr, flush=True)
    elif "TORCHELASTIC_RUN_ID" in os.environ:
        # torchrun stops every rank when the first one exits: give rank 0 the time to print (its
        # exit ends this wait too)
        import time

        time.sleep(FAIL_GRACE_S)
    raise SystemExit(STARTUP_ERROR_STATUS)
