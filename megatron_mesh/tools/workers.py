"""The planner's worker processes: ``--jobs N`` plans and simulates the rows in N spawned
processes (:func:`worker_pool`), each collecting garbage as the planner does
(:func:`~.plan_budget.set_planning_gc`)."""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager

from .plan_budget import set_planning_gc

__all__ = ["check_jobs", "sigterm_as_exit", "worker_pool"]


def check_jobs(jobs) -> int:
    """The number of processes ``jobs`` asks for: a positive integer, or 0 for one per CPU core this
    process may run on. ValueError names anything else."""
    if not isinstance(jobs, int) or isinstance(jobs, bool) or jobs < 0:
        raise ValueError(f"jobs must be a whole number >= 0 (0: one process per CPU core), got {jobs!r}")
    if jobs:
        return jobs
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _terminated(signum, frame):
    raise SystemExit(128 + signum)


@contextmanager
def sigterm_as_exit():
    """Inside: SIGTERM (a job's time limit, ``kill``) raised as ``SystemExit(143)``, so that a
    :func:`worker_pool` stops its workers on the way out instead of leaving them to init, planning
    for minutes; the caller's handler comes back at the end. Only the main thread can set a
    handler: elsewhere nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


@contextmanager
def worker_pool(jobs: int):
    """A pool of ``jobs`` worker processes (:func:`check_jobs`; None for one: plan here) to pass as
    ``executor`` to several :func:`~.planner.evaluate` / :func:`~.layout_rows.layout_rows` calls. Spawned, not forked: the
    planner may run inside a process that holds threads (torch, a test runner), which a fork copies
    in whatever state they are."""
    jobs = check_jobs(jobs)
    if jobs == 1:
        yield None
        return
    pool = ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn"), initializer=set_planning_gc)
    try:
        yield pool
    except BaseException:  # Ctrl-C, SIGTERM, a dead worker: drop the rows not started, stop the running ones
        workers = list(getattr(pool, "_processes", None) or {})  # pids; the executor has no public handle
        # its thread, joined once the workers are gone: at exit CPython 3.11 wakes a pool's thread
        # through a pipe that thread closes as it ends, and a race of the two printed a traceback
        manager = getattr(pool, "_executor_manager_thread", None)
        pool.shutdown(wait=False, cancel_futures=True)
        for pid in workers:
            try:
                os.kill(pid, signal.SIGTERM)
            except OSError:  # already gone
                pass
        if manager is not None:
            manager.join(timeout=30)
        raise
    pool.shutdown()
