"""Stopping a (possibly distributed) start-up with one message: :func:`fail`, shared by the
start-up machinery (:mod:`.bootstrap`) and Megatron's argument parser (:func:`.args.add_args`
routes its errors here), so that every bad setting reads the same: one line from the first rank
of each node (rank 0 on one node), status 2 on every rank.

In a job of several nodes a node that stops -- :func:`fail`, or any error that ends one of its
ranks (:func:`crash_stops_other_nodes`) -- tells the others through torchrun's store, which each
node's first rank watches (:func:`watch_other_nodes`): otherwise they would wait for it in their
next collective until the distributed timeout."""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from typing import Iterator, NoReturn

__all__ = ["fail", "one_line_for", "watch_other_nodes", "all_ranks_met", "crash_stops_other_nodes", "FAIL_GRACE_S",
           "STARTUP_ERROR_STATUS"]

# every rank's exit status after fail(): the launcher knows by it that the failure is explained
STARTUP_ERROR_STATUS = 2
FAIL_GRACE_S = 10.0  # how long the other ranks of a failed start-up wait for their node's first rank to print


_FAILING = threading.Event()  # this process is stopping with its own message (fail, a crash): it wins
_MET = threading.Event()  # every rank has met the others: the start-up is over
_EXITING = threading.Event()  # this process exits: the watcher stops
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
    """Put this node's failure where the other nodes' watchers (:func:`watch_other_nodes`)
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
        node = os.environ.get("GROUP_RANK", "?")
        when = "" if _MET.is_set() else " at start-up"
        text = f"node {node} ({socket.gethostname()}, {ranks}) stopped{when}: {message}"
        key = _failure_key()
        value = f"{node}|{text}"  # the node first: its own watcher leaves it
        if store.compare_set(key, "", value).decode().split("|", 1)[0] != node:
            return  # another node failed first: its message is the one the others read
        # this node's message (this rank's or another's of this node: it waits too, lest its exit --
        # torchrun then stops the node -- end the others' collectives before they have read it)
        others = int(os.environ.get("GROUP_WORLD_SIZE", "1")) - 1
        deadline = time.monotonic() + TELL_WAIT_S
        while store.add(key + "/read", 0) < others and time.monotonic() < deadline:
            time.sleep(0.1)
    except Exception:  # noqa: BLE001 -- the store may be gone (node 0 stopped first): nothing to tell
        pass


def watch_other_nodes() -> None:
    """In a job of several nodes, stop this node -- one line, status 2 -- as soon as another node
    stops (:func:`fail` or :func:`crash_stops_other_nodes` there writes its message into
    torchrun's store): otherwise this node would wait in its next collective until the
    distributed timeout (Megatron's ``--distributed-timeout-minutes``, 10 by default) -- at
    start-up in the store's rendezvous, later on NCCL, whose collectives do not see a peer's
    exit (gloo's do). On each node's first rank (torchrun stops the node's other ranks when it
    exits) a daemon thread polls the store every :data:`WATCH_POLL_S` -- one small request -- until
    the process exits. No-op outside a torchrun job of several nodes."""
    if not _multi_node_job() or not _first_rank_of_node():
        return

    def watch() -> None:
        try:
            store = _job_store(30.0)
            key = _failure_key()
            while not _EXITING.is_set():
                if store.check([key]):
                    if _FAILING.is_set():  # this rank stops with its own message
                        return
                    node, text = store.get(key).decode().split("|", 1)
                    if node == os.environ.get("GROUP_RANK"):  # another rank of this node: it stops by itself
                        return
                    store.add(key + "/read", 1)
                    print(f"megatron_mesh: error: {text}", file=sys.stderr, flush=True)
                    _exit_now()
                _EXITING.wait(WATCH_POLL_S)
        except Exception:  # noqa: BLE001 -- the store is gone (node 0 has ended): the job is ending anyway
            return

    import atexit

    thread = threading.Thread(target=watch, name="megatron_mesh-watch-other-nodes", daemon=True)

    def stop() -> None:  # before the interpreter goes: a daemon thread inside a store call could abort it
        _EXITING.set()
        thread.join(timeout=2 * WATCH_POLL_S)

    atexit.register(stop)
    thread.start()


def all_ranks_met() -> None:
    """Every rank has met the others (the plugin's settings agreement): a node that stops from now
    on stopped during the run, not at start-up (its message says which)."""
    _MET.set()


def fail(message: str, *, at_once: bool = False) -> NoReturn:
    """Stop a (possibly distributed) start-up: the first rank of each node (rank 0 on one node)
    prints ``message`` once -- every node's log says why --, every rank exits
    :data:`STARTUP_ERROR_STATUS` (2). ``at_once``: exit without Python's shutdown (``os._exit``),
    for a process that has started its process groups: their threads, torn down by the shutdown,
    can abort it ("terminate called without an active exception", status 134)."""
    _FAILING.set()
    if _first_rank_of_node():
        print(f"megatron_mesh: error: {message}", file=sys.stderr, flush=True)
        if _multi_node_job():  # the other nodes would wait for this one
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


def _describe(error: BaseException) -> str:
    """One line for another node's log: the error's type and first line."""
    if isinstance(error, SystemExit):
        if isinstance(error.code, str):  # sys.exit("message"): Python prints it and exits 1
            return error.code.strip().splitlines()[0][:300] if error.code.strip() else "exit status 1"
        return f"exit status {error.code}" + (" (interrupted)" if error.code == 130 else "")
    if isinstance(error, KeyboardInterrupt):
        return "interrupted"
    first = next((line for line in str(error).splitlines() if line.strip()), "")
    text = f"{type(error).__name__}: {first}" if first else type(error).__name__
    return (text if len(text) <= 300 else text[:297] + "...") + " (the traceback is in that node's log)"


@contextlib.contextmanager
def crash_stops_other_nodes() -> Iterator[None]:
    """Around an entry script's whole run: an error that ends this rank -- Megatron's own, at
    start-up (an argument check, a missing file) or later -- is told to the other nodes first
    (:func:`watch_other_nodes` stops them, naming this node and the error) and then raised as it
    would be (its traceback in this node's log). A normal exit (status 0) tells nothing; neither
    does a process :func:`fail` stops (it told them itself). No-op outside a torchrun job of
    several nodes."""
    try:
        yield
    except BaseException as e:
        normal = isinstance(e, SystemExit) and e.code in (0, None)
        if not normal and not _FAILING.is_set() and _multi_node_job():
            _FAILING.set()
            _tell_other_nodes(_describe(e))
        raise
