"""The main job end to end: scripts/compare_cp_modes.py runs Megatron's real pretrain() for the
CP=1 baseline and a Mesh mode, and writes the report (Markdown, CSV, four PNG plots) -- from the
runs' metrics JSON lines, not their logs -- whose losses match the baseline and whose attention
bytes per step equal what the plan predicts."""

import csv
import os
import sys

import psutil
import pytest
from scripts_util import ROOT, free_port, run_script

from megatron_mesh.plan import AttentionShape, build_mesh_plan, plan_bytes

pytest.importorskip("megatron.core", reason="needs megatron-core (scripts/setup_env.sh installs it)")

pytestmark = [pytest.mark.megatron, pytest.mark.slow]


def test_compare_cp_modes_writes_the_report(tmp_path):
    out = tmp_path / "report"
    env = dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS="1", MASTER_PORT=str(free_port()))
    rc, text = run_script([sys.executable, "scripts/compare_cp_modes.py", "--config", "configs/gpt_tiny_cpu.yaml",
                           "--cp", "2", "--iters", "2", "--modes", "baseline", "mesh:2x1", "--run-timeout", "150",
                           "--out", str(out)], env, timeout=400)
    assert rc == 0, text[-6000:]
    assert "[mesh:2x1]   iteration 2/2" in text  # progress while it runs
    for name in ("report.md", "report.csv", "loss.png", "time.png", "bytes.png", "memory.png"):
        assert (out / name).stat().st_size > 0, name
    rows = {r["mode"]: r for r in csv.DictReader(open(out / "report.csv"))}
    assert rows.keys() == {"baseline", "mesh:2x1"} and all(r["status"] == "ok" for r in rows.values()), rows
    mesh = rows["mesh:2x1"]
    assert mesh["tile"] == "2x1" and float(mesh["max_loss_deviation"]) <= 1e-5, mesh
    assert float(rows["baseline"]["attention_bytes_per_rank_per_step"]) == 0
    # gpt_tiny_cpu.yaml: 2 layers, 2 micro-batches of 1 per step, seq 64 (32 per rank), 4/2 heads of 16, fp32
    shape = AttentionShape(seq_local=32, batch=1, heads=4, kv_heads=2, head_dim=16, itemsize=4)
    per_call = max(b.sent for b in plan_bytes(build_mesh_plan(2, (2, 1), shape), shape))
    assert float(mesh["attention_bytes_per_rank_per_step"]) == 2 * 2 * per_call
    report = (out / "report.md").read_text()
    assert "| mesh:2x1 | 2 | 2x1 |" in report and "![loss.png](loss.png)" in report


def test_a_run_past_its_timeout_is_stopped_and_reported(tmp_path):
    out = tmp_path / "report"
    env = dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS="1", MASTER_PORT=str(free_port()))
    rc, text = run_script([sys.executable, "scripts/compare_cp_modes.py", "--config", "configs/gpt_tiny_cpu.yaml",
                           "--cp", "2", "--iters", "2", "--modes", "baseline", "--run-timeout", "3",
                           "--out", str(out)], env, timeout=120)
    assert rc == 1, text[-3000:]
    assert "[baseline] FAILED" in text
    rows = list(csv.DictReader(open(out / "report.csv")))
    assert rows[0]["status"].startswith("FAILED: stopped after --run-timeout 3 s"), rows
    # torchrun puts its workers in sessions of their own: none of them may outlive the run
    left = [(p.info["pid"], " ".join(p.info["cmdline"])[:120]) for p in psutil.process_iter(["pid", "cmdline"])
            if any(str(out) in part for part in p.info["cmdline"] or ())]  # the ranks carry --cp-metrics-dir OUT/...
    assert not left, left
