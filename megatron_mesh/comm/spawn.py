"""Run a function on N local processes joined in a gloo process group, with a hard timeout.

The tests, the side-by-side demo and the benchmarks use :func:`spawn` instead of torchrun: one
spawn per world size runs many cases (process start-up costs seconds), a FileStore rendezvous needs
no ports, and a hang becomes an error after ``timeout`` seconds instead of stalling CI::

    def case(rank, world_size, n):          # module level: the spawned processes import it by name
        import torch.distributed as dist
        t = torch.tensor([rank + n]); dist.all_reduce(t); return t.item()

    spawn(case, 4, 10)                      # -> [46, 46, 46, 46]
"""

from __future__ import annotations

import os
import pickle
import tempfile
import time
import traceback
from typing import Any, Callable

import torch.multiprocessing as mp

__all__ = ["SpawnError", "spawn"]


class SpawnError(RuntimeError):
    """A rank raised, died or timed out."""


def _entry(rank: int, world_size: int, store_path: str, out_dir: str, fn: Callable, args: tuple,
           backend: str, threads: int) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    result_path = os.path.join(out_dir, f"rank{rank}.pkl")
    try:
        dist.init_process_group(backend, store=dist.FileStore(store_path, world_size), rank=rank,
                                world_size=world_size)
        try:
            value = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        payload = ("ok", value)
    except BaseException as e:  # report every failure to the parent, with its traceback
        payload = ("error", f"rank {rank}: {type(e).__name__}: {e}\n{traceback.format_exc()}")
    with open(result_path, "wb") as f:
        pickle.dump(payload, f)
    if payload[0] == "error":
        raise SystemExit(1)


def spawn(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 300.0, backend: str = "gloo",
          threads: int = 1) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned processes in a process group;
    return each rank's result (picklable) in rank order.

    ``fn`` must be importable by name (a module-level function). Raises :class:`SpawnError` with
    the failing rank's traceback if any rank raises, and kills every rank after ``timeout`` s.
    """
    with tempfile.TemporaryDirectory(prefix="megatron_mesh_spawn_") as tmp:
        ctx = mp.start_processes(
            _entry, args=(world_size, os.path.join(tmp, "store"), tmp, fn, args, backend, threads),
            nprocs=world_size, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout
        try:
            while not ctx.join(timeout=max(0.1, min(1.0, deadline - time.monotonic()))):
                if time.monotonic() > deadline:
                    raise SpawnError(f"{getattr(fn, '__name__', fn)} on {world_size} ranks timed out after "
                                     f"{timeout:.0f} s (a hang or deadlock)")
        except mp.ProcessRaisedException as e:  # pragma: no cover - _entry catches everything
            raise SpawnError(str(e)) from None
        except mp.ProcessExitedException:
            pass  # the rank's own report below says why
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
        results, errors = [], []
        for r in range(world_size):
            path = os.path.join(tmp, f"rank{r}.pkl")
            if not os.path.exists(path):
                errors.append(f"rank {r}: exited without a result (killed or crashed)")
                results.append(None)
                continue
            with open(path, "rb") as f:
                status, value = pickle.load(f)
            if status == "error":
                errors.append(value)
            results.append(value)
        if errors:
            raise SpawnError("\n".join(errors))
        return results
