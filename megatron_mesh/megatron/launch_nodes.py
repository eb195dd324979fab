"""The launcher's side of a job of several nodes (:mod:`megatron_mesh.megatron.launch` runs torchrun
in its process): node 0 warns where MASTER_ADDR is not its machine (:func:`master_addr_warning`);
a node waiting for the others at torchrun's rendezvous says so, and Ctrl-C / SIGTERM stop it there
(:func:`watch_while_waiting_for_the_nodes`); a rank of this node killed by a signal is told to the
other nodes (:class:`KilledRank`).

Example (two machines, the second given NODE_RANK=0 too by a copied command line): that node warns
"MASTER_ADDR 10.0.0.5 is not an address of this machine ...", and after 20 s both say "still waiting
for the other nodes after 20 s (...; this node: NODE_RANK=0 of NNODES=2, NPROC=8) ..."."""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from typing import Mapping, Sequence

import psutil

from .errors import tell_other_nodes_from_launcher

__all__ = ["master_addr_warning", "waiting_notice", "watch_while_waiting_for_the_nodes", "KilledRank",
           "tell_other_nodes_of_a_killed_rank", "TORCHRUN_FAILED", "WAITING_NOTICE_S"]

TORCHRUN_FAILED = "failed (exitcode: %s) local_rank: %s (pid: %s) of binary: %s"  # torchrun's line for a failed rank


def master_addr_warning(env: Mapping[str, str]) -> str | None:
    """On NODE_RANK 0 of a static job, a warning where MASTER_ADDR is not an address of this
    machine (no socket can bind to it); ValueError where it does not resolve. Node 0's torchrun
    hosts the job's store on every interface and connects to it at MASTER_ADDR: a second machine
    given NODE_RANK=0 too hosted its own store, and both waited for the other nodes until
    torchrun's timeout. A warning: an address routed here (a Kubernetes service's) works. Example: ``NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.5`` on 10.0.0.6 -> "MASTER_ADDR
    10.0.0.5 is not an address of this machine ..."."""
    import socket

    nnodes, addr = env.get("NNODES", "1"), env.get("MASTER_ADDR", "127.0.0.1")
    if env.get("NODE_RANK", "0") != "0" or ":" in nnodes:
        return None
    try:
        infos = socket.getaddrinfo(addr, None, type=socket.SOCK_STREAM)
    except OSError as e:
        raise ValueError(f"MASTER_ADDR {addr!r} does not resolve ({e.strerror or e}): set it to the address of "
                         "the machine with NODE_RANK=0") from None
    for family, _, _, _, sockaddr in infos:
        try:
            with socket.socket(family, socket.SOCK_STREAM) as probe:
                probe.bind((sockaddr[0], 0, *sockaddr[2:]))
            return None
        except OSError:
            continue
    return (f"MASTER_ADDR {addr} is not an address of this machine, yet NODE_RANK=0 (NNODES={nnodes}) hosts the "
            f"job's store: if {addr} is another machine, give this one its own NODE_RANK (two machines with "
            "NODE_RANK=0 each wait for the other nodes until torchrun's timeout); an address routed here (a load "
            "balancer's, a Kubernetes service's) is fine")


WAITING_NOTICE_S = 20.0  # the first "still waiting for the other nodes" line; then 4x, 16x, ... later


def waiting_notice(env: Mapping[str, str], waited_s: float) -> str:
    """The line a node prints while it waits for the others at torchrun's rendezvous: a peer
    started with another NNODES (refused at once) or never started left it waiting until
    torchrun's timeout (15 min) without a word (stop 79, a reviewer's two-node runs)."""
    return (f"megatron_mesh.megatron.launch: still waiting for the other nodes after {waited_s:.0f} s (torchrun's "
            f"rendezvous at {env.get('MASTER_ADDR', '127.0.0.1')}:{env.get('MASTER_PORT', '29500')}; this node: "
            f"NODE_RANK={env.get('NODE_RANK', '0')} of NNODES={env.get('NNODES', '1')}, NPROC="
            f"{env.get('NPROC') or env.get('CP') or '1'}): start every node with the same NNODES and NPROC and its own "
            "NODE_RANK (a node that refused to start says why in its own log); Ctrl-C stops this one")


def watch_while_waiting_for_the_nodes(env: Mapping[str, str], notice_s: float = WAITING_NOTICE_S) -> None:
    """While this node waits for the others at torchrun's rendezvous (no worker started): Ctrl-C or
    SIGTERM stops it at once, in one line, status 130 / 143, and after ``notice_s`` seconds (then
    4x as long each time) it says that it is still waiting and for what (:func:`waiting_notice`).
    There the main thread sits in the store's C++ loops, which retry an interrupted call: a
    reviewer's Ctrl-C did nothing for 35 s, or printed C++ frames and went on waiting (stop 79);
    SIGTERM, which has no Python handler before torchrun's, killed the launcher without a word.
    Python's C-level handler writes the signal to a wakeup fd: a thread reads it and, while no
    worker has started, exits; once they run, torchrun's handlers stop them (``_interrupted``)."""
    import select
    import time

    read, write = os.pipe()
    os.set_blocking(write, False)
    signal.set_wakeup_fd(write, warn_on_full_buffer=False)
    start = time.monotonic()

    def stop_if_waiting(signum: int) -> None:
        if not psutil.Process().children() and thread.is_alive():  # the watcher returns once ranks have run
            print(f"megatron_mesh.megatron.launch: interrupted ({signal.Signals(signum).name}) while waiting for the "
                  "other nodes (torchrun's rendezvous): no rank had started", file=sys.stderr, flush=True)
            os._exit(128 + signum)

    def on_sigterm(signum, frame) -> None:  # the main thread, between the store's calls
        from torch.distributed.elastic.multiprocessing.api import SignalException

        stop_if_waiting(signum)
        raise SignalException(f"Process {os.getpid()} got signal: {signum}", sigval=signal.Signals(signum))

    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:  # a Python handler: the wakeup fd hears it
        signal.signal(signal.SIGTERM, on_sigterm)

    def watch() -> None:
        notice_at = notice_s
        while True:  # a look each second: once ranks have run, this node no longer waits at the rendezvous
            ready, _, _ = select.select([read], [], [], min(1.0, max(0.0, start + notice_at - time.monotonic())))
            if psutil.Process().children():
                return  # torchrun's handlers from now on; its exit barrier is not the rendezvous (stop 80's review)
            if not ready:
                if time.monotonic() >= start + notice_at:
                    print(waiting_notice(env, time.monotonic() - start), file=sys.stderr, flush=True)
                    notice_at *= 4
                continue
            got = os.read(read, 1)
            if got and got[0] in (signal.SIGINT, signal.SIGTERM):
                stop_if_waiting(got[0])

    thread = threading.Thread(target=watch, name="megatron_mesh-waiting-for-the-nodes", daemon=True)
    thread.start()


class KilledRank(logging.Handler):
    """In a job of several nodes, tells the other nodes (:func:`.errors.tell_other_nodes_from_launcher`)
    when torchrun reports that a rank of this node was killed by a signal -- ``kill -9``, the
    kernel's OOM killer: the rank could say nothing, and the other nodes would wait for it in their
    next collective until the distributed timeout (NCCL; gloo notices a dead peer). Torchrun reports
    it once it has stopped the node's other ranks, its store (node 0's) still up. Not for a rank's
    SIGTERM / SIGINT: the launcher's (its ``_interrupted``) or a plain ``kill PID`` of one rank."""

    NOT_TOLD = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, **job):
        super().__init__()
        self.job = job

    def emit(self, record: logging.LogRecord) -> None:
        if record.msg != TORCHRUN_FAILED or not isinstance(record.args[0], int) or record.args[0] >= 0:
            return
        number = -record.args[0]
        if number in self.NOT_TOLD:
            return
        try:
            name = signal.Signals(number).name
        except ValueError:
            name = str(number)
        cause = " (kill -9, or the kernel's OOM killer)" if number == signal.SIGKILL else ""
        rank = self.job["node"] * self.job["local"] + record.args[1]
        tell_other_nodes_from_launcher(f"rank {rank} (local rank {record.args[1]}) was killed by signal {name}{cause}",
                                       **self.job)


def tell_other_nodes_of_a_killed_rank(torchrun_args: Sequence[str]) -> dict | None:
    """Install :class:`KilledRank` for a job of several nodes, torchrun's arguments read as torchrun
    reads them (its ``PET_*`` environment variables too): a static rendezvous -- the store on node
    0, where the workers' watchers look -- without restarts, plain integers (an elastic ``--nnodes
    1:4`` is left alone). Returns the job (for the launcher's ``_interrupted``), None where nothing is told."""
    from torch.distributed.run import parse_args

    args = parse_args(list(torchrun_args))
    try:
        job = dict(node=int(args.node_rank), nodes=int(args.nnodes), local=int(args.nproc_per_node),
                   addr=args.master_addr, port=int(args.master_port), run_id=args.rdzv_id)
    except (TypeError, ValueError):
        return
    if job["nodes"] > 1 and args.rdzv_backend == "static" and args.max_restarts == 0:
        logging.getLogger("torch.distributed.elastic.multiprocessing.api").addHandler(KilledRank(**job))
        return job
    return None
