"""Planner / simulator (pure Python, no process groups): the CLI and its JSON schema, speed at
P = 1024, the simulator's invariants, buffer memory, the auto tile, Ulysses/USP formulas."""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_mesh.plan import (AttentionShape, buffer_bytes, build_mesh_plan, build_ring_plan, mesh_bytes_formula,
                                tile_shapes)
from megatron_mesh.plan.autotile import choose_tile, rank_tiles
from megatron_mesh.plan.memory import buffer_memory
from megatron_mesh.plan.simulate import round_traffic, simulate, time_breakdown
from megatron_mesh.plan.topology import Topology
from megatron_mesh.tools.plan_args import document_bounds
from megatron_mesh.tools.plan_cli import main

from helpers import png_size
from megatron_mesh.plan.simulate import BACKWARD_FLOPS
from megatron_mesh.plan.layouts import ThdKind, layout_names, thd_layout
from megatron_mesh.tools.formulas import ulysses_result, usp_result
from megatron_mesh.tools.layout_rows import TE_ROWS, layout_rows
from megatron_mesh.tools.planner import TIME_TOLERANCE, allowed_pairs, compute_floor, evaluate, mean_rows

GQA = AttentionShape(seq_local=16384, heads=32, kv_heads=8, head_dim=128)
MHA = AttentionShape(seq_local=4096, heads=32, kv_heads=32, head_dim=128)
NO_NETWORK = dict(intra_bandwidth=1e30, inter_bandwidth=1e30, intra_latency=0.0, inter_latency=0.0, host_op_time=0.0)
NO_COMPUTE = dict(attention_flops=1e30, kernel_latency=0.0, memory_bandwidth=1e30, host_op_time=0.0)


def _json(capsys, *argv) -> dict:
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _comm(plan, shape, topo) -> float:
    return sum(sum(round_traffic(plan, shape, topo, d).duration.values()) for d in ("forward", "backward"))


# -- CLI ---------------------------------------------------------------------------------------------
def test_cli_json_schema(capsys):
    data = _json(capsys, "--cp", "16", "--heads", "32", "--kv-heads", "8", "--seq-len", "262144")
    rows = data["modes"]
    assert {r["mode"] for r in rows} >= {"ring", "mesh", "mesh-auto", "tasp", "a2a+ring", "a2a+mesh-auto", "a2a+tasp",
                                         "auto", "ulysses", "usp"}
    for r in rows:
        assert isinstance(r["mode"], str) and 16 % r["ulysses"] == 0
        # a hybrid's tile is its inner Mesh tile, over CP / ulysses ranks
        assert r["tile"] is None or (len(r["tile"]) == 2 and r["tile"][0] * r["tile"][1] * r["ulysses"] == 16)
        assert isinstance(r["bytes_per_rank"], int) and r["bytes_per_rank"] > 0
        assert 0 <= r["inter_node_bytes_per_rank"] <= r["bytes_per_rank"]
        assert isinstance(r["rounds"], int) and r["rounds"] > 0
        assert r["time_s"] > 0
    shape = AttentionShape(seq_local=262144 // 16, heads=32, kv_heads=8, head_dim=128)
    ring = next(r for r in rows if r["mode"] == "ring")
    assert ring["tile"] == [1, 16] and ring["bytes_per_rank"] == mesh_bytes_formula(16, (1, 16), shape).sent
    for r in rows:
        if r["mode"] == "mesh":
            assert r["bytes_per_rank"] == mesh_bytes_formula(16, tuple(r["tile"]), shape).sent
    auto = next(r for r in rows if r["mode"] == "mesh-auto")
    assert [auto["tile"], auto["contiguous"]] in [[r["tile"], r["contiguous"]] for r in rows if r["mode"] in ("mesh", "ring")]


def test_cli_table_and_plot(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "plan.png"
    assert main(["--cp", "8", "--seq-len", "65536", "--plot", str(png), "--plot-cp", "8,16,32"]) == 0
    out = capsys.readouterr().out
    assert "ring" in out and "mesh-auto" in out and "speedup" in out
    assert png_size(png) == (15 * 120, round(4.8 * 120))  # figsize (15, 4.8) inches at 120 dpi
    # the plot plans every CP size again: its time is reported, not hidden in the table's
    assert re.search(r"\(planned and simulated in [0-9.]+ s; the plot, 3 CP sizes planned and drawn, in [0-9.]+ s, "
                     rf"written to {re.escape(str(png))}; [0-9.]+ s in all\)", out), out


def test_plot_figure_shows_every_line_and_the_time_relative_to_ring():
    """Every mode in each panel with its own line style and marker (tasp moves ring's bytes: both
    still show), a linear panel of time / ring's time, one legend below the panels, off the data."""
    pytest.importorskip("matplotlib")
    from megatron_mesh.tools.plan_plot import PLOT_MODES, plot_fig

    shape = AttentionShape(seq_local=4096, heads=32, kv_heads=8, head_dim=128)
    series = {}
    for P in (8, 16, 32):
        rows, _ = evaluate(P, shape, Topology.for_cp(P), modes=PLOT_MODES)
        for r in rows:
            series.setdefault(r.mode, []).append((P, r))
    fig = plot_fig(series, "test", 8)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    ax_b, ax_t, ax_r = fig.axes
    for ax in (ax_b, ax_t, ax_r):
        assert len(ax.get_lines()) == len(series)
        styles = [(line.get_linestyle(), line.get_marker(), line.get_linewidth()) for line in ax.get_lines()]
        assert len(set(styles)) == len(styles), styles  # no two lines alike: coinciding ones both show
        assert [t.get_text() for t in ax.get_xticklabels()] == ["8", "16", "32"]
    ring_ratio = ax_r.get_lines()[list(series).index("ring")].get_ydata()
    assert list(ring_ratio) == [1.0, 1.0, 1.0]
    usp = dict(series["usp"])
    ring = dict(series["ring"])
    assert list(ax_r.get_lines()[list(series).index("usp")].get_ydata()) == \
        pytest.approx([usp[P].time_s / ring[P].time_s for P in (8, 16, 32)])
    assert ax_r.get_yscale() == "linear" and ax_t.get_yscale() == "log"
    (legend,) = fig.legends
    assert [t.get_text() for t in legend.get_texts()] == list(series)
    box = legend.get_window_extent(renderer)
    for ax in fig.axes:  # under the panels, inside the figure
        assert box.y1 <= ax.get_tightbbox(renderer).y0
    assert box.y0 >= 0 and box.x0 >= 0 and box.x1 <= fig.bbox.x1
    # a mode several times ring's time puts the ratios on a log axis (linear, it squashed every curve
    # under 1 together: stop 81's review); a mode that stops short says where in the legend
    slow = {**series, "tasp": [(P, dataclasses.replace(r, time_s=5 * ring[P].time_s)) for P, r in series["tasp"]],
            "ulysses": series["ulysses"][:2]}
    fig = plot_fig(slow, "test", 8)
    _, _, ax_r = fig.axes
    assert ax_r.get_yscale() == "log" and ax_r.get_title() == "time relative to ring (log)"
    (legend,) = fig.legends
    assert "ulysses (to CP 16)" in [t.get_text() for t in legend.get_texts()]


@pytest.mark.parametrize("argv, message", [
    (["--cp", "8", "--seq-len", "1000"], "divisible by 2 \\* CP size = 16"),
    (["--cp", "64", "--nodes", "2"], "does not fit 2 nodes x 8 GPUs"),
    (["--modes", "ring,bogus"], "unknown \\['bogus'\\]"),
    (["--heads", "32", "--kv-heads", "5"], "divisible by kv_heads"),
    (["--cp", "4", "--layout", "balanced"], "--layout balanced places documents: give them with --docs"),
    *[(["--seq-len", "8192", "--docs", spec], f"--docs '{re.escape(spec)}' must be parts joined by '\\+': one:N .* then at "
       "most one of fixed:N \\(an integer 1 <= N <= --seq-len 8192\\) or lognormal:MEAN,SIGMA \\(finite numbers, 1 <= "
       "MEAN <= --seq-len 8192, SIGMA >= 0\\)")
      for spec in ("lognormal:inf,1", "lognormal:nan,1", "lognormal:64,nan", "lognormal:64,1e308", "lognormal:0.5,1",
                   "lognormal:9000,1", "fixed:100000", "fixed:0", "fixed:-3", "fixed:2.5", "fixed:", "poisson:4",
                   "fixed:4+one:4", "one:x", "one:0+fixed:4")],
    # a document longer than what is left of the sequence: said as such (stop 81's review)
    (["--seq-len", "8192", "--docs", "one:9000+fixed:4"], "--docs 'one:9000\\+fixed:4': 'one:9000' is longer than the "
     "8192 tokens of --seq-len 8192 left after the documents before it; give a longer --seq-len or a shorter document"),
    (["--seq-len", "8192", "--docs", "one:8000+one:500"], "'one:500' is longer than the 192 tokens of --seq-len 8192 "
     "left"),
    (["--seq-len", "8192", "--docs", "one:4096"], "its one:N documents cover 4096 of --seq-len 8192 tokens"),
    (["--seq-len", "1024", "--docs", "one:1024+fixed:4"], "'fixed:4' fills nothing, the one:N documents before it"),
    (["--modes", ","], "--modes ',' names no mode; allowed: ring, "),
    (["--modes", "ring,mesh,ring"], "--modes 'ring,mesh,ring' names ring more than once"),
    (["--seq-len", "-8", "--cp", "2"], "--seq-len must be >= 1, got -8"),
    # machine numbers: finite, named by their option (not by the simulator's field in SI units)
    (["--inter-latency", "inf"], "--inter-latency must be a finite number >= 0, got inf"),
    (["--intra-bandwidth", "-1"], "--intra-bandwidth must be a finite number > 0, got -1"),
    (["--tflops", "nan"], "--tflops must be a finite number > 0, got nan"),
    (["--kernel-latency", "inf", "--json"], "--kernel-latency must be a finite number >= 0, got inf"),
    (["--host-view-us", "-3"], "--host-view-us must be a finite number >= 0, got -3"),
    # --plot is checked before any planning: a file it can write, modes it draws, CP sizes that fit
    (["--cp", "4", "--seq-len", "4096", "--plot", "/nonexistent/dir/x.png"],
     "--plot '/nonexistent/dir/x.png' must be a PNG file \\(FILE.png\\) in a writable folder"),
    (["--cp", "4", "--seq-len", "4096", "--plot", "."], "--plot '.' must be a PNG file"),
    (["--cp", "4", "--seq-len", "4096", "--plot", "p.jpg"], "--plot 'p.jpg' must be a PNG file \\(FILE.png\\)"),
    (["--cp", "4", "--seq-len", "4096", "--plot-cp", "8,16"],
     "--plot-cp 8,16 sets the CP sizes of --plot FILE.png, which is not given"),
    (["--cp", "4", "--seq-len", "4096", "--modes", "mesh", "--plot", "p.png"],
     "--plot draws ring, mesh-auto, .*; --modes 'mesh' names none of them"),
    (["--cp", "4", "--seq-len", "4096", "--window", "16", "--plot", "p.png"],
     "--plot draws unmasked attention against the CP size; it does not take --window or --docs"),
    *[(["--cp", "4", "--seq-len", "4096", "--plot", "p.png", "--plot-cp", cps],
       f"--plot-cp '{cps}' must be CP sizes joined by ',' that each split --seq-len 4096 into 2 x CP halves{tail}")
      for cps, tail in (("8,abc", ""), ("", ""), ("0", "; not \\[0\\]"), ("3,8", "; not \\[3\\]"))],
    (["--cp", "4", "--jobs", "-1"], "--jobs -1: must be >= 0 \\(N processes; 0: one per CPU core\\)"),
    (["--cp", "4", "--seq-len", "4096", "--docs", "lognormal:100,1", "--samples", "0"], "--samples 0: must be >= 1"),
    (["--cp", "4", "--seq-len", "4096", "--docs", "one:96+fixed:1000", "--samples", "2"],
     "--samples 2 draws --docs with seeds 0..1: give --docs a lognormal part \\(one: and fixed: documents are the "
     "same in every sample\\), got 'one:96\\+fixed:1000'"),
    (["--cp", "4", "--seed", "5", "--samples", "3"], "--samples 3 draws --docs with seeds 5..7: .*got None"),
    (["--cp", "4", "--seq-len", "4096", "--docs", "lognormal:100,1", "--samples", "2", "--explain"],
     "--explain breaks down one sample's plans: leave out --samples 2 or --explain"),
    # issue 48: a count that would not fit in memory, and the shape's numbers named by their flags
    (["--cp", "4", "--seq-len", "4096", "--docs", "lognormal:100,1", "--samples", "1000000000"],
     "--samples 1000000000: at most 10,000 \\(each sample plans every row again"),
    (["--cp", "4", "--heads", "0"], "--heads must be >= 1, got 0"),
    (["--cp", "4", "--kv-heads", "-2"], "--kv-heads must be >= 1, got -2"),
    (["--cp", "4", "--head-dim", "0"], "--head-dim must be >= 1, got 0"),
    (["--cp", "4", "--batch", "0"], "--batch must be >= 1, got 0"),
])
def test_cli_rejects_bad_input(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert re.search(message, err) and len(err.strip().splitlines()) == 1, err


def test_cli_config_prints_the_prediction_of_every_kind_of_layer(capsys):
    """--config CONFIG.yaml: the prediction for a Megatron config's attention (the main job's
    --predict section), a table per kind of layer -- Llama 4 Scout's 36 chunked and 12 global
    layers -- and the stack, on the machine its flags describe; a problem flag or --nodes beside
    it, a bad machine value, or a config it cannot plan is one line."""
    from megatron_mesh.tools import predict

    path = os.path.join(predict.ROOT, "configs", "llama4_scout_128k_cp16.yaml")
    assert main(["--config", path]) == 0
    assert capsys.readouterr().out.strip() == predict.prediction_section(path).strip()
    # the machine's flags go with it: GPUs per node (each CP group holds gpus-per-node / TP), the links
    scout = predict.read_config(path)
    assert main(["--config", path, "--gpus-per-node", "4", "--inter-bandwidth", "100"]) == 0
    four = predict.machine(scout, 4, inter_bandwidth=100e9)
    assert four.gpus_per_node == 2 and capsys.readouterr().out.strip() == predict.prediction_section(path, four).strip()
    assert "CP 16 spans 8 node(s)" in predict.prediction_section(path, four)
    for argv, message in ((["--config", path, "--cp", "8"], "plans the config's own problem: leave out --cp"),
                          (["--config", path, "--nodes", "4"], "leave out --nodes (with it go only the machine's flags"),
                          (["--config", path, "--tflops", "0"], "--tflops must be a finite number > 0, got 0"),
                          (["--config", os.path.join(predict.ROOT, "configs", "gpt_tiny_cpu.yaml")],
                           "context-parallel size 1: the CP modes need --context-parallel-size >= 2")):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err


def test_cli_output_into_a_closed_pipe_is_not_an_error(tmp_path):
    """`megatron-mesh-plan ... | head -1`: the reader stops early; no BrokenPipeError traceback."""
    import subprocess

    plan = subprocess.Popen([sys.executable, "-m", "megatron_mesh.tools.plan_cli", "--cp", "8", "--seq-len", "8192"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    plan.stdout.close()  # closed before the table is written
    _, err = plan.communicate(timeout=120)
    assert plan.returncode == 0 and b"Traceback" not in err and b"BrokenPipe" not in err, err.decode()[-2000:]


def test_documents_spec_with_single_documents():
    """one:N parts place single documents first (a long document among short ones), then the
    filling part; the documents cover the sequence exactly."""
    assert document_bounds("one:4+fixed:3", 12) == [0, 4, 7, 10, 12]
    assert document_bounds("one:8192", 8192) == [0, 8192]
    cu = document_bounds("one:4096+one:1024+lognormal:64,1", 8192, seed=1)
    assert cu[:3] == [0, 4096, 5120] and cu[-1] == 8192 and all(b > a for a, b in zip(cu, cu[1:]))
    assert cu == document_bounds("one:4096+one:1024+lognormal:64,1", 8192, seed=1)  # deterministic


def test_one_document_plans_as_the_zigzag_on_every_layout(capsys):
    """One document over the whole sequence is plain causal attention: the balanced layout of it is
    the zigzag (the same rows), and the floor is the causal one."""
    data = _json(capsys, "--cp", "4", "--seq-len", "256", "--docs", "one:256", "--modes", "ring,tasp")
    by = {(r["layout"], r["mode"]): r for r in data["modes"]}
    for mode in ("ring", "tasp"):
        zig, bal = by["zigzag", mode], by["balanced", mode]
        assert (bal["bytes_per_rank"], bal["time_s"], bal["rounds"]) == (zig["bytes_per_rank"], zig["time_s"], zig["rounds"])
    assert data["compute_floor_s"] > 0


def test_cli_layouts_side_by_side(capsys):
    """With --docs the planner compares the layouts; every row is at or above the compute floor,
    the balanced layout evens the causal work that the zigzag leaves uneven, TE's own THD rows are
    there, and balanced-hide has the hybrids' rows alone (the plain modes' layout is the balanced one)."""
    data = _json(capsys, "--cp", "8", "--seq-len", "16384", "--docs", "lognormal:1024,1", "--modes",
                 "ring,mesh,tasp,a2a+tasp")
    floor = data["compute_floor_s"]
    assert floor > 0
    by = {(r["layout"], r["mode"]): r for r in data["modes"]}
    assert {layout for layout, _ in by} == set(layout_names())
    assert {mode for layout, mode in by if layout == "balanced-hide"} == {"a2a+tasp"}
    assert {("thd", m) for m in TE_ROWS} <= set(by)
    assert all(r["time_s"] >= floor for r in data["modes"])
    zig, bal = by["zigzag", "ring"], by["balanced", "ring"]
    assert bal["forward_work_max_over_mean"] < 1.05 < zig["forward_work_max_over_mean"]
    one = _json(capsys, "--cp", "8", "--seq-len", "16384", "--docs", "lognormal:1024,1", "--modes", "ring",
                "--layout", "balanced")
    assert {r["layout"] for r in one["modes"]} == {"balanced"} and one["compute_floor_s"] == floor
    assert main(["--cp", "8", "--seq-len", "16384", "--docs", "fixed:4096"]) == 0
    out = capsys.readouterr().out
    assert "compute floor:" in out and "x floor" in out and "balanced" in out
    with pytest.raises(SystemExit):
        main(["--cp", "4", "--docs", "fixed:4", "--layout", "bogus"])
    assert "invalid choice: 'bogus'" in capsys.readouterr().err


def test_cli_table_of_one_layout_says_which(capsys):
    """A table of one layout has no layout column: its header names the layout (issue 48)."""
    for layout in ("balanced", "zigzag", "thd"):
        assert main(["--cp", "4", "--seq-len", "4096", "--docs", "fixed:512", "--modes", "ring", "--layout",
                     layout]) == 0
        head = capsys.readouterr().out.splitlines()[0]
        assert head.endswith(f"8 documents of mean 512 tokens; every row on the {layout} layout"), head


def test_cli_puts_the_busiest_rank_bytes_next_to_their_bound(capsys):
    """With causal documents the planner gives the sample's bounds on the busiest rank's bytes
    (plan/bound.py) and each row's bytes over the query-owner one; the plain modes' plans are at or
    above it. A window leaves them out (the bounds are derived without one)."""
    from megatron_mesh.plan.bound import placement_bound, query_owner_bound
    from megatron_mesh.tools.plan_args import document_bounds

    argv = ["--cp", "8", "--seq-len", "16384", "--docs", "lognormal:1024,1", "--modes", "ring,tasp", "--layout",
            "balanced"]
    data = _json(capsys, *argv)
    cu, shape = document_bounds("lognormal:1024,1", 16384), AttentionShape(2048, 1, 32, 32, 128, 2)
    bounds = data["bounds"]
    assert bounds["query_owner_bytes"] == query_owner_bound(cu, 8, shape).bytes > 0
    assert bounds["any_placement_bytes"] == placement_bound(cu, 8, shape).bytes < bounds["query_owner_bytes"]
    assert all(r["bytes_per_rank"] >= bounds["query_owner_bytes"] for r in data["modes"])
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "x bound" in out and "when every pair is computed by its query's owner" in out
    assert _json(capsys, *argv, "--window", "512")["bounds"] is None


def test_cli_says_which_rows_a_layout_leaves_out(capsys):
    """balanced-hide with only plain modes (or the formulas, which price dense attention) is no
    empty table: every row left out is named, once per reason."""
    base = ["--cp", "4", "--seq-len", "64", "--heads", "4", "--docs", "lognormal:10,1", "--layout", "balanced-hide"]
    data = _json(capsys, *base, "--modes", "ring,mesh,usp")
    assert data["modes"] == []
    assert [s["mode"] for s in data["skipped"]] == ["usp", "ring (balanced-hide)", "mesh (balanced-hide)"]
    assert main(base + ["--modes", "ring,mesh,usp"]) == 0
    out = capsys.readouterr().out
    assert "not available: usp: priced by formula for dense attention only, not under documents" in out
    assert ("not available: ring (balanced-hide), mesh (balanced-hide): balanced-hide changes only the Ulysses "
            "groups' layouts") in out
    data = _json(capsys, "--cp", "3", "--seq-len", "66", "--heads", "4", "--docs", "lognormal:10,1", "--layout",
                 "balanced-hide", "--modes", "auto")  # no hybrid fits CP 3 with 4 heads: neither does auto
    assert data["modes"] == [] and {s["mode"] for s in data["skipped"]} >= {"auto (balanced-hide)"}


def test_cli_prices_a_layout_from_a_file(capsys, tmp_path):
    """--layout-file adds one more layout of the same documents as layout "file": BalancedLayout's
    worked example (P = 3, one document of 12 tokens, rank r holds [4r, 4r + 4)). Its owners
    (rank 0 computes rank 2's queries against its own keys) give every rank 26 pairs; only Mesh
    computes blocks where a layout names, so the other modes' rows are left out, saying why; the
    bytes are the plan's; no Megatron flag runs such a layout."""
    from megatron_mesh.plan import Mask, plan_bytes, resolve
    from megatron_mesh.plan.layout import layout_from_text

    base = ["--cp", "3", "--seq-len", "12", "--heads", "2", "--head-dim", "8", "--docs", "one:12", "--layout", "zigzag"]
    owned, plain = tmp_path / "owned.txt", tmp_path / "plain.txt"
    owned.write_text("balanced P=3 U=1 cu=0,12 runs=0+4;4+4;8+4 owners=2>0:0\n")
    plain.write_text("balanced P=3 U=1 cu=0,12 runs=0+4;4+4;8+4\n")
    data = _json(capsys, *base, "--modes", "ring,mesh", "--layout-file", str(owned))
    rows = {(r["layout"], r["mode"]) for r in data["modes"]}
    assert {("zigzag", "ring"), ("file", "mesh")} <= rows and ("file", "ring") not in rows, rows
    # named once: "ring (CP 3, zigzag ring) (file)", not "ring (ring (CP 3, ...)) (file)"
    reason = next(s["reason"] for s in data["skipped"] if s["mode"].startswith("ring (CP 3")
                  and s["mode"].endswith(") (file)"))
    assert "owners" in reason and "use mesh" in reason, reason
    shape = AttentionShape(seq_local=4, heads=2, kv_heads=2, head_dim=8)
    layout = layout_from_text(owned.read_text())
    for r in (r for r in data["modes"] if r["layout"] == "file"):
        assert r["forward_work_max_over_mean"] == 1.0, r  # 26 pairs on each rank
        plan = resolve("mesh", 3, shape, tile=tuple(r["tile"])).build(shape, Mask(True), layout)
        assert r["bytes_per_rank"] == max(b.sent for b in plan_bytes(plan, shape)), r
    # without owners the query owner computes every block: 10, 26 and 42 pairs, and ring runs it
    data = _json(capsys, *base, "--modes", "ring", "--layout-file", str(plain))
    ring = next(r for r in data["modes"] if r["layout"] == "file")
    assert abs(ring["forward_work_max_over_mean"] - 42 / 26) < 1e-9, ring
    assert main([*base, "--modes", "mesh", "--layout-file", str(owned)]) == 0
    out = capsys.readouterr().out
    assert "fastest over the layouts: mesh" in out and " on file, " in out and "in Megatron:" not in out, out


def test_cli_layout_file_must_fit_the_problem(capsys, tmp_path):
    """A layout file that cannot be read, or holds another problem's layout, stops the planner
    with one line naming the file and what differs."""
    good = tmp_path / "layout.txt"
    good.write_text("balanced P=3 U=1 cu=0,12 runs=0+4;4+4;8+4 owners=2>0:0\n")
    bad = tmp_path / "bad.txt"
    bad.write_text("balanced P=3 U=1 cu=0,12 runs=0+4;4+4;8+5\n")
    zigzag, thd = tmp_path / "zigzag.txt", tmp_path / "thd.txt"
    zigzag.write_text("zigzag P=3 S=12\n")
    thd.write_text("thd P=3 S=12\n")
    base = ["--cp", "3", "--seq-len", "12", "--heads", "2", "--head-dim", "8"]
    cases = [
        ([*base, "--docs", "one:12", "--layout-file", str(tmp_path / "none.txt")], "--layout-file .*none.txt: .*No such"),
        ([*base, "--docs", "one:12", "--layout-file", str(bad)],
         "--layout-file .*bad.txt: every rank must hold the same number of tokens, got \\[4, 5\\]"),
        ([*base, "--layout-file", str(good)], "holds one sample's layout of its documents: give the --docs"),
        (["--cp", "3", "--seq-len", "24", "--docs", "lognormal:4,1", "--samples", "2", "--layout-file", str(good)],
         "holds one sample's layout .*--samples 2"),
        (["--cp", "6", "--seq-len", "12", "--docs", "one:12", "--layout-file", str(good)],
         "a layout of 3 ranks, --cp 6"),
        ([*base, "--docs", "one:12", "--layout-file", str(zigzag)],
         "--layout-file .*zigzag.txt: a zigzag layout places no documents; give a layout of the documents"),
        ([*base, "--docs", "one:12", "--layout-file", str(thd)], "--layout-file .*thd.txt: not a thd layout: 'P=3 S=12'"),
        ([*base, "--docs", "fixed:6", "--layout-file", str(good)],
         "its documents are not those of --docs \\(give the --docs, --seed"),
    ]
    for argv, message in cases:
        assert main(argv) == 2, argv
        assert re.search(message, capsys.readouterr().err), (argv, message)


def test_cli_names_the_fastest_row_and_the_fewest_bytes_over_the_layouts(capsys):
    """Side by side, the table ends with the fastest row (and the Megatron flags that run it) and
    the row whose busiest rank sends the fewest bytes, over every layout -- the same rows the
    JSON's minima give (auto repeats a row)."""
    argv = ["--cp", "4", "--seq-len", "8192", "--docs", "lognormal:1024,1", "--modes", "ring,mesh,tasp,a2a+ring,auto"]
    data = _json(capsys, *argv)
    rows = [r for r in data["modes"] if r["mode"] != "auto"]
    fast = min(rows, key=lambda r: r["time_s"])
    light = min(rows, key=lambda r: r["bytes_per_rank"])
    assert main(argv) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("fastest over the layouts: "))
    assert f"{fast['mode']} " in line and f" on {fast['layout']}, {fast['time_s'] * 1e3:.2f} ms" in line
    assert f"({fast['time_s'] / data['compute_floor_s']:.2f}x the compute floor)" in line
    flags = next(x for x in out.splitlines() if x.startswith("  in Megatron: --cp-comm-type "))
    assert flags.split()[3] == fast["mode"].removesuffix("-auto")  # the flags' own test: tests/megatron
    line = next(x for x in out.splitlines() if x.startswith("fewest bytes sent by the busiest rank: "))
    assert f"{light['mode']} " in line and f" on {light['layout']}, " in line
    assert "(one sample of --docs, --seed 0: --samples N gives the mean over N samples)" in out
    assert main(argv + ["--layout", "balanced"]) == 0  # one layout: the table's auto row says it
    assert "fastest over the layouts" not in capsys.readouterr().out


def test_te_rows_run_a_blocks_documents_in_one_kernel_call():
    """Transformer Engine runs a THD block as one variable-length kernel call over its documents
    (``kernel_calls="block"``); this package's kernels run its full pieces in one call, its causal
    pieces in another, each masked piece alone ("varlen"), or every piece alone ("piece"). Same
    pairs, same merge: the prices of a masked block differ by exactly the launches."""
    from megatron_mesh.plan.mask import call_groups
    from megatron_mesh.plan import Mask
    from megatron_mesh.plan.costs import compute_cost
    from megatron_mesh.plan.ir import Attend
    from megatron_mesh.plan.mask import BlockKind, mask_pieces
    from megatron_mesh.plan.mesh import build_rotation_plan
    from megatron_mesh.plan.problem import normalize

    P, shape, topo = 4, AttentionShape(seq_local=5120, heads=8, kv_heads=2, head_dim=64), Topology(nodes=1)
    cu = [0, 3000, 7000, 12000, 20480]  # every document's halves of >= 128 tokens: full and causal pieces
    thd = thd_layout(cu, P)
    padded = AttentionShape(seq_local=thd.seq_local, heads=8, kv_heads=2, head_dim=64)
    mask, layout = normalize(P, padded, Mask(True), thd)
    te = build_rotation_plan(P, padded, mask, layout, "te-p2p")
    assert te.kernel_calls == "block" and build_ring_plan(P, shape).kernel_calls == "varlen"
    per_piece = dataclasses.replace(te, kernel_calls="piece", _cache={})
    varlen = dataclasses.replace(te, kernel_calls="varlen", _cache={})
    seen = 0
    for op in te.rank(1).forward:
        if type(op) is not Attend or op.mask != BlockKind.MASKED:
            continue
        pieces = mask_pieces(te.mask, te.positions(op.q, op.rows),
                             tuple(r for i, k in enumerate(op.kv) for r in te.positions(k, op.col(i))), topo.mask_piece)
        block = compute_cost(te, op, padded, topo)
        assert compute_cost(per_piece, op, padded, topo) - block == pytest.approx((len(pieces) - 1) * topo.kernel_latency)
        groups = call_groups(pieces, "varlen")
        assert compute_cost(varlen, op, padded, topo) - block == pytest.approx((len(groups) - 1) * topo.kernel_latency)
        seen += len(pieces) > len(groups)
    assert seen  # blocks with several documents' pieces were priced, joined by the varlen calls


@pytest.mark.parametrize("dtype_bytes", [2, 4])
def test_copy_costs_read_and_write_what_they_move(dtype_bytes):
    """A Ulysses plan's copies: a token reorder reads and writes its rows in the input dtype; a cast
    of an fp32 accumulator (o -> y, dq -> gq, dkv -> gkv) reads its values (not an output's row
    statistics) and writes them once in the input dtype: 4 + 2 bytes an element in bf16, 4 + 4 in fp32."""
    from megatron_mesh.plan.costs import compute_cost
    from megatron_mesh.plan.ir import Copy
    from megatron_mesh.plan.modes.base import resolve

    shape = AttentionShape(seq_local=64, heads=8, kv_heads=4, head_dim=16, itemsize=dtype_bytes)
    topo = Topology(nodes=1, memory_bandwidth=1.0)  # seconds = bytes
    plan = resolve("a2a+ring", 4, shape, ulysses_size=2).build(shape)
    seen = set()
    for direction in ("forward", "backward"):
        for op in plan.rank(1).ops(direction):
            if type(op) is not Copy:
                continue
            h, g = plan.head_counts(op.src, shape.heads, shape.kv_heads)
            rows = plan.tokens(op.src) if op.rows is None else sum(s.stop - s.start for s in op.rows)
            elements = rows * shape.head_dim * (h if op.dst.kind in ("q", "y", "gq", "dy") else 2 * g)
            cast = op.src.kind != op.dst.kind
            per_element = (4 + dtype_bytes) if cast else 2 * dtype_bytes
            assert compute_cost(plan, op, shape, topo) == pytest.approx(elements * per_element), op
            seen.add((op.src.kind, op.dst.kind))
    assert seen >= {("q", "q"), ("kv", "kv"), ("o", "y"), ("dq", "gq"), ("dkv", "gkv"), ("y", "y")}, seen


def test_merges_read_the_kernel_result_in_the_input_dtype():
    """A kernel call's result reaches its fp32 accumulator as the kernel returns it, in the input
    dtype (torch's attention ops: out, dQ, dK, dV in q's dtype, lse in fp32): per element a merge
    reads and writes the accumulator (4 + 4 bytes) and reads the result (2 in bf16), a first write
    reads the result and writes the accumulator. The same block in bf16 and in fp32 differs by
    exactly 2 bytes per element of its result -- every row it touches, merged or written first."""
    from megatron_mesh.plan.costs import block_cost_parts, fresh_rows
    from megatron_mesh.plan.ir import Attend, AttendBackward

    topo = Topology(nodes=1, memory_bandwidth=1.0)  # seconds = bytes
    bf16, fp32 = (AttentionShape(seq_local=64, heads=8, kv_heads=2, head_dim=16, itemsize=b) for b in (2, 4))
    plan = build_ring_plan(4, bf16)
    seen = set()
    for direction in ("forward", "backward"):
        first = plan.first_writes(1, direction)
        for i, op in enumerate(plan.rank(1).ops(direction)):
            if type(op) not in (Attend, AttendBackward):
                continue
            fresh = fresh_rows(op, first.get(i))
            rows = sum(s.stop - s.start for s in op.rows) if op.rows is not None else plan.tokens(op.q)
            cols = sum(plan.tokens(k) if op.col(j) is None else sum(s.stop - s.start for s in op.col(j))
                       for j, k in enumerate(op.kv))
            elements = 8 * 16 * rows if type(op) is Attend else 16 * (8 * rows + 2 * 2 * cols)
            a, b = block_cost_parts(plan, op, bf16, topo, fresh)[2], block_cost_parts(plan, op, fp32, topo, fresh)[2]
            assert b - a == pytest.approx(2 * elements), op
            if type(op) is Attend and fresh[:2] == (0, 0):  # a merge: 2 x 4 (out + lse) + 2 x 16 + 4 a row and head
                assert a == pytest.approx(8 * rows * (2 * 4 * 17 + 2 * 16 + 4)), op
            seen.add((direction, fresh[:2] == (0, 0)))
    assert seen >= {("forward", True), ("forward", False), ("backward", False)}, seen  # merges and first writes


def test_compute_floor_worked_example():
    """Two documents of 4 and 2 tokens. Causal: 4*5/2 + 2*3/2 = 13 allowed pairs; not causal: 16 + 4;
    a window of one key back (each query sees itself and the key before): (1+2+2+2) + (1+2) = 10."""
    assert allowed_pairs([0, 4, 6]) == 13
    assert allowed_pairs([0, 4, 6], causal=False) == 16 + 4
    assert allowed_pairs([0, 4, 6], window=(1, 0)) == 10
    shape = AttentionShape(seq_local=3, heads=2, kv_heads=2, head_dim=4)
    topo = Topology(attention_flops=1e3)
    # 4 flops per pair per head-dim per head, forward + BACKWARD_FLOPS x backward, over 2 ranks
    assert compute_floor(13, 2, shape, topo) == pytest.approx(4 * 2 * 4 * 13 / 2 * (1 + BACKWARD_FLOPS) / 1e3)


def test_layout_rows_rejects_bad_input():
    shape = AttentionShape(seq_local=8, heads=2, kv_heads=2, head_dim=4)
    with pytest.raises(ValueError, match="unknown CP layout .ragged.; allowed: zigzag, thd, balanced"):
        layout_rows(2, shape, Topology(), [0, 16], layouts=("ragged",))
    with pytest.raises(ValueError, match="the documents cover 10 tokens, the sequence 16"):
        layout_rows(2, shape, Topology(), [0, 10])


@pytest.mark.parametrize("P, S, window, u", [(4, 4096, None, 2), (6, 12288, None, 3), (8, 16384, (300, 0), 4)])
def test_owner_work_is_the_te_plans_rank_work(P, S, window, u):
    """The TE rows' work column comes from the layout (owner_work), not from every rank's blocks:
    the same counts as rank_work of TE's p2p plan and of its a2a+p2p hybrid, on THD."""
    from megatron_mesh.plan import Mask
    from megatron_mesh.plan.accounting import owner_work, rank_work
    from megatron_mesh.plan.hybrid import build_hybrid_plan
    from megatron_mesh.plan.layout import ZigzagLayout
    from megatron_mesh.plan.mesh import build_rotation_plan
    from megatron_mesh.plan.problem import normalize
    from megatron_mesh.tools.plan_args import document_bounds

    assert owner_work(Mask.from_cu_seqlens([0, 4, 8], 8), ZigzagLayout(2, 8)) == [10, 10]  # the docstring's
    thd = thd_layout(document_bounds("lognormal:700,1.0", S, 1), P)
    shape = AttentionShape(seq_local=thd.seq_local, heads=12, kv_heads=12, head_dim=8)
    mask, layout = normalize(P, shape, Mask(True, window), thd)
    assert rank_work(build_rotation_plan(P, shape, mask, layout, "te-p2p")) == owner_work(mask, layout)
    hybrid = build_hybrid_plan("te-a2a+p2p", P, u, lambda sub, m, lay: build_rotation_plan(P // u, sub, m, lay),
                               shape, mask, layout)
    assert rank_work(hybrid) == owner_work(mask, layout, u)


def test_jobs_plan_the_same_rows_in_parallel(capsys, tmp_path):
    """Rows planned and simulated in worker processes are the rows of one process, in the same
    order, with the same skipped rows -- over every layout (balanced per Ulysses group included)
    and through the CLI (whose table differs only in the time it took)."""
    shape = AttentionShape(seq_local=256, heads=4, kv_heads=2, head_dim=8)
    cu = document_bounds("lognormal:300,1", 8 * 256, seed=3)
    modes = ("ring", "mesh", "mesh-auto", "tasp", "a2a+tasp", "a2a+mesh", "auto", "usp")
    one = layout_rows(8, shape, Topology(nodes=2, gpus_per_node=4), cu, modes=modes)
    two = layout_rows(8, shape, Topology(nodes=2, gpus_per_node=4), cu, modes=modes, jobs=2)
    assert one == two and [r.extra for r in one[0]] == [r.extra for r in two[0]]  # extra: not in ==
    # Mesh's owners layout cannot balance this sample: its rows are skipped, saying why
    assert {r.layout for r in one[0]} == set(layout_names()) - {"owners"} and one[1]
    owners = {s["mode"]: s["reason"] for s in one[1] if s["mode"].endswith("(owners)")}
    assert set(owners) == {f"{m} (owners)" for m in modes if m != "usp"}
    assert "work max/mean 1.143" in owners["mesh (owners)"] and "not ring" in owners["ring (owners)"]
    assert evaluate(4, shape, Topology(), modes=("ring", "mesh", "auto"), jobs=2) == \
        evaluate(4, shape, Topology(), modes=("ring", "mesh", "auto"))
    argv = ["--cp", "4", "--seq-len", "4096", "--docs", "lognormal:500,1", "--modes", "ring,tasp,a2a+ring,auto"]
    tables = []
    for jobs in ("1", "2", "0"):
        assert main(argv + ["--jobs", jobs]) == 0
        tables.append(re.sub(r"planned and simulated in [0-9.]+ s", "", capsys.readouterr().out))
    assert tables[0] == tables[1] == tables[2] and "fastest over the layouts" in tables[0]
    # the plot's CP sizes share the table's workers
    assert main(["--cp", "4", "--seq-len", "4096", "--plot", str(tmp_path / "p.png"), "--plot-cp", "4,8",
                 "--jobs", "2"]) == 0
    assert png_size(tmp_path / "p.png")[0] > 0


def test_cli_samples_give_each_rows_mean_over_the_samples(capsys, monkeypatch):
    """--samples N plans N samples of the documents (seeds --seed..--seed+N-1): every number is the
    mean of the rows of each seed alone, buffer memory the largest, the slowest sample's time its
    own column; the fastest row over the layouts is a placement Megatron's flags can name (a
    derived row may pick differently per sample)."""
    base = ["--cp", "4", "--seq-len", "8192", "--docs", "lognormal:700,1.2", "--modes",
            "ring,tasp,a2a+ring,mesh-auto,auto", "--seed", "2"]
    each = [_json(capsys, *base[:-1], str(seed)) for seed in (2, 3, 4)]
    mean = _json(capsys, *base, "--samples", "3", "--jobs", "2")
    assert mean["samples"] == 3 and mean["seeds"] == [2, 3, 4]
    assert mean["compute_floor_s"] == pytest.approx(sum(d["compute_floor_s"] for d in each) / 3)
    key = lambda r: (r["layout"], r["mode"], r["ulysses"], str(r["tile"]))  # noqa: E731
    fixed = {key(r): r for r in mean["modes"] if r["mode"] in ("ring", "tasp", "a2a+ring", "te-p2p", "te-a2a+p2p")}
    assert {k[0] for k in fixed} == set(layout_names()) - {"owners"} and len(fixed) >= 8  # owners: Mesh only
    for k, row in fixed.items():
        rows = [next(r for r in d["modes"] if key(r) == k) for d in each]
        for field in ("time_s", "forward_s", "backward_s", "forward_work_max_over_mean"):
            assert row[field] == pytest.approx(sum(r[field] for r in rows) / 3), (k, field)
        assert abs(row["bytes_per_rank"] - sum(r["bytes_per_rank"] for r in rows) / 3) <= 0.5
        assert row["peak_buffer_bytes"] == max(r["peak_buffer_bytes"] for r in rows)
        assert row["time_s_max"] == max(r["time_s"] for r in rows) and row["samples"] == 3
    assert main(base + ["--samples", "3"]) == 0
    out = capsys.readouterr().out
    assert "samples: 3 of --docs lognormal:700,1.2 (--seed 2..4); every number is the mean over them" in out
    monkeypatch.setattr(ThdKind, "plan_ranks", 2)  # THD's reason names each sample's document count
    names = [x["mode"] for x in _json(capsys, *base, "--samples", "3")["skipped"]]
    assert "ring (balanced-hide)" in names and "ring (thd)" in names and len(set(names)) == len(names)
    assert " time max " in out.splitlines()[next(i for i, x in enumerate(out.splitlines()) if x.startswith("layout"))]
    line = next(x for x in out.splitlines() if x.startswith("fastest over the layouts: "))
    pool = [r for r in mean["modes"] if r["mode"] not in ("auto", "mesh-auto")]
    fast = min(pool, key=lambda r: r["time_s"])
    assert f"{fast['mode']} " in line and f"mean over 3 samples {fast['time_s'] * 1e3:.2f} ms" in line


def test_mean_rows_say_what_they_cannot_average():
    """A row missing from a sample is left out with the reason; a derived row whose pick changes
    names no tile and counts its picks."""
    shape = AttentionShape(seq_local=256, heads=4, kv_heads=2, head_dim=8)
    rows, _ = evaluate(4, shape, Topology(), modes=("ring", "mesh", "mesh-auto"))
    ring = next(r for r in rows if r.mode == "ring")
    auto = next(r for r in rows if r.mode == "mesh-auto")
    other = dataclasses.replace(auto, tile=(4, 1), time_s=auto.time_s * 3, extra={**auto.extra, "pick": "mesh 4x1 q"})
    got, skipped = mean_rows([[ring, auto], [auto.__class__(**{**dataclasses.asdict(other)})]])
    assert [r.mode for r in got] == ["mesh-auto"] and got[0].tile is None
    assert got[0].time_s == pytest.approx(auto.time_s * 2) and got[0].extra["time_s_max"] == other.time_s
    assert got[0].detail == f"the fastest per sample: {auto.extra['pick']} in 1, mesh 4x1 q in 1 of the 2 samples"
    assert got[0].extra["picks"] == [auto.extra["pick"], "mesh 4x1 q"]
    assert skipped == [{"mode": "ring (zigzag)", "reason": "planned in 1 of the 2 samples only"}]
    with pytest.raises(ValueError, match="a non-empty list of samples"):
        mean_rows([])


def test_samples_match_rows_by_placement_and_name_the_picks(capsys):
    """A sample of one document plans ring as the dense zigzag (with a tile): its rows still match
    the other samples' by placement; a derived row names what it picked per sample (mesh-auto can
    pick ring) and, where it picked one placement in every sample, can be the fastest row."""
    argv = ["--cp", "8", "--seq-len", "16384", "--docs", "lognormal:6000,2", "--modes", "ring,tasp,a2a+ring,auto",
            "--layout", "zigzag", "--samples", "3"]
    assert document_bounds("lognormal:6000,2", 16384, seed=2) == [0, 16384]  # seed 2: one document
    data = _json(capsys, *argv)
    assert not [s for s in data["skipped"] if "samples only" in s["reason"]]
    assert {r["mode"] for r in data["modes"]} >= {"ring", "tasp", "a2a+ring", "auto"}
    assert len([r for r in data["modes"] if r["mode"] == "a2a+ring"]) >= 2
    data = _json(capsys, "--cp", "8", "--seq-len", "16384", "--docs", "lognormal:1500,1.2", "--gpus-per-node", "4",
                 "--layout", "zigzag", "--modes", "ring,mesh,mesh-auto", "--samples", "3")
    auto = next(r for r in data["modes"] if r["mode"] == "mesh-auto")
    each = [next(r for r in _json(capsys, "--cp", "8", "--seq-len", "16384", "--docs", "lognormal:1500,1.2",
                                  "--gpus-per-node", "4", "--layout", "zigzag", "--modes", "ring,mesh,mesh-auto",
                                  "--seed", str(seed))["modes"] if r["mode"] == "mesh-auto") for seed in range(3)]
    assert auto["picks"] == [r["pick"] for r in each] and all(p.split()[0] in ("ring", "mesh") for p in auto["picks"])
    argv = ["--cp", "4", "--seq-len", "8192", "--docs", "lognormal:700,1.2", "--modes", "a2a+mesh-auto", "--samples", "3"]
    rows = _json(capsys, *argv)["modes"]
    steady = [r for r in rows if r["mode"] == "a2a+mesh-auto" and len(set(r["picks"])) == 1]
    assert steady
    assert main(argv) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("fastest over the layouts: "))
    fast = min([r for r in rows if r["mode"] != "a2a+mesh-auto"] + steady, key=lambda r: r["time_s"])
    assert f"{fast['time_s'] * 1e3:.2f} ms" in line


def test_layout_rows_take_the_layouts_in_any_order():
    shape = AttentionShape(seq_local=2048, heads=4, kv_heads=2, head_dim=8)
    rows, _ = layout_rows(4, shape, Topology(), [0, 1000, 3000, 8192], layouts=("balanced-hide", "zigzag"),
                          modes=["ring", "a2a+ring", "auto"])
    assert [r.layout for r in rows][0] == "balanced-hide" and rows[-1].layout == "zigzag"


def _workers(pid: int) -> list[int]:
    """The pool workers a process spawned (not multiprocessing's resource tracker)."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    parent = int(f.read().rsplit(")", 1)[1].split()[1])
                with open(f"/proc/{d}/cmdline", "rb") as f:
                    worker = b"spawn_main" in f.read()
            except OSError:
                continue
            if parent == pid and worker:
                out.append(int(d))
    return out


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds the worker processes in /proc")
def test_cli_says_when_a_worker_is_killed():
    """A worker killed mid-plan (out of memory, a signal) is an error naming --jobs, not a traceback
    or a table short of its rows."""
    proc = subprocess.Popen([sys.executable, "-m", "megatron_mesh.tools.plan_cli", "--cp", "64", "--seq-len", "262144",
                             "--docs", "lognormal:4096,1", "--layout", "balanced", "--jobs", "2"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not (kids := _workers(proc.pid)) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert kids, "no worker process started"
        time.sleep(1)  # spawned and planning
        os.kill(kids[0], signal.SIGKILL)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 1 and out == ""
    assert "error: a worker process of --jobs 2 ended before its rows were planned" in err
    assert "Traceback" not in err


def _interrupt(argv: list[str], how: str) -> tuple[subprocess.Popen, str, str, list[int]]:
    """Run ``argv`` in a process group of its own, wait for its pool workers, then Ctrl-C the group
    or SIGTERM the process alone; (the process, its stdout, stderr, its workers' pids)."""
    def interruptible():  # a shell's background job ignores SIGINT; a terminal's foreground one does not
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.setpgrp()

    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=interruptible)
    try:
        deadline = time.monotonic() + 60
        while not (kids := _workers(proc.pid)) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert kids, "no worker process started"
        time.sleep(1)
        if how == "ctrl-c":
            os.killpg(proc.pid, signal.SIGINT)
        else:
            os.kill(proc.pid, signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
        deadline = time.monotonic() + 30
        while any(os.path.exists(f"/proc/{k}") for k in kids) and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        proc.kill()
    return proc, out, err, kids


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds the worker processes in /proc")
@pytest.mark.parametrize("how", ["ctrl-c", "sigterm"])
def test_cli_stops_its_workers_when_interrupted(how):
    """Ctrl-C (SIGINT to the terminal's process group: the CLI and its workers) or SIGTERM to the
    CLI alone (a job's time limit, kill) ends a parallel run at once, its workers with it -- the
    rows not started are dropped, not planned first (this run takes minutes)."""
    proc, out, err, kids = _interrupt([sys.executable, "-m", "megatron_mesh.tools.plan_cli", "--cp", "64", "--seq-len",
                                       "262144", "--docs", "lognormal:4096,1", "--layout", "all", "--jobs", "2"], how)
    assert out == "" and not any(os.path.exists(f"/proc/{k}") for k in kids), "a worker outlived the run"
    if how == "ctrl-c":
        assert proc.returncode == 130 and err.endswith("megatron-mesh-plan: interrupted\n")
    else:
        assert proc.returncode == 128 + signal.SIGTERM and "Traceback" not in err


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds the worker processes in /proc")
def test_layout_tables_stop_their_workers_when_killed():
    """SIGTERM to ``scripts/layout_tables.py --jobs 2`` (a job's time limit, kill) ends it at once
    and its workers with it: they used to go on planning their seeds for minutes, orphaned."""
    script = Path(__file__).resolve().parents[2] / "scripts" / "layout_tables.py"
    proc, out, err, kids = _interrupt([sys.executable, str(script), "--cp", "64", "--seq-len", "262144", "--docs",
                                       "lognormal:4096,1", "--jobs", "2", "--seeds", "0", "1", "2"], "sigterm")
    assert not any(os.path.exists(f"/proc/{k}") for k in kids), "a worker outlived the run"
    assert proc.returncode == 128 + signal.SIGTERM and "Traceback" not in err


@pytest.mark.parametrize("jobs", [-1, 1.5, True, "2", None])
def test_jobs_must_be_a_whole_number(jobs):
    with pytest.raises(ValueError, match=re.escape(f"jobs must be a whole number >= 0 (0: one process per CPU core), "
                                                   f"got {jobs!r}")):
        layout_rows(2, AttentionShape(seq_local=8), Topology(), [0, 16], jobs=jobs)
    with pytest.raises(ValueError, match="jobs must be a whole number"):
        evaluate(2, AttentionShape(seq_local=8), Topology(), jobs=jobs)


def test_layout_rows_plan_thd_only_when_asked_above_the_limit(monkeypatch):
    """Above ThdKind.plan_ranks a comparison of every layout lists the plugin's modes on THD as not
    planned, saying why and how to plan them; TE's own THD rows and the other layouts are priced.
    Asked for (``plan_all=True``, the CLI's ``--layout thd``) they are planned."""
    shape = AttentionShape(seq_local=64, heads=2, kv_heads=2, head_dim=4)
    cu = [0, 40, 100, 256]
    monkeypatch.setattr(ThdKind, "plan_ranks", 2)
    rows, skipped = layout_rows(4, shape, Topology(), cu, modes=("ring", "auto"))
    assert {(r.layout, r.mode) for r in rows} >= {("zigzag", "ring"), ("balanced", "ring"), ("thd", "te-p2p")}
    assert not any(r.layout == "thd" and r.mode in ("ring", "auto") for r in rows)
    from megatron_mesh.tools.planner import RING_COPY  # Mesh's tiles on the balanced layout: ring's plan
    skipped = [s for s in skipped if s["reason"] != RING_COPY]
    assert [s["mode"] for s in skipped] == ["ring (thd)", "auto (thd)", "ring (balanced-hide)", "ring (owners)",
                                            "auto (owners)"]  # owners: Mesh only
    assert "the plain modes run on the balanced one (--layout balanced)" in skipped[2]["reason"]
    assert "not planned on THD at CP 4: every rank holds two halves of each of the 3 documents" in skipped[0]["reason"]
    assert "(plan them with --layout thd)" in skipped[0]["reason"]
    rows, skipped = layout_rows(4, shape, Topology(), cu, modes=("ring",), layouts=("thd",), plan_all=True)
    assert ("thd", "ring") in {(r.layout, r.mode) for r in rows} and not skipped


def test_cli_runs_without_torch():
    code = ("import sys, json, io, contextlib; sys.modules['torch'] = None\n"
            "from megatron_mesh.tools.plan_cli import main\n"
            "buf = io.StringIO()\n"
            "with contextlib.redirect_stdout(buf): rc = main(['--cp', '4', '--json'])\n"
            "assert rc == 0 and json.loads(buf.getvalue())['modes']\n"
            "assert 'torch' not in [k for k, v in sys.modules.items() if v is not None]\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_planner_at_1024_ranks_plans_every_tile(capsys):
    """The planner at P = 1024 (the scale docs/performance.md, "Planner speed", times: its seconds are
    a benchmark's figure, not this test's -- a timed assertion fails on a loaded CI machine)."""
    data = _json(capsys, "--cp", "1024", "--heads", "32", "--kv-heads", "8", "--seq-len", str(1 << 20),
                 "--modes", "ring,mesh,mesh-auto,tasp")
    tiles = {tuple(r["tile"]) for r in data["modes"] if r["mode"] == "mesh"}
    assert [r["mode"] for r in data["modes"]].count("tasp") == 1
    assert tiles == set(tile_shapes(1024)) - {(1, 1024)}


def test_keys_and_values_are_counted_at_their_own_head_dims(capsys):
    """--v-head-dim (MLA: queries and keys of 192, values of 128): every buffer kind has its tensors
    at their own dims (plan.ir.KINDS), the planner's ring and Mesh rows move the closed form's
    bytes at those dims, the memory walk's ring forward peak is one K + V chunk, the FLOPs per pair
    are 2 (192 + 128) forward and 2 (3 x 192 + 2 x 128) backward, the table's header names both
    dims, and a bad value is refused naming the flag."""
    from megatron_mesh.plan.costs import pair_flops

    shape = AttentionShape(seq_local=2048, batch=1, heads=8, kv_heads=2, head_dim=192, itemsize=2, v_head_dim=128)
    T = 4
    sizes = {"q": 8 * 192 * 2, "kv": 2 * (192 + 128) * 2, "o": 8 * (128 + 1) * 4, "do": 8 * (128 * 2 + 4 + 4),
             "dq": 8 * 192 * 4, "dkv": 2 * (192 + 128) * 4, "y": 8 * 128 * 2, "dy": 8 * 128 * 2, "gq": 8 * 192 * 2,
             "gkv": 2 * (192 + 128) * 2}
    assert {kind: buffer_bytes(kind, T, shape) for kind in sizes} == {kind: n * T for kind, n in sizes.items()}
    rows = _json(capsys, "--cp", "8", "--heads", "8", "--kv-heads", "2", "--seq-len", "16384", "--head-dim", "192",
                 "--v-head-dim", "128", "--modes", "ring,mesh")["modes"]
    assert {r["mode"] for r in rows} == {"ring", "mesh"}
    for r in rows:
        assert r["bytes_per_rank"] == mesh_bytes_formula(8, tuple(r["tile"]), shape).sent, r
    assert buffer_memory(build_ring_plan(2, shape), shape).forward_peak == buffer_bytes("kv", 2048, shape)
    assert pair_flops(shape, 8) == 8 * 2 * 320 and pair_flops(shape, 8, backward=True) == 8 * 2 * (576 + 256)
    equal = dataclasses.replace(shape, v_head_dim=192)
    assert pair_flops(equal, 8, backward=True) == BACKWARD_FLOPS * pair_flops(equal, 8)
    assert main(["--cp", "8", "--seq-len", "16384", "--head-dim", "192", "--v-head-dim", "128", "--modes", "ring"]) == 0
    assert "head dim 192 (values 128)" in capsys.readouterr().out
    assert main(["--cp", "8", "--v-head-dim", "0"]) == 2
    assert "--v-head-dim must be >= 1, got 0" in capsys.readouterr().err


# -- simulator -------------------------------------------------------------------------------------------
def test_worked_example_ring_of_two():
    shape = AttentionShape(seq_local=4096, heads=8, kv_heads=8, head_dim=128)
    topo = Topology(nodes=1, gpus_per_node=2, kernel_latency=0.0, memory_bandwidth=1e30, host_op_time=0.0)
    plan = build_ring_plan(2, shape)
    res = simulate(plan, shape, topo)
    n, flops = 4096, 4 * 8 * 128
    diagonal, half = flops * n * (n + 1) / 2 / topo.attention_flops, flops * n * n / 2 / topo.attention_flops
    m = topo.intra_latency + buffer_bytes("kv", n, shape) / topo.intra_bandwidth
    assert res.forward.time == pytest.approx(max(diagonal, m) + half)
    assert res.forward.rounds == 1 and res.forward.bytes_sent == buffer_bytes("kv", n, shape)


def test_the_host_sets_the_pace_where_it_is_behind():
    """Each rank's host issues its ops at Topology.host_op_time per torch op and host_view_time
    per view (plan.hostops counts them): with no host the time is the device's; at 1K tokens per
    rank on the default machine the host is behind (the rows say host-bound) and sets the time; a host a hundred times slower
    makes the step its host's issue time (the device waits), which the breakdown names; at 16K
    tokens per rank the default host keeps ahead."""
    from megatron_mesh.plan.hostops import step_host_ops

    shape = AttentionShape(seq_local=1024, heads=32, kv_heads=8, head_dim=128)
    plan = build_ring_plan(8, shape)
    none = simulate(plan, shape, Topology.for_cp(8, host_op_time=0.0))
    default = simulate(plan, shape, Topology.for_cp(8))
    assert none.host == 0 and not none.host_bound
    assert default.host_bound and default.time > none.time and default.time >= default.host
    d = Topology()
    slow = Topology.for_cp(8, host_op_time=100 * d.host_op_time, host_view_time=100 * d.host_view_time)
    res = simulate(plan, shape, slow, timeline=True)
    for phase, direction in ((res.forward, "forward"), (res.backward, "backward")):
        ops, around = step_host_ops(plan, 7, direction, shape, piece=slow.mask_piece)
        # every launch and point-to-point call at host_op_time, every view at host_view_time
        issue = sum((h.launches + h.transfers) * slow.host_op_time + h.views * slow.host_view_time
                    for h in (*ops, around))
        assert phase.host == pytest.approx(issue, rel=0.02)  # the slowest rank's (ranks 0 and 7 differ little)
        assert phase.time == pytest.approx(phase.host, rel=0.02) and phase.host_bound
    parts = time_breakdown(plan, shape, slow, res)
    assert all(b.parts["host"] > 0.9 * b.time for b in parts)
    # the planner's --host-view-us sets the views' price: the machine line names it, and free views
    # leave the launches' share of the host
    assert "23 us per torch op, 3 per view" in Topology().describe()
    free_views = simulate(plan, shape, Topology.for_cp(8, host_view_time=0.0))
    assert 0 < free_views.host < default.host


def test_a_host_ahead_of_its_gpu_hides_its_ops(tmp_path):
    """Topology.host_lead: the host starts that far ahead of the GPU in each direction (what the
    layer's other work gave it once nothing syncs them per call). At 1K tokens per rank the ring
    plan's host is behind from its first op: the time falls with the lead -- never below the
    device's own (host free) time, which a lead of the host's whole issue time reaches --, the host
    seconds reported stay its issue time, the layout choice's host price falls by the lead, the
    machine line names it, and --host-lead-us sets it (a negative one is refused, naming it)."""
    from megatron_mesh.plan.choice import _host_seconds
    from megatron_mesh.tools.plan_args import parser, topology_of

    shape = AttentionShape(seq_local=1024, heads=32, kv_heads=8, head_dim=128)
    plan = build_ring_plan(8, shape)
    free = simulate(plan, shape, Topology.for_cp(8, host_op_time=0.0))
    times, hosts = [], []
    for lead in (0.0, 1e-4, 5e-4, 1.0):
        res = simulate(plan, shape, Topology.for_cp(8, host_lead=lead))
        times.append(res.time)
        hosts.append(res.host)
    assert times[0] > times[1] > times[2] >= times[3] >= free.time * (1 - 1e-9)
    assert times[3] == pytest.approx(free.time, rel=1e-6)
    assert hosts == pytest.approx([hosts[0]] * 4, rel=0.01)  # the slowest rank's (0 or 7: they differ a little)
    topo = Topology.for_cp(8, host_lead=2e-4)
    assert _host_seconds([(100, 10)], topo) == pytest.approx(100 * topo.host_op_time + 10 * topo.host_view_time - 2e-4)
    assert _host_seconds([(1, 0)], topo) == 0.0
    assert topo.describe().endswith("3 per view, 200 us ahead") and "ahead" not in Topology().describe()
    with pytest.raises(ValueError, match="host_lead must be finite and >= 0, got -1"):
        Topology(host_lead=-1)
    args = parser().parse_args(["--cp", "8", "--host-lead-us", "1500"])
    assert topology_of(args, 8).host_lead == pytest.approx(1.5e-3)
    with pytest.raises(ValueError, match="--host-lead-us must be a finite number >= 0, got -2"):
        topology_of(parser().parse_args(["--cp", "8", "--host-lead-us", "-2"]), 8)


def test_the_host_prices_come_from_flags_and_files(tmp_path):
    """--host-op-us takes a number or a file; a host_cost.json's host_view_us goes with its op's
    price (gpu_targets.py measured both), --host-view-us overrides it; a bad file value is named."""
    from megatron_mesh.tools.plan_args import parser, topology_of

    def machine(*argv):
        return topology_of(parser().parse_args(["--cp", "8", *argv]), 8)
    d = Topology()
    assert (machine().host_op_time, machine().host_view_time) == (d.host_op_time, d.host_view_time)
    cost = tmp_path / "host_cost.json"
    cost.write_text(json.dumps({"host_op_us": 17.0, "host_view_us": 1.5, "source": "x"}))
    assert machine("--host-op-us", str(cost)).host_op_time == pytest.approx(17e-6)
    assert machine("--host-op-us", str(cost)).host_view_time == pytest.approx(1.5e-6)
    assert machine("--host-op-us", str(cost), "--host-view-us", "4").host_view_time == pytest.approx(4e-6)
    assert machine("--host-op-us", "30").host_view_time == d.host_view_time  # a number is the op's alone
    cost.write_text(json.dumps({"host_op_us": 17.0, "host_view_us": -1}))
    with pytest.raises(ValueError, match="--host-op-us: host cost per view: .* 'host_view_us' -1, not a finite number"):
        machine("--host-op-us", str(cost))
    big = AttentionShape(seq_local=16384, heads=32, kv_heads=8, head_dim=128)
    assert not simulate(build_ring_plan(8, big), big, Topology.for_cp(8)).host_bound


@pytest.mark.parametrize("tile", [(1, 64), (2, 32), (8, 8), (16, 4)])
@pytest.mark.parametrize("shape", [GQA, MHA])
def test_time_between_max_and_sum_of_compute_and_communication(tile, shape):
    topo = Topology.for_cp(64)
    plan = build_mesh_plan(64, tile, shape)
    res = simulate(plan, shape, topo)
    comm = _comm(plan, shape, topo)
    assert res.time >= max(res.compute, comm) * (1 - 1e-12)
    assert res.time <= (res.compute + comm) * (1 + 1e-12)
    assert res.exposed_comm == pytest.approx(res.time - res.compute)


def test_overlap_hides_communication():
    topo = Topology.for_cp(64)
    plan = build_mesh_plan(64, (4, 16), MHA)
    res = simulate(plan, MHA, topo)
    comm = _comm(plan, MHA, topo)
    assert comm > 0.5 * res.compute  # there is communication to hide ...
    assert res.time < res.compute + 0.5 * comm  # ... and most of it is hidden


def test_no_network_means_compute_and_no_compute_means_serial_rounds():
    plan = build_mesh_plan(32, (4, 8), MHA)
    free_net = simulate(plan, MHA, Topology.for_cp(32, **NO_NETWORK))
    assert free_net.time == pytest.approx(free_net.compute, rel=1e-9)
    topo = Topology.for_cp(32, **NO_COMPUTE)
    free_compute = simulate(plan, MHA, topo)
    assert free_compute.time == pytest.approx(_comm(plan, MHA, topo), rel=1e-9)


@pytest.mark.parametrize("tile", [(1, 32), (4, 8)])
def test_time_is_monotonic_in_bandwidth_latency_and_flops(tile):
    plan = build_mesh_plan(32, tile, MHA)
    t = lambda **kw: simulate(plan, MHA, Topology.for_cp(32, **kw)).time  # noqa: E731
    for name, values in (("inter_bandwidth", [10e9, 25e9, 50e9, 100e9, 400e9]),
                         ("intra_bandwidth", [50e9, 150e9, 450e9, 900e9]),
                         ("attention_flops", [100e12, 200e12, 400e12, 800e12])):
        times = [t(**{name: v}) for v in values]
        assert all(a >= b for a, b in zip(times, times[1:])), (name, times)
    times = [t(inter_latency=v) for v in (0.0, 10e-6, 100e-6)]
    assert all(a <= b for a, b in zip(times, times[1:]))


def test_ring_traffic_from_rings_equals_every_rank():
    """Approximation 3 (each rank's traffic from rank 0's rounds and the plan's rings) is exact
    for Mesh plans: same round durations and link bytes as reading every rank's rounds."""
    for P, M in ((4, 2), (6, 2), (8, 4), (12, 4), (16, 8), (24, 8)):
        topo = Topology.for_cp(P, M)
        shape = AttentionShape(seq_local=8, heads=8, kv_heads=2, head_dim=16)
        for tile in tile_shapes(P):
            for contiguous in ("q", "kv"):
                plan = build_mesh_plan(P, tile, shape, contiguous=contiguous, backward_chunks="keep")
                for d in ("forward", "backward"):
                    fast, exact = round_traffic(plan, shape, topo, d), round_traffic(plan, shape, topo, d, exact=True)
                    assert fast.sent is None  # the fast path was taken
                    assert fast.duration == exact.duration, (P, M, tile, contiguous, d)
                    assert (fast.bytes_sent, fast.max_inter) == (exact.bytes_sent, exact.max_inter)
                    assert fast.mean_inter == pytest.approx(exact.mean_inter)


def test_ranks_zero_and_last_stand_for_every_rank():
    """Approximation 2: simulating ranks 0 and P-1 gives the time of simulating all ranks (the
    zigzag layout gives every rank the same FLOPs; merge traffic and call counts differ a bit)."""
    topo = Topology.for_cp(16, 4)
    for tile in ((1, 16), (4, 4), (2, 8), (16, 1)):
        plan = build_mesh_plan(16, tile, MHA)
        default, every = simulate(plan, MHA, topo), simulate(plan, MHA, topo, ranks=list(range(16)), exact=True)
        assert default.time <= every.time
        assert default.time == pytest.approx(every.time, rel=2e-3)


def test_timeline_events():
    plan = build_mesh_plan(8, (2, 4), MHA)
    res = simulate(plan, MHA, Topology.for_cp(8), timeline=True)
    for phase, rank in itertools.product((res.forward, res.backward), (0, 7)):
        compute = [e for e in phase.timeline if e.stream == "compute" and e.rank == rank]
        comm = [e for e in phase.timeline if e.stream == "comm" and e.rank == rank]
        assert len(comm) == phase.rounds
        assert all(a.end <= b.start + 1e-15 for a, b in zip(compute, compute[1:]))
        assert all(a.end <= b.start + 1e-15 for a, b in zip(comm, comm[1:]))  # rounds run in order
        assert max(e.end for e in phase.timeline) == pytest.approx(phase.time)


def test_time_breakdown_adds_up_and_names_the_rounds_it_waits_for():
    """The parts of each direction's time on its slowest rank add up to the time; FLOPs are the
    kernel calls' pairs at peak; a Ulysses hybrid under documents waits for its all-to-all of Q
    and K/V (round 2: the documents that cross into another group; round 1, the first documents'
    of balanced-hide, is not posted on the balanced layout), and a plan whose communication hides
    behind compute waits for nothing."""
    from megatron_mesh.plan.balance import balanced_layout
    from megatron_mesh.plan.mask import Mask
    from megatron_mesh.plan.modes import MODES
    from megatron_mesh.plan.simulate import time_breakdown
    topo = Topology.for_cp(8)
    ring = build_ring_plan(8, MHA)
    for b in time_breakdown(ring, MHA, topo):
        assert sum(b.parts.values()) == pytest.approx(b.time)
        S = 8 * MHA.seq_local
        flops = 4 * MHA.heads * MHA.head_dim * S * (S + 1) / 2 / 8  # causal pairs, an eighth per rank
        assert b.parts["flops"] == pytest.approx(flops * (BACKWARD_FLOPS if b.direction == "backward" else 1)
                                                 / topo.attention_flops, rel=0.01)
    shape = AttentionShape(seq_local=2048, heads=8, kv_heads=2, head_dim=64)
    cu = document_bounds("lognormal:1024,1", 8 * 2048, 0)
    p = next(c for c in MODES["a2a+tasp"].candidates(8, shape, topo) if c.ulysses == 2)
    plan = p.build(shape, Mask(True), balanced_layout(cu, 8, group=2))
    fwd, bwd = time_breakdown(plan, shape, topo)
    for b in (fwd, bwd):
        assert sum(b.parts.values()) == pytest.approx(b.time)
        assert b.parts["copies"] > 0 and b.parts["launches"] > 0  # the all-to-all's reorder, the calls
        assert b.parts["exposed"] == pytest.approx(b.time - sum(v for k, v in b.parts.items() if k != "exposed"))
    assert (2, "kv,q with 1 peer") in {(t, what) for t, _, what in fwd.waits}
    assert all(w > 0 for _, w, _ in fwd.waits + bwd.waits)
    assert sum(w for _, w, _ in fwd.waits) <= fwd.parts["exposed"] + 1e-12


def test_the_results_casts_are_priced_where_the_caller_makes_them():
    """A plain plan leaves its output and gradients in fp32 accumulators and casts them into the
    input dtype at the end (runtime/results.py): after each direction the simulator runs those casts
    on the compute stream (read the fp32 values, write them in bf16: the output's heads x v_head_dim
    x 6 bytes per token forward; dQ's and dK/dV's backward), except on rows one kernel call wrote
    straight into the result (plan/single_writes.py): ring's rank 0 holds the zigzag's first and
    last chunks, and its first chunk's rows see only its own keys, so its output and dQ there are
    one call's: half of those casts is left (its dK/dV come home from the ring: all cast). A Ulysses
    hybrid casts inside its plan (Copy ops, priced as ops); fp32 inputs need no cast."""
    from megatron_mesh.plan.costs import result_casts
    from megatron_mesh.plan.modes import MODES
    topo = Topology.for_cp(8)
    shape = AttentionShape(seq_local=1024, heads=8, kv_heads=2, head_dim=64)
    ring = build_ring_plan(8, shape)
    T, bw = shape.seq_local, topo.memory_bandwidth
    assert result_casts(ring, 0, "forward", shape, topo) == pytest.approx(T / 2 * 8 * 64 * 6 / bw)
    assert result_casts(ring, 0, "backward", shape, topo) == pytest.approx((T / 2 * 8 + T * 2 * 2) * 64 * 6 / bw)
    assert result_casts(ring, 3, "forward", shape, topo) == pytest.approx(T * 8 * 64 * 6 / bw)  # none single
    priced = simulate(ring, shape, topo, timeline=True)
    casts = [e for e in priced.forward.timeline if e.what == "cast"]
    assert len(casts) >= 2 and all(e.end - e.start == pytest.approx(result_casts(ring, e.rank, "forward", shape, topo))
                                   for e in casts)
    for b in time_breakdown(ring, shape, topo, priced):
        assert sum(b.parts.values()) == pytest.approx(b.time)
        assert b.parts["copies"] == pytest.approx(result_casts(ring, b.rank, b.direction, shape, topo))
    hybrid = next(c for c in MODES["a2a+ring"].candidates(8, shape, topo) if c.ulysses == 2).build(shape)
    assert result_casts(hybrid, 0, "forward", shape, topo) == result_casts(hybrid, 0, "backward", shape, topo) == 0
    fp32 = dataclasses.replace(shape, itemsize=4)
    assert result_casts(build_ring_plan(8, fp32), 0, "forward", fp32, topo) == 0


def test_cli_explain(capsys):
    """--explain says where the fastest plan of each layout spends its time; --json carries it on every row."""
    assert main(["--cp", "8", "--seq-len", "16384", "--docs", "lognormal:1024,1", "--modes", "ring,a2a+tasp,auto",
                 "--explain"]) == 0
    out = capsys.readouterr().out
    assert out.count("where the time goes:") == len(layout_names())  # owners: its fastest row is Mesh's
    assert re.search(r"forward +[0-9.]+ ms on rank \d+: flops [0-9.]+, launches [0-9.]+, accumulate [0-9.]+, "
                     r"copies [0-9.]+, combine [0-9.]+, host [0-9.]+, exposed [0-9.]+ ms", out)
    data = _json(capsys, "--cp", "8", "--seq-len", "65536", "--modes", "ring", "--explain")
    (row,) = data["modes"]
    fwd, bwd = row["breakdown"]
    assert (fwd["direction"], bwd["direction"]) == ("forward", "backward")
    assert fwd["time_s"] + bwd["time_s"] == pytest.approx(row["time_s"])
    assert "breakdown" not in _json(capsys, "--cp", "8", "--seq-len", "65536", "--modes", "ring")["modes"][0]


def test_simulate_rejects_bad_input():
    plan = build_mesh_plan(8, (2, 4), MHA)
    with pytest.raises(ValueError, match="does not fit"):
        simulate(plan, MHA, Topology(nodes=1, gpus_per_node=4))
    with pytest.raises(ValueError, match="seq_local"):
        simulate(plan, GQA, Topology.for_cp(8))
    with pytest.raises(ValueError, match="subset"):
        simulate(plan, MHA, ranks=[8])


# -- memory ------------------------------------------------------------------------------------------------
def test_memory_worked_example_ring_of_two():
    shape = AttentionShape(seq_local=2, heads=1, kv_heads=1, head_dim=1)
    mem = buffer_memory(build_ring_plan(2, shape), shape)
    kv, dkv = buffer_bytes("kv", 2, shape), buffer_bytes("dkv", 2, shape)
    assert (mem.forward_peak, mem.backward_peak, mem.saved) == (kv, 2 * dkv, 0)
    assert mem.outputs == buffer_bytes("o", 2, shape) + buffer_bytes("dq", 2, shape) + dkv


def test_memory_keep_saves_the_pulled_chunks():
    shape = AttentionShape(seq_local=8, heads=4, kv_heads=2, head_dim=8)
    keep = buffer_memory(build_mesh_plan(6, (2, 3), shape, backward_chunks="keep"), shape)
    refetch = buffer_memory(build_mesh_plan(6, (2, 3), shape), shape)
    assert keep.saved == 1 * buffer_bytes("q", 8, shape) + 2 * buffer_bytes("kv", 8, shape)
    assert refetch.saved == 0
    assert keep.forward_peak >= keep.saved
    assert keep.held >= keep.peak and refetch.held >= refetch.peak
    ring = buffer_memory(build_ring_plan(6, shape), shape)
    assert refetch.peak >= ring.peak  # Mesh holds more chunks at once than ring attention


# -- auto tile -------------------------------------------------------------------------------------------
def test_choose_tile_docstring_example():
    shape = AttentionShape(seq_local=(1 << 20) // 64, heads=32, kv_heads=8, head_dim=128)
    assert choose_tile(64, shape, Topology.for_cp(64)) == ((8, 8), "q")


@pytest.mark.parametrize("P, shape", [(8, GQA), (16, MHA), (64, GQA), (64, MHA), (32, MHA)])
def test_auto_is_the_fastest_candidate_and_never_slower_than_ring(P, shape):
    topo = Topology.for_cp(P)
    rows = rank_tiles(P, shape, topo)
    tile, contiguous = choose_tile(P, shape, topo)
    chosen = next(r for r in rows if (r.tile, r.contiguous) == (tile, contiguous))
    ring = next(r for r in rows if r.tile == (1, P))
    assert chosen.time_s <= rows[0].time_s * (1 + TIME_TOLERANCE)
    assert chosen.time_s <= ring.time_s * (1 + TIME_TOLERANCE)
    if P <= 8:  # one node: the rank order does not matter and is not searched
        assert {r.contiguous for r in rows} == {"q"}


def test_auto_cuts_traffic_when_ring_is_communication_bound():
    P = 256
    topo = Topology.for_cp(P)
    rows, _ = evaluate(P, MHA, topo, modes=("ring", "mesh-auto"))
    ring, auto = rows
    assert ring.exposed_comm_s > ring.compute_s  # ring attention waits on the network
    assert auto.bytes_per_rank < 0.3 * ring.bytes_per_rank
    assert auto.time_s < 0.5 * ring.time_s


# -- formulas and topology --------------------------------------------------------------------------------
def test_ulysses_formula_single_node():
    P, shape = 8, AttentionShape(seq_local=1024, heads=32, kv_heads=8, head_dim=128)
    row = ulysses_result(P, shape, Topology.for_cp(P))
    q = 1024 * 32 * 128 * 2
    kv = 2 * 1024 * 8 * 128 * 2
    assert row.bytes_per_rank == round((q + kv + q + q + q + kv) * (P - 1) / P)
    assert row.inter_node_bytes_per_rank == 0 and row.rounds == 4 and row.tile is None
    with pytest.raises(ValueError, match="needs heads"):
        ulysses_result(64, shape, Topology.for_cp(64))


def test_usp_keeps_its_all_to_all_inside_nodes():
    P, shape = 32, AttentionShape(seq_local=1024, heads=32, kv_heads=8, head_dim=128)
    topo = Topology.for_cp(P)
    row = usp_result(P, shape, topo)
    assert {k: v for k, v in row.extra.items() if k != "host_s"} == {"ulysses_degree": 8, "ring_degree": 4}
    assert row.extra["host_s"] > 0  # its ring part's host (the all-to-alls by formula have none)
    sub = AttentionShape(seq_local=8 * 1024, heads=4, kv_heads=1, head_dim=128)
    ring_part = mesh_bytes_formula(4, (1, 4), sub).sent
    assert row.inter_node_bytes_per_rank == pytest.approx(ring_part)  # only the ring crosses nodes


def test_topology_worked_example_and_validation():
    topo = Topology(nodes=2, gpus_per_node=4)
    assert [topo.node(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert topo.link(3, 4) == "inter" and topo.link(1, 2) == "intra"
    assert Topology.for_cp(256).nodes == 32
    with pytest.raises(ValueError, match="nodes must be an integer >= 1"):
        Topology(nodes=0)
    with pytest.raises(ValueError, match="inter_bandwidth must be finite and > 0"):
        Topology(inter_bandwidth=0)
    with pytest.raises(ValueError, match="kernel_latency must be finite and >= 0, got inf"):
        Topology(kernel_latency=float("inf"))
    with pytest.raises(ValueError, match="CP size <= 8"):
        topo.check(9)
    strided = Topology(node_of=(0, 1, 0, 1))
    assert strided.link(0, 2) == "intra" and strided.link(0, 1) == "inter"


def test_tasp_rows_move_ring_bytes_and_beat_ring_across_nodes():
    from megatron_mesh.plan import tasp_bytes_formula

    P, shape = 32, AttentionShape(seq_local=8192, heads=32, kv_heads=32, head_dim=128)
    topo = Topology.for_cp(P)  # 4 nodes x 8
    rows, skipped = evaluate(P, shape, topo, modes=("ring", "tasp"))
    assert not skipped, skipped
    ring, tasp = rows
    assert tasp.bytes_per_rank == tasp_bytes_formula(P, shape).sent
    assert tasp.max_inter_node_bytes < ring.max_inter_node_bytes  # spread over every NIC
    assert tasp.time_s < ring.time_s


def test_tasp_and_hybrid_details_count_in_the_right_number():
    """The rows' details read right for one and for many: one rank per node is one ring (no
    "1 rings ... 0 slots"), an all-to-all over every rank leaves the inner mode one rank."""
    from megatron_mesh.plan.tasp import tasp_rings
    from megatron_mesh.plan.units import count

    assert (count(1, "ring"), count(2, "ring"), count(0, "slot")) == ("1 ring", "2 rings", "0 slots")
    _, (one,) = tasp_rings(4, ranks_per_node=1)
    assert one == "one ring over 4 nodes of 1 GPU: each rank sends 1 slot to the next node per step"
    _, (two,) = tasp_rings(8, ranks_per_node=2)
    assert two.startswith("2 rings chained over 4 nodes of 2 GPUs: each rank sends 1 slot inside its node")
    _, (many,) = tasp_rings(16, ranks_per_node=4)
    assert "sends 3 slots inside its node" in many
    shape = AttentionShape(seq_local=1024, heads=8, kv_heads=1, head_dim=64)
    rows, _ = evaluate(8, shape, Topology.for_cp(8, 8), modes=("a2a+tasp",))
    details = " | ".join(r.detail for r in rows)
    assert "then tasp over 1 rank;" in details or details.endswith("then tasp over 1 rank"), details
    assert "1 key-value head per rank" in details and "then tasp over 4 ranks" in details, details
    assert not re.search(r"\b1 (rings|ranks|slots|GPUs|key-value heads)\b", details), details


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_auto_is_described_with_its_tie_rule_everywhere(capsys):
    """Wherever a derived row is called the fastest -- --help, the table, the docs -- the tie rule
    (TIME_TOLERANCE, the one place the number lives) is said with it: otherwise a row a little
    faster than auto's pick reads as a wrong pick."""
    from megatron_mesh.plan.autotile import TIE_RULE

    rule = f"ties within {TIME_TOLERANCE * 100:g} % going to fewer inter-node bytes"
    assert TIE_RULE == rule
    with pytest.raises(SystemExit):
        main(["--help"])
    assert rule in " ".join(capsys.readouterr().out.split())  # argparse wraps the lines
    assert main(["--cp", "8", "--seq-len", "16384", "--modes", "ring,mesh,mesh-auto,auto"]) == 0
    assert f"mesh-auto, auto: the fastest of their candidates, {rule}" in capsys.readouterr().out
    for doc in ("README.md", "docs/megatron.md", "docs/performance.md"):
        with open(os.path.join(ROOT, doc)) as f:
            assert rule in " ".join(f.read().split()), doc


def test_help_states_each_default_once(capsys):
    """argparse's "(default: X)" only where X means something: not True for --no-causal, not None
    next to the help's own default; --explain says it does not take --samples."""
    with pytest.raises(SystemExit):
        main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "(default: True)" not in out and "(default: False)" not in out and "(default: None)" not in out
    assert "full (non-causal) attention (default: causal)" in out
    assert out.count("(default: H, i.e. MHA)") == 1
    assert "(default: all with --docs, zigzag without" in out
    assert "one sample's plans, so not with --samples N > 1" in out


def test_cli_window_error_names_the_flags_spelling(capsys):
    """R > 0 under a causal mask is refused in the CLI's terms (0 or left out, --no-causal), not
    the Mask's (None)."""
    assert main(["--cp", "4", "--seq-len", "4096", "--window", "4096,16"]) == 2
    err = capsys.readouterr().err
    assert "--window '4096,16': a causal query never sees a later key, so R must be 0 or left out (--window " \
           "4096); give --no-causal for R > 0" in err
    assert "None" not in err
    assert main(["--cp", "4", "--seq-len", "4096", "--window", "64,16", "--no-causal", "--modes", "ring"]) == 0


def test_table_says_which_bytes_are_the_busiest_ranks_and_which_the_means(capsys):
    """bytes max is the busiest rank's, intra / inter mean are means over the ranks: the header
    says so, and for the ring (every rank sends the same) the means add up to the max."""
    assert main(["--cp", "16", "--seq-len", "32768", "--modes", "ring,tasp"]) == 0
    out = capsys.readouterr().out
    head = next(line for line in out.splitlines() if line.startswith("mode"))
    assert head.split()[4:10] == ["bytes", "max", "vs", "ring", "intra", "mean"]
    assert "'max': the busiest rank's, 'mean': the mean over the ranks" in out
    rows = {r["mode"]: r for r in _json(capsys, "--cp", "16", "--seq-len", "32768", "--modes", "ring,tasp")["modes"]}
    ring = rows["ring"]
    assert abs(ring["intra_node_bytes_per_rank"] + ring["inter_node_bytes_per_rank"] - ring["bytes_per_rank"]) <= 1
    tasp = rows["tasp"]  # the mean rank never sends more than the busiest
    assert tasp["intra_node_bytes_per_rank"] + tasp["inter_node_bytes_per_rank"] <= tasp["bytes_per_rank"] + 1


def test_mesh_auto_skips_the_tiles_whose_plan_is_rings_on_the_balanced_layout():
    """On a layout that places documents, a Mesh tile computes every block at its query owner,
    one round per shift: ring's plan, which wins the tie. Asked as ``mesh``, every tile is planned
    and has ring's numbers; asked only as ``mesh-auto``, none is, and the row is the same."""
    from megatron_mesh.plan import Mask
    from megatron_mesh.plan.balance import balanced_layout
    from megatron_mesh.tools.planner import RING_COPY
    cu = document_bounds("lognormal:1024,1.0", 16 * 512, 1)
    shape, topo = AttentionShape(512, 1, 4, 2, 32), Topology(nodes=2, gpus_per_node=8)
    layout = balanced_layout(cu, 16, ranks_per_node=8)
    every, _ = evaluate(16, shape, topo, modes=["ring", "mesh", "mesh-auto"], mask=Mask(True), layout=layout)
    ring = next(r for r in every if r.mode == "ring")
    numbers = [f.name for f in dataclasses.fields(ring) if f.name not in ("mode", "tile", "contiguous", "detail")]
    tiles = [r for r in every if r.mode == "mesh"]
    assert len(tiles) == 7 and all(getattr(r, n) == getattr(ring, n) for r in tiles for n in numbers)
    rows, skipped = evaluate(16, shape, topo, modes=["mesh-auto"], mask=Mask(True), layout=layout)
    assert rows == [r for r in every if r.mode == "mesh-auto"] and rows[0].extra["pick"] == "ring"
    assert [s["reason"] for s in skipped] == [RING_COPY] * 7


def test_cli_backward_keep_limit(capsys):
    """--backward-keep-limit X sets the modes' backward_keep_limit on every row: under documents a
    larger limit keeps more of what the ranks pulled, so the busiest rank moves no more bytes (8
    ranks, lognormal:16384 documents, seed 0, the balanced layout); a bad value, or a limit with
    backward chunks other than 'auto', is an error naming it."""
    argv = ["--cp", "8", "--seq-len", "65536", "--docs", "lognormal:16384,1.0", "--layout", "balanced",
            "--modes", "ring,tasp"]
    got = {x: {r["mode"]: r["bytes_per_rank"] for r in _json(capsys, *argv, "--backward-keep-limit", x)["modes"]}
           for x in ("0", "1", "inf")}
    for mode in ("ring", "tasp"):
        assert got["inf"][mode] <= got["1"][mode] <= got["0"][mode] and got["inf"][mode] < got["0"][mode], got
    assert main([*argv, "--backward-keep-limit", "-0.5"]) == 2
    assert "--backward-keep-limit must be a number >= 0" in capsys.readouterr().err
    assert main([*argv, "--backward-keep-limit", "3", "--backward-chunks", "refetch"]) == 2
    assert "a keep limit (3.0) applies only with backward chunks 'auto', got 'refetch'" in capsys.readouterr().err


def test_a_sample_past_the_budget_is_left_out_of_the_mean_not_every_row():
    """--samples 3 where the third sample's share of --plan-budget planned nothing: the mean is over
    the two samples that planned every row, and the table names the sample left out -- every row was
    "planned in 2 of the 3 samples only", an empty table (stop 81's review). Samples that planned
    the same rows are all kept; one short of a single row is left out only where that keeps more rows."""
    from megatron_mesh.tools.plan_cli import _complete_samples

    shape = AttentionShape(seq_local=256, heads=4, kv_heads=2, head_dim=8)
    rows, _ = evaluate(4, shape, Topology(), modes=("ring", "mesh", "tasp"))
    from megatron_mesh.tools.plan_budget import BUDGET_REASON

    past = [{"mode": "tasp", "reason": BUDGET_REASON}]
    full, half, empty = (rows, [], 1.0, None), (rows[:1], past, 1.0, None), ([], past, 1.0, None)
    kept, short = _complete_samples([full, full, empty])
    assert kept == [full, full]
    assert short == [{"mode": "sample 3 of 3", "reason": f"planned 0 of the {len(rows)} rows the others planned (past "
                      "the planning budget); every number is the mean over the 2 other samples; --plan-budget 0 plans "
                      "every row"}]
    assert _complete_samples([full, full]) == ([full, full], [])
    kept, short = _complete_samples([half, full])  # leaving out the short one keeps more rows
    assert kept == [full] and short[0]["mode"] == "sample 1 of 2"
    other = (rows[:1], [], 1.0, None)  # short by its documents, not by the budget: kept
    assert _complete_samples([other, full]) == ([other, full], [])


def test_the_report_says_when_the_budget_left_rows_out_and_explains_autos_pick(capsys):
    """Rows past --plan-budget: a note under the fastest row says it is the fastest of the rows
    planned only; --explain explains the row auto recommends (a row within 1 % may be faster)."""
    argv = ["--cp", "16", "--seq-len", "65536", "--docs", "lognormal:4096,1", "--modes", "ring,tasp,auto",
            "--layout", "all", "--plan-budget", "0.5"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "note: " in out and "within the planning budget (--plan-budget, CPU seconds): the fastest row and the " \
        "fewest bytes are among the rows planned only" in out, out[-3000:]
    small = ["--cp", "8", "--seq-len", "16384", "--modes", "ring,tasp,auto", "--explain"]
    auto = next(r for r in _json(capsys, *small)["modes"] if r["mode"] == "auto")
    assert main(small) == 0
    out = capsys.readouterr().out
    assert "note: " not in out
    explained = next(x for x in out.splitlines() if x.startswith("where the time goes: "))
    assert explained.startswith(f"where the time goes: auto = {auto['detail'].split(':')[0]}"), explained
    assert f", {auto['time_s'] * 1e3:.2f} ms" in explained, (explained, auto["time_s"])
