#!/usr/bin/env python
"""The planner's tables for docs/performance.md: every mode against USP (Ulysses x ring,
Transformer Engine's a2a+p2p) at 256 GPUs = 32 nodes x 8, for the nine configurations (MHA 32/32,
GQA 32/8 and 64/8; 256K, 512K, 1M tokens), and the same on a machine with another speed ratio;
``--table mesh``: Mesh-Attention against ring attention in the same nine (the page's first table
and its headline numbers).

    python scripts/planner_tables.py                      # the default H100 machine (Topology())
    python scripts/planner_tables.py --tflops 800         # twice the attention throughput
    python scripts/planner_tables.py --inter-bandwidth 25 # half the network
    python scripts/planner_tables.py --table mesh         # Mesh vs ring
    python scripts/planner_tables.py --host-op-us 0       # the host left out (the model before issue 52)

Columns: ring attention, the fastest Mesh tile, USP by formula (its ring part simulated from the
ring plan; no reorder copies counted) and simulated from its plan (``a2a+ring``), the fastest
Ulysses x Mesh hybrid, ``auto`` (the fastest plan of every mode, ties within
:data:`~megatron_mesh.plan.autotile.TIME_TOLERANCE` going to fewer inter-node bytes), auto's speedup over USP, and the
*compute floor*: the attention FLOPs of one rank at the machine's throughput (forward + 2.5x
backward) -- no CP mode can be faster, so USP's time over the floor bounds any mode's speedup.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_mesh.plan import AttentionShape, Topology  # noqa: E402
from megatron_mesh.plan.hostcost import host_op_us  # noqa: E402
from megatron_mesh.plan.mesh import best_tile  # noqa: E402
from megatron_mesh.plan.simulate import BACKWARD_FLOPS  # noqa: E402
from megatron_mesh.tools.planner import evaluate  # noqa: E402

CONFIGS = [(h, g, s) for h, g in ((32, 32), (32, 8), (64, 8)) for s in (262144, 524288, 1048576)]


def floor_s(shape: AttentionShape, seq_len: int, P: int, topo: Topology) -> float:
    """Causal attention FLOPs per rank (balanced) at the machine's throughput, fwd + bwd."""
    pairs = seq_len * (seq_len + 1) / 2 / P
    return 4.0 * shape.batch * shape.heads * shape.head_dim * pairs * (1 + BACKWARD_FLOPS) / topo.attention_flops


def mesh_table(cp: int, topo: Topology) -> int:
    """Per configuration: ring attention; the fewest-bytes tile (:func:`best_tile`, closed form;
    of its two rank orders the one with fewer bytes, then the faster); ``mesh-auto`` (the
    simulator's fastest, ties within the planner's tolerance to fewer inter-node bytes); USP.
    Then the headline: bytes and speedups against ring attention, max and mean over the nine."""
    print("| heads q/kv | S | ring GiB/rank | ring ms (exposed) | fewest-bytes tile | bytes | speedup | mesh-auto tile "
          "| bytes | ms | speedup | USP ms (speedup) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    fewest, auto_bytes, auto_speedups, start = {}, [], [], time.perf_counter()
    for h, g, S in CONFIGS:
        shape = AttentionShape(seq_local=S // cp, heads=h, kv_heads=g, head_dim=128)
        rows, _ = evaluate(cp, shape, topo, modes=("ring", "mesh", "mesh-auto", "usp"))
        ring = next(r for r in rows if r.mode == "ring")
        tile = best_tile(cp, shape)
        # (1, P) is ring attention's row: the mesh rows leave it out
        few = min((r for r in rows if r.mode in ("mesh", "ring") and r.tile == tile),
                  key=lambda r: (r.bytes_per_rank, r.time_s))
        auto = next(r for r in rows if r.mode == "mesh-auto")
        usp = next(r for r in rows if r.mode == "usp")
        fewest[h, g, S] = few.bytes_per_rank / ring.bytes_per_rank - 1
        auto_bytes.append(auto.bytes_per_rank / ring.bytes_per_rank - 1)
        auto_speedups.append(ring.time_s / auto.time_s)

        def name(r):
            return f"{r.tile[0]}x{r.tile[1]}" + (f" {r.contiguous}" if r.contiguous else "")
        print(f"| {h}/{g} | {S // 1024}K | {ring.bytes_per_rank / 2**30:.2f} | {ring.time_s * 1e3:.0f} "
              f"({ring.exposed_comm_s / ring.time_s:.0%}) | {name(few)} | {fewest[h, g, S]:+.1%} | "
              f"{ring.time_s / few.time_s:.2f}x | {name(auto)} | {auto_bytes[-1]:+.1%} | {auto.time_s * 1e3:.0f} | "
              f"{auto_speedups[-1]:.2f}x | {usp.time_s * 1e3:.0f} ({ring.time_s / usp.time_s:.2f}x) |", flush=True)
    mha = [v for (h, g, _), v in fewest.items() if h == g]
    gqa = [v for (h, g, _), v in fewest.items() if h != g]
    n = len(CONFIGS)
    print(f"\nfewest-bytes tile: bytes {min(fewest.values()):+.1%} max, {sum(fewest.values()) / n:+.1%} average "
          f"(MHA {min(mha):+.1%}, GQA {max(gqa):+.1%} ... {min(gqa):+.1%}); mesh-auto: bytes {min(auto_bytes):+.1%} max, "
          f"{sum(auto_bytes) / n:+.1%} average; speedup {max(auto_speedups):.2f}x max, "
          f"{sum(auto_speedups) / n:.2f}x average (MHA {min(auto_speedups[:3]):.2f}-{max(auto_speedups[:3]):.2f}x; "
          f"GQA {min(auto_speedups[3:]):.2f}-{max(auto_speedups[3:]):.2f}x) "
          f"({time.perf_counter() - start:.0f} s; machine: {topo.describe()})")
    return 0


def main(argv=None) -> int:
    d = Topology()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cp", type=int, default=256)
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--tflops", type=float, default=d.attention_flops / 1e12)
    p.add_argument("--inter-bandwidth", type=float, default=d.inter_bandwidth / 1e9, help="GB/s per GPU")
    p.add_argument("--host-op-us", default=None, metavar="US|FILE",
                   help=f"the host's us per torch op, or a file holding it, as megatron-mesh-plan takes it (0: no "
                        f"host; default {d.host_op_time * 1e6:g})")
    p.add_argument("--table", choices=("usp", "mesh"), default="usp",
                   help="usp: every mode against USP (default); mesh: Mesh-Attention against ring attention")
    a = p.parse_args(argv)
    try:
        host = d.host_op_time if a.host_op_us is None else host_op_us(a.host_op_us)[0] * 1e-6
    except ValueError as e:
        p.error(f"--host-op-us: {e}")
    topo = Topology.for_cp(a.cp, a.gpus_per_node, attention_flops=a.tflops * 1e12,
                           inter_bandwidth=a.inter_bandwidth * 1e9, host_op_time=host)
    if a.table == "mesh":
        return mesh_table(a.cp, topo)
    print("| heads q/kv | S | ring ms | mesh-auto ms | USP ms (formula) | a2a+ring ms (USP plan) | best a2a+mesh "
          "(U, tile) ms | auto ms | auto vs USP | floor ms | USP / floor |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    speedups, start = [], time.perf_counter()
    for h, g, S in CONFIGS:
        shape = AttentionShape(seq_local=S // a.cp, heads=h, kv_heads=g, head_dim=128)
        rows, _ = evaluate(a.cp, shape, topo, modes=("ring", "mesh-auto", "a2a+ring", "a2a+mesh-auto", "usp", "auto"))
        by = {}
        for r in rows:
            by.setdefault(r.mode, []).append(r)
        usp = by["usp"][0]
        a2a_ring = min(by["a2a+ring"], key=lambda r: abs(r.ulysses - usp.ulysses))  # the USP degree
        hyb, auto = by["a2a+mesh-auto"][0], by["auto"][0]
        fl = floor_s(shape, S, a.cp, topo)
        speedups.append(usp.time_s / auto.time_s)
        ms = lambda r: f"{r.time_s * 1e3:.1f}"  # noqa: E731
        print(f"| {h}/{g} | {S // 1024}K | {ms(by['ring'][0])} | {ms(by['mesh-auto'][0])} | {ms(usp)} | "
              f"{ms(a2a_ring)} | {ms(hyb)} (U={hyb.ulysses}, {hyb.tile[0]}x{hyb.tile[1]}) | {ms(auto)} | "
              f"**{speedups[-1]:.2f}x** | {fl * 1e3:.1f} | {usp.time_s / fl:.2f} |", flush=True)
    print(f"\nauto vs USP: min {min(speedups):.3f}x, mean {sum(speedups) / len(speedups):.3f}x "
          f"({time.perf_counter() - start:.0f} s; machine: {topo.describe()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
