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
# how long a node that failed keeps its processes (and so, on node 0, torchrun's store) alive for the
# other nodes' watchers to read its message: two polls and a margin
TELL_WAIT_S = 2 * WATCH_POLL_S + 1.0


def _multi_node_job() -> bool:
    """A torchrun job of several nodes, its workers on the agent's store, no elastic restarts (a
    restart would read the last attempt's failure; the plugin's launcher allows none)."""
    return (os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
            and int(os.environ.get("GROUP_WORLD_SIZE", "1")) > 1
            and os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") == "0")


def _first_rank_of_node() -> bool:
    """Whether this process prints for its node (torchrun's LOCAL_RANK 0; RANK 0 outside torchrun)."""
    return int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0"))) == 0


def _exit_now() -> NoReturn:
    """Exit with :data:`STARTUP_ERROR_STATUS` without Python's shutdown, the output flushed."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(STARTUP_ERROR_STATUS)


def _failure_key() -> str:
    return f"megatron_mesh/start_up_failure/{os.environ.get('TORCHELASTIC_RUN_ID', '')}"


def _job_store(timeout_s: float):
    """A client of the torchrun agent's store (MASTER_ADDR:MASTER_PORT, on node 0, which every node
    of the job reaches)."""
    from datetime import timedelta

    import torch.distributed as dist

    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                         timeout=timedelta(seconds=timeout_s))


def _tell_other_nodes(message: str) -> None:
    """Put this node's start-up failure where the other nodes' watchers (:func:`watch_other_nodes`)
    read it -- the first node's to fail, if several do -- and wait (at most :data:`TELL_WAIT_S`)
    until each has read it: on node 0 the store lives in torchrun, which goes once this process
    exits. Best effort: the message is printed here anyway."""
    import socket
    import time

    try:
        store = _job_store(2.0)
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        first = int(os.environ.get("RANK", "0")) - int(os.environ.get("LOCAL_RANK", "0"))
        ranks = f"rank {first}" if local == 1 else f"ranks {first}-{first + local - 1}"
        text = (f"node {os.environ.get('GROUP_RANK', '?')} ({socket.gethostname()}, {ranks}) stopped at start-up: "
                f"{message}")
        key = _failure_key()
        if store.compare_set(key, "", text).decode() != text:
            return  # another node failed first: its message is the one the others read
        others = int(os.environ.get("GROUP_WORLD_SIZE", "1")) - 1
        deadline = time.monotonic() + TELL_WAIT_S
        while store.add(key + "/read", 0) < others and time.monotonic() < deadline:
            time.sleep(0.1)
    except Exception:  # noqa: BLE001 -- the store may be gone (node 0 stopped first): nothing to tell
        pass


def watch_other_nodes() -> None:
    """In a job of several nodes, stop this node -- one line, status 2 -- as soon as another node
    stops at start-up (:func:`fail` there writes its message into torchrun's store): otherwise this
    node would wait in its first collective until the distributed timeout (Megatron's
    ``--distributed-timeout-minutes``, 10 by default). On each node's first rank (torchrun stops
    the node's other ranks when it exits) a daemon thread polls the store every
    :data:`WATCH_POLL_S` until :func:`stop_watching_other_nodes` (every rank has met the others) or
    the process exits. No-op outside a torchrun job of several nodes."""
    if not _multi_node_job() or not _first_rank_of_node():
        return

    def watch() -> None:
        try:
            store = _job_store(30.0)
            key = _failure_key()
            while not _WATCH_DONE.is_set():
                if store.check([key]):
                    if _FAILING.is_set():  # this rank stops with its own message
                        return
                    text = store.get(key).decode()
                    store.add(key + "/read", 1)
                    print(f"megatron_mesh: error: {text}", file=sys.stderr, flush=True)
                    _exit_now()
                _WATCH_DONE.wait(WATCH_POLL_S)
        except Exception:  # noqa: BLE001 -- the store is gone: the job is ending anyway
            return

    import atexit

    thread = threading.Thread(target=watch, name="megatron_mesh-watch-other-nodes", daemon=True)

    def stop() -> None:  # before the interpreter goes: a daemon thread inside a store call could abort it
        _WATCH_DONE.set()
        thread.join(timeout=2 * WATCH_POLL_S)

    atexit.register(stop)
    thread.start()


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
    if _first_rank_of_node():
        print(f"megatron_mesh: error: {message}", file=sys.stderr, flush=True)
        if _multi_node_job() and not _WATCH_DONE.is_set():  # the other nodes have not met this one: they would wait
            _tell_other_nodes(message)
    elif "TORCHELASTIC_RUN_ID" in os.environ:
        # torchrun stops every rank when the first one exits: give the node's first rank the time
        # to print (its exit ends this wait too)
        import time

        time.sleep(FAIL_GRACE_S)
    if at_once:
        _exit_now()
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
