#!/usr/bin/env python
"""How much does cutting attention into a plan's tile of blocks cost, on one device?

For each local sequence length and each plan (ring 1xP, Mesh tiles, TASP), causal, it times:

(a) **fused**: one attention call of the block kernel over the whole problem -- causal attention of
    the full sequence S = P x s_local -- divided by P: the time one rank would need if its share
    of the work (1/P of the causal matrix) ran at the speed of a single fused kernel call.
(b) **tiled**: the plan itself. All P virtual ranks of the plan run on this one device through the
    in-process transport (:mod:`megatron_mesh.comm.inprocess`, serial mode: one rank at a time,
    so the wall time is the sum of every rank's work), each running the executor's forward or
    backward: its blocks, LSE merges, gradient adds, buffer pool and the mailbox copies. Time
    divided by P. "compute only" subtracts the measured mailbox copy time (copies stand in for
    NCCL transfers, which on real ranks overlap the blocks).
(c) **alone**: the busiest rank (by the plan's work) once more, alone on the device: the messages
    it received in (b) replayed into its receive buffers (:mod:`megatron_mesh.comm.replay`), so it
    computes exactly what it computed in (b), with nothing between its ops but its own host work
    (launches, the executor's Python). Its host runs ahead of the device as on a real GPU of a
    P-GPU job: "alone ms" is its wall time per step (sync at the end of the loop only), "host ms"
    the time the host took to issue one step, "ops" the torch ops it issued (one more step, counted
    with count_host_ops.py's counter; their mean host time per op is the JSON's
    ``meta.host_op_us``, the planner's ``--host-op-us``). Host ms close to alone ms: the host sets
    the pace; well below it: the device does. With ``--graphs`` each direction is also captured as
    a CUDA graph and replayed ("graph ms"): the host's cost then no longer grows with the plan's
    ops. The communication itself is left out (it overlaps the blocks).

Both modes do the same useful FLOPs (the plan covers the causal matrix exactly once): forward
4*B*H*S^2*D/2, backward 2.5x that (flash-attention's convention). Efficiency = time(a) / time(b)
= TFLOP/s(b) / TFLOP/s(a); the goal is >= 0.90. Peak memory per mode is
``torch.cuda.max_memory_allocated`` above what was allocated before the mode (inputs excluded),
for all P virtual ranks together and per rank (/P); on the CPU it is not measured. Max errors
compare the tiled outputs and gradients with the fused ones. The JSON's ``meta.calibration``
holds the fused kernel's measured FLOP/s for the planner (``Topology(attention_flops=...)``).

    python scripts/bench_kernels.py                       # CUDA if available, else small CPU shapes
    python scripts/bench_kernels.py --seq-local 2048 8192 --world 8 --tiles 1x8 2x4 --json out.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from megatron_mesh.comm.inprocess import Mailbox, run_inprocess  # noqa: E402
from megatron_mesh.comm.replay import Recorder, ReplayCommunicator  # noqa: E402
from megatron_mesh.kernels import CAUSAL, get_kernel  # noqa: E402
from megatron_mesh.plan import AttentionShape, build_mesh_plan, build_tasp_plan, parse_tile  # noqa: E402
from megatron_mesh.plan.accounting import rank_work  # noqa: E402
from megatron_mesh.runtime.api import zigzag_shard, zigzag_unshard  # noqa: E402
from megatron_mesh.runtime.executor import Executor  # noqa: E402

DIR = {"forward": "fwd", "backward": "bwd"}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DEFAULTS = {  # realistic on a GPU; small enough for < 1 min on a CPU
    "cuda": dict(seq_local=[2048, 8192, 32768], heads=32, kv_heads=8, head_dim=128, batch=1, world=4,
                 tiles=["1x4", "2x2"], dtype="bf16", iters=5, warmup=2),
    "cpu": dict(seq_local=[256, 512], heads=8, kv_heads=2, head_dim=64, batch=1, world=4,
                tiles=["1x4", "2x2"], dtype="fp32", iters=2, warmup=1),
}


@dataclass
class Row:
    seq_local: int
    mode: str  # "fused" or "ring 1x4" / "mesh 2x2"
    direction: str  # "forward" / "backward"
    ms_per_rank: float
    tflops: float
    efficiency: float  # fused time / this time (1.0 for fused)
    compute_ms_per_rank: float  # without the mailbox copies (= ms_per_rank for fused)
    compute_efficiency: float
    peak_mib_total: float | None
    peak_mib_per_rank: float | None
    max_abs_err: dict | None  # tiled vs fused, per tensor
    alone_rank: int | None = None  # (c): the busiest rank, run alone (None for fused)
    alone_ms: float | None = None  # its wall ms per step, the host free-running
    alone_host_ms: float | None = None  # the host's ms to issue one step
    alone_efficiency: float | None = None  # fused ms per rank / alone ms
    alone_ops: float | None = None  # torch ops the rank's host issues per step (views included)
    alone_views: float | None = None  # views among them
    graph_ms: float | None = None  # --graphs: its wall ms per step replaying the step's CUDA graph
    graph_efficiency: float | None = None  # fused ms per rank / graph ms


def attention_flops(batch, heads, seq, head_dim, direction):
    fwd = 4 * batch * heads * seq * seq * head_dim / 2  # causal: half the matrix
    return fwd if direction == "forward" else 2.5 * fwd


class Device:
    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def start_memory(self) -> int:
        if not self.cuda:
            return 0
        self.sync()
        torch.cuda.reset_peak_memory_stats(self.device)
        return torch.cuda.memory_allocated(self.device)

    def peak_mib(self, base: int) -> float | None:
        return (torch.cuda.max_memory_allocated(self.device) - base) / 2**20 if self.cuda else None


def timed(dev: Device, fn, iters: int) -> float:
    """Seconds per call of fn() (fn runs ``iters`` calls itself, or once per loop here)."""
    dev.sync()
    t0 = time.perf_counter()
    fn()
    dev.sync()
    return (time.perf_counter() - t0) / iters


def bench_fused(dev, kernel, q, k, v, dout, scale, iters, warmup):
    """(a): one kernel call over the whole sequence; returns seconds, peaks, outputs."""
    for _ in range(warmup):
        out, lse = kernel.forward(q, k, v, mask=CAUSAL, scale=scale)
        kernel.backward(dout, q, k, v, lse, (dout.float() * out.float()).sum(-1), mask=CAUSAL, scale=scale)
    base = dev.start_memory()
    res = {}

    def fwd():
        for _ in range(iters):
            res["fwd"] = kernel.forward(q, k, v, mask=CAUSAL, scale=scale)

    t_fwd = timed(dev, fwd, iters)
    peak_fwd = dev.peak_mib(base)
    out, lse = res.pop("fwd")
    delta = (dout.float() * out.float()).sum(-1)
    base = dev.start_memory()

    def bwd():
        for _ in range(iters):
            res["bwd"] = kernel.backward(dout, q, k, v, lse, delta, mask=CAUSAL, scale=scale)

    t_bwd = timed(dev, bwd, iters)
    return (t_fwd, peak_fwd, out), (t_bwd, dev.peak_mib(base), res["bwd"])


def bench_tiled(dev, plan, kernel, shards, scale, iters, warmup):
    """(b): all P virtual ranks of ``plan`` on this device; returns per direction (seconds for
    all ranks, copy seconds, peak MiB) and the last outputs per rank."""
    world = plan.world_size
    saved = [None] * world

    def forward(rank, comm, n):
        ex = Executor(plan, comm, kernel, scale)
        q, k, v, _ = shards[rank]
        for _ in range(n):
            saved[rank] = ex.forward(q, k, v)

    def backward(rank, comm, n):
        ex = Executor(plan, comm, kernel, scale)
        q, k, v, dout = shards[rank]
        res = saved[rank]
        out, grads = res.out.to(q.dtype), None
        for _ in range(n):
            grads = ex.backward(q, k, v, out, res.lse, dout, res.saved)
        return grads

    results = {}
    for name, fn in (("forward", forward), ("backward", backward)):
        run_inprocess(fn, world, warmup, serial=True, device=dev.device)
        base = dev.start_memory()
        box = Mailbox(world, timed=True)
        grads = []
        seconds = timed(dev, lambda: grads.append(run_inprocess(fn, world, iters, serial=True, device=dev.device,
                                                                mailbox=box)), iters)
        results[name] = (seconds, box.copy_seconds() / iters, dev.peak_mib(base))
        if name == "backward":
            results["grads"] = grads[-1]
    results["out"] = [s.out for s in saved]
    return results


def free_running(sync, step, iters: int, warmup: int) -> tuple[float, float]:
    """``step()`` ``iters`` times after ``warmup``, the device synchronised (``sync()``) only
    before and after the loop, so the host runs ahead as on a GPU of a P-GPU job: (wall seconds
    per step, host seconds to issue one)."""
    for _ in range(warmup):
        step()
    sync()
    t0 = time.perf_counter()
    for _ in range(iters):
        step()
    issued = time.perf_counter() - t0
    sync()
    return (time.perf_counter() - t0) / iters, issued / iters


def bench_alone(dev, plan, kernel, shards, scale, iters, warmup, graphs: bool = False) -> dict:
    """(c): the busiest rank (by the plan's forward work; the lowest such rank): record the messages
    it receives in one in-process step of all ranks, then run it alone with them replayed,
    ``iters`` steps per direction after ``warmup``: its rank, and per direction (wall seconds per
    step, host seconds to issue one step, torch ops issued per step, and with ``graphs`` wall
    seconds per step replaying the direction's CUDA graph: :mod:`megatron_mesh.runtime.graphs`)."""
    world = plan.world_size
    work = rank_work(plan)
    rank = work.index(max(work))
    recorded: dict = {}  # direction -> that rank's received messages (only its: they can be GBs)
    saved = [None] * world

    def forward(r, comm):
        rec = Recorder(comm) if r == rank else comm
        q, k, v, _ = shards[r]
        saved[r] = Executor(plan, rec, kernel, scale).forward(q, k, v)
        if r == rank:
            recorded["forward"] = rec.received()

    def backward(r, comm):
        rec = Recorder(comm) if r == rank else comm
        q, k, v, dout = shards[r]
        res = saved[r]
        Executor(plan, rec, kernel, scale).backward(q, k, v, res.out.to(q.dtype), res.lse, dout, res.saved)
        if r == rank:
            recorded["backward"] = rec.received()

    for fn in (forward, backward):
        run_inprocess(fn, world, serial=True, device=dev.device)
    del saved
    q, k, v, dout = shards[rank]
    result = {"rank": rank}
    comm = lambda d: ReplayCommunicator(rank, world, recorded[d])  # noqa: E731
    fwd, bwd = Executor(plan, comm("forward"), kernel, scale), Executor(plan, comm("backward"), kernel, scale)
    res = fwd.forward(q, k, v)
    out = res.out.to(q.dtype)
    steps = {"forward": lambda: fwd.forward(q, k, v),
             "backward": lambda: bwd.backward(q, k, v, out, res.lse, dout, res.saved)}
    from count_host_ops import OpCounter  # scripts/ is on the path of a script and of its tests
    for direction, step in steps.items():
        wall, host = free_running(dev.sync, step, iters, warmup)
        with OpCounter() as counter:
            step()
        result[direction] = [wall, host, *counter.issued, None]
    if graphs and dev.cuda:
        from megatron_mesh.runtime.graphs import PlanGraphs
        captured = PlanGraphs(Executor(plan, comm("forward"), kernel, scale),
                              Executor(plan, comm("backward"), kernel, scale), q, k, v, dout)
        for direction, step in (("forward", captured.forward), ("backward", captured.backward)):
            result[direction][3] = free_running(dev.sync, step, iters, warmup)[0]
    return result


def max_errors(fused_out, fused_grads, tiled) -> dict:
    unshard = lambda parts: zigzag_unshard(list(parts), dim=2)  # noqa: E731
    got = {"out": unshard(tiled["out"])}
    for i, name in enumerate(("dq", "dk", "dv")):
        got[name] = unshard(g[i] for g in tiled["grads"])
    want = {"out": fused_out, "dq": fused_grads[0], "dk": fused_grads[1], "dv": fused_grads[2]}
    return {n: (got[n].double() - want[n].double()).abs().max().item() for n in got}


def run(args) -> tuple[list[Row], dict]:
    dev = Device(torch.device(args.device))
    dtype = DTYPES[args.dtype]
    kernel = get_kernel(args.kernel, dev.device)
    rows: list[Row] = []
    P = args.world
    for s_local in args.seq_local:
        S = P * s_local
        g = torch.Generator().manual_seed(0)
        mk = lambda h: torch.randn(args.batch, h, S, args.head_dim, generator=g).to(dev.device, dtype)  # noqa: E731
        q, k, v, dout = mk(args.heads), mk(args.kv_heads), mk(args.kv_heads), mk(args.heads)
        scale = 1 / math.sqrt(args.head_dim)
        fused = bench_fused(dev, kernel, q, k, v, dout, scale, args.iters, args.warmup)
        shape = AttentionShape(s_local, args.batch, args.heads, args.kv_heads, args.head_dim, q.element_size())
        # [B, H, T, D] views of token-major [T, B, H, D] shards: what Megatron's layers hand the executor
        shards = [tuple(zigzag_shard(x, r, P, dim=2).permute(2, 0, 1, 3).contiguous().permute(1, 2, 0, 3)
                        for x in (q, k, v, dout)) for r in range(P)]
        for direction, (t, peak, _) in zip(("forward", "backward"), fused):
            flops = attention_flops(args.batch, args.heads, S, args.head_dim, direction) / P
            rows.append(Row(s_local, "fused", direction, 1e3 * t / P, flops / (t / P) / 1e12, 1.0, 1e3 * t / P, 1.0,
                            peak, peak / P if peak is not None else None, None))
        for tile in args.tiles:
            plan, mode = build_plan(tile, P, shape)
            tiled = bench_tiled(dev, plan, kernel, shards, scale, args.iters, args.warmup)
            alone = bench_alone(dev, plan, kernel, shards, scale, args.iters, args.warmup, args.graphs)
            errors = max_errors(fused[0][2][0], fused[1][2], tiled)
            for i, direction in enumerate(("forward", "backward")):
                t_all, copy_s, peak = tiled[direction]
                t, tc, tf = t_all / P, (t_all - copy_s) / P, fused[i][0] / P
                flops = attention_flops(args.batch, args.heads, S, args.head_dim, direction) / P
                err = {n: errors[n] for n in (("out",) if direction == "forward" else ("dq", "dk", "dv"))}
                wall, host, ops, views, graph = alone[direction]
                rows.append(Row(s_local, mode, direction, 1e3 * t, flops / t / 1e12, tf / t, 1e3 * tc, tf / tc,
                                peak, peak / P if peak is not None else None, err, alone["rank"], 1e3 * wall,
                                1e3 * host, tf / wall, ops, views, None if graph is None else 1e3 * graph,
                                None if graph is None else tf / graph))
        del q, k, v, dout, shards
    meta = dict(device=describe(dev.device), kernel=kernel.name, dtype=args.dtype, world=P, heads=args.heads,
                kv_heads=args.kv_heads, head_dim=args.head_dim, batch=args.batch, iters=args.iters,
                torch=torch.__version__, threads=torch.get_num_threads(), calibration=calibration(rows),
                **host_cost(rows, describe(dev.device)))
    return rows, meta


def host_cost(rows: list[Row], device: str) -> dict:
    """The host's us per torch op over the runs alone (host ms to issue a step / the ops it
    issued, mean over the rows): what the planner's ``--host-op-us`` reads from this file, and
    ``scripts/gpu_check.sh`` writes as ``host_cost.json`` (the planner's default when copied to
    megatron_mesh/plan/host_cost.json)."""
    from count_host_ops import host_op_us  # scripts/ is on the path of a script and of its tests
    per_op = [x for r in rows if r.alone_ops for x in (host_op_us(r.alone_host_ms, r.alone_ops, r.alone_views),)
              if x is not None]
    if not per_op:
        return {}
    return dict(host_op_us=sum(per_op) / len(per_op),
                host_op_source=f"{device}, torch {torch.__version__}: scripts/bench_kernels.py, one rank alone, "
                               f"host ms per step less its views' (the planner's us per view) / its other torch "
                               f"ops, mean of {len(per_op)} runs")


def calibration(rows: list[Row]) -> dict:
    """Measured fused-kernel throughput at the longest local sequence, in the units of the
    planner's ``Topology.attention_flops`` (FLOP/s; the planner prices the backward as 2.5x the
    forward FLOPs at that rate, ``attention_flops_backward`` is the rate the backward achieved)."""
    longest = max(r.seq_local for r in rows)
    rate = {r.direction: r.tflops * 1e12 for r in rows if r.mode == "fused" and r.seq_local == longest}
    return dict(seq_local=longest, attention_flops=rate["forward"], attention_flops_backward=rate["backward"])


def build_plan(tile: str, world: int, shape: AttentionShape):
    """The causal plan named by ``tile`` ("AxB", or "tasp") and its row label."""
    if tile == "tasp":
        return build_tasp_plan(world, shape, causal=True), f"tasp P={world}"
    a, b = parse_tile(tile, world)
    return build_mesh_plan(world, (a, b), shape, causal=True), (f"ring 1x{world}" if a == 1 else f"mesh {a}x{b}")


def describe(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({torch.get_num_threads()} threads)"


def markdown(rows: list[Row], meta: dict) -> str:
    fmt = lambda x, spec: "n/a" if x is None else format(x, spec)  # noqa: E731
    lines = [f"device: {meta['device']}, kernel backend: {meta['kernel']}, {meta['dtype']}, P={meta['world']}, "
             f"heads {meta['heads']}/{meta['kv_heads']}, head_dim {meta['head_dim']}, batch {meta['batch']}, causal",
             "",
             "| s_local | mode | dir | ms/rank | TFLOP/s | efficiency | compute-only ms | compute-only eff. "
             "| peak MiB/rank | max abs err vs fused | alone: rank | alone ms | host ms | ops | alone eff. | graph ms "
             "| graph eff. |",
             "|---:|---|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        err = ", ".join(f"{k} {v:.1e}" for k, v in r.max_abs_err.items()) if r.max_abs_err else "-"
        lines.append(f"| {r.seq_local} | {r.mode} | {DIR[r.direction]} | {r.ms_per_rank:.3f} | {r.tflops:.3f} | "
                     f"{r.efficiency:.3f} | {r.compute_ms_per_rank:.3f} | {r.compute_efficiency:.3f} | "
                     f"{fmt(r.peak_mib_per_rank, '.1f')} | {err} | {fmt(r.alone_rank, 'd')} | "
                     f"{fmt(r.alone_ms, '.3f')} | {fmt(r.alone_host_ms, '.3f')} | {fmt(r.alone_ops, '.0f')} | "
                     f"{fmt(r.alone_efficiency, '.3f')} | {fmt(r.graph_ms, '.3f')} | {fmt(r.graph_efficiency, '.3f')} |")
    if meta.get("host_op_us") is not None:
        lines.append(f"\nhost per torch op: {meta['host_op_us']:.1f} us ({meta['host_op_source']})")
    return "\n".join(lines)


def with_device_defaults(args, defaults: dict):
    """``args`` with every option left unset taken from ``defaults[device type]`` ("cuda" or
    "cpu"), and --iters / --warmup and the output files' folders checked (shared with
    scripts/bench_masks.py)."""
    device_type = torch.device(args.device).type
    if device_type not in defaults:
        raise SystemExit(f"--device must be a cpu or cuda device, got {args.device!r}")
    for key, value in defaults[device_type].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.iters < 1 or args.warmup < 0:
        raise SystemExit(f"--iters must be >= 1 and --warmup >= 0, got {args.iters} and {args.warmup}")
    for flag in ("json", "profile", "calls"):  # found out now, not after the run (GPU time is scarce)
        path = getattr(args, flag, None)
        if path and not Path(path).resolve().parent.is_dir():
            raise SystemExit(f"--{flag} {path}: no folder {Path(path).resolve().parent} to write it in")
    return args


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seq-local", type=int, nargs="+", help="local sequence lengths (tokens per rank)")
    p.add_argument("--world", type=int, help="CP size P of the plans")
    p.add_argument("--tiles", nargs="+", help='plans: tiles "AxB" with A*B == P (1xP is ring attention), or "tasp"')
    for name in ("heads", "kv-heads", "head-dim", "batch", "iters", "warmup"):
        p.add_argument(f"--{name}", type=int)
    p.add_argument("--dtype", choices=sorted(DTYPES))
    p.add_argument("--kernel", default="auto", help="block kernel backend (see megatron_mesh.kernels.get_kernel)")
    p.add_argument("--json", default="-", help="write the results as JSON to this file ('-': print them)")
    p.add_argument("--graphs", action="store_true",
                   help="(c) also replays each direction of the rank alone as a CUDA graph (CUDA only; "
                        "megatron_mesh.runtime.graphs): 'graph ms', 'graph eff.'")
    args = with_device_defaults(p.parse_args(argv), DEFAULTS)
    for s in args.seq_local:
        if s < 2 or s % 2:
            raise SystemExit(f"--seq-local values must be even and >= 2 (two zigzag halves), got {s}")
    for tile in args.tiles:
        if tile == "tasp":
            continue
        try:
            parse_tile(tile, args.world)
        except ValueError as e:
            raise SystemExit(f"--tiles: {e}") from None
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    rows, meta = run(args)
    print(markdown(rows, meta))
    result = dict(meta=meta, rows=[asdict(r) for r in rows])
    text = json.dumps(result, indent=1)
    if args.json == "-":
        print(text)
    else:
        Path(args.json).write_text(text + "\n")
        print(f"JSON written to {args.json}")
    return result


if __name__ == "__main__":
    main()
