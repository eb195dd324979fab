"""What the plan-agreement check costs per attention call, on CPU/gloo.

    OMP_NUM_THREADS=1 python scripts/bench_agreement.py --world 8 --iters 30

Every call of the public API checks that the ranks of its CP group make the same call (one
16-byte all-reduce, :mod:`megatron_mesh.runtime.agreement`). Per problem shape this times, on
each rank, median over iterations, the slowest rank's median reported:

* ``check``: the check alone (``agreement.check`` on the call's description, a burst of
  ``--burst`` calls per iteration, per call);
* ``fwd on`` / ``fwd off``: the attention forward with the check (the default) and without it
  (``MEGATRON_MESH_PLAN_AGREEMENT=0``), alternating so drift in machine load hits both alike;
* ``fwd+bwd``: forward and backward with the check (what a training step runs per layer).

``check / fwd`` and ``check / fwd+bwd`` are the relative costs. The outputs with and without the
check are compared bitwise (the script exits if they differ). ``--collectives`` also times the
collectives the check could have used (the all-reduce it uses, a barrier, an all-gather of one
int64 per rank) next to one 64-byte P2P ring round. CPU/gloo with P processes on a few shared
cores says what the check costs there; on GPUs the all-reduce runs on NCCL and the host reads its
result (one stream synchronisation per call).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

# (label, s_local, batch, heads, kv heads, head dim, mode): a tiny layer (the check's worst case
# relative to the work) and a small but real one
SHAPES = (("tiny", 16, 1, 4, 2, 32, "ring"), ("small", 256, 1, 8, 2, 64, "ring"), ("small", 256, 1, 8, 2, 64, "mesh"))


def _bench(rank: int, world: int, iters: int, burst: int, shapes) -> list[dict]:
    import torch.distributed as dist

    import megatron_mesh as mm
    from megatron_mesh.runtime import agreement
    from megatron_mesh.runtime.api import backward_follows, prepare

    out = []
    for label, s, b, h, g, d, mode in shapes:
        gen = torch.Generator().manual_seed(rank)
        q, k, v = (torch.randn(s, b, n, d, generator=gen, requires_grad=True) for n in (h, g, g))
        kw = dict(mode=mode, cu_seqlens=None) if mode == "ring" else dict(mode=mode, tile="auto")
        p = prepare(q.detach(), k.detach(), v.detach(), **kw)
        call = agreement.Call(p.plan, p.placement, tuple(q.shape), tuple(k.shape), q.dtype, p.scale, p.kernel,
                              backward_follows(q, k, v))
        times: dict = {"check": [], "fwd on": [], "fwd off": [], "fwd+bwd": []}
        outputs = {}
        for i in range(iters + 2):  # two warm-up iterations
            dist.barrier()
            t = time.perf_counter()
            for _ in range(burst):
                agreement.check(p.comm, call)
            times["check"].append((time.perf_counter() - t) / burst)
            for name, env in (("fwd on", "1"), ("fwd off", "0")):
                os.environ[agreement.ENV] = env
                if env == "0":  # the first call without the check agrees on that (one all-reduce): untimed
                    with torch.no_grad():
                        mm.attention(q, k, v, **kw)
                dist.barrier()
                t = time.perf_counter()
                with torch.no_grad():
                    outputs[name] = mm.attention(q, k, v, **kw)
                times[name].append(time.perf_counter() - t)
            os.environ[agreement.ENV] = "1"
            dist.barrier()
            t = time.perf_counter()
            mm.attention(q, k, v, **kw).sum().backward()
            times["fwd+bwd"].append(time.perf_counter() - t)
        if not torch.equal(outputs["fwd on"], outputs["fwd off"]):
            raise AssertionError(f"{label} {mode}: the check changed the output")
        out.append(dict(shape=f"{label} {mode} s_local={s} b={b} h={h}/{g} d={d}",
                        **{name: statistics.median(ts[2:]) for name, ts in times.items()}))
    return out


def _collectives(rank: int, world: int, iters: int) -> dict:
    import torch.distributed as dist

    def ring_round():
        ops = [dist.P2POp(dist.isend, torch.zeros(16), (rank + 1) % world),
               dist.P2POp(dist.irecv, torch.empty(16), (rank - 1) % world)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()

    one = torch.tensor([rank], dtype=torch.int64)
    fns = {"all_reduce MAX of 2 int64 (the check)":
           lambda: dist.all_reduce(torch.tensor([rank, -rank], dtype=torch.int64), op=dist.ReduceOp.MAX),
           "barrier": dist.barrier,
           "all_gather of 1 int64 per rank": lambda: dist.all_gather([torch.empty_like(one) for _ in range(world)], one),
           "P2P ring round, 64 bytes": ring_round}
    times: dict = {name: [] for name in fns}
    for _ in range(iters + 2):
        for name, fn in fns.items():
            dist.barrier()
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    return {name: statistics.median(ts[2:]) for name, ts in times.items()}


def main(argv: list[str] | None = None) -> list[dict]:
    """Print a markdown table (slowest rank's medians); return its rows."""
    from megatron_mesh.comm.spawn import spawn

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--burst", type=int, default=20, help="checks per iteration for the 'check' column")
    ap.add_argument("--collectives", action="store_true", help="also time the candidate collectives")
    a = ap.parse_args(argv)
    if a.collectives:
        res = spawn(_collectives, a.world, a.iters, timeout=600)
        print(f"P = {a.world} (gloo), median of {a.iters} iterations, slowest rank")
        for name in res[0]:
            print(f"  {name}: {max(r[name] for r in res) * 1e3:.2f} ms")
    res = spawn(_bench, a.world, a.iters, a.burst, SHAPES, timeout=1200)
    rows = []
    print(f"P = {a.world} (gloo), median of {a.iters} iterations, slowest rank\n")
    print("| shape | check | fwd on | fwd off | fwd+bwd | check / fwd | check / fwd+bwd |")
    print("|---|---|---|---|---|---|---|")
    for i, first in enumerate(res[0]):
        row = dict(shape=first["shape"], **{key: max(r[i][key] for r in res) for key in first if key != "shape"})
        rows.append(row)
        print(f"| {row['shape']} | {row['check'] * 1e6:.0f} us | {row['fwd on'] * 1e3:.2f} ms | "
              f"{row['fwd off'] * 1e3:.2f} ms | {row['fwd+bwd'] * 1e3:.2f} ms | "
              f"{row['check'] / row['fwd off']:.1%} | {row['check'] / row['fwd+bwd']:.1%} |")
    return rows


if __name__ == "__main__":
    main()
