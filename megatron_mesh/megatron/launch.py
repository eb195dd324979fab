"""Launching training: torchrun commands for the training entry points and killing a launcher's
whole process tree.

* :func:`training_command` / ``python -m megatron_mesh.megatron.launch`` -- the torchrun (``torch.distributed.run``)
  command and environment for the plugin's entry script (``pretrain``, from a Megatron
  functional-test style YAML) or any Megatron script (``script``, through
  ``megatron_mesh.megatron.run_script``). ``scripts/pretrain_gpt.sh`` and
  ``scripts/run_megatron_script.sh`` are thin wrappers around the command line::

      python -m megatron_mesh.megatron.launch pretrain configs/gpt_tiny_cpu.yaml --train-iters 3
      python -m megatron_mesh.megatron.launch script /path/to/Megatron-LM/pretrain_gpt.py [CONFIG.yaml] [flags]

  Environment: NPROC (processes on this node; default CP, else 1), CP (--context-parallel-size),
  CP_COMM_TYPE (--cp-comm-type: one mode or a space-separated list, one per layer), NNODES,
  NODE_RANK, MASTER_ADDR, MASTER_PORT (torchrun's), BACKEND (nccl | gloo; default nccl when CUDA is
  available, else gloo). Flags come in this order, later ones winning: the config's MODEL_ARGS <
  ``--distributed-backend`` < CP / CP_COMM_TYPE < the flags on the command line (one
  ``--distributed-backend`` reaches the command: the winner).

  Before torchrun starts it refuses, in one line with status 2, a SCRIPT.py that is not there, a
  world size NPROC x NNODES that is not a multiple of TP x PP x CP (as the flags give them), and
  torchrun settings it could not start with (:func:`_check_torchrun_settings`: NPROC 0, NNODES 0,
  a NODE_RANK outside 0..NNODES-1 -- torchrun would wait for ever for the nodes before it --, a
  MASTER_PORT that is no TCP port); a MASTER_PORT another job listens on is one line too, once
  torchrun finds it taken.
  Ctrl-C / SIGTERM: torchrun stops every rank, the launcher says so in one line and exits 128 + the
  signal (130 / 143). Failed ranks: their exit status when they agree (2: a start-up error, or
  another node stopped the job), else 1; 128 + N where none exited by itself and one was killed by
  signal N (137: kill -9, OOM). A start-up error is the rank's one line: torchrun's lines that
  repeat it are dropped (:class:`_QuietShutdown`). In a job of several nodes the others are told
  of a rank killed by a signal (:class:`.launch_nodes.KilledRank`) and of the launcher's own (:func:`_interrupted`).
* :func:`kill_process_tree` -- SIGKILL a process and everything below it.

The tests' and benchmarks' process groups are started by ``megatron_mesh.comm.spawn`` instead.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from typing import Mapping, Sequence

import psutil

from .errors import STARTUP_ERROR_STATUS, tell_other_nodes_from_launcher
from .launch_nodes import (TORCHRUN_FAILED, master_addr_warning, tell_other_nodes_of_a_killed_rank,
                           watch_while_waiting_for_the_nodes)

__all__ = ["kill_process_tree", "free_port", "training_command", "main"]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout (for PYTHONPATH)
ENTRY = {"pretrain": ["-m", "megatron_mesh.megatron.pretrain_gpt"],
         "script": ["-m", "megatron_mesh.megatron.run_script"]}


def free_port() -> int:
    """A TCP port free on this machine now (for torchrun's MASTER_PORT)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kill_process_tree(pid: int) -> None:
    """SIGKILL ``pid`` and every process below it. Killing a process group is not enough for
    torchrun: it starts each worker in a session of its own, and workers orphaned by a killed
    torchrun hang on its rendezvous store forever."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]  # listed before any dies and is reparented
    except psutil.NoSuchProcess:
        return
    for proc in procs:
        try:
            proc.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=10)


def _have_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def training_command(entry: str, args: Sequence[str], environ: Mapping[str, str] | None = None
                     ) -> tuple[list[str], dict[str, str]]:
    """(torchrun arguments, environment) of one training run.

    ``entry``: "pretrain" (``args`` = CONFIG.yaml, then flags) or "script" (``args`` = SCRIPT.py,
    optionally CONFIG.yaml, then flags). The arguments go to ``torch.distributed.run``'s ``main``
    (or after ``python -m torch.distributed.run``); the environment is ``environ`` (default
    os.environ) plus the config's ENV_VARS and what the workers need. See the module docstring for
    the variables read."""
    env = dict(os.environ if environ is None else environ)
    env.pop("MEGATRON_MESH_LAUNCHER_PID", None)  # main() sets its own; a subprocess' parent is torchrun itself
    args = list(args)
    target = [*ENTRY[entry]]
    if entry == "script":
        if not args or not args[0].endswith(".py"):
            raise ValueError("script: the first argument must be the Megatron script (SCRIPT.py)")
        if not os.path.isfile(args[0]):  # here, not after torchrun has started every rank to find out
            raise ValueError(f"script: no such file: {args[0]}")
        target.append(args.pop(0))
    config_args: list[str] = []
    if entry == "pretrain" or (args and args[0].endswith((".yaml", ".yml"))):
        if not args:
            raise ValueError("pretrain: the first argument must be a YAML config (CONFIG.yaml)")
        config_args = _config_flags(args.pop(0), env)
    run_args = []
    if env.get("CP"):
        if not env["CP"].isdigit() or int(env["CP"]) < 1:  # torchrun would take CP=four for its NPROC and fail in 29 lines
            raise ValueError(f"CP (--context-parallel-size) must be a positive integer, got {env['CP']!r}")
        run_args += ["--context-parallel-size", env["CP"]]
    if env.get("CP_COMM_TYPE"):
        run_args += ["--cp-comm-type", *env["CP_COMM_TYPE"].split()]
    nproc = env.get("NPROC") or env.get("CP") or "1"
    # before the backend: finding out whether CUDA is there imports torch (1.5 s on 2 cores), which
    # a command line refused here need not wait for
    _check_torchrun_settings(nproc, env)
    _check_world_size(nproc, env.get("NNODES", "1"), [*config_args, *run_args, *args])
    backend = env.get("BACKEND") or ("nccl" if _have_cuda() else "gloo")
    # the plugin's entry always names the backend; another script gets only what it lacks (gloo).
    # One --distributed-backend reaches the command, the one that wins by the order above: the
    # launcher's replaces the config's, a flag on the command line replaces both.
    launcher_backend = entry == "pretrain" or backend != "nccl"
    given = _flag_value(args, BACKEND_FLAG) is not None
    if launcher_backend or given:
        config_args = _without_flag(config_args, BACKEND_FLAG)
    if launcher_backend and not given:
        run_args = [BACKEND_FLAG, backend, *run_args]
    env.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")  # Megatron requires it with TP/CP > 1
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    flags = [*config_args, *run_args, *args]
    torchrun = ["--nproc-per-node", nproc, "--nnodes", env.get("NNODES", "1"), "--node-rank", env.get("NODE_RANK", "0"),
                "--master-addr", env.get("MASTER_ADDR", "127.0.0.1"), "--master-port", env.get("MASTER_PORT", "29500")]
    return [*torchrun, *target, *flags], env


def _config_flags(config: str, env: dict[str, str]) -> list[str]:
    """A YAML config's MODEL_ARGS as flags, its ENV_VARS added to ``env`` (where not set there);
    ValueError naming the config where a ${VAR} is set nowhere."""
    from ..tools import yaml_args

    doc = yaml_args.load(config)
    env.update(yaml_args.environment(doc, env))
    try:
        return yaml_args.model_args(doc, env)
    except ValueError as e:
        raise ValueError(f"{config}: {e}") from None


BACKEND_FLAG = "--distributed-backend"
_MODEL_PARALLEL = (("TP", "--tensor-model-parallel-size"), ("PP", "--pipeline-model-parallel-size"),
                   ("CP", "--context-parallel-size"))


def _flag_value(argv: Sequence[str], flag: str) -> str | None:
    """The value of the last ``flag VALUE`` / ``flag=VALUE`` in ``argv`` (argparse's: the last
    wins; Megatron's parser takes no abbreviations), else None."""
    value = None
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(flag + "="):
            value = arg[len(flag) + 1:]
    return value


def _without_flag(argv: Sequence[str], flag: str) -> list[str]:
    """``argv`` without any ``flag VALUE`` / ``flag=VALUE`` (a flag of one value)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == flag:
            skip = True
        elif not arg.startswith(flag + "="):
            out.append(arg)
    return out


NPROC_WORDS = ("auto", "cpu", "gpu", "xpu")  # torchrun's --nproc-per-node words (its processes per device)


def _check_torchrun_settings(nproc: str, env: Mapping[str, str]) -> None:
    """ValueError naming the variable where torchrun could not start the job: NPROC not an integer
    >= 1 nor one of :data:`NPROC_WORDS` (torchrun: a bare AssertionError or ValueError, 20-49 lines
    of traceback); NNODES not an integer >= 1 nor an elastic MIN:MAX; NODE_RANK outside 0 ..
    NNODES - 1 (torchrun starts, and waits without a word for the nodes below it, which never come:
    a NODE_RANK left in the shell, or a scheduler's); MASTER_PORT not a TCP port 1..65535.

    Example: ``NNODES=2 NODE_RANK=2`` -> "NODE_RANK must be an integer in 0..1 (NNODES=2), got '2'"."""
    if nproc not in NPROC_WORDS and not (nproc.isdigit() and int(nproc) >= 1):
        raise ValueError(f"NPROC (processes on this node) must be an integer >= 1 or one of {', '.join(NPROC_WORDS)}, "
                         f"got {nproc!r}")
    nnodes = env.get("NNODES", "1")
    low, elastic, high = nnodes.partition(":")
    if not (low.isdigit() and int(low) >= 1) or (elastic and not (high.isdigit() and int(high) >= int(low))):
        raise ValueError(f"NNODES must be an integer >= 1 (or MIN:MAX, 1 <= MIN <= MAX, for an elastic job), "
                         f"got {nnodes!r}")
    most, node = int(high or low), env.get("NODE_RANK", "0")
    if not (node.isdigit() and int(node) < most):
        raise ValueError(f"NODE_RANK must be an integer in 0..{most - 1} (NNODES={nnodes}), got {node!r}: the job "
                         "would wait for ever for the nodes below it")
    port = env.get("MASTER_PORT", "29500")
    if not (port.isdigit() and 1 <= int(port) <= 65535):
        raise ValueError(f"MASTER_PORT must be a TCP port 1..65535, got {port!r}")


def _check_world_size(nproc: str, nnodes: str, flags: Sequence[str]) -> None:
    """ValueError unless the world size NPROC x NNODES is a multiple of TP x PP x CP as the flags
    give them: Megatron asserts it only after every rank has imported torch and Megatron (4-7 s),
    once per rank. Values that are not plain integers (torchrun's ``--nproc-per-node gpu``, an
    elastic ``--nnodes 1:4``, a bad flag value) are left to torchrun and Megatron."""
    try:
        world = int(nproc) * int(nnodes)
        sizes = [(name, flag, int(_flag_value(flags, flag) or 1)) for name, flag in _MODEL_PARALLEL]
    except ValueError:
        return
    model = 1
    for _, _, size in sizes:
        model *= size
    if world > 0 and model > 0 and world % model:
        given = [(name, flag, size) for name, flag, size in sizes if size != 1 or name == "CP"]
        names = " x ".join(name for name, _, _ in given)
        values = " x ".join(str(size) for _, _, size in given)
        product = f"{names} = {values}" + (f" = {model}" if len(given) > 1 else "")
        raise ValueError(f"world size NPROC x NNODES = {nproc} x {nnodes} = {world} is not a multiple of {product} "
                         f"({', '.join(flag for _, flag, _ in given)}); make NPROC x NNODES a multiple of {model}")


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m megatron_mesh.megatron.launch {pretrain CONFIG.yaml | script SCRIPT.py [CONFIG.yaml]} [flags]``:
    run torchrun in this process (its workers die with it, see megatron_mesh.megatron.bootstrap).

    Returns 0 when every rank finished; 2 for a bad command line (printed in one line before
    anything starts); when ranks failed, their exit status if every rank that exited by itself
    returned the same one (2 for the plugin's start-up errors and where another node stopped the
    job), else 1 (see :func:`_failure_status`);
    128 + N when signal N (SIGINT: 130, SIGTERM: 143) stopped the launcher, after torchrun has
    stopped the ranks."""
    from .bootstrap import freeze_gc, pause_gc, resume_gc

    argv = list(sys.argv[1:] if argv is None else argv)
    usage = __doc__.split("* :func:`kill_process_tree`")[0]
    if argv[:1] in (["-h"], ["--help"]) or (argv[:1] and argv[0] in ENTRY and argv[1:2] in (["-h"], ["--help"])):
        print(usage)
        return 0
    if not argv or argv[0] not in ENTRY:
        print(usage, file=sys.stderr)
        return 2
    pause_gc()  # while torch loads (see bootstrap.pause_gc)
    try:
        torchrun_args, env = training_command(argv[0], argv[1:])
        _say_if_warned(master_addr_warning(env))
        from torch.distributed import DistNetworkError
        from torch.distributed.elastic.multiprocessing import SignalException
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
        from torch.distributed.run import main as torchrun_main
    except (OSError, ValueError) as e:
        print(f"megatron_mesh.megatron.launch: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C while torch loads: nothing has started yet
        print("megatron_mesh.megatron.launch: interrupted (SIGINT) before torchrun started", file=sys.stderr)
        return 128 + signal.SIGINT
    finally:
        resume_gc()
    env["MEGATRON_MESH_LAUNCHER_PID"] = str(os.getpid())  # the workers' parent: see bootstrap.die_with_parent
    os.environ.clear()
    os.environ.update(env)
    nproc, nnodes = env.get("NPROC") or env.get("CP") or "1", env.get("NNODES", "1")
    print(f"megatron_mesh.megatron.launch: {nproc} process(es) per node x {nnodes} node(s): "
          f"torchrun {' '.join(torchrun_args)}", file=sys.stderr, flush=True)
    _quiet_torchrun_shutdown()
    job = tell_other_nodes_of_a_killed_rank(torchrun_args)
    if nnodes != "1":
        watch_while_waiting_for_the_nodes(env)
    try:
        torchrun_main(torchrun_args)
    except ChildFailedError as e:
        return _failure_status(e)  # torchrun has printed which rank failed and how
    except SignalException as e:  # torchrun's handler: it has stopped the ranks (SIGKILL after a grace time)
        return _interrupted(signal.Signals(e.sigval), nproc, nnodes, job)
    except KeyboardInterrupt:  # before torchrun installed its handler (rendezvous): ranks may be starting
        return _interrupted(signal.SIGINT, nproc, nnodes, job)
    except DistNetworkError as e:
        return _port_taken(e, env)
    finally:
        freeze_gc()  # a quicker exit
    return 0


def _say_if_warned(warning: str | None) -> None:  # one line, before torchrun's
    if warning:
        print(f"megatron_mesh.megatron.launch: warning: {warning}", file=sys.stderr, flush=True)


def _port_taken(error: Exception, env: Mapping[str, str]) -> int:
    """Where torchrun's store could not listen on MASTER_PORT (torch's DistNetworkError, EADDRINUSE:
    45 lines of traceback) -- another job, or one not yet gone, holds it --, one line and
    :data:`STARTUP_ERROR_STATUS`; any other network error raised as it was."""
    if "EADDRINUSE" not in str(error):
        raise error
    print(f"megatron_mesh.megatron.launch: error: MASTER_PORT {env.get('MASTER_PORT', '29500')} on "
          f"{env.get('MASTER_ADDR', '127.0.0.1')} is in use (another job, or another launcher on this machine with "
          f"NODE_RANK={env.get('NODE_RANK', '0')}: each node needs its own NODE_RANK): set MASTER_PORT to a free port",
          file=sys.stderr, flush=True)
    return STARTUP_ERROR_STATUS


def _failure_status(error) -> int:
    """The launcher's exit status when ranks failed (``error``: torchrun's ChildFailedError): the
    status of the ranks that exited by themselves if they all agree, else 1. Ranks killed by a
    signal do not count: once one rank fails, torchrun stops the others with SIGTERM; where no rank
    exited by itself, 128 + the signal that killed one (137: kill -9, or the kernel's OOM killer)."""
    codes = {f.exitcode for f in error.failures.values() if f.exitcode > 0}
    if not codes:  # no rank exited by itself: one was killed (kill -9, out of memory), as a shell says it
        killed = {-f.exitcode for f in error.failures.values() if f.exitcode < 0 and -f.exitcode != signal.SIGTERM}
        return 128 + killed.pop() if len(killed) == 1 else 1
    return codes.pop() if len(codes) == 1 else 1


def _interrupted(sig: signal.Signals, nproc: str, nnodes: str, job: dict | None = None) -> int:
    """After signal ``sig`` stopped torchrun: no process it started is left (a second Ctrl-C can
    cut torchrun's shutdown short), one line, the other nodes told (``job``; SIGTERM to one node's
    launcher gave the others a gloo traceback per rank, status 1: stop 79's review), 128 + ``sig``."""
    for handled in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(handled, signal.SIG_IGN)  # a further Ctrl-C must not interrupt the clean-up with a traceback
    for child in psutil.Process().children():
        kill_process_tree(child.pid)
    where = " on this node" if nnodes != "1" else ""
    print(f"megatron_mesh.megatron.launch: interrupted ({sig.name}): stopped torchrun and its {nproc} rank(s){where}",
          file=sys.stderr, flush=True)
    if job is not None:  # the first node's message wins (each node of a job a scheduler stops tells too)
        tell_other_nodes_from_launcher(f"interrupted ({sig.name} to its launcher)", **job)
    return 128 + int(sig)


class _QuietShutdown(logging.Filter):
    """Drops torchrun's lines that repeat what the launcher or a rank has said in one line:

    * after a signal (Ctrl-C, SIGTERM): that it received it and forwards it to each rank (one line
      per rank) -- the launcher reports the interruption itself;
    * after a rank failed: that it stops each other rank (one line per rank: torchrun always does,
      and the launcher's docs say so), and, where the failed rank exited with status 2 -- a start-up
      error, or another node's failure, which the rank has named in one line (``megatron_mesh: error:
      ...``) -- the status line.

    Kept: a rank that failed otherwise, which and how (with its traceback above it)."""

    RECEIVED = "Received %s death signal, shutting down workers"
    SENDING = "Sending process %s closing signal %s"
    FAILED = TORCHRUN_FAILED

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg == self.FAILED:
            return record.args[0] != STARTUP_ERROR_STATUS
        return record.msg not in (self.RECEIVED, self.SENDING)


def _quiet_torchrun_shutdown() -> None:
    quiet = _QuietShutdown()
    for name in ("torch.distributed.elastic.agent.server.api", "torch.distributed.elastic.multiprocessing.api"):
        logging.getLogger(name).addFilter(quiet)


if __name__ == "__main__":
    raise SystemExit(main())
