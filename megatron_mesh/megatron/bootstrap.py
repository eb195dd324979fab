"""Process start-up shared by the plugin's entry script and ``run_script`` (any Megatron script).

* :func:`die_with_parent` -- a torchrun worker dies with its launcher (Linux ``PR_SET_PDEATHSIG``),
  and what it forks from its main thread dies with it;
* :func:`quiet_interrupt` -- a worker of the launcher exits on SIGINT without a traceback;
* :func:`prepare_runtime` -- what Megatron-LM's training code needs before it runs here: the
  ``typing.override`` polyfill, on a CPU the workarounds of :mod:`.cpu_compat`, the prebuilt
  dataset helpers of the wheel;
* :func:`check_args` -- the plugin's start-up checks on Megatron's parsed arguments (and that the
  datasets they name exist): a bad setting is printed once (by rank 0) and every rank exits with
  status 2, before anything is built;
* :func:`install_argument_hook` -- the plugin's flags and checks inside Megatron's own argument
  parsing, for scripts that do not register them (Megatron-LM's ``pretrain_gpt.py``);
* :func:`megatron_args` -- Megatron's parsed arguments, when a Megatron training script set them;
* :func:`pause_gc` / :func:`resume_gc` / :func:`freeze_gc` -- no cyclic garbage collection while
  a worker imports torch and Megatron, and none over those objects at exit.

Nothing here imports Megatron at module level: ``run_script`` decides where ``megatron`` comes
from (a Megatron-LM checkout next to the script shadows the wheel) before the first import.
"""

from __future__ import annotations

import functools
import gc
import logging
import os
import sys
from typing import NoReturn

from . import ensure_typing_override
from .errors import entry_run, fail  # bootstrap.fail: also the entry scripts' way to stop a start-up
from .process import PROCESS, ProcessState

__all__ = ["die_with_parent", "quiet_interrupt", "prepare_runtime", "check_args", "fail", "entry_run", "install_argument_hook", "megatron_args",
           "substitute", "pause_gc", "resume_gc", "freeze_gc"]

_PARENT_AT_START = os.getppid()  # before the launcher could have died: the reference for die_with_parent
LAUNCHER_PID_ENV = "MEGATRON_MESH_LAUNCHER_PID"


def pause_gc() -> None:
    """Start-up, before the first import of torch: no cyclic garbage collection until
    :func:`resume_gc`. Importing torch and Megatron makes millions of objects that live as long
    as the process, and the collector keeps making full passes over the growing heap while they
    load: 1.2 s of a 5.5-7 s import (torch, megatron.core and megatron.training on this
    project's CPU machines, Python 3.11), in every rank. Only the entry scripts call it, as
    ``__main__`` (importing them as modules changes nothing)."""
    if gc.isenabled():
        gc.disable()
        PROCESS.gc_paused = True


def resume_gc() -> None:
    """End of start-up, called by the argument hook (:func:`install_argument_hook`): a script
    parses its arguments once it has imported what it runs, and every Megatron 0.19 script parses
    through the hook (``parse_and_validate_args`` and Megatron's own second parse look
    ``parse_args`` up at call time; the plugin's flags depend on it too). What exists now moves
    to the collector's permanent generation, never scanned again (``gc.freeze``: it lives until
    exit anyway), and collection resumes for what training makes -- with Megatron's
    ``--manual-gc`` on its own schedule. A no-op unless :func:`pause_gc` turned the collector
    off; the launcher calls it itself once torch is loaded."""
    if PROCESS.gc_paused:
        PROCESS.gc_paused = False
        gc.freeze()
        gc.enable()


def freeze_gc() -> None:
    """After training: the interpreter's exit collects garbage several times while it tears the
    modules down, each time over every object still tracked -- 1-2 s of a rank's exit, measured
    here. Frozen objects are skipped; their finalizers still run as their references go (files
    are flushed and closed as before)."""
    gc.freeze()


def die_with_parent(process: ProcessState = PROCESS) -> None:
    """In a torchrun worker, ask Linux to SIGKILL this process when its parent -- torchrun's agent --
    dies, so that ``kill -9`` of the launcher does not leave the ranks running (torchrun puts each
    worker in a session of its own; orphans would block on its rendezvous store forever); and every
    process this one forks from its main thread from then on dies with it
    (:func:`_main_thread_forks_die_with_this_process`).

    The parent may already be gone by the time this runs: then the process kills itself. The
    signal fires when the parent *thread* that forked the worker exits; torchrun's agent starts its
    workers from its main thread, which lives as long as the launcher. No-op outside torchrun
    (``python -m ...`` by hand must survive its shell) and outside Linux."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return
    _sigkill_when_parent_dies(int(os.environ.get(LAUNCHER_PID_ENV) or _PARENT_AT_START))
    _main_thread_forks_die_with_this_process(process)


def _sigkill_when_parent_dies(expected_parent: int) -> None:
    import ctypes
    import signal

    libc = ctypes.CDLL(None, use_errno=True)
    pr_set_pdeathsig = 1  # <linux/prctl.h>
    if libc.prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != expected_parent:  # the parent died before prctl: nobody will send the signal
        os.kill(os.getpid(), signal.SIGKILL)


def _main_thread_forks_die_with_this_process(process: ProcessState = PROCESS) -> None:
    """Every process this one forks (``os.fork``: multiprocessing's fork context) from its main
    thread is SIGKILLed when it dies. PR_SET_PDEATHSIG is not inherited across fork, so a rank
    killed with ``kill -9`` left its children behind: the checkpoint writer's result-queue manager
    for ever, its data-loader workers for 2-20 s (torch's watchdog polls their parent every few
    seconds) and their shared memory with them. Forks from another thread are left alone: the signal
    fires when the forking *thread* exits, which would kill a child of a short-lived thread early.
    A ``subprocess`` child is not concerned (its fork runs no Python at-fork hook)."""
    if process.at_fork_registered:
        return
    import threading

    def before() -> None:  # in the forking thread; the child starts with this memory
        process.fork_parent = os.getpid() if threading.current_thread() is threading.main_thread() else 0

    def after_in_child() -> None:
        parent, process.fork_parent = process.fork_parent, 0
        if parent:
            _sigkill_when_parent_dies(parent)

    os.register_at_fork(before=before, after_in_child=after_in_child)
    process.at_fork_registered = True


INTERRUPT_AGAIN_S = 0.05  # Ctrl-C's exit swallowed where Python cannot raise: sent again this much later


def quiet_interrupt() -> None:
    """In a worker of megatron_mesh's launcher: SIGINT -- Ctrl-C, which torchrun forwards to every
    rank -- exits with status 130 (128 + SIGINT) like KeyboardInterrupt would, unwinding the same
    way (``finally`` blocks, ``atexit``), but without its traceback: one per rank, ~70 lines each,
    while the launcher says in one line that the run was interrupted. Errors keep their
    tracebacks. Elsewhere (``python -m ...`` by hand, torchrun run directly) Ctrl-C stays
    KeyboardInterrupt, and so it does in the processes a rank forks (they inherit the handler):
    PyTorch's data-loader workers, which torchrun's SIGINT to the rank's process group reaches
    too, end quietly on KeyboardInterrupt, but a worker that exited 130 would make the rank raise
    "DataLoader worker exited unexpectedly". Megatron's own ``--exit-signal-handler`` installs its
    handler later and wins.

    The signal can land where Python cannot raise (a ``__del__``, logging's at-fork hook
    ``_releaseLock`` while the data loader forks): it then printed "Exception ignored in ..." with
    the handler's traceback, and the rank trained on until its peers were gone ("Connection closed
    by peer", a traceback per rank). There the signal is sent again a moment later, from a thread
    (the hook itself runs Python, so the handler would fire inside it), without a word."""
    import signal
    import threading
    import time

    if LAUNCHER_PID_ENV not in os.environ or "TORCHELASTIC_RUN_ID" not in os.environ \
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler:  # ignored, or someone's own
        return
    rank_pid = os.getpid()

    class Interrupted(SystemExit):
        """The handler's exit (Ctrl-C's status): what the hook below knows it by."""

    def interrupted(signum, frame) -> NoReturn:
        if os.getpid() != rank_pid:  # a forked child: Python's default
            raise KeyboardInterrupt
        raise Interrupted(128 + signum)

    def again(signum: int) -> None:
        time.sleep(INTERRUPT_AGAIN_S)  # the finaliser or hook that swallowed the exit has returned
        os.kill(rank_pid, signum)

    def unraisable(event, previous=sys.unraisablehook) -> None:
        if isinstance(event.exc_value, Interrupted) and os.getpid() == rank_pid:
            threading.Thread(target=again, args=(event.exc_value.code - 128,), daemon=True).start()
        else:
            previous(event)

    signal.signal(signal.SIGINT, interrupted)
    sys.unraisablehook = unraisable


def prepare_runtime() -> None:
    """Make Megatron's training code runnable here: ``typing.override`` on Python 3.11; without
    CUDA, every workaround of :mod:`.cpu_compat` (never loaded on GPUs); and Megatron's dataset
    helpers (GPUs too): the megatron-core wheel's prebuilt ones, or a source checkout's built with
    this interpreter."""
    ensure_typing_override()
    import torch

    if not torch.cuda.is_available():
        from . import cpu_compat

        cpu_compat.install_training_patches()
    # The megatron-core wheel ships the prebuilt dataset helpers but not their Makefile, so the
    # `make` that initialize._compile_dependencies runs fails (on GPUs too). Use the prebuilt ones.
    from megatron.core.datasets import utils as dataset_utils

    try:
        from megatron.core.datasets import helpers_cpp  # noqa: F401
    except ImportError:
        # A source checkout (Megatron-LM): its Makefile builds them with whatever `python3` and
        # `python3-config` are on PATH -- often not this interpreter, or one without pybind11.
        # What the build needs is checked here, on every rank: Megatron builds on rank 0 alone
        # while the others wait in a barrier, which a failed rank 0 turns into their tracebacks.
        where = os.path.dirname(os.path.abspath(dataset_utils.__file__))
        _check_helpers_build(where)
        dataset_utils.compile_helpers = lambda: _compile_dataset_helpers(where)
        return
    dataset_utils.compile_helpers = lambda: None


def _check_helpers_build(where: str) -> None:
    """Stop the start-up (:func:`fail`) where the dataset helpers in ``where`` cannot be built."""
    import importlib.util
    import shutil

    if importlib.util.find_spec("pybind11") is None:
        fail(f"the dataset helpers of the Megatron checkout at {where} are not built, and {sys.executable} cannot "
             f"build them: it has no pybind11 (`{sys.executable} -m pip install pybind11`; scripts/setup_env.sh "
             f"installs it), or build them once yourself: `make -C {where}` with a python3 that has pybind11")
    missing = [tool for tool in ("make", os.environ.get("CXX", "g++")) if shutil.which(tool) is None]
    if missing:
        fail(f"the dataset helpers of the Megatron checkout at {where} are not built, and this machine cannot build "
             f"them: no {' or '.join(missing)} on PATH (build them once elsewhere: `make -C {where}`)")


def _compile_dataset_helpers(where: str) -> None:
    """Megatron's ``compile_helpers`` (rank 0 only) for a source checkout: the Makefile in
    ``where``, with this interpreter's pybind11 includes and extension suffix in place of the ones
    `python3` on PATH would give. A build that fails stops the start-up with one message."""
    import subprocess
    import sysconfig

    includes = subprocess.run([sys.executable, "-m", "pybind11", "--includes"], capture_output=True, text=True,
                              check=True)
    build = subprocess.run(["make", "-C", where, f"CPPFLAGS={includes.stdout.strip()}",
                            f"LIBEXT={sysconfig.get_config_var('EXT_SUFFIX')}"], capture_output=True, text=True)
    if build.returncode != 0:
        fail(f"building the dataset helpers of the Megatron checkout at {where} failed (`make -C {where}`, "
             f"exit {build.returncode}):\n{(build.stdout + build.stderr).strip()[-2000:]}")


def check_args(args) -> None:
    """:func:`.checks.validate_args` and :func:`.data_checks.check_data_files` (the datasets the flags
    name exist) on Megatron's parsed arguments, once per arguments object; a bad setting stops the
    process through :func:`fail`."""
    if id(args) in PROCESS.checked:
        return
    from .checks import validate_args
    from .data_checks import check_data_files

    try:
        unused = validate_args(args, entry_packs_documents=PROCESS.entry_packs_documents,
                               batch_documents=PROCESS.batch_documents)
        check_data_files(args)
    except ValueError as e:
        fail(str(e))
    PROCESS.checked.add(id(args))
    if unused and int(os.environ.get("RANK", "0")) == 0:  # once per run: the same arguments on every rank
        logging.getLogger(__name__).warning(
            "megatron_mesh: %s: only used at CP > 1, unused at --context-parallel-size 1 (accepted, so that one "
            "config serves the CP 1 baseline and the CP runs)", ", ".join(unused))


def megatron_args():
    """Megatron-LM's global arguments when a training script has parsed them, else None. Looks
    only at modules already imported: Python users of Megatron-Core never import megatron.training."""
    global_vars = sys.modules.get("megatron.training.global_vars")
    return getattr(global_vars, "_GLOBAL_ARGS", None) if global_vars is not None else None


def substitute(module, name: str, make) -> None:
    """Replace Megatron's function ``module.name`` -- which Megatron looks up in ``module`` at call
    time -- by ``make(original)``, once: the substitute is marked (``megatron_mesh``) and keeps the
    original's name, signature and ``__wrapped__``. E.g. ``substitute(training,
    "get_forward_backward_func", wrap)``."""
    original = getattr(module, name)
    if getattr(original, "megatron_mesh", False):
        return
    replacement = functools.update_wrapper(make(original), original)
    replacement.megatron_mesh = True
    setattr(module, name, replacement)


def install_argument_hook() -> None:
    """Add the plugin's flags to Megatron's argument parser and run its checks before Megatron's
    own validation, for every script that parses arguments through
    ``megatron.training.arguments.parse_and_validate_args`` (it looks both functions up at call
    time). A script that registers :func:`.args.add_args` itself keeps its registration."""
    from megatron.training import arguments

    from .args import add_args

    if getattr(arguments.parse_args, "megatron_mesh_hook", False):
        return
    parse, validate = arguments.parse_args, arguments.validate_args

    def parse_args(extra_args_provider=None, ignore_unknown_args=False):
        resume_gc()  # the script has imported what it runs: start-up is over
        def provider(parser):
            if extra_args_provider is not None:
                parser = extra_args_provider(parser)
            if "--mesh-tile-shape" not in parser._option_string_actions:
                parser = add_args(parser)
            return parser

        return parse(provider, ignore_unknown_args)

    def validate_args(args, defaults={}):  # noqa: B006 -- Megatron's signature
        check_args(args)  # first: a bad plugin setting stops here, before Megatron's own asserts
        return validate(args, defaults)

    parse_args.megatron_mesh_hook = True
    arguments.parse_args, arguments.validate_args = parse_args, validate_args
