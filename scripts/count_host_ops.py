#!/usr/bin/env python
"""How many torch ops does one rank issue for one attention layer's forward + backward?

On a GPU every non-view op is a kernel launch, and at a few thousand tokens per rank the host's
launches, not the GPU, set the pace (docs/performance.md, "Measured on GPU"). This counts them on
the CPU -- the executor issues the same ops on either device -- with a ``TorchDispatchMode``
around each virtual rank's ``forward_backward`` (in-process transport), for packed documents on
Megatron's zigzag and on the balanced layout. The in-process transport's mailbox copies (NCCL's
transfers on a GPU) are counted apart, in "transport".

``--bytes`` counts, instead, the memory the plugin's non-attention ops read and write per rank
(merges, casts, fills, copies, the row statistic: the "other kernels" of ``bench_masks.py
--profile``) at a real shape (``--heads``, ``--kv-heads``, ``--head-dim``, ``--dtype``; default
the H100 benchmark's GQA 32/8 of 128 in bf16), on meta tensors -- shapes only, no compute, so
seconds for 16K tokens per rank -- through the CUDA flash kernel's own plumbing.

``--meta`` counts the ops of the CUDA kernel's path instead (flash in 16-bit, its
variable-length calls, CUDA's mask piece, the casts of 16-bit inputs) on meta tensors of
``--dtype``: what a GPU's host issues, where the CPU's fp32 run has no casts and one kernel call
per mask piece.

It counts a step after the plan's first (``--first-call``: the first, which also makes the block
masks, the arena's views and the gathers' indices, once per plan), and prints next to the counts
the planner's model of them ("model": ops / non-view ops per rank, :mod:`megatron_mesh.plan.hostops`,
as the CPU runs the plan: one kernel call per mask piece; the planner prices a GPU's calls).

    python scripts/count_host_ops.py                                  # P = 4, 2K tokens per rank
    python scripts/count_host_ops.py --world 8 --modes ring tasp a2a+ring:2 --top 5
    python scripts/count_host_ops.py --bytes --world 8 --seq-local 16384 --docs lognormal:4096,1.0
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
from megatron_mesh.kernels.torch_sdpa import TorchAttentionKernel  # noqa: E402
from megatron_mesh.plan import AttentionShape, balanced_layout, resolve  # noqa: E402
from megatron_mesh.plan.hostops import step_host_ops  # noqa: E402
from megatron_mesh.plan.mask import MASK_PIECE  # noqa: E402
from megatron_mesh.plan.modes.base import parse_mode_spec  # noqa: E402
from megatron_mesh.runtime.autograd import forward_backward  # noqa: E402
from megatron_mesh.runtime.inputs import attention_mask  # noqa: E402
from megatron_mesh.runtime.sharding import layout_shard  # noqa: E402
from megatron_mesh.tools.plan_args import document_bounds  # noqa: E402

# ops that make a view: no kernel on a GPU, but a dispatch on the host
VIEWS = frozenset({"slice", "unsqueeze", "squeeze", "view", "permute", "expand", "transpose", "select", "alias",
                   "narrow", "as_strided", "_unsafe_view", "t"})


TRANSPORT = str(Path(inprocess.__file__).resolve())
PACKAGE = str(Path(inprocess.__file__).resolve().parents[1])


DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# attention kernels (their memory traffic is the kernel's own, priced with its FLOPs)
ATTENTION = ("flash", "attention")
# ops that only write their first argument (it is not read)
WRITE_ONLY = frozenset({"copy_", "fill_", "zero_", "_foreach_copy_", "_foreach_zero_"})
# in-place ops that return nothing: what they write, by their arguments (the fused merge: out and lse)
WRITTEN = {"merge_": slice(0, 2)}


def host_op_us(host_ms: float, ops: float, views: float) -> float | None:
    """The host's us per torch op that is not a view (and per transport call), from a step's host
    ms, its ops (views included) and its views, the views priced at the planner's
    ``Topology.host_view_time`` (:mod:`megatron_mesh.plan.hostcost`): what ``--host-op-us`` means.
    None where the step issued nothing but views."""
    from megatron_mesh.plan.hostcost import HOST_VIEW_TIME
    if ops <= views:
        return None
    return max(0.0, 1e3 * host_ms - views * HOST_VIEW_TIME * 1e6) / (ops - views)


class OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched while it is active (on this thread): the plugin's in
    ``ops``, the in-process transport's mailbox copies (what NCCL's transfers are on a GPU) in
    ``transport``; and in ``bytes`` what each of the plugin's non-view, non-attention ops reads
    and writes (its tensor arguments and results)."""

    def __init__(self):
        super().__init__()
        self.ops: collections.Counter = collections.Counter()
        self.transport: collections.Counter = collections.Counter()
        self.bytes: collections.Counter = collections.Counter()

    @property
    def issued(self) -> tuple[float, float]:
        """(torch ops issued, views among them): the plugin's and the transport's."""
        ops = sum(self.ops.values()) + sum(self.transport.values())
        return float(ops), float(sum(n for op, n in (*self.ops.items(), *self.transport.items()) if op in VIEWS))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        frame = sys._getframe(1)  # the innermost of the package's frames says whose op it is
        while frame is not None and not frame.f_code.co_filename.startswith(PACKAGE):
            frame = frame.f_back
        mine = frame is None or frame.f_code.co_filename != TRANSPORT
        name = func.overloadpacket.__name__
        (self.ops if mine else self.transport)[name] += 1
        out = func(*args, **(kwargs or {}))
        if mine and name not in VIEWS and not any(a in name for a in ATTENTION) and not name.startswith("empty"):
            read = args[1:] if name in WRITE_ONLY else args
            written = out if out is not None else args[WRITTEN.get(name, slice(0, 1))] if name.endswith("_") else None
            self.bytes[name] += _nbytes(read) + _nbytes(list((kwargs or {}).values())) + _nbytes(written)
        return out


def _nbytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(y) for y in x)
    return 0


def count(world: int, seq_local: int, mode: str, docs: str, layout_name: str,
          seed: int = 0, warm: bool = True, meta_dtype: torch.dtype | None = None
          ) -> tuple[collections.Counter, collections.Counter]:
    """The ops of every rank together, for ``mode`` on ``layout_name`` ("zigzag" / "balanced"):
    the plugin's and the in-process transport's; ``warm``: of a step after the plan's first
    (what every layer's call is once the plan is built: its block masks, arena and views made);
    ``meta_dtype``: the CUDA kernel's path on meta tensors of that dtype instead of the CPU's."""
    where = dict(device="cpu") if meta_dtype is None else dict(device="meta", dtype=meta_dtype)
    counted = run_counted(world, seq_local, mode, docs, layout_name, seed, warm=warm, **where)
    return sum((c.ops for c in counted), collections.Counter()), sum((c.transport for c in counted),
                                                                      collections.Counter())


def plan_of(world: int, seq_local: int, mode: str, docs: str, layout_name: str, seed: int = 0,
            heads: int | None = None, kv_heads: int | None = None, head_dim: int = 8,
            dtype: torch.dtype = torch.float32):
    """(the plan :func:`run_counted` runs, its per-rank shape)."""
    name, settings = parse_mode_spec(mode)
    u = int(settings.get("ulysses_size", 1))
    heads, kv_heads = 4 * u if heads is None else heads, 2 * u if kv_heads is None else kv_heads
    shape = AttentionShape(seq_local, 1, heads, kv_heads, head_dim, torch.empty((), dtype=dtype).element_size())
    placement = resolve(name, world, shape, **settings)
    bounds = document_bounds(docs, world * seq_local, seed)
    layout = balanced_layout(bounds, world, group=placement.ulysses) if layout_name == "balanced" else None
    mask, layout = attention_mask(world, shape, causal=True, cu_seqlens=None if layout else bounds, layout=layout)
    return placement.build(shape, mask, layout), shape


def modelled(plan, shape, world: int, cuda: bool = False) -> tuple[float, float]:
    """The host-op model's (ops, non-view ops) per rank, forward + backward, as the CPU runs them
    (no variable-length calls, the CPU's mask piece; ``cuda``: as CUDA flash does, with
    variable-length calls and CUDA's piece): :mod:`megatron_mesh.plan.hostops`."""
    device = "cuda" if cuda else "cpu"
    total = launches = 0.0
    for rank in range(world):
        for direction in ("forward", "backward"):
            ops, around = step_host_ops(plan, rank, direction, shape, varlen=cuda, piece=MASK_PIECE[device])
            for h in (*ops, around):
                total += h.launches + h.views
                launches += h.launches
    return total / world, launches / world


def run_counted(world: int, seq_local: int, mode: str, docs: str, layout_name: str, seed: int = 0,
                heads: int | None = None, kv_heads: int | None = None, head_dim: int = 8,
                dtype: torch.dtype = torch.float32, device: str = "cpu", warm: bool = False) -> list[OpCounter]:
    """Each rank's :class:`OpCounter` over one forward + backward of ``mode``'s plan (``warm``:
    the second one, its block masks made). Default sizes: GQA 2:1 heads on every rank (the op
    count does not depend on the sizes). On the meta device the tensors are shapes only and the
    kernel is the CUDA flash op's plumbing."""
    S = world * seq_local
    plan, shape = plan_of(world, seq_local, mode, docs, layout_name, seed, heads, kv_heads, head_dim, dtype)
    heads, kv_heads, layout = shape.heads, shape.kv_heads, plan.layout
    if device == "meta":
        inputs = [torch.empty(S, 1, h, head_dim, dtype=dtype, device="meta") for h in (heads, kv_heads, kv_heads, heads)]
        kernel = TorchAttentionKernel("cuda", "flash")
    else:
        g = torch.Generator().manual_seed(0)
        inputs = [torch.randn(S, 1, h, head_dim, generator=g).to(dtype) for h in (heads, kv_heads, kv_heads, heads)]
        kernel = "auto"
    shards = [tuple(layout_shard(x, r, layout, dim=0) for x in inputs) for r in range(world)]
    counted = [None] * world

    def rank_fn(rank, comm):
        if warm:  # the block masks are made once per plan and cached: leave them out of a step's count
            forward_backward(*shards[rank], plan, comm=comm, kernel=kernel)
        counter = OpCounter()
        with counter:
            forward_backward(*shards[rank], plan, comm=comm, kernel=kernel)
        counted[rank] = counter

    run_inprocess(rank_fn, world, serial=True, device=torch.device(device))
    return counted


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--seq-local", type=int, default=2048)
    p.add_argument("--docs", default="lognormal:512,1.0", help="packed documents, as megatron-mesh-plan's --docs")
    p.add_argument("--modes", nargs="+", default=["ring", "tasp", "a2a+ring:2"])
    p.add_argument("--layouts", nargs="+", default=["zigzag", "balanced"], choices=["zigzag", "balanced"])
    p.add_argument("--top", type=int, default=8, help="name the most frequent ops (--bytes: the most bytes)")
    p.add_argument("--first-call", action="store_true",
                   help="count a plan's first call (it also makes the block masks, the arena's views and the "
                        "gathers' indices, once per plan) instead of a later one")
    p.add_argument("--bytes", action="store_true",
                   help="count the bytes the non-attention ops read and write per rank instead (meta tensors, "
                        "the sizes below)")
    p.add_argument("--meta", action="store_true",
                   help="count the ops of the CUDA kernel's path (flash, variable-length calls, CUDA's mask piece) "
                        "on meta tensors of --dtype, as a GPU's host issues them, instead of the CPU's")
    p.add_argument("--heads", type=int, default=32, help="--bytes: query heads")
    p.add_argument("--kv-heads", type=int, default=8, help="--bytes: key/value heads")
    p.add_argument("--head-dim", type=int, default=128, help="--bytes: head dimension")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="--bytes, --meta: the inputs' dtype")
    p.add_argument("--hbm", type=float, default=3.35, help="--bytes: TB/s for the time those bytes take")
    args = p.parse_args(argv)
    if args.world < 1 or args.seq_local < 1 or args.top < 0:
        p.error(f"--world and --seq-local must be >= 1 and --top >= 0, got {args.world}, {args.seq_local}, {args.top}")
    try:  # the documents fit the sample (the planner's message names its own --seq-len: say which that is)
        document_bounds(args.docs, args.world * args.seq_local)
    except ValueError as e:
        p.error(f"--docs {args.docs!r} over --world x --seq-local = {args.world * args.seq_local} tokens: {e}")
    if args.bytes:
        if min(args.heads, args.kv_heads, args.head_dim) < 1 or not args.hbm > 0:
            p.error(f"--heads, --kv-heads and --head-dim must be >= 1 and --hbm > 0, got {args.heads}, "
                    f"{args.kv_heads}, {args.head_dim} and {args.hbm}")
        return bytes_rows(args)
    rows = []
    print(f"ops per rank, forward + backward ({'a plan' + chr(39) + 's first call' if args.first_call else 'a later call'}"
          f"{f'; the CUDA path on meta tensors, {args.dtype}' if args.meta else ''}): "
          f"P={args.world}, {args.seq_local} tokens per rank, documents {args.docs}")
    print(f"{'layout':<10}{'mode':<14}{'ops':>7}{'non-view':>10}{'transport':>11}{'model':>13}  "
          "most frequent (the plugin's)")
    for layout_name in args.layouts:
        for mode in args.modes:
            try:
                ops, transport = count(args.world, args.seq_local, mode, args.docs, layout_name,
                                       warm=not args.first_call, meta_dtype=DTYPES[args.dtype] if args.meta else None)
            except ValueError as e:  # a bad --world, --modes or --docs: the message names it
                raise SystemExit(f"{layout_name} {mode}: {e}") from None
            total = sum(ops.values()) / args.world
            kernels = sum(n for op, n in ops.items() if op not in VIEWS) / args.world
            moved = sum(transport.values()) / args.world
            top = ", ".join(f"{op} {n / args.world:.0f}" for op, n in ops.most_common(args.top))
            model = modelled(*plan_of(args.world, args.seq_local, mode, args.docs, layout_name), args.world, args.meta)
            print(f"{layout_name:<10}{mode:<14}{total:>7.0f}{kernels:>10.0f}{moved:>11.0f}"
                  f"{f'{model[0]:.0f} / {model[1]:.0f}':>13}  {top}")
            rows.append(dict(layout=layout_name, mode=mode, ops=total, non_view=kernels, transport=moved,
                             model_ops=model[0], model_non_view=model[1]))
    return rows


def bytes_rows(args) -> list[dict]:
    """--bytes: per rank, the GB the plugin's non-attention ops read and write (mean and busiest
    rank), their time at --hbm TB/s, and the busiest rank's top ops by bytes."""
    print(f"bytes read + written per rank by the non-attention ops, forward + backward: P={args.world}, "
          f"{args.seq_local} tokens per rank, documents {args.docs}, heads {args.heads}/{args.kv_heads} of "
          f"{args.head_dim}, {args.dtype}; ms at {args.hbm} TB/s")
    print(f"{'layout':<10}{'mode':<14}{'mean GB':>9}{'max GB':>8}{'mean ms':>9}  busiest rank's ops (GB / calls)")
    rows = []
    for layout_name in args.layouts:
        for mode in args.modes:
            try:
                counted = run_counted(args.world, args.seq_local, mode, args.docs, layout_name, heads=args.heads,
                                      kv_heads=args.kv_heads, head_dim=args.head_dim, dtype=DTYPES[args.dtype],
                                      device="meta", warm=True)
            except ValueError as e:
                raise SystemExit(f"{layout_name} {mode}: {e}") from None
            per_rank = [sum(c.bytes.values()) for c in counted]
            busiest = counted[max(range(args.world), key=per_rank.__getitem__)]
            mean = sum(per_rank) / args.world
            top = ", ".join(f"{op} {b / 1e9:.2f}/{busiest.ops[op]}" for op, b in busiest.bytes.most_common(args.top))
            print(f"{layout_name:<10}{mode:<14}{mean / 1e9:>9.2f}{max(per_rank) / 1e9:>8.2f}"
                  f"{mean / (args.hbm * 1e12) * 1e3:>9.2f}  {top}")
            rows.append(dict(layout=layout_name, mode=mode, bytes_per_rank=per_rank,
                             top={op: b for op, b in busiest.bytes.most_common(args.top)}))
    return rows


if __name__ == "__main__":
    main()
