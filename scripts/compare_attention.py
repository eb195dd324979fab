#!/usr/bin/env python
"""Side-by-side run of CP attention modes on N CPU processes (gloo): exactness and bytes moved.

For each mode (ring, Mesh tiles, TASP, the Ulysses hybrids) it runs the same zigzag-sharded
attention forward + backward through ``megatron_mesh.attention``, and prints per mode: the max
error of out/dq/dk/dv against a dense fp64 reference on the full sequence, the bytes each rank
sent (measured by ``comm_counter()`` and predicted by the plan of the same placement) and the wall
time of forward + backward.

    python scripts/compare_attention.py --world 4 --modes ring mesh:auto mesh:2x2 mesh:4x1 tasp a2a+ring:2

Modes: ``ring``, ``mesh[:AxB|:auto]``, ``tasp[:GPUS_PER_NODE]``, ``a2a+ring:U``, ``a2a+mesh:U[:AxB]``,
``a2a+tasp:U`` (U: the all-to-all degree).
"""

from __future__ import annotations

import argparse
import time

import torch

import megatron_mesh as mm
from megatron_mesh.kernels import reference_attention
from megatron_mesh.launch import spawn
from megatron_mesh.plan import AttentionShape, Mask, parse_tile, plan_bytes, resolve

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp64": torch.float64}


def mode_settings(mode: str, world: int) -> tuple[str, dict]:
    """(registered mode, its settings) of a command-line mode like ``mesh:2x2`` or ``a2a+mesh:2:1x2``."""
    name, *args = mode.split(":")
    if name == "ring" and not args:
        return "ring", {}
    if name == "mesh" and len(args) <= 1:
        return "mesh", {"tile": parse_tile(args[0] if args else "auto", world)}
    if name == "tasp" and len(args) <= 1:
        return "tasp", {"gpus_per_node": int(args[0])} if args else {}
    if name in ("a2a+ring", "a2a+tasp") and len(args) == 1:
        return name, {"ulysses_size": int(args[0])}
    if name == "a2a+mesh" and len(args) in (1, 2):
        U = int(args[0])
        return name, {"ulysses_size": U, "tile": parse_tile(args[1] if len(args) > 1 else "auto", world // U)}
    raise ValueError(f"unknown mode {mode!r}; use ring, mesh[:AxB|:auto], tasp[:GPUS_PER_NODE], a2a+ring:U, "
                     "a2a+mesh:U[:AxB], a2a+tasp:U")


def planned(mode: str, world: int, shape: AttentionShape, causal: bool):
    """The plan the runtime runs for ``mode`` (the same placement: settings, auto tile, mask)."""
    name, settings = mode_settings(mode, world)
    if name == "mesh":
        settings["causal"] = causal  # tile "auto" is simulated for this mask, as the runtime does
    placement = resolve(name, world, shape, **settings)
    return placement, placement.build(shape, Mask(causal))


def run_rank(rank: int, world: int, args) -> list[dict]:
    dtype = DTYPES[args.dtype]
    g = torch.Generator().manual_seed(0)
    S, B, H, G, D = args.seq_len, args.batch, args.heads, args.kv_heads, args.head_dim
    Q, K, V, dO = (torch.randn(S, B, h, D, generator=g, dtype=torch.float64) for h in (H, G, G, H))
    ref_in = [x.clone().requires_grad_() for x in (Q, K, V)]
    ref = reference_attention(*ref_in, causal=not args.full)
    ref.backward(dO)
    want = [ref.detach()] + [x.grad for x in ref_in]
    shard = lambda x: mm.zigzag_shard(x, rank, world)  # noqa: E731
    rows = []
    for mode in args.modes:
        name, settings = mode_settings(mode, world)
        q, k, v = (shard(x).to(dtype).requires_grad_() for x in (Q, K, V))
        torch.distributed.barrier()
        t0 = time.perf_counter()
        with mm.comm_counter() as c:
            out = mm.attention(q, k, v, mode=name, causal=not args.full, **settings)
            out.backward(shard(dO).to(dtype))
        elapsed = time.perf_counter() - t0
        got = [out, q.grad, k.grad, v.grad]
        err = max((a.double() - shard(b)).abs().max().item() for a, b in zip(got, want))
        rows.append(dict(mode=mode, err=err, sent=c.bytes_sent, received=c.bytes_received, time=elapsed))
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    """Print the table; return one row per mode (max error, max bytes sent and the plan's, time)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=4, help="CP size = number of CPU processes (default 4)")
    ap.add_argument("--modes", nargs="+", default=["ring", "mesh:auto", "mesh:2x2", "mesh:4x1", "tasp"])
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    ap.add_argument("--full", action="store_true", help="non-causal attention")
    args = ap.parse_args(argv)
    if args.seq_len % (2 * args.world):
        raise SystemExit(f"--seq-len {args.seq_len} must be divisible by 2 * --world = {2 * args.world}")
    shape = AttentionShape(args.seq_len // args.world, args.batch, args.heads, args.kv_heads, args.head_dim,
                           torch.tensor([], dtype=DTYPES[args.dtype]).element_size())
    plans = {}
    for mode in args.modes:
        try:
            plans[mode] = planned(mode, args.world, shape, not args.full)
        except ValueError as e:
            raise SystemExit(f"--modes {mode}: {e}") from None
    results = spawn(run_rank, args.world, args, timeout=600)
    print(f"CP={args.world} seq_len={args.seq_len} heads={args.heads}/{args.kv_heads} head_dim={args.head_dim} "
          f"{args.dtype} {'full' if args.full else 'causal'} (forward + backward, per rank)")
    print(f"{'mode':<14}{'tile':>8}{'max err vs fp64':>17}{'bytes sent':>14}{'planned':>14}{'vs ring':>9}{'time s':>9}")
    table, ring_bytes = [], None
    for i, mode in enumerate(args.modes):
        rows = [r[i] for r in results]
        placement, plan = plans[mode]
        want = [(b.sent, b.received) for b in plan_bytes(plan, shape)]
        sent, planned_sent = max(r["sent"] for r in rows), max(s for s, _ in want)
        if mode == "ring":
            ring_bytes = sent
        ratio = f"{sent / ring_bytes:.2f}" if ring_bytes else "-"
        tile = placement.tile or (placement.inner.tile if placement.inner is not None else None)
        tile_s = f"{tile[0]}x{tile[1]}" if tile else "-"
        err = max(r["err"] for r in rows)
        print(f"{mode:<14}{tile_s:>8}{err:>17.2e}{sent:>14,}{planned_sent:>14,}{ratio:>9}"
              f"{max(r['time'] for r in rows):>9.3f}")
        table.append(dict(mode=mode, tile=tile, err=err, sent=sent, planned=planned_sent,
                          time=max(r["time"] for r in rows)))
        if [(r["sent"], r["received"]) for r in rows] != want:
            raise SystemExit(f"{mode}: measured bytes {[(r['sent'], r['received']) for r in rows]} differ from the "
                             f"plan's {want}")
    return table


if __name__ == "__main__":
    main()
