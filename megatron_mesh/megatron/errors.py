"""Stopping a (possibly distributed) start-up with one message: :func:`fail`, shared by the
start-up machinery (:mod:`.bootstrap`) and Megatron's argument parser (:func:`.args.add_args`
routes its errors here), so that every bad setting reads the same: one line from the first rank
of each node (rank 0 on one node), status 2 on every rank.

In a job of several nodes a node that stops -- :func:`fail`, an error that ends one of its ranks
(:func:`crash_stops_other_nodes`), or one of its ranks killed by a signal (its launcher:
:func:`tell_other_nodes_from_launcher`) -- tells the others through torchrun's store, which each
node's first rank watches (:func:`watch_other_nodes`): otherwise they would wait for it in their
next collective until the distributed timeout. Worked example, 3 nodes: node 1's Megatron raises
an AssertionError at start-up; its rank writes "1|node 1 (host-b, ranks 2-3) stopped at start-up:
AssertionError: ..." under :attr:`_Job.key` (the first writer wins), then waits until nodes 0
and 2 have each set their ``/read/<node>`` key (at most :data:`TELL_WAIT_S`) and raises as it
would have; the watchers of nodes 0 and 2 read it within a second, set their keys, print the
line, wait likewise -- node 0's torchrun holds the store, so node 0 must not go before node 2 has
read -- and exit with status 2."""

from __future__ import annotations

import contextlib
import os
import re
import sys
import threading
from typing import Iterator, NamedTuple, NoReturn

from .process import PROCESS, ProcessState

__all__ = ["fail", "one_line_for", "index_cache_missing_is_one_line", "watch_other_nodes", "crash_stops_other_nodes",
           "tell_other_nodes_from_launcher", "entry_run", "SettingsMismatchError", "FAIL_GRACE_S", "STARTUP_ERROR_STATUS"]

class SettingsMismatchError(ValueError):
    """The ranks were started with different settings (two nodes launched with different flags):
    they would create different process groups and wait for each other for ever, or train
    different models (raised by :func:`.groups.check_settings_agree`)."""


# every rank's exit status after fail(), and a node's that another node stopped: the launcher knows
# by it that the failure is explained (in one line)
STARTUP_ERROR_STATUS = 2
FAIL_GRACE_S = 10.0  # how long the other ranks of a failed start-up wait for their node's first rank to print


WATCH_POLL_S = 1.0
WATCH_STORE_TIMEOUT_S = 5.0  # a store call that hangs longer (node 0 gone from the network) ends the watcher
# how long a node that failed keeps its processes (and so, on node 0, torchrun's store) alive for the
# other nodes' watchers to read its message: two polls and a margin
TELL_WAIT_S = 2 * WATCH_POLL_S + 1.0
# the same for node 0, whose torchrun holds the store: a rank of it killed as it starts is told by
# its launcher before the other nodes' watchers exist (they start once torch is imported, seconds)
STORE_NODE_WAIT_S = 30.0
GONE_AFTER_S = 3 * WATCH_POLL_S  # a watcher that has not beaten for this long: its node is gone


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


class _Job(NamedTuple):
    """Where a node's failure goes: torchrun's store (``addr``:``port``, held by node 0's torchrun,
    which every node reaches) and who this node is -- from a worker's environment
    (:meth:`of_worker`) or from the node's launcher, which starts torchrun in its own process."""

    node: str  # torchrun's node rank (GROUP_RANK)
    nodes: int
    first_rank: int  # the global rank of the node's first process
    local: int  # processes per node
    addr: str
    port: int
    run_id: str  # torchrun's --rdzv-id ("none" by default): one job's key, not another's

    @classmethod
    def of_worker(cls) -> "_Job":
        env = os.environ
        return cls(env.get("GROUP_RANK", "?"), int(env.get("GROUP_WORLD_SIZE", "1")),
                   int(env.get("RANK", "0")) - int(env.get("LOCAL_RANK", "0")), int(env.get("LOCAL_WORLD_SIZE", "1")),
                   env.get("MASTER_ADDR", ""), int(env.get("MASTER_PORT", "0")), env.get("TORCHELASTIC_RUN_ID", ""))

    @property
    def key(self) -> str:
        return f"megatron_mesh/node_failure/{self.run_id}"

    def store(self, timeout_s: float):
        """A client of the store (torchrun's, at MASTER_ADDR:MASTER_PORT)."""
        from datetime import timedelta

        import torch.distributed as dist

        if not self.addr or not self.port:  # not started by torchrun: a client would wait out its timeout
            raise ConnectionError("no torchrun store: MASTER_ADDR / MASTER_PORT are not set")
        import socket

        # node 0 gone: a TCPStore client would retry for its timeout, printing C++ frames each time
        socket.create_connection((self.addr, self.port), timeout=min(timeout_s, 2.0)).close()

        return dist.TCPStore(self.addr, self.port, is_master=False, timeout=timedelta(seconds=timeout_s))

    def acknowledge(self, store) -> None:
        """This node has the message: the failing node need not wait for it."""
        store.set(f"{self.key}/read/{self.node}", "1")

    def beat(self, store) -> None:
        """This node's watcher is alive (one add per poll, :func:`watch_other_nodes`)."""
        store.add(f"{self.key}/alive/{self.node}", 1)

    def beats(self, store, node: str) -> int:
        """How often node ``node``'s watcher has beaten (0: it has not started)."""
        return store.add(f"{self.key}/alive/{node}", 0)

    def wait_until_read(self, store, writer: str) -> None:
        """Wait (at most :data:`TELL_WAIT_S`; :data:`STORE_NODE_WAIT_S` on node 0 after its own
        failure) until every node but ``writer`` has acknowledged -- or has gone: a node whose
        watcher beat and then stopped for :data:`GONE_AFTER_S` (its launcher killed, ``kill -9``)
        is not waited for; node 0 waited the whole 30 s for it (stop 80's review: 41 s)."""
        import time

        others = {str(n): f"{self.key}/read/{n}" for n in range(self.nodes) if str(n) != writer}
        wait = STORE_NODE_WAIT_S if writer == self.node == "0" else TELL_WAIT_S
        now = time.monotonic()
        deadline, beats = now + wait, {n: (self.beats(store, n), now) for n in others}
        while others and now < deadline:
            for n in list(others):
                beat = self.beats(store, n)  # 0: its watcher has not started yet, wait
                if store.check([others[n]]) or (beat and beat == beats[n][0] and now - beats[n][1] > GONE_AFTER_S):
                    del others[n]
                elif beat != beats[n][0]:
                    beats[n] = (beat, now)
            time.sleep(0.1)
            now = time.monotonic()

    def tell(self, message: str, at_start_up: bool) -> None:
        """Put this node's failure where the other nodes' watchers (:func:`watch_other_nodes`) read
        it -- the first node's to fail, if several do (a node that loses acknowledges the winner's:
        it stops by itself) -- and wait until each has read it: on node 0 the store lives in
        torchrun, which goes once its process exits. Best effort: the message is printed here
        anyway."""
        import socket

        try:
            store = self.store(2.0)
            last = self.first_rank + self.local - 1
            ranks = f"rank {self.first_rank}" if self.local == 1 else f"ranks {self.first_rank}-{last}"
            text = (f"node {self.node} ({socket.gethostname()}, {ranks}) stopped{' at start-up' if at_start_up else ''}: "
                    f"{message}")
            value = f"{self.node}|{text}"  # the node first: its own watcher leaves it
            writer = store.compare_set(self.key, "", value).decode().split("|", 1)[0]
            if writer != self.node:  # another node failed first: its message is the one the others read
                self.acknowledge(store)
                return
            # this node's message (this rank's or another's of this node: it waits too, lest its exit --
            # torchrun then stops the node -- end the others' collectives before they have read it)
            self.wait_until_read(store, self.node)
        except (RuntimeError, OSError, ValueError):  # the store may be gone (node 0 stopped first): nothing to tell
            pass  # (not Exception: torchrun's SignalException, in the launcher, must reach torchrun)


def _started() -> bool:
    """Whether this process has joined the job's process group (before, the others wait for it in
    the rendezvous: "at start-up")."""
    dist = sys.modules.get("torch.distributed")
    return dist is not None and dist.is_available() and dist.is_initialized()


def _tell_other_nodes(message: str) -> None:
    """From a worker: :meth:`_Job.tell`, "at start-up" before this process joined the process group."""
    _Job.of_worker().tell(message, at_start_up=not _started())


def tell_other_nodes_from_launcher(message: str, *, node: int, nodes: int, local: int, addr: str, port: int,
                                   run_id: str = "none") -> None:
    """From a node's launcher (torchrun in its process, its workers' parent): what no worker can
    tell -- one of them killed by a signal (``kill -9``, the kernel's OOM killer). No-op for a job
    of one node."""
    if nodes > 1:
        _Job(str(node), nodes, node * local, local, addr, port, run_id).tell(message, at_start_up=False)


def watch_other_nodes(process: ProcessState = PROCESS) -> None:
    """In a job of several nodes, stop this node -- one line, status 2 -- as soon as another node
    stops (:func:`fail`, :func:`crash_stops_other_nodes` or, for a rank killed by a signal, its
    launcher -- :func:`tell_other_nodes_from_launcher` -- writes its message into torchrun's
    store): otherwise this node would wait in its next collective until the
    distributed timeout (Megatron's ``--distributed-timeout-minutes``, 10 by default) -- at
    start-up in the rendezvous, later on NCCL, whose collectives do not see a peer's exit (gloo's
    do). On each node's first rank (torchrun stops the node's other ranks when it exits) a daemon
    thread polls the store every :data:`WATCH_POLL_S` -- one small request -- until the run has
    finished or the process exits. No-op outside a torchrun job of several nodes."""
    if not _multi_node_job() or not _first_rank_of_node():
        return

    def watch() -> None:
        try:
            job = _Job.of_worker()
            store = job.store(WATCH_STORE_TIMEOUT_S)
            while not process.exiting.is_set():
                job.beat(store)
                if store.check([job.key]):
                    if process.failing.is_set():  # this rank stops with its own message
                        return
                    writer, text = store.get(job.key).decode().split("|", 1)
                    if writer == job.node:  # another rank of this node, or its launcher: it stops by itself
                        return
                    process.heard.set()  # before the others may go: this rank's own error is then a consequence
                    job.acknowledge(store)
                    print(f"megatron_mesh: error: {text}", file=sys.stderr, flush=True)
                    try:  # node 0's torchrun holds the store: it must not go before the others have read
                        job.wait_until_read(store, writer)
                    finally:
                        _exit_now()
                process.exiting.wait(WATCH_POLL_S)
        except Exception:  # noqa: BLE001 -- the store is gone (node 0 has ended): the job is ending anyway
            return

    import atexit

    thread = threading.Thread(target=watch, name="megatron_mesh-watch-other-nodes", daemon=True)

    def stop() -> None:  # before the interpreter goes: a daemon thread inside a store call could abort it
        process.exiting.set()
        thread.join(timeout=2 * WATCH_POLL_S)

    atexit.register(stop)
    thread.start()


def fail(message: str, *, at_once: bool = False, tell: bool = True, process: ProcessState = PROCESS) -> NoReturn:
    """Stop a (possibly distributed) start-up: the first rank of each node (rank 0 on one node)
    prints ``message`` once -- every node's log says why --, every rank exits
    :data:`STARTUP_ERROR_STATUS` (2); in a job of several nodes the others are told (``tell``;
    False for an error every rank raises alike). ``at_once``: exit without Python's shutdown
    (``os._exit``), for a process that has started its process groups: their threads, torn down by
    the shutdown, can abort it ("terminate called without an active exception", status 134).
    ``process``: whose state says it is failing (the process's own; a test passes another)."""
    process.failing.set()
    if _first_rank_of_node():
        print(f"megatron_mesh: error: {message}", file=sys.stderr, flush=True)
    if tell and _multi_node_job():  # from any rank that fails: the first rank may not
        _tell_other_nodes(message)
    if not _first_rank_of_node() and "TORCHELASTIC_RUN_ID" in os.environ:
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
    different settings), one line per node instead of a traceback per rank -- and nothing told
    between nodes, which say it themselves."""
    try:
        yield
    except errors as e:
        fail(str(e), at_once=True, tell=False)


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


def _tells(error: BaseException) -> bool:
    """Whether ``error`` ending a rank is a failure the other nodes must hear of: an exception, an
    interrupt (KeyboardInterrupt, or status 130 from the launcher's SIGINT handler) or
    ``sys.exit("message")`` -- not an exit with another integer status, which stops every rank
    alike on purpose (Megatron's rerun state machine exits 16 / 17 on all ranks, to be resumed)."""
    if isinstance(error, SystemExit):
        return isinstance(error.code, str) or error.code == 130
    return True


@contextlib.contextmanager
def crash_stops_other_nodes(process: ProcessState = PROCESS) -> Iterator[None]:
    """Around an entry script's whole run: an error that ends this rank -- Megatron's own, at
    start-up (an argument check, a missing file) or later, or an interrupt -- is told to the other
    nodes first (:func:`watch_other_nodes` stops them, naming this node and the error) and then
    raised as it would be (its traceback in this node's log). An exit on purpose tells nothing
    (:func:`_tells`); neither does a process :func:`fail` stops (it told them itself). Once the
    run has finished, this node no longer watches. No-op outside a torchrun job of several nodes."""
    try:
        yield
    except BaseException as e:
        lost = PEER_LOST_WAIT_S if _peer_lost(e) else 0.0  # its node may not have told yet
        # the watcher has heard (its line printed or about to be): node 0 may have gone once this node
        # read the message, taking the store -- this rank's error, "connection closed" in the
        # rendezvous, is the consequence (stop 81's CI: a traceback after the line); else ask the store
        if not process.failing.is_set() and _multi_node_job() and (process.heard.is_set()
                                                                   or _another_node_stopped(lost)):
            # that node's failure ended this rank too (gloo's collectives see its ranks go): this
            # node's first rank says so in one line (its watcher prints and exits within a poll); no
            # traceback of the consequence. Every rank waits for that line: another rank's exit made
            # torchrun stop the first before its watcher printed, and the node ended without a word
            # (stop 79, a reviewer's two-node runs: 4 times of 9)
            process.exiting.wait(3 * WATCH_POLL_S)
            _exit_now()
        gone, sign = _gone_nodes() if lost and not process.failing.is_set() and _multi_node_job() else ([], "")
        if gone:  # nobody could tell (its launcher killed with kill -9): one line, not a traceback per rank
            process.failing.set()
            message = (f"node {', '.join(gone)} went away without a word ({type(e).__name__}: "
                       f"{_PEER_LOST.search(str(e)).group(0)}; {sign}): its launcher killed with kill -9, its "
                       "processes killed, or its machine or network gone")
            _say_once_for_this_node(message)  # the rank that found out: the node's first may wait on it
            _tell_other_nodes(message)
            _exit_now()
        if _tells(e) and not process.failing.is_set() and _multi_node_job():
            process.failing.set()
            try:
                _tell_other_nodes(_describe(e))
            except Exception:  # noqa: BLE001 -- an error whose text cannot be made: the error itself matters
                pass
        raise
    process.exiting.set()  # finished: another node's failure from now on is not this node's


# an error that says a peer went away: its node may be about to say why (a launcher's signal, told
# once torchrun has stopped its ranks)
_PEER_LOST = re.compile(r"Connection (reset|closed)|Broken pipe|Socket closed|closed by peer", re.IGNORECASE)
PEER_LOST_WAIT_S = 5.0  # how long a rank whose peer went away waits for that node's message


def _peer_lost(error: BaseException) -> bool:
    try:
        return bool(_PEER_LOST.search(str(error)))
    except Exception:  # noqa: BLE001 -- an error whose text fails: not one that names a lost peer
        return False


def _say_once_for_this_node(message: str) -> None:
    """Print ``message`` from the first rank of this node to claim it in the store (every rank
    of the node where there is none)."""
    try:
        job = _Job.of_worker()
        me = os.environ.get("RANK", "0")
        first = job.store(WATCH_STORE_TIMEOUT_S).compare_set(f"{job.key}/said/{job.node}", "", me).decode() == me
    except Exception:  # noqa: BLE001 -- no store: say it anyway
        first = True
    if first:
        print(f"megatron_mesh: error: {message}", file=sys.stderr, flush=True)


def _gone_nodes() -> tuple[list[str], str]:
    """The other nodes whose watcher beat (:meth:`_Job.beat`) and then did not for
    :data:`GONE_AFTER_S` -- nodes gone without a word (waits that long) --, and what showed it."""
    import time

    try:
        job = _Job.of_worker()
        store = job.store(WATCH_STORE_TIMEOUT_S)
        before = {str(n): job.beats(store, str(n)) for n in range(job.nodes) if str(n) != job.node}
        time.sleep(GONE_AFTER_S)
        return [n for n, b in before.items() if b and job.beats(store, n) == b], "its watcher stopped"
    except OSError:  # the store does not answer: node 0, whose torchrun holds it, is gone
        gone = ["0"] if os.environ.get("GROUP_RANK", "0") != "0" else []
        return gone, "torchrun's store, which it held, with it"
    except Exception:  # noqa: BLE001 -- not a torchrun job: no one to name
        return [], ""


def _another_node_stopped(wait_s: float = 0.0) -> bool:
    """Whether another node has told the job it stopped (its message is in torchrun's store),
    asking again for up to ``wait_s`` seconds."""
    import time

    deadline = time.monotonic() + wait_s
    try:
        job = _Job.of_worker()
        store = job.store(WATCH_STORE_TIMEOUT_S)
        while True:
            if store.check([job.key]) and store.get(job.key).decode().split("|", 1)[0] != job.node:
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.2)
    except Exception:  # noqa: BLE001 -- no store (node 0 has ended, or not a torchrun job): nothing to tell
        return False


# Megatron's dataset index cache: {cache}/{hash}-{dataset class}-{split}-{part}
_INDEX_CACHE_FILE = re.compile(r"-(train|valid|test)-(description\.txt|(document|sample|shuffle|dataset|dataset_sample)"
                               r"_index\.npy)$")


@contextlib.contextmanager
def index_cache_missing_is_one_line() -> Iterator[None]:
    """A FileNotFoundError for a file of Megatron's dataset index cache as one line per node
    (:func:`fail`): global rank 0 alone writes the cache and every other rank reads it, under file
    names made from the dataset's path; a node whose dataset lay at another path (its own copy),
    or on a disk the others do not see, raised a traceback per rank and the other nodes heard
    "FileNotFoundError" (stop 80, a reviewer's two-node runs). A shared ``--data-cache-path``
    alone does not help there: the names differ (the review again)."""
    try:
        yield
    except FileNotFoundError as e:
        if not _INDEX_CACHE_FILE.search(str(e.filename or "")):
            raise
        fail(f"no {e.filename} here: that is Megatron's dataset index cache, which global rank 0 alone writes (in "
             "--data-cache-path, else PREFIX/cache/) and every other rank reads; its file names follow the dataset's "
             "path, so give every node the dataset at the same path and, where that path is not on a file system every "
             "node sees, --data-cache-path a folder every node sees", at_once=True)


@contextlib.contextmanager
def entry_run() -> Iterator[None]:
    """An entry script's run (ours, and Megatron's scripts through run_script), as every node must
    run it: watching the other nodes (:func:`watch_other_nodes`; call it after torch's import), an
    error that ends a rank told to them (:func:`crash_stops_other_nodes`), ranks started with
    different settings (:class:`SettingsMismatchError`, every rank alike) and a node that cannot
    read Megatron's dataset index cache (:func:`index_cache_missing_is_one_line`) as one line per node."""
    watch_other_nodes()
    with crash_stops_other_nodes(), one_line_for(SettingsMismatchError), index_cache_missing_is_one_line():
        yield
