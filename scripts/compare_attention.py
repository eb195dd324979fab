#!/usr/bin/env python
"""Side-by-side run of CP attention modes on N CPU processes (gloo): exactness and bytes moved.

For each mode (ring, Mesh tiles, TASP, the Ulysses hybrids) it runs the same sharded (zigzag, or --layout)
attention forward + backward through ``megatron_mesh.attention``, and prints per mode: the max
error of out/dq/dk/dv against a dense fp64 reference on the full sequence, the bytes each rank
sent (measured by ``comm_counter()`` and predicted by the plan of the same placement), the wall
time of forward + backward (best of --repeat) and the per-rank work (allowed (query, key) pairs
computed, max / mean over ranks: 1.00 is perfect balance).

Masks: ``--docs fixed:N|lognormal:MEAN,SIGMA`` packs documents into the sequence (``cu_seqlens``,
Megatron's global zigzag layout), ``--window L[,R]`` adds a sliding window; ``--unmasked`` also runs
every mode without the mask, so each row shows masked / unmasked bytes and time. ``--layout K``
runs the documents on a layout of the registry (Megatron's ``--cp-layout`` values), built for each
mode as Megatron builds it: ``balanced`` (or ``both``: and the zigzag) the plugin's balanced layout
(one per Ulysses group size for the hybrids); ``balanced-hide`` (or ``all``: the zigzag, balanced
and this) the same with the hybrids' first and last documents set apart; ``owners`` Mesh's own
(Mesh only; a sample it cannot lay out is an error); ``auto`` the default's pick per mode.
``--layout-file F`` adds a layout given as its text line (``BalancedLayout.text()``), e.g. one
that ``scripts/search_layout.py`` found for the same documents; a layout that names its blocks'
owners runs under Mesh only (the other modes refuse it).

    python scripts/compare_attention.py --world 4 --modes ring mesh:auto mesh:2x2 mesh:4x1 tasp a2a+ring:2
    python scripts/compare_attention.py --world 8 --seq-len 65536 --heads 2 --kv-heads 2 --head-dim 32 \
        --docs lognormal:4096,1.0 --unmasked --modes ring mesh:auto mesh:2x4 tasp
    python scripts/compare_attention.py --world 8 --seq-len 65536 --heads 2 --kv-heads 2 --head-dim 32 \
        --docs lognormal:4096,1.0 --layout both --no-check --modes ring mesh:auto tasp a2a+mesh:2

Modes: ``ring``, ``mesh[:AxB|:auto]``, ``tasp[:GPUS_PER_NODE]``, ``a2a+ring:U``, ``a2a+mesh:U[:AxB]``,
``a2a+tasp:U`` (U: the all-to-all degree).
"""

from __future__ import annotations

import argparse
import math
from dataclasses import fields
import os
import time

import torch

import megatron_mesh as mm
from megatron_mesh.kernels import reference_attention
from megatron_mesh.comm.spawn import spawn
from megatron_mesh.plan import AttentionShape, Mask, plan_bytes, resolve
from megatron_mesh.plan.modes import REFERENCE_MODE, parse_mode_spec
from megatron_mesh.plan.layouts import LAYOUTS, Sample, cp_layout_names, get_layout_kind
from megatron_mesh.plan.sparse_needs import KEEP_LIMIT, check_keep_limit, keep_limit_of
from megatron_mesh.plan.accounting import rank_work
from megatron_mesh.tools.plan_args import document_bounds, read_layout_file, window_of

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp64": torch.float64}


def mask_of(args) -> Mask:
    """The run's mask: causal or full, with --docs and --window (Megatron's global layout)."""
    window = None if args.window is None else window_of(args.window, not args.full, full_flag="--full")
    if args.docs is None:
        return Mask(not args.full, window).normalized(args.seq_len)
    return Mask.from_cu_seqlens(document_bounds(args.docs, args.seq_len, args.seed), args.seq_len, not args.full,
                                window).normalized(args.seq_len)


# --layout values that run several layouts side by side
SETS = {"both": ("zigzag", "balanced"), "all": ("zigzag", "balanced", "balanced-hide")}


def mode_settings(mode: str, keep_limit: float = KEEP_LIMIT) -> tuple[str, dict]:
    """(name, settings) of a command-line ``mode``, with --backward-keep-limit where it is not the default."""
    name, settings = parse_mode_spec(mode)
    return name, {**settings, "backward_keep_limit": keep_limit} if keep_limit != KEEP_LIMIT else settings


def planned(mode: str, world: int, shape: AttentionShape, mask: Mask, layout: str = "zigzag", given=None,
            keep_limit: float = KEEP_LIMIT):
    """(placement, plan, layout) the runtime runs for ``mode`` (the same placement: settings, auto
    tile, mask, ``keep_limit``); ``layout``: a CP layout of the registry built for the documents of
    ``mask`` as Megatron builds it for the mode (its Ulysses group, shape and backward; None:
    Megatron's zigzag), or "file": the layout ``given``. ValueError where the mode cannot run on
    it (the layout kind's reason)."""
    name, settings = mode_settings(mode, keep_limit)
    # 'auto' choices are made for causal / full attention, as the runtime does
    placement = resolve(name, world, shape, mask=Mask(mask.causal), **settings)
    if layout == "file":
        built = given
    elif mask.documents is None:  # nothing to lay out: Megatron's zigzag (--layout other than zigzag needs --docs)
        built = None
    else:
        kind = get_layout_kind(layout)
        why = kind.runs(name)
        if why is not None:
            raise ValueError(why)
        window = None if mask.window in ((None, None), (None, 0)) else mask.window  # (None, 0): causal, no window
        sample = Sample(tuple(_cu_seqlens(mask)), world, mask.causal, window, placement.ulysses, mode=name,
                        shape=shape, keep_limit=keep_limit_of(getattr(placement.options, "backward_chunks", "auto"),
                                                              getattr(placement.options, "backward_keep_limit", KEEP_LIMIT)),
                        options=tuple((f.name, getattr(placement.options, f.name)) for f in fields(placement.options)))
        built = kind.build(sample)
    if built is None:
        return placement, placement.build(shape, mask), None
    plain = Mask(mask.causal, _window(mask))
    return placement, placement.build(shape, plain, built), built


def _layout_file(path: str, world: int, mask: Mask):
    """The layout in ``path`` (one text line), checked against the run: ValueError naming what differs."""
    return read_layout_file(path, world, mask.documents, "--world")


def _window(mask: Mask):
    return None if mask.window == (None, None) else mask.window


def _cu_seqlens(mask: Mask) -> list[int]:
    return [mask.documents[0][0]] + [b for _, b in mask.documents]  # packed: no gaps


def _kwargs(mask: Mask, layout) -> dict:
    """megatron_mesh.attention's mask arguments for ``mask`` (its documents given by ``layout``
    when there is one)."""
    kw = dict(causal=mask.causal)
    if mask.window != (None, None):
        kw["window"] = mask.window
    if layout is not None:
        kw["layout"] = layout
    elif mask.documents is not None:
        kw["cu_seqlens"] = _cu_seqlens(mask)
    return kw


def reference_bytes(args) -> int:
    """Memory the dense fp64 reference takes on all processes together: scores, probabilities and
    their gradients, [batch, heads, S, S] each, on every process."""
    return args.world * 4 * args.batch * args.heads * args.seq_len ** 2 * 8


def run_rank(rank: int, world: int, args, runs) -> list[dict]:
    """``runs``: [(mask, layout name, [layout of each of args.modes (None: zigzag)])]."""
    dtype = DTYPES[args.dtype]
    g = torch.Generator().manual_seed(0)
    S, B, H, G, D = args.seq_len, args.batch, args.heads, args.kv_heads, args.head_dim
    Q, K, V, dO = (torch.randn(S, B, h, D, generator=g, dtype=torch.float64) for h in (H, G, G, H))
    rows, refs = [], {}
    for mask, layout_name, layouts in runs:
        if not args.no_check and mask not in refs:
            ref_in = [x.clone().requires_grad_() for x in (Q, K, V)]
            ref = reference_attention(*ref_in, mask=mask)
            ref.backward(dO)
            refs[mask] = [ref.detach()] + [x.grad for x in ref_in]
        want = refs.get(mask)
        for mode, layout in zip(args.modes, layouts):
            name, settings = mode_settings(mode, args.backward_keep_limit)
            shard = ((lambda x: mm.zigzag_shard(x, rank, world)) if layout is None  # noqa: E731
                     else (lambda x, layout=layout: mm.layout_shard(x, rank, layout)))
            best = None
            for _ in range(args.repeat):
                q, k, v = (shard(x).to(dtype).requires_grad_() for x in (Q, K, V))
                torch.distributed.barrier()
                t0 = time.perf_counter()
                with mm.comm_counter() as c:
                    out = mm.attention(q, k, v, mode=name, **settings, **_kwargs(mask, layout))
                    out.backward(shard(dO).to(dtype))
                elapsed = time.perf_counter() - t0
                best = elapsed if best is None else min(best, elapsed)
            err = float("nan")
            if want is not None:
                got = [out, q.grad, k.grad, v.grad]
                err = max((a.double() - shard(b)).abs().max().item() for a, b in zip(got, want))
            rows.append(dict(mode=mode, mask=mask.text(), layout=layout_name, err=err, sent=c.bytes_sent, received=c.bytes_received,
                             time=best))
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    """Print the table; return one row per (mask, mode): max error, max bytes sent and the plan's,
    time, per-rank work max / mean."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=4, help="CP size = number of CPU processes (default 4)")
    ap.add_argument("--modes", nargs="+", default=["ring", "mesh:auto", "mesh:2x2", "mesh:4x1", "tasp"])
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=None, help="key/value heads (default: --heads, i.e. MHA)")
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    ap.add_argument("--full", action="store_true", help="non-causal attention")
    ap.add_argument("--docs", help="packed documents: fixed:N or lognormal:MEAN,SIGMA (see megatron-mesh-plan)")
    ap.add_argument("--seed", type=int, default=0, help="random seed of --docs lognormal")
    ap.add_argument("--window", help="sliding window L or L,R (R defaults to 0 when causal)")
    ap.add_argument("--unmasked", action="store_true", help="also run every mode without --docs / --window")
    ap.add_argument("--layout", choices=(*cp_layout_names(), *SETS), default="zigzag",
                    help="the layout of --docs, as Megatron's --cp-layout builds it for each mode: " +
                         "; ".join(f"{n}: {LAYOUTS[n].help}" for n in cp_layout_names()) +
                         "; " + "; ".join(f"{k}: {' and '.join(v)}" for k, v in SETS.items()) + " (default zigzag)")
    ap.add_argument("--layout-file", help="also run --docs on the layout in this file: its text line "
                                          "(BalancedLayout.text(), as scripts/search_layout.py writes it)")
    ap.add_argument("--repeat", type=int, default=1, help="runs per mode; the time is the best (default 1)")
    ap.add_argument("--no-check", action="store_true", help="skip the dense fp64 reference (long sequences)")
    ap.add_argument("--backward-keep-limit", type=float, default=KEEP_LIMIT, metavar="X",
                    help="every mode's backward_keep_limit: under documents or a window a rank keeps what it pulled "
                         f"up to X times its own Q, K and V for the backward (default {KEEP_LIMIT})")
    args = ap.parse_args(argv)
    if args.kv_heads is None:
        args.kv_heads = args.heads
    if args.world < 1 or args.repeat < 1:
        ap.error(f"--world and --repeat must be >= 1, got {args.world} and {args.repeat}")
    try:
        check_keep_limit("--backward-keep-limit", args.backward_keep_limit)
    except ValueError as e:
        ap.error(str(e))
    if args.seq_len < 2 * args.world or args.seq_len % (2 * args.world):  # 0 too: each rank holds two halves
        ap.error(f"--seq-len {args.seq_len} must be a positive multiple of 2 * --world = {2 * args.world}")
    if not args.no_check:  # every process builds the dense reference: say so before they are killed
        need, free = reference_bytes(args), os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
        if need > free:
            ap.error(f"--seq-len {args.seq_len}: the dense fp64 reference needs about {need / 2**30:.1f} GiB on the "
                     f"{args.world} processes (each builds it: ~4 x batch x heads x seq_len^2 x 8 bytes), "
                     f"{free / 2**30:.1f} GiB are free; pass --no-check (bytes and times only) or a shorter --seq-len")
    try:
        mask = mask_of(args)
    except ValueError as e:
        ap.error(str(e))
    if args.layout != "zigzag" and mask.documents is None:
        ap.error(f"--layout {args.layout} lays out documents: give --docs")
    variants = [(mask, name) for name in SETS.get(args.layout, (args.layout,))]
    given = None
    if args.layout_file:
        try:
            given = _layout_file(args.layout_file, args.world, mask)
        except ValueError as e:
            ap.error(str(e))
        variants.append((mask, "file"))
    if args.unmasked and not mask.is_dense:
        variants.append((Mask(not args.full).normalized(args.seq_len), "zigzag"))
    try:
        shape = AttentionShape(args.seq_len // args.world, args.batch, args.heads, args.kv_heads, args.head_dim,
                               torch.tensor([], dtype=DTYPES[args.dtype]).element_size())
    except ValueError as e:  # heads / sizes: the message names the value
        ap.error(str(e))
    plans = {}
    for v in variants:
        for mode in args.modes:
            try:
                plans[v, mode] = planned(mode, args.world, shape, *v, given=given, keep_limit=args.backward_keep_limit)
            except ValueError as e:
                # the API's setting names, as the mode spec spells them (mode:U for the all-to-all degree)
                ap.error(f"--modes {mode}: " + str(e).replace("ulysses_size ", "the all-to-all degree U = "))
    runs = [(m, name, [plans[(m, name), mode][2] for mode in args.modes]) for m, name in variants]
    results = spawn(run_rank, args.world, args, runs, timeout=3600)
    return _report(args, shape, variants, plans, results)


def _report(args, shape: AttentionShape, variants: list, plans: dict, results: list[list[dict]]) -> list[dict]:
    """Print one table per (mask, layout) (the rows of every rank merged: the busiest rank's bytes
    and the slowest rank's time); exit if a rank's measured bytes differ from its plan's."""
    print(f"CP={args.world} seq_len={args.seq_len} heads={args.heads}/{args.kv_heads} head_dim={args.head_dim} "
          f"{args.dtype} {'full' if args.full else 'causal'} (forward + backward, per rank)")
    table = []
    for j, (m, layout_name) in enumerate(variants):
        print(f"\nmask: {m.summary()}; layout: {layout_name}")
        print(f"{'mode':<14}{'tile':>8}{'max err vs fp64':>17}{'bytes sent':>14}{'planned':>14}{'vs ring':>9}"
              f"{'time s':>9}{'work max/mean':>15}")
        ring_bytes = None
        for i, mode in enumerate(args.modes):
            rows = [r[j * len(args.modes) + i] for r in results]
            placement, plan, _ = plans[(m, layout_name), mode]
            want = [(b.sent, b.received) for b in plan_bytes(plan, shape)]
            sent, planned_sent = max(r["sent"] for r in rows), max(s for s, _ in want)
            if mode == REFERENCE_MODE:
                ring_bytes = sent
            ratio = f"{sent / ring_bytes:.2f}" if ring_bytes else "-"
            # the tile the plan runs: under a mask a Mesh plan may take another tile map than the
            # placement's dense choice ("auto"), or none (every block at its query's owner: "-")
            tile = plan.facts.tile_placed if placement.tile else None
            tile_s = f"{tile[0]}x{tile[1]}" if tile else "-"
            err = max(r["err"] for r in rows)
            work = [f + b for f, b in zip(rank_work(plan, "forward"), rank_work(plan, "backward"))]
            balance = max(work) / (sum(work) / len(work)) if sum(work) else 1.0
            elapsed = max(r["time"] for r in rows)
            err_s = "not checked" if math.isnan(err) else f"{err:.2e}"
            print(f"{mode:<14}{tile_s:>8}{err_s:>17}{sent:>14,}{planned_sent:>14,}{ratio:>9}{elapsed:>9.3f}"
                  f"{balance:>15.3f}")
            table.append(dict(mode=mode, mask=m.text(), layout=layout_name, tile=tile, err=err, sent=sent, planned=planned_sent,
                              time=elapsed, work_max=max(work), work_mean=sum(work) / len(work), balance=balance))
            if [(r["sent"], r["received"]) for r in rows] != want:
                raise SystemExit(f"{mode}: measured bytes {[(r['sent'], r['received']) for r in rows]} differ from "
                                 f"the plan's {want}")
    return table


if __name__ == "__main__":
    main()
