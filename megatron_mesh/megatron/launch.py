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
  ``--distributed-backend`` < CP / CP_COMM_TYPE < the flags on the command line.
* :func:`kill_process_tree` -- SIGKILL a process and everything below it.

The tests' and benchmarks' process groups are started by ``megatron_mesh.comm.spawn`` instead.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Mapping, Sequence

import psutil

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
    from . import yaml_args

    env = dict(os.environ if environ is None else environ)
    env.pop("MEGATRON_MESH_LAUNCHER_PID", None)  # main() sets its own; a subprocess' parent is torchrun itself
    args = list(args)
    target = [*ENTRY[entry]]
    if entry == "script":
        if not args or not args[0].endswith(".py"):
            raise ValueError("script: the first argument must be the Megatron script (SCRIPT.py)")
        target.append(args.pop(0))
    config_args: list[str] = []
    if entry == "pretrain" or (args and args[0].endswith((".yaml", ".yml"))):
        if not args:
            raise ValueError("pretrain: the first argument must be a YAML config (CONFIG.yaml)")
        doc = yaml_args.load(args.pop(0))
        env_vars = yaml_args.environment(doc, env)
        env.update(env_vars)
        config_args = yaml_args.model_args(doc, env)
    backend = env.get("BACKEND") or ("nccl" if _have_cuda() else "gloo")
    run_args = []
    # the plugin's entry always names the backend; another script gets only what it lacks (gloo)
    if entry == "pretrain" or backend != "nccl":
        run_args += ["--distributed-backend", backend]
    if env.get("CP"):
        run_args += ["--context-parallel-size", env["CP"]]
    if env.get("CP_COMM_TYPE"):
        run_args += ["--cp-comm-type", *env["CP_COMM_TYPE"].split()]
    env.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")  # Megatron requires it with TP/CP > 1
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    nproc = env.get("NPROC") or env.get("CP") or "1"
    torchrun = ["--nproc-per-node", nproc, "--nnodes", env.get("NNODES", "1"), "--node-rank", env.get("NODE_RANK", "0"),
                "--master-addr", env.get("MASTER_ADDR", "127.0.0.1"), "--master-port", env.get("MASTER_PORT", "29500")]
    return [*torchrun, *target, *config_args, *run_args, *args], env


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m megatron_mesh.megatron.launch {pretrain CONFIG.yaml | script SCRIPT.py [CONFIG.yaml]} [flags]``:
    run torchrun in this process (its workers die with it, see megatron_mesh.megatron.bootstrap)."""
    from .bootstrap import freeze_gc, pause_gc, resume_gc

    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in ENTRY:
        print(__doc__.split("* :func:`kill_process_tree`")[0], file=sys.stderr)
        return 2
    pause_gc()  # while torch loads (see bootstrap.pause_gc)
    try:
        torchrun_args, env = training_command(argv[0], argv[1:])
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
        from torch.distributed.run import main as torchrun_main
    except (OSError, ValueError) as e:
        print(f"megatron_mesh.megatron.launch: error: {e}", file=sys.stderr)
        return 2
    finally:
        resume_gc()
    env["MEGATRON_MESH_LAUNCHER_PID"] = str(os.getpid())  # the workers' parent: see bootstrap.die_with_parent
    os.environ.clear()
    os.environ.update(env)
    print(f"megatron_mesh.megatron.launch: {env.get('NPROC') or env.get('CP') or '1'} process(es) per node x "
          f"{env.get('NNODES', '1')} node(s): torchrun {' '.join(torchrun_args)}", file=sys.stderr, flush=True)
    try:
        torchrun_main(torchrun_args)
    except ChildFailedError:
        return 1  # torchrun has printed which rank failed and how
    finally:
        freeze_gc()  # a quicker exit
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
