#!/usr/bin/env python
"""How many torch ops does one rank issue for one attention layer's forward + backward?

On a GPU every non-view op is a kernel launch, and at a few thousand tokens per rank the host's
launches, not the GPU, set the pace (docs/performance.md, "Measured on GPU"). This counts them on
the CPU -- the executor issues the same ops on either device -- with a ``TorchDispatchMode``
around each virtual rank's ``forward_backward`` (in-process transport), for packed documents on
Megatron's zigzag and on the balanced layout. The in-process transport's mailbox copies (NCCL's
transfers on a GPU) are counted apart, in "transport".

    python scripts/count_host_ops.py                                  # P = 4, 2K tokens per rank
    python scripts/count_host_ops.py --world 8 --modes ring tasp a2a+ring:2 --top 5
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from megatron_mesh.comm import inprocess  # noqa: E402
from megatron_mesh.comm.inprocess import run_inprocess  # noqa: E402
from megatron_mesh.plan import AttentionShape, balanced_layout, resolve  # noqa: E402
from megatron_mesh.plan.modes.base import parse_mode_spec  # noqa: E402
from megatron_mesh.runtime.autograd import forward_backward  # noqa: E402
from megatron_mesh.runtime.inputs import attention_mask  # noqa: E402
from megatron_mesh.runtime.sharding import layout_shard  # noqa: E402
from megatron_mesh.tools.plan_cli import document_bounds  # noqa: E402

# ops that make a view: no kernel on a GPU, but a dispatch on the host
VIEWS = frozenset({"slice", "unsqueeze", "squeeze", "view", "permute", "expand", "transpose", "select", "alias",
                   "narrow", "as_strided", "_unsafe_view", "t"})


TRANSPORT = str(Path(inprocess.__file__).resolve())
PACKAGE = str(Path(inprocess.__file__).resolve().parents[1])


class OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched while it is active (on this thread): the plugin's in
    ``ops``, the in-process transport's mailbox copies (what NCCL's transfers are on a GPU) in
    ``transport``."""

    def __init__(self):
        super().__init__()
        self.ops: collections.Counter = collections.Counter()
        self.transport: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        frame = sys._getframe(1)  # the innermost of the package's frames says whose op it is
        while frame is not None and not frame.f_code.co_filename.startswith(PACKAGE):
            frame = frame.f_back
        mine = frame is None or frame.f_code.co_filename != TRANSPORT
        (self.ops if mine else self.transport)[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def count(world: int, seq_local: int, mode: str, docs: str, layout_name: str,
          seed: int = 0) -> tuple[collections.Counter, collections.Counter]:
    """The ops of every rank together, for ``mode`` on ``layout_name`` ("zigzag" / "balanced"):
    the plugin's and the in-process transport's."""
    S = world * seq_local
    name, settings = parse_mode_spec(mode)
    u = int(settings.get("ulysses_size", 1))
    heads, kv_heads = 4 * u, 2 * u  # GQA 2:1 on every rank; the count does not depend on the sizes
    shape = AttentionShape(seq_local, 1, heads, kv_heads, 8, 4)
    placement = resolve(name, world, shape, **settings)
    bounds = document_bounds(docs, S, seed)
    layout = balanced_layout(bounds, world, group=placement.ulysses) if layout_name == "balanced" else None
    mask, layout = attention_mask(world, shape, causal=True, cu_seqlens=None if layout else bounds, layout=layout)
    plan = placement.build(shape, mask, layout)
    g = torch.Generator().manual_seed(0)
    inputs = [torch.randn(S, 1, h, 8, generator=g) for h in (heads, kv_heads, kv_heads, heads)]
    shards = [tuple(layout_shard(x, r, layout, dim=0) for x in inputs) for r in range(world)]
    counted = [None] * world

    def rank_fn(rank, comm):
        counter = OpCounter()
        with counter:
            forward_backward(*shards[rank], plan, comm=comm)
        counted[rank] = counter

    run_inprocess(rank_fn, world, serial=True)
    return sum((c.ops for c in counted), collections.Counter()), sum((c.transport for c in counted),
                                                                      collections.Counter())


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--seq-local", type=int, default=2048)
    p.add_argument("--docs", default="lognormal:512,1.0", help="packed documents, as megatron-mesh-plan's --docs")
    p.add_argument("--modes", nargs="+", default=["ring", "tasp", "a2a+ring:2"])
    p.add_argument("--layouts", nargs="+", default=["zigzag", "balanced"], choices=["zigzag", "balanced"])
    p.add_argument("--top", type=int, default=8, help="name the most frequent ops")
    args = p.parse_args(argv)
    if args.world < 1 or args.seq_local < 1 or args.top < 0:
        p.error(f"--world and --seq-local must be >= 1 and --top >= 0, got {args.world}, {args.seq_local}, {args.top}")
    try:  # the documents fit the sample (the planner's message names its own --seq-len: say which that is)
        document_bounds(args.docs, args.world * args.seq_local)
    except ValueError as e:
        p.error(f"--docs {args.docs!r} over --world x --seq-local = {args.world * args.seq_local} tokens: {e}")
    rows = []
    print(f"ops per rank, forward + backward: P={args.world}, {args.seq_local} tokens per rank, documents {args.docs}")
    print(f"{'layout':<10}{'mode':<14}{'ops':>7}{'non-view':>10}{'transport':>11}  most frequent (the plugin's)")
    for layout_name in args.layouts:
        for mode in args.modes:
            try:
                ops, transport = count(args.world, args.seq_local, mode, args.docs, layout_name)
            except ValueError as e:  # a bad --world, --modes or --docs: the message names it
                raise SystemExit(f"{layout_name} {mode}: {e}") from None
            total = sum(ops.values()) / args.world
            kernels = sum(n for op, n in ops.items() if op not in VIEWS) / args.world
            moved = sum(transport.values()) / args.world
            top = ", ".join(f"{op} {n / args.world:.0f}" for op, n in ops.most_common(args.top))
            print(f"{layout_name:<10}{mode:<14}{total:>7.0f}{kernels:>10.0f}{moved:>11.0f}  {top}")
            rows.append(dict(layout=layout_name, mode=mode, ops=total, non_view=kernels, transport=moved))
    return rows


if __name__ == "__main__":
    main()
