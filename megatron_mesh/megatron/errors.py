"""Stopping a (possibly distributed) start-up with one message: :func:`fail`, shared by the
start-up machinery (:mod:`.bootstrap`) and Megatron's argument parser (:func:`.args.add_args`
routes its errors here), so that every bad setting reads the same: one line from the first rank
of each node (rank 0 on one node), status 2 on every rank."""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from typing import Iterator, NoReturn

__all__ = ["fail", "one_line_for", "watch_other_nodes", "stop_watching_other_nodes", "FAIL_GRACE_S",
           "STARTUP_ERROR_STATUS"]

# every rank's exit status after fail(): the launcher knows by it that the failure is explained
STARTUP_ERROR_STATUS = 2
FAIL_GRACE_S = 10.0  # how long the other ranks of a failed start-up wait for their node's first rank to print


_FAILING = threading.Event()  # this process is stopping through fail(): its own message wins
_WATCH_DONE = threading.Event()  # every rank has met the others: stop watching for other nodes' failures
WATCH_POLL_S = 1.0


def _failure_key() -> str:
    # one per restart of the job: an elastic restart must not read the last attempt's failure
    return f"megatron_mesh/start_up_failure/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def _job_store(timeout_s: float):
    """A client of the torchrun agent's store (MASTER_ADDR:MASTER_PORT, which every node of the
    job reaches), or None outside a torchrun job of several nodes."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or int(os.environ.get("GROUP_WORLD_SIZE", "1")) < 2:
        return None
    from datetime import timedelta

    import torch.distributed as dist

    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                         timeout=timedelta(seconds=timeout_s))


def _tell_other_nodes(message: str) -> None:
    """Put this node's start-up failure where the other nodes' watchers (:func:`watch_other_nodes`)
    read it; best effort (the message is printed here anyway)."""
    try:
        store = _job_store(5.0)
        if store is not None:
            local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
            first = int(os.environ.get("RANK", "0")) - int(os.environ.get("LOCAL_RANK", "0"))
            ranks = f"rank {first}" if local == 1 else f"ranks {first}-{first + local - 1}"
            store.set(_failure_key(), f"node {os.environ.get('GROUP_RANK', '?')} ({ranks}) stopped at start-up: "
                                      f"{message}")
    except Exception:  # noqa: BLE001 -- the store may be gone (its node stopped first): nothing to tell
        pass


def watch_other_nodes() -> None:
    """In a job of several nodes, stop this rank -- one line on each node's first rank, status 2 --
    as soon as another node stops at start-up (:func:`fail` there writes its message into torchrun's
    store): otherwise this node would wait in its first collective until the distributed timeout
    (Megatron's ``--distributed-timeout-minutes``, 10 by default). A daemon thread polls the store
    every :data:`WATCH_POLL_S` until :func:`stop_watching_other_nodes` (every rank has met the
    others). No-op outside a torchrun job of several nodes."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or int(os.environ.get("GROUP_WORLD_SIZE", "1")) < 2:
        return

    def watch() -> None:
        try:
            store = _job_store(30.0)
            key = _failure_key()
            while not _WATCH_DONE.is_set():
                if store.check([key]):
                    if _FAILING.is_set():  # this rank stops with its own message
                        return
                    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
                        print(f"megatron_mesh: error: {store.get(key).decode()}", file=sys.stderr, flush=True)
                    else:  # as fail(): torchrun stops the node once one rank exits; let the first print
                        _WATCH_DONE.wait(FAIL_GRACE_S)
                    sys.stdout.flush()
                    os._exit(STARTUP_ERROR_STATUS)
                _WATCH_DONE.wait(WATCH_POLL_S)
        except Exception:  # noqa: BLE001 -- the store is gone: the job is ending anyway
            return

    import atexit

    atexit.register(_WATCH_DONE.set)  # a run that never met the others through the plugin: stop before exit
    threading.Thread(target=watch, name="megatron_mesh-watch-other-nodes", daemon=True).start()


def stop_watching_other_nodes() -> None:
    """Every rank has met the others (the plugin's settings agreement): a node that fails from now
    on is seen in the collectives, not through the store."""
    _WATCH_DONE.set()


def fail(message: str, *, at_once: bool = False) -> NoReturn:
    """Stop a (possibly distributed) start-up: the first rank of each node (rank 0 on one node)
    prints ``message`` once -- every node's log says why --, every rank exits
    :data:`STARTUP_ERROR_STATUS` (2). ``at_once``: exit without Python's shutdown (``os._exit``),
    for a process that has started its process groups: their threads, torn down by the shutdown,
    can abort it ("terminate called without an active exception", status 134)."""
    _FAILING.set()
    if int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0"))) == 0:
        print(f"megatron_mesh: error: {message}", file=sys.stderr, flush=True)
        if not _WATCH_DONE.is_set():  # the other nodes have not met this one yet: they would wait
            _tell_other_nodes(message)
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
