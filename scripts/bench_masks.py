#!/usr/bin/env python
"""How fast do the mask-aware plans run packed documents, on one device?

For a packed sample (``--docs``, the planner's document specs) of S = P x s_local tokens and each
layout (Megatron's zigzag, the balanced layout) and mode, it runs the mode's mask-aware plan on all P
virtual ranks of the in-process transport (serial: one rank at a time, so the wall time is the sum
of every rank's work; see ``scripts/bench_kernels.py``) and times forward + backward per rank:

* **tiled**: the plan, with the kernel's variable-length calls (``varlen``: consecutive full or
  causal pieces in one flash varlen call, CUDA) and with one call per piece (``loop``);
* **fused**: one flash varlen call over the whole packed sample (every document a sequence),
  forward + backward, divided by P: the compute floor at the kernel's own speed on this device.

Efficiency = fused / tiled (1.0: the plan's pieces cost what one call over the sample costs).
**Busiest rank ms**: the largest of the ranks' own times (each rank's turns in the serial run, the
device synchronised at every hand-over): what one step on P devices would take without
communication; step efficiency = (fused / P) / busiest rank -- where the layout's balance shows.
The busiest rank's work (allowed pairs, max / mean) comes from the plan; the max errors compare the
tiled out / dq / dk / dv with the fused call's. "ms per rank" sums the ranks' times (what the
pieces cost in all); "busiest rank ms" is the balance. A hybrid's balanced layout balances its
Ulysses groups (``balanced_layout(group=U)``), as Megatron's adapter builds it.

**Alone**: the busiest rank once more, alone on the device, its received messages replayed
(:mod:`megatron_mesh.comm.replay`, as ``scripts/bench_kernels.py`` (c)): its wall ms per step with
the host free-running ("alone ms"), the host's ms to issue a step, and (fused / P) / alone ms.
The truest one-device figure for a step on P GPUs: the rank's own kernels and host work, no
hand-overs; communication left out.

``--profile FILE`` runs each row once more under ``torch.profiler`` and adds where its time goes:
the device's busy time in attention kernels and in all other kernels (merges, casts, copies), and
the kernel launches, each per rank (sum / P); whatever the wall time has beyond the busy time is
the host's (launch overhead, Python, the serial run's hand-overs). And the busiest rank's own
device busy time (each turn of the serial run marked on the device, :class:`MarkedTurns`): what a
step on P devices takes where each rank's host keeps ahead of its device and the transfers hide.
FILE gets each row's top kernels.

``--calls FILE`` runs each row once more with every kernel call timed on the device (CUDA events
around it; the clock on the CPU) and sized (the allowed (query, key) pairs it computes), and
writes, per row, how the calls of each size ran against the fused call's rate: which pieces lose
the kernel's speed (:class:`CallLog`). A call's time includes its own glue (the varlen calls'
packing, the offsets), as the fused call's does, and -- it is the device's timeline between two
events -- any wait of the device for the host issuing the call: small calls' times are mostly
the host's.

    python scripts/bench_masks.py                                      # CUDA defaults, else small CPU shapes
    python scripts/bench_masks.py --world 8 --seq-local 16384 --docs lognormal:4096,1.0 --modes ring tasp
    python scripts/bench_masks.py --profile profile.txt                # + device busy time and launches
    python scripts/bench_masks.py --modes ring --calls calls.txt          # + each kernel call's size and speed
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/: the kernel benchmark's helpers

from bench_kernels import free_running, with_device_defaults  # noqa: E402
from megatron_mesh.comm.inprocess import Mailbox, run_inprocess  # noqa: E402
from megatron_mesh.comm.replay import Recorder, ReplayCommunicator  # noqa: E402
from megatron_mesh.kernels import get_kernel  # noqa: E402
from megatron_mesh.kernels.base import loop_varlen_backward, loop_varlen_forward  # noqa: E402
from megatron_mesh.plan import AttentionShape, balanced_layout, resolve  # noqa: E402
from megatron_mesh.plan.modes.base import parse_mode_spec  # noqa: E402
from megatron_mesh.plan.accounting import rank_work  # noqa: E402
from megatron_mesh.runtime.autograd import forward_backward  # noqa: E402
from megatron_mesh.runtime.inputs import attention_mask  # noqa: E402
from megatron_mesh.runtime.sharding import layout_shard, layout_unshard  # noqa: E402
from megatron_mesh.tools.plan_args import document_bounds  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DEFAULTS = {  # realistic on a GPU; seconds on a CPU
    "cuda": dict(world=4, seq_local=16384, heads=32, kv_heads=8, head_dim=128, dtype="bf16", iters=3, warmup=1,
                 docs="lognormal:4096,1.0"),
    "cpu": dict(world=4, seq_local=512, heads=4, kv_heads=2, head_dim=32, dtype="fp32", iters=1, warmup=1,
                docs="lognormal:256,1.0"),
}


def fused(kernel, q, k, v, dout, seqs, scale):
    """One variable-length call over the whole packed sample ([1, H, S, D] inputs): (out, lse),
    (dq, dk, dv). Falls back to one call per document where the kernel has no varlen calls."""
    if getattr(kernel, "varlen", False):
        out, lse = kernel.forward_varlen(q, k, v, seqs, causal=True, scale=scale)
        delta = (dout.float() * out.float()).sum(-1)
        # the rows' output and lse as the kernel takes them, made before the call, as the executor
        # makes them for a rank's own rows (``backward_rows``): not a stand-in inside the call
        rows = kernel.backward_rows(dout, lse, delta, out) if getattr(kernel, "backward_rows", None) else None
        return (out, lse), kernel.backward_varlen(dout, q, k, v, lse, delta, seqs, causal=True, scale=scale,
                                                  rows=rows)
    out, lse = loop_varlen_forward(kernel, q, k, v, seqs, causal=True, scale=scale)
    delta = (dout.float() * out.float()).sum(-1)
    return (out, lse), loop_varlen_backward(kernel, dout, q, k, v, lse, delta, seqs, causal=True, scale=scale)


def timed(device, fn, iters):
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    sync()
    return (time.perf_counter() - t0) / iters


ATTENTION_KERNELS = ("flash", "fmha", "attention", "sdpa", "cudnn")  # kernel names that are attention


class MarkedTurns(Mailbox):
    """A serial run's mailbox that also marks the start of every turn on the device (``mark``; by
    default a tiny ``spin_kernel`` on ``device``, which nothing else launches) and records whose
    turn it was. Every rank runs on the one default stream and the device is synchronised at
    every hand-over, so the kernels between two marks are that rank's."""

    def __init__(self, world_size: int, device: torch.device | None = None, mark=None):
        super().__init__(world_size, turns=True)
        self.order: list[int] = []
        self.mark = mark or (lambda: _spin(device))

    def take_turn(self, rank: int) -> None:
        super().take_turn(rank)
        if self.serial:
            self.order.append(rank)
            self.mark()


def _spin(device) -> None:
    with torch.cuda.device(device):  # a rank's first turn starts before it sets its device
        torch.cuda._sleep(1)


def busy_per_rank(kernels, order: list[int], P: int) -> list[float]:
    """Device busy ms of each rank: ``kernels`` ((name, start us, end us) of every device kernel
    and copy) split at the turn marks (``spin_kernel``) in time order, the i-th turn being rank
    ``order[i]``'s (:class:`MarkedTurns`); the marks themselves count to no one."""
    busy = [0.0] * P
    turn = -1
    for name, start, end in sorted(kernels, key=lambda k: k[1]):
        if "spin_kernel" in name:
            turn += 1
            if turn >= len(order):
                break
        elif turn >= 0:
            busy[order[turn]] += (end - start) / 1e3
    if turn != len(order) - 1:
        raise RuntimeError(f"{turn + 1} turn marks on the device for {len(order)} turns")
    return busy


def profile_row(device, fn, P, title, out, box: MarkedTurns | None = None) -> dict:
    """Run ``fn`` once under torch.profiler: device busy ms per rank in attention kernels and in the
    others, kernel launches per rank, and -- for a plan run through ``box`` -- the busiest rank's
    device busy ms; the top kernels by device time are appended to ``out``."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        fn()
    out.append(f"## {title}\n\n" + prof.key_averages().table(
        sort_by="self_device_time_total" if device.type == "cuda" else "self_cpu_time_total", row_limit=20) + "\n")
    if device.type != "cuda":  # the CPU has no kernel launches to count: only the table
        return dict(attention_ms=None, other_kernels_ms=None, launches=None, busiest_device_ms=None)
    timeline = [(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
                if e.device_type == DeviceType.CUDA]
    kernels = [k for k in timeline if "spin_kernel" not in k[0]]  # without the turn marks
    attention = [k for k in kernels if any(w in k[0].lower() for w in ATTENTION_KERNELS)]
    busy = lambda ks: sum(e - s for _, s, e in ks) / 1e3 / P  # noqa: E731 -- us -> ms per rank
    # the busiest rank's own device time: a step on P devices whose hosts keep ahead of them
    # (for the fused call, its share: the whole / P)
    busiest = busy(kernels)
    if box is not None:
        try:
            busiest = max(busy_per_rank(timeline, box.order, P))
        except RuntimeError as e:  # say so and keep the run's other rows (GPU time is scarce)
            print(f"warning: {title}: no busiest rank's device time: {e}", file=sys.stderr)
            busiest = None
    return dict(attention_ms=busy(attention), other_kernels_ms=busy(kernels) - busy(attention),
                launches=len(kernels) / P, busiest_device_ms=busiest)


class CallLog:
    """A block kernel that records each call of the kernel it wraps: direction, kind (one block's
    "full" / "causal" / "masked" call, or a "varlen" call of several pieces), the allowed (query,
    key) pairs it computes and its device time (CUDA events on the calling thread's stream, read
    by :meth:`records` after a synchronisation; the clock on the CPU, where calls are synchronous).
    Everything else is the wrapped kernel's."""

    def __init__(self, kernel, device: torch.device):
        self.kernel, self.device, self._calls = kernel, device, []
        self.name = kernel.name  # an attribute of its own: Python 3.12's isinstance(BlockKernel) looks statically
        # id(allowed) -> (allowed, its count): one host read per mask; holding the tensor keeps its id unique
        self._pairs: dict[int, tuple] = {}

    def __getattr__(self, name):  # varlen, backward_rows, ...: the wrapped kernel's
        return getattr(self.kernel, name)

    def _timed(self, direction, kind, pieces, pairs, heads, head_dim, fn):
        if self.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            result = fn()
            end.record()
            timing = (start, end)
        else:
            t0 = time.perf_counter()
            result = fn()
            timing = 1e3 * (time.perf_counter() - t0)
        self._calls.append(dict(direction=direction, kind=kind, pieces=pieces, pairs=pairs, heads=heads,
                                head_dim=head_dim, timing=timing))
        return result

    def _block_pairs(self, q, k, mask) -> int:
        sq, sk = q.shape[2], k.shape[2]
        if mask.allowed is not None:
            key = id(mask.allowed)
            if key not in self._pairs:
                self._pairs[key] = (mask.allowed, int(mask.allowed.sum()))
            return self._pairs[key][1]
        return sq * (sq + 1) // 2 if mask.causal else sq * sk

    def forward(self, q, k, v, *, mask, scale):
        return self._timed("forward", str(mask.kind.value), q.shape[0], q.shape[0] * self._block_pairs(q, k, mask),
                           q.shape[1], q.shape[3], lambda: self.kernel.forward(q, k, v, mask=mask, scale=scale))

    def backward(self, dout, q, k, v, lse, delta, *, mask, scale, **kw):
        return self._timed("backward", str(mask.kind.value), q.shape[0], q.shape[0] * self._block_pairs(q, k, mask),
                           q.shape[1], q.shape[3],
                           lambda: self.kernel.backward(dout, q, k, v, lse, delta, mask=mask, scale=scale, **kw))

    @staticmethod
    def _varlen_pairs(seqs, causal) -> int:
        return sum(nq * (nq + 1) // 2 if causal else nq * nk for nq, nk in seqs)

    def forward_varlen(self, q, k, v, seqs, *, causal, scale):
        return self._timed("forward", f"varlen {'causal' if causal else 'full'}", q.shape[0] * len(seqs), q.shape[0] * self._varlen_pairs(seqs, causal),
                           q.shape[1], q.shape[3],
                           lambda: self.kernel.forward_varlen(q, k, v, seqs, causal=causal, scale=scale))

    def backward_varlen(self, dout, q, k, v, lse, delta, seqs, *, causal, scale, **kw):
        return self._timed("backward", f"varlen {'causal' if causal else 'full'}", q.shape[0] * len(seqs), q.shape[0] * self._varlen_pairs(seqs, causal),
                           q.shape[1], q.shape[3],
                           lambda: self.kernel.backward_varlen(dout, q, k, v, lse, delta, seqs, causal=causal,
                                                               scale=scale, **kw))

    def records(self) -> list[dict]:
        """Every call so far with its ``ms`` and ``flops`` (forward 4 x heads x head_dim x pairs,
        the backward 2.5x that, as the benchmarks count); forgets them."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        out = []
        for c in self._calls:
            t = c.pop("timing")
            c["ms"] = t if isinstance(t, float) else t[0].elapsed_time(t[1])
            c["flops"] = 4 * c["heads"] * c["head_dim"] * c["pairs"] * (2.5 if c["direction"] == "backward" else 1)
            out.append(c)
        self._calls = []
        return out


SIZES = (512, 1024, 2048, 4096, 8192)  # bucket edges: a piece's side, sqrt(2 x its pairs) for causal


def piece_side(c) -> float:
    """The side of the call's mean piece: of a square of its pairs, or for a causal piece the n of
    its n (n + 1) / 2 pairs (so a causal and a full piece of n tokens fall in one bucket)."""
    pairs = c["pairs"] / c["pieces"]
    if c["kind"].endswith("causal"):
        return (math.sqrt(8 * pairs + 1) - 1) / 2
    return math.sqrt(pairs)


def calls_summary(records: list[dict], fused_rate: dict, P: int) -> list[dict]:
    """Per direction, kind and size bucket of the mean piece (:func:`piece_side`): the calls, their share
    of the FLOPs, device ms per rank (sum / P), TFLOP/s, and the ms per rank they take beyond what
    the fused call's rate (``fused_rate[direction]``, FLOP/ms) would need for the same FLOPs."""
    rows = {}
    for c in records:
        side = piece_side(c)
        bucket = next((f"<= {e}" for e in SIZES if side <= e), f"> {SIZES[-1]}")
        r = rows.setdefault((c["direction"], c["kind"], bucket), dict(direction=c["direction"], kind=c["kind"],
                                                                      size=bucket, calls=0, pieces=0, flops=0.0,
                                                                      ms=0.0))
        r["calls"] += 1
        r["pieces"] += c["pieces"]
        r["flops"] += c["flops"]
        r["ms"] += c["ms"]
    total = {d: sum(r["flops"] for r in rows.values() if r["direction"] == d) or 1.0 for d in ("forward", "backward")}
    order = {f"<= {e}": i for i, e in enumerate(SIZES)} | {f"> {SIZES[-1]}": len(SIZES)}
    out = []
    for (d, kind, b), r in sorted(rows.items(), key=lambda kv: (kv[0][0] != "forward", kv[0][1], order[kv[0][2]])):
        out.append(dict(r, flop_share=r["flops"] / total[d], ms=r["ms"] / P,
                        tflops=r["flops"] / r["ms"] / 1e9 if r["ms"] else float("nan"),
                        lost_ms=(r["ms"] - r["flops"] / fused_rate[d]) / P))
    return out


CALLS_HEADER = """Kernel calls by the size of their mean piece (the side of a square of its allowed pairs; a causal
piece of n tokens: n), device time of each call (CUDA events around it, its glue included), P = {world}, {docs},
heads {heads}/{kv_heads} of {head_dim}, {dtype}: per rank (sum / P), and what they take beyond the fused call's
rate for the same FLOPs.

"""


def calls_markdown(title: str, summary: list[dict]) -> str:
    lines = [f"## {title}", "", "| dir | kind | piece side | calls | pieces | FLOP share | ms per rank | TFLOP/s "
             "| ms per rank beyond the fused rate |", "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in summary:
        lines.append(f"| {r['direction']} | {r['kind']} | {r['size']} | {r['calls']} | {r['pieces']} | "
                     f"{r['flop_share']:.2f} | {r['ms']:.3f} | {r['tflops']:.3g} | {r['lost_ms']:+.3f} |")
    return "\n".join(lines) + "\n"


def alone(device, plan, kernel, shards, rank, iters, warmup) -> tuple[float, float, float, float]:
    """``rank`` of ``plan`` alone on ``device``: the messages it received in one in-process step
    replayed (:class:`ReplayCommunicator`), ``iters`` forward + backward steps after ``warmup``,
    the device synchronised only after the loop: (wall seconds per step, host seconds to issue
    one, torch ops it issues per step and the views among them: one more step, counted)."""
    P = plan.world_size
    recorded = []  # only this rank's received messages (every rank's can be GBs)

    def record(r, comm):
        rec = Recorder(comm) if r == rank else comm
        forward_backward(*shards[r], plan, comm=rec, kernel=kernel)
        if r == rank:
            recorded.extend(rec.received())

    run_inprocess(record, P, serial=True, device=device, timeout=600)
    comm = ReplayCommunicator(rank, P, recorded)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    step = lambda: forward_backward(*shards[rank], plan, comm=comm, kernel=kernel)  # noqa: E731
    wall, host = free_running(sync, step, iters, warmup)
    from count_host_ops import OpCounter  # scripts/ is on the path of a script and of its tests
    with OpCounter() as counter:
        step()
    return (wall, host, *counter.issued)


def run(args) -> tuple[list[dict], dict]:
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    P, S = args.world, args.world * args.seq_local
    try:
        bounds = document_bounds(args.docs, S, args.seed)
    except ValueError as e:
        raise SystemExit(f"{e} (--seq-len here: --world x --seq-local)") from None
    seqs = tuple((b - a, b - a) for a, b in zip(bounds, bounds[1:]))
    g = torch.Generator().manual_seed(0)
    mk = lambda h: torch.randn(S, 1, h, args.head_dim, generator=g).to(device, dtype)  # noqa: E731 -- sbhd
    Q, K, V, dO = mk(args.heads), mk(args.kv_heads), mk(args.kv_heads), mk(args.heads)
    bhsd = lambda x: x.permute(1, 2, 0, 3)  # noqa: E731
    shape = AttentionShape(args.seq_local, 1, args.heads, args.kv_heads, args.head_dim, Q.element_size())
    scale = 1 / math.sqrt(args.head_dim)
    kernel = get_kernel(args.kernel, device)
    for _ in range(args.warmup):
        fused(kernel, bhsd(Q), bhsd(K), bhsd(V), bhsd(dO), seqs, scale)
    ref = {}
    t_fused = timed(device, lambda: ref.update(r=fused(kernel, bhsd(Q), bhsd(K), bhsd(V), bhsd(dO), seqs, scale)),
                    args.iters)
    (ref_out, _), ref_grads = ref["r"]
    profiles = []
    want = {"out": ref_out, "dq": ref_grads[0], "dk": ref_grads[1], "dv": ref_grads[2]}
    rows = [dict(layout="-", mode="fused", calls="varlen" if kernel.varlen else "loop", ms_per_rank=1e3 * t_fused / P,
                 busiest_ms=1e3 * t_fused / P, efficiency=1.0, step_efficiency=1.0, work_max_mean=1.0, errors={},
                 alone_rank=None, alone_ms=None, alone_host_ms=None, alone_efficiency=None, alone_ops=None)]
    if args.profile:
        rows[0].update(profile_row(device, lambda: fused(kernel, bhsd(Q), bhsd(K), bhsd(V), bhsd(dO), seqs, scale),
                                   P, "fused", profiles))
    calls_out, fused_rate = [], {}
    if args.calls:  # the fused call's rate per direction (FLOP per ms), its calls timed as the plans' are
        log = CallLog(kernel, device)
        fused(log, bhsd(Q), bhsd(K), bhsd(V), bhsd(dO), seqs, scale)
        records = log.records()
        for d in ("forward", "backward"):
            mine = [c for c in records if c["direction"] == d]
            fused_rate[d] = sum(c["flops"] for c in mine) / sum(c["ms"] for c in mine)
        rows[0]["calls_summary"] = calls_summary(records, fused_rate, P)
        calls_out.append(calls_markdown("fused", rows[0]["calls_summary"]))
    for layout_name in args.layouts:
        for mode in args.modes:
            try:
                name, settings = parse_mode_spec(mode)
                placement = resolve(name, P, shape, **settings)
            except ValueError as e:
                raise SystemExit(f"--modes {mode}: {e}") from None
            # the balanced layout of a hybrid balances its Ulysses groups, as the runtime builds it
            layout = balanced_layout(bounds, P, group=placement.ulysses) if layout_name == "balanced" else None
            mask, layout = attention_mask(P, shape, causal=True, cu_seqlens=None if layout else bounds, layout=layout)
            shards = [tuple(layout_shard(x, r, layout, dim=0) for x in (Q, K, V, dO)) for r in range(P)]
            plan = placement.build(shape, mask, layout)
            work = rank_work(plan)  # allowed (query, key) pairs each rank computes
            for calls in (("varlen", "loop") if kernel.varlen else ("loop",)):
                kern = get_kernel(args.kernel, device)
                kern.varlen = calls == "varlen"
                got = [None] * P

                def rank_fn(rank, comm, n):
                    for _ in range(n):
                        got[rank] = forward_backward(*shards[rank], plan, comm=comm, kernel=kern)

                if args.warmup:
                    run_inprocess(rank_fn, P, args.warmup, serial=True, device=device, timeout=600)
                box = Mailbox(P, turns=True)
                t = timed(device, lambda: run_inprocess(rank_fn, P, args.iters, serial=True, device=device,
                                                        timeout=600, mailbox=box), 1) / args.iters
                busiest = max(box.busy) / args.iters  # each rank's own turns: one step of P devices
                errors = {}
                for i, name in enumerate(("out", "dq", "dk", "dv")):
                    whole = bhsd(layout_unshard([r[i] for r in got], layout, dim=0))
                    errors[name] = (whole.double() - want[name].double()).abs().max().item()
                rank = work.index(max(work))
                wall, host, ops, views = alone(device, plan, kern, shards, rank, args.iters, args.warmup)
                rows.append(dict(layout=layout_name, mode=mode, calls=calls, ms_per_rank=1e3 * t / P,
                                 busiest_ms=1e3 * busiest, efficiency=t_fused / t,
                                 step_efficiency=t_fused / P / busiest, work_max_mean=max(work) / (sum(work) / P),
                                 errors=errors, alone_rank=rank, alone_ms=1e3 * wall, alone_host_ms=1e3 * host,
                                 alone_efficiency=t_fused / P / wall, alone_ops=ops, alone_views=views))
                if args.profile:
                    marks = MarkedTurns(P, device) if device.type == "cuda" else None
                    rows[-1].update(profile_row(device, lambda: run_inprocess(rank_fn, P, 1, serial=True, device=device,
                                                                              timeout=600, mailbox=marks),
                                                P, f"{layout_name} {mode} {calls}", profiles, marks))
                if args.calls:
                    log = CallLog(kern, device)
                    run_inprocess(lambda rank, comm: forward_backward(*shards[rank], plan, comm=comm, kernel=log),
                                  P, serial=True, device=device, timeout=600)
                    rows[-1]["calls_summary"] = calls_summary(log.records(), fused_rate, P)
                    calls_out.append(calls_markdown(f"{layout_name} {mode} {calls}", rows[-1]["calls_summary"]))
    meta = dict(device=torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU", kernel=kernel.name,
                dtype=args.dtype, world=P, seq_len=S, docs=args.docs, seed=args.seed, documents=len(seqs),
                heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim, iters=args.iters,
                torch=torch.__version__)
    from count_host_ops import host_op_us  # scripts/ is on the path of a script and of its tests
    per_op = [x for r in rows if r.get("alone_ops")
              for x in (host_op_us(r["alone_host_ms"], r["alone_ops"], r["alone_views"]),) if x is not None]
    if per_op:  # what the planner's --host-op-us reads from this file
        meta.update(host_op_us=sum(per_op) / len(per_op),
                    host_op_source=f"{meta['device']}, torch {torch.__version__}: scripts/bench_masks.py, one rank "
                                   f"alone, host ms per step less its views' (the planner's us per view) / its other "
                                   f"torch ops, mean of {len(per_op)} runs")
    if args.profile:
        Path(args.profile).write_text("\n".join(profiles))
    if args.calls:
        Path(args.calls).write_text(CALLS_HEADER.format(**vars(args)) + "\n".join(calls_out))
    return rows, meta


def markdown(rows, meta) -> str:
    lines = [f"device: {meta['device']}, {meta['kernel']}, {meta['dtype']}, P={meta['world']}, S={meta['seq_len']}, "
             f"{meta['documents']} documents ({meta['docs']}, seed {meta['seed']}), heads {meta['heads']}/"
             f"{meta['kv_heads']} of {meta['head_dim']}, causal, forward + backward", "",
             "| layout | mode | calls | ms per rank (sum / P) | efficiency | busiest rank ms | step efficiency "
             "| work max/mean | max abs err (out, dq, dk, dv) | alone: rank | alone ms | host ms | alone eff. |",
             "|---|---|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|"]
    profiled = "launches" in rows[0]
    if profiled:  # where the time goes, per rank (sum / P)
        lines[2] += " attention kernels ms | other kernels ms | launches | busiest rank's device ms |"
        lines[3] += "---:|---:|---:|---:|"
    for r in rows:
        err = ", ".join(f"{v:.1e}" for v in r["errors"].values()) or "-"
        lines.append(f"| {r['layout']} | {r['mode']} | {r['calls']} | {r['ms_per_rank']:.3f} | {r['efficiency']:.2f} | "
                     f"{r['busiest_ms']:.3f} | {r['step_efficiency']:.2f} | {r['work_max_mean']:.2f} | {err} | " +
                     " | ".join("-" if r[k] is None else f"{r[k]:{f}}" for k, f in
                                (("alone_rank", "d"), ("alone_ms", ".3f"), ("alone_host_ms", ".3f"),
                                 ("alone_efficiency", ".2f"))) + " |")
        if profiled:
            lines[-1] += " " + " | ".join("-" if r[k] is None else f"{r[k]:.{d}f}" for k, d in
                                          (("attention_ms", 3), ("other_kernels_ms", 3), ("launches", 0),
                                           ("busiest_device_ms", 3))) + " |"
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    for name in ("world", "seq-local", "heads", "kv-heads", "head-dim", "iters", "warmup"):
        p.add_argument(f"--{name}", type=int)
    p.add_argument("--dtype", choices=sorted(DTYPES))
    p.add_argument("--docs", help="packed documents, as megatron-mesh-plan's --docs (default lognormal:4096,1.0 on "
                                  "CUDA, lognormal:256,1.0 on the CPU)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layouts", nargs="+", default=["zigzag", "balanced"], choices=["zigzag", "balanced"])
    p.add_argument("--modes", nargs="+", default=["ring", "tasp", "a2a+ring:2"],
                   help="modes as compare_attention.py takes them (mesh:2x2, a2a+ring:2, ...)")
    p.add_argument("--kernel", default="auto")
    p.add_argument("--json", default=None, help="also write the rows as JSON to this file")
    p.add_argument("--calls", default=None,
                   help="time each kernel call once more: per row, the calls by piece size against the fused rate, "
                        "to this file")
    p.add_argument("--profile", default=None,
                   help="profile each row once more: device busy time and launches per rank; top kernels to this file")
    return with_device_defaults(p.parse_args(argv), DEFAULTS)


def main(argv=None) -> dict:
    args = parse_args(argv)
    rows, meta = run(args)
    print(markdown(rows, meta))
    result = dict(meta=meta, rows=rows)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
        print(f"JSON written to {args.json}")
    return result


if __name__ == "__main__":
    main()
