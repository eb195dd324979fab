#!/usr/bin/env python
"""Issue 52's GPU targets, read off ``scripts/gpu_check.sh``'s results, and the host's cost per
torch op written where the planner reads it.

Targets (one rank alone: its host free-running, its messages replayed; "eff." = the fused kernel's
share of the same work / the rank's time per step):

* dense plans, ring and Mesh at P = 4 (``kernels.json``) and P = 8 (``kernels8.json``), each
  direction, replayed as CUDA graphs (``--graphs``; eager where no graph was captured): eff. >=
  0.90 at 4K tokens per rank, >= 0.75 at 2K;
* packed documents at P = 8, 16K tokens per rank, the balanced layout (``masks8.json``), ring and
  Mesh 2x4 (eager: each sample brings its own plan): eff. >= 0.95 (the other modes are listed).

It writes ``host_cost.json`` in the results folder: the host's us per torch op that is not a view
and per view, both fitted to the runs alone (:func:`fit_host`: each row's host time against its
ops and views), or where the rows cannot separate them the mean of the result files'
``meta.host_op_us`` (their ops' time net of the views at the planner's price, which it keeps as
``host_view_us``): copy it to
``megatron_mesh/plan/host_cost.json`` to make it the planner's default. Exit status 1 if a target
is missed or a result file is absent.

    python scripts/gpu_targets.py DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

DENSE = {2048: 0.75, 4096: 0.90}  # tokens per rank -> the eff. a rank alone must reach
DOCUMENTS = 0.95
DOCUMENT_MODES = ("ring", "mesh:2x4")


def _load(folder: Path, name: str) -> dict | None:
    path = folder / name
    return json.loads(path.read_text()) if path.exists() else None


def dense_lines(result: dict, name: str) -> tuple[list[str], bool]:
    lines, ok = [], True
    for r in result["rows"]:
        want = DENSE.get(r["seq_local"])
        if want is None or r["mode"] == "fused" or not r["mode"].startswith(("ring", "mesh")):
            continue
        eff = r.get("graph_efficiency") or r["alone_efficiency"]
        how = "graph" if r.get("graph_efficiency") else "eager"
        good = eff >= want
        ok &= good
        lines.append(f"{'PASS' if good else 'FAIL'}  {name} P={result['meta']['world']} {r['seq_local']} tokens/rank "
                     f"{r['mode']} {r['direction']}: {how} eff. {eff:.3f} (>= {want}); eager {r['alone_efficiency']:.3f}, "
                     f"host {r['alone_host_ms']:.3f} ms for {r.get('alone_ops') or 0:.0f} ops")
    return lines, ok


def document_lines(result: dict) -> tuple[list[str], bool]:
    lines, ok = [], True
    meta = result["meta"]
    for r in result["rows"]:
        if r["layout"] != "balanced":
            continue
        target = r["mode"] in DOCUMENT_MODES and meta["world"] == 8
        good = r["alone_efficiency"] >= DOCUMENTS
        ok &= good or not target
        verdict = ("PASS" if good else "FAIL") if target else "info"
        lines.append(f"{verdict}  documents P={meta['world']} {meta['seq_len'] // meta['world']} tokens/rank balanced "
                     f"{r['mode']} ({r['calls']}): eff. {r['alone_efficiency']:.3f}" + (f" (>= {DOCUMENTS})" if target
                                                                                        else ""))
    return lines, ok


def fit_host(rows: list[dict]) -> tuple[float, float] | None:
    """(us per torch op that is not a view, us per view) fitted to the runs alone: each row's host
    ms per step against its ops and views (``alone_ops``, views included, and ``alone_views``), by
    least squares relative to each row's time. None where that cannot separate the two prices:
    fewer than 4 rows, their views' share of the ops spread less than 0.1, or a price < 0."""
    got = [(r["alone_ops"] - r["alone_views"], r["alone_views"], 1e3 * r["alone_host_ms"]) for r in rows
           if r.get("alone_ops") and r.get("alone_views") is not None and r.get("alone_host_ms")]
    if len(got) < 4:
        return None
    shares = [v / (n + v) for n, v, _ in got]
    if max(shares) - min(shares) < 0.1:
        return None
    # normal equations of min sum ((a n + b v - t) / t)^2
    snn = sum(n * n / t / t for n, v, t in got)
    snv = sum(n * v / t / t for n, v, t in got)
    svv = sum(v * v / t / t for n, v, t in got)
    snt = sum(n / t for n, v, t in got)
    svt = sum(v / t for n, v, t in got)
    det = snn * svv - snv * snv
    if det <= 0:
        return None
    op, view = (snt * svv - svt * snv) / det, (svt * snn - snt * snv) / det
    return (op, view) if op > 0 and view >= 0 else None


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or not Path(args[0]).is_dir():
        print(f"usage: gpu_targets.py DIR (scripts/gpu_check.sh's results folder), got {args}", file=sys.stderr)
        return 2
    folder = Path(args[0])
    ok, lines, per_op, alone = True, [], [], []
    for name in ("kernels.json", "kernels8.json", "masks8.json"):
        result = _load(folder, name)
        if result is None:
            lines.append(f"FAIL  {name}: absent (its step did not finish)")
            ok = False
            continue
        got, good = document_lines(result) if name.startswith("masks") else dense_lines(result, name)
        lines += got
        ok &= good
        if result["meta"].get("host_op_us"):
            per_op.append((result["meta"]["host_op_us"], result["meta"]["host_op_source"]))
        alone += result["rows"]
    fitted = fit_host(alone)
    if fitted is not None:  # the runs' own views' price: both prices measured here
        us, view = fitted
        source = (f"{len(alone)} rows of {', '.join(src for _, src in per_op) or 'the result files'}: both prices "
                  "fitted by least squares (scripts/gpu_targets.py)")
    elif per_op:  # one price: the ops' net of the views at the planner's price
        from megatron_mesh.plan.hostcost import HOST_VIEW_TIME
        us, view = sum(x for x, _ in per_op) / len(per_op), HOST_VIEW_TIME * 1e6
        source = "; ".join(src for _, src in per_op) + f" (mean of {len(per_op)} files, scripts/gpu_targets.py)"
    if fitted is not None or per_op:
        cost = {"host_op_us": round(us, 2), "host_view_us": round(view, 2), "source": source}
        (folder / "host_cost.json").write_text(json.dumps(cost, indent=1) + "\n")
        lines.append(f"host per torch op: {us:.1f} us, per view {view:.1f} us"
                     f"{' (fitted)' if fitted is not None else ''} -> {folder / 'host_cost.json'} "
                     "(copy to megatron_mesh/plan/host_cost.json for the planner's default)")
    print("\n".join(lines))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
