#!/usr/bin/env python
"""Side-by-side run of CP attention modes on N CPU processes (gloo): exactness and bytes moved.

For each mode (ring, Mesh tiles, TASP when available) it runs the same zigzag-sharded attention
forward + backward, and prints per mode: the max error of out/dq/dk/dv against a dense fp64
reference on the full sequence, the bytes each rank sent (measured by ``comm_counter()`` and
predicted by the plan) and the wall time of forward + backward.

    python scripts/compare_attention.py --world 4 --modes ring mesh:auto mesh:2x2 mesh:4x1
"""

from __future__ import annotations

import argparse
import time

import torch

import megatron_mesh as mm
from megatron_mesh.kernels import reference_attention
from megatron_mesh.launch import spawn
from megatron_mesh.plan import AttentionShape, build_mesh_plan, parse_tile, plan_bytes

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp64": torch.float64}


def _attention_fn(mode: str, world: int, causal: bool):
    name, _, arg = mode.partition(":")
    if name == "ring":
        return lambda q, k, v: mm.ring_attention(q, k, v, causal=causal)
    if name == "mesh":
        tile = parse_tile(arg or "auto", world)
        return lambda q, k, v: mm.mesh_attention(q, k, v, tile=tile, causal=causal)
    if name == "tasp":
        from megatron_mesh.runtime.tasp_api import tasp_attention
        return lambda q, k, v: tasp_attention(q, k, v, causal=causal)
    raise ValueError(f"unknown mode {mode!r}; use ring, mesh[:AxB|:auto], tasp")


def _planned_bytes(mode: str, world: int, shape: AttentionShape, causal: bool) -> int:
    name, _, arg = mode.partition(":")
    if name == "tasp":
        from megatron_mesh.plan.tasp import build_tasp_plan
        plan = build_tasp_plan(world, shape, causal=causal)
    else:
        tile = (1, world) if name == "ring" else parse_tile(arg or "auto", world)
        plan = build_mesh_plan(world, tile, shape, causal=causal)
    return plan_bytes(plan, shape)[0].sent, plan.tile


def run_rank(rank: int, world: int, args) -> list[dict]:
    dtype = DTYPES[args.dtype]
    g = torch.Generator().manual_seed(0)
    S, B, H, G, D = args.seq_len, args.batch, args.heads, args.kv_heads, args.head_dim
    full = [torch.randn(S, B, h, D, generator=g, dtype=torch.float64) for h in (H, G, G, H)]
    Q, K, V, dO = full
    ref_in = [x.clone().requires_grad_() for x in (Q, K, V)]
    ref = reference_attention(*ref_in, causal=not args.full)
    ref.backward(dO)
    want = [ref.detach()] + [x.grad for x in ref_in]
    shard = lambda x: mm.zigzag_shard(x, rank, world)  # noqa: E731
    rows = []
    for mode in args.modes:
        fn = _attention_fn(mode, world, not args.full)
        q, k, v = (shard(x).to(dtype).requires_grad_() for x in (Q, K, V))
        torch.distributed.barrier()
        t0 = time.perf_counter()
        with mm.comm_counter() as c:
            out = fn(q, k, v)
            out.backward(shard(dO).to(dtype))
        elapsed = time.perf_counter() - t0
        got = [out, q.grad, k.grad, v.grad]
        err = max((a.double() - shard(b)).abs().max().item() for a, b in zip(got, want))
        rows.append(dict(mode=mode, err=err, sent=c.bytes_sent, received=c.bytes_received, time=elapsed))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=4, help="CP size = number of CPU processes (default 4)")
    ap.add_argument("--modes", nargs="+", default=["ring", "mesh:auto", "mesh:2x2", "mesh:4x1"])
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    ap.add_argument("--full", action="store_true", help="non-causal attention")
    args = ap.parse_args()
    results = spawn(run_rank, args.world, args, timeout=600)
    shape = AttentionShape(args.seq_len // args.world, args.batch, args.heads, args.kv_heads, args.head_dim,
                           torch.tensor([], dtype=DTYPES[args.dtype]).element_size())
    ring_bytes = None
    print(f"CP={args.world} seq_len={args.seq_len} heads={args.heads}/{args.kv_heads} head_dim={args.head_dim} "
          f"{args.dtype} {'full' if args.full else 'causal'} (forward + backward, per rank)")
    print(f"{'mode':<12}{'tile':>8}{'max err vs fp64':>17}{'bytes sent':>14}{'planned':>14}{'vs ring':>9}{'time s':>9}")
    for i, mode in enumerate(args.modes):
        rows = [r[i] for r in results]
        sent = max(r["sent"] for r in rows)
        planned, tile = _planned_bytes(mode, args.world, shape, not args.full)
        if mode == "ring":
            ring_bytes = sent
        ratio = f"{sent / ring_bytes:.2f}" if ring_bytes else "-"
        tile_s = f"{tile[0]}x{tile[1]}" if tile else "-"
        print(f"{mode:<12}{tile_s:>8}{max(r['err'] for r in rows):>17.2e}{sent:>14,}{planned:>14,}{ratio:>9}"
              f"{max(r['time'] for r in rows):>9.3f}")
        if any(r["sent"] != planned or r["received"] != planned for r in rows):
            raise SystemExit(f"{mode}: measured bytes differ from the plan's prediction")


if __name__ == "__main__":
    main()
