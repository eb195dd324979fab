"""Per-step link load of ring attention vs TASP, from the plans' own byte accounting.

    python scripts/tasp_link_load.py                      # P = 8, Llama-3-8B-like GQA, 14K tokens/rank, bf16
    python scripts/tasp_link_load.py --world 16 --gpus-per-node 8 --seq-local 8192

Both algorithms take P - 1 steps. Per plan and direction it prints the bytes of the busiest
directed link per step (its total over the call / (P - 1); ring attention's backward moves KV and
dK/dV in two rounds per step, TASP in one) and per round; with nodes, the inter-node bytes the
busiest rank sends per step and over how many links.
"""

from __future__ import annotations

import argparse
from collections import defaultdict

from megatron_mesh.plan import AttentionShape, build_ring_plan, build_tasp_plan, link_bytes, link_load


def _mib(b: int) -> str:
    return f"{b / 2**20:8.3f} MiB"


def main(argv: list[str] | None = None) -> dict:
    """Print the tables; return them as {"single": [row, ...], "nodes": [row, ...]} with bytes per row."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--gpus-per-node", type=int, default=4, help="emulated node size for the multi-node rows")
    ap.add_argument("--seq-local", type=int, default=14 * 1024, help="tokens per rank (14K: equal slots for 7 and 4 rings)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--itemsize", type=int, default=2)
    a = ap.parse_args(argv)
    shape = AttentionShape(a.seq_local, a.batch, a.heads, a.kv_heads, a.head_dim, a.itemsize)
    P, m = a.world, a.gpus_per_node
    print(f"P={P}, seq_local={a.seq_local}, batch={a.batch}, heads={a.heads}, kv_heads={a.kv_heads}, "
          f"head_dim={a.head_dim}, itemsize={a.itemsize}")
    steps = P - 1
    out: dict[str, list[dict]] = {"single": [], "nodes": []}
    plans = {"ring": build_ring_plan(P, shape), "tasp (one node)": build_tasp_plan(P, shape)}
    print(f"\nsingle node: bytes on the busiest link, per step and per round ({steps} steps)")
    for name, plan in plans.items():
        for direction in ("forward", "backward"):
            per_step = max(link_bytes(plan, shape, direction).values()) // steps
            load = link_load(plan, shape, direction)
            out["single"].append(dict(plan=name, direction=direction, per_step=per_step, per_round=load.max_link,
                                      rounds=load.rounds))
            print(f"  {name:<22} {direction:<8} {_mib(per_step)} /step  {_mib(load.max_link)} /round "
                  f"({load.rounds} rounds)")
    if m and P % m == 0 and P // m >= 2:
        plans[f"tasp ({P // m} nodes of {m})"] = build_tasp_plan(P, shape, ranks_per_node=m)
        print(f"\n{P // m} nodes of {m}: inter-node bytes the busiest rank sends per step (over how many links)")
        for name, plan in plans.items():
            for direction in ("forward", "backward"):
                sent: dict[int, int] = defaultdict(int)
                for (src, dst), b in link_bytes(plan, shape, direction).items():
                    if src // m != dst // m:
                        sent[src] += b
                load = link_load(plan, shape, direction, ranks_per_node=m)
                per_step = max(sent.values()) // steps
                out["nodes"].append(dict(plan=name, direction=direction, per_step=per_step,
                                         links=load.inter_node_links))
                print(f"  {name:<22} {direction:<8} {_mib(per_step)} /step  over {load.inter_node_links} link(s)")
    return out


if __name__ == "__main__":
    main()
