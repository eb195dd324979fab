"""The side-by-side report: per-rank metrics (JSON lines) reduced over ranks, Markdown/CSV/PNG output."""

import csv
import json

from helpers import png_size
from megatron_mesh.tools.report import PLOTTING_MISSING, Metrics, RunResult, format_bytes, read_metrics, write_report

LOSSES = {1: 4.876635, 2: 4.81261, 3: 4.649817}
TIMES = {1: 3326.7, 2: 331.2, 3: 320.6}


def _metrics(tmp_path, name, per_rank_steps, peak, last_stage=(1,)):
    """rank<R>.jsonl files as megatron_mesh.megatron.telemetry writes them: layer records, then one
    record per iteration (losses only on the last pipeline stage's ranks)."""
    d = tmp_path / name
    d.mkdir()
    for rank, steps in enumerate(per_rank_steps):
        recs = [{"kind": "layer", "layer": n, "mode": "mesh", "cp": 4, "tile": "2x2", "description": "mesh (...)"}
                for n in (1, 2)]
        for it, b in enumerate(steps, start=1):
            recs.append({"kind": "iteration", "iteration": it,
                         "losses": {"lm loss": LOSSES[it]} if rank in last_stage else {},
                         "time_ms": TIMES[it] - rank, "bytes_sent": b, "bytes_received": b,
                         "peak_memory": peak + rank, "memory_kind": "max RSS"})
        (d / f"rank{rank}.jsonl").write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    return str(d)


def test_read_metrics_reduces_over_ranks(tmp_path):
    path = _metrics(tmp_path, "m", [[100, 100, 100], [200, 200, 200]], peak=1000)
    m = read_metrics(path)
    assert m.losses == LOSSES  # from the rank that holds the loss
    assert m.times_ms == TIMES  # the slowest rank (rank 0 here)
    assert (m.bytes_per_step, m.peak_memory, m.memory_kind) == (200.0, 1001, "max RSS")
    assert m.tile == "2x2" and sorted(m.layers) == [1, 2] and m.layers[1]["mode"] == "mesh"
    assert read_metrics(str(tmp_path / "missing")) == Metrics()


def test_read_metrics_keeps_what_the_latest_run_stands_on(tmp_path):
    """A directory used again: a new run from iteration 1 replaces the old one's records (layers,
    losses, bytes) -- they were mixed before; a run resumed at iteration 3 keeps iterations 1-2."""
    from megatron_mesh.megatron.metrics import MetricsWriter

    def run(directory, layers, iterations, bytes_sent):
        w = MetricsWriter(str(directory), 0, 1)
        for n, mode in layers:
            w.write({"kind": "layer", "layer": n, "mode": mode, "cp": 4, "tile": "", "description": mode})
        for it in iterations:
            w.write({"kind": "iteration", "iteration": it, "losses": {"lm loss": 10.0 * it + bytes_sent},
                     "time_ms": 1.0, "bytes_sent": bytes_sent, "bytes_received": bytes_sent, "peak_memory": 1,
                     "memory_kind": "max RSS"})

    run(tmp_path / "again", [(1, "ring"), (2, "tasp"), (3, "mesh"), (4, "ring")], range(1, 6), 100)
    run(tmp_path / "again", [(1, "mesh"), (2, "mesh")], range(1, 3), 40)
    m = read_metrics(str(tmp_path / "again"))
    assert sorted(m.layers) == [1, 2] and m.layers[1]["mode"] == "mesh"
    assert m.losses == {1: 50.0, 2: 60.0} and m.bytes_per_step == 40.0
    run(tmp_path / "resumed", [(1, "ring")], range(1, 5), 100)  # stopped after iteration 4, saved at 2
    run(tmp_path / "resumed", [(1, "ring")], range(3, 6), 40)
    m = read_metrics(str(tmp_path / "resumed"))
    assert m.losses == {1: 110.0, 2: 120.0, 3: 70.0, 4: 80.0, 5: 90.0}
    assert m.bytes_per_step == (2 * 100 + 3 * 40) / 5
    # a run of fewer ranks (CP 4, then CP 1, in one directory): the first rank's writer drops the others' files,
    # which were read as this run's (their bytes, modes and CP size)
    for rank in range(4):
        MetricsWriter(str(tmp_path / "fewer"), rank, 4).write({"kind": "layer", "layer": 1, "mode": "mesh", "cp": 4,
                                                                "tile": "2x2", "description": "mesh"})
    run(tmp_path / "fewer", [(1, "ring")], range(1, 3), 40)
    assert sorted(p.name for p in (tmp_path / "fewer").iterdir()) == ["rank0.jsonl"]
    assert read_metrics(str(tmp_path / "fewer")).layers[1]["mode"] == "ring"
    run(tmp_path / "fewer", [], range(1, 3), 0)  # a run without plugin layers (CP 1): no layers of the runs before
    assert read_metrics(str(tmp_path / "fewer")).layers == {}


def test_a_report_of_runs_that_all_failed_has_no_empty_tables(tmp_path):
    """Every run stopped (a --run-timeout too short): the status table and the reasons, no loss
    table without columns, no legend of figures that were not drawn."""
    runs = [RunResult("baseline", 1, ok=False, error="stopped"), RunResult("ring", 4, ok=False, error="stopped")]
    text = write_report(runs, str(tmp_path), "title", baseline="baseline")
    assert "| ring (failed) | none | 4 |" in text and "**ring failed**: stopped" in text
    assert "Loss per iteration" not in text and "| run |  |" not in text
    if not text.endswith(PLOTTING_MISSING + "\n"):
        assert text.rstrip().endswith("Figures: none (no run finished).") and not list(tmp_path.glob("*.png"))


def test_format_bytes():
    assert [format_bytes(n) for n in (None, 0, 1023, 1024, 3 * 2**20)] == ["-", "0 B", "1023 B", "1.00 KiB", "3.00 MiB"]


def test_write_report(tmp_path):
    runs = [RunResult("baseline", 1, losses=LOSSES, times_ms=TIMES, bytes_per_step=0, peak_memory=10),
            RunResult("ring", 4, tile="", losses=LOSSES, times_ms=TIMES, bytes_per_step=400, peak_memory=12),
            RunResult("mesh:2x2", 4, tile="2x2", losses={i: v + 1e-6 for i, v in LOSSES.items()}, times_ms=TIMES,
                      bytes_per_step=300, peak_memory=11),
            RunResult("tasp", 4, ok=False, error="exit code 1")]
    text = write_report(runs, str(tmp_path), "title", baseline="baseline")
    assert "| mesh:2x2 | none | 4 | 2x2 | 1.00e-06 | 325.9 | 300 B | 0.75 |" in text
    assert "With and without the masks" not in text  # one mask: no second table
    assert "**tasp failed**: exit code 1" in text
    with open(tmp_path / "report.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["mode"] for r in rows] == ["baseline", "ring", "mesh:2x2", "tasp"]
    assert float(rows[2]["bytes_vs_ring"]) == 0.75 and rows[0]["bytes_vs_ring"] == ""  # CP 1: no ratio
    assert "| baseline | none | 1 | - | baseline | 325.9 | 0 B | - |" in text
    for png in ("loss.png", "time.png", "bytes.png", "memory.png"):  # no per-rank metrics: no ranks/heatmap
        w, h = png_size(tmp_path / png)
        assert 300 < w < 2000 and 200 < h < 1500, (png, w, h)
        assert f"![{png}]({png})" in text
    assert not (tmp_path / "ranks.png").exists() and "![ranks.png]" not in text


def test_masked_runs_compare_with_their_own_baseline_and_ring(tmp_path):
    """Each mask's runs are compared with that mask's baseline and ring; a second table puts each
    mode's bytes and time under every mask side by side."""
    doc_losses = {i: v - 0.5 for i, v in LOSSES.items()}
    runs = [RunResult("baseline", 1, losses=LOSSES, times_ms=TIMES, bytes_per_step=0),
            RunResult("ring", 4, losses=LOSSES, times_ms=TIMES, bytes_per_step=400),
            RunResult("baseline", 1, mask="docs", losses=doc_losses, times_ms=TIMES, bytes_per_step=0),
            RunResult("ring", 4, mask="docs", losses={i: v + 2e-6 for i, v in doc_losses.items()}, times_ms=TIMES,
                      bytes_per_step=100),
            RunResult("mesh:2x2", 4, mask="docs", tile="2x2", losses=doc_losses, times_ms=TIMES, bytes_per_step=50)]
    text = write_report(runs, str(tmp_path), "title", baseline="baseline")
    assert "| ring | docs | 4 | - | 2.00e-06 | 325.9 | 100 B | 1.00 |" in text
    assert "| mesh:2x2 | docs | 4 | 2x2 | 0.00e+00 | 325.9 | 50 B | 0.50 |" in text  # vs the docs ring
    assert "| baseline | docs | 1 | - | baseline |" in text
    assert "| mode | bytes [none] | bytes [docs] | ms [none] | ms [docs] |" in text
    assert "| ring | 400 B | 100 B | 325.9 | 325.9 |" in text and "| mesh:2x2 | - | 50 B | - | 325.9 |" in text
    assert "| ring [docs] | " in text  # the loss table names the mask
    rows = list(csv.DictReader(open(tmp_path / "report.csv")))
    assert [(r["mode"], r["mask"]) for r in rows][2:] == [("baseline", "docs"), ("ring", "docs"), ("mesh:2x2", "docs")]


def _per_rank_metrics(tmp_path, name, matrix, work):
    """rank<R>.jsonl files with the per-peer bytes and work a CP run's telemetry writes."""
    d = tmp_path / name
    d.mkdir()
    for rank, row in enumerate(matrix):
        recs = [{"kind": "iteration", "iteration": it, "losses": {"lm loss": LOSSES[it]}, "time_ms": TIMES[it],
                 "bytes_sent": sum(row) * it, "bytes_received": 0, "peak_memory": 1000, "memory_kind": "max RSS",
                 "cp_rank": rank, "attention_work": work[rank],
                 "bytes_sent_to": {str(p): n * it for p, n in enumerate(row) if n}} for it in (1, 2, 3)]
        (d / f"rank{rank}.jsonl").write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    return str(d)


def test_read_metrics_per_rank_work_and_bytes_matrix(tmp_path):
    matrix = [[0, 300, 0], [0, 0, 500], [700, 0, 0]]  # a ring of 3: iteration i sends i x these
    m = read_metrics(_per_rank_metrics(tmp_path, "ring", matrix, work=[10, 20, 30]))
    assert m.bytes_matrix == [[0, 600, 0], [0, 0, 1000], [1400, 0, 0]]  # means over iterations 1-3
    assert m.rank_bytes == [600, 1000, 1400] == [sum(row) for row in m.bytes_matrix]
    assert m.rank_work == [10, 20, 30] and m.bytes_per_step == 1400


def test_per_rank_columns_and_the_zigzag_layout_table(tmp_path):
    """Work and bytes max/mean in both tables; a mask '<m>-zigzag' is compared with '<m>'."""
    def run(mode, mask, work, rank_bytes, dev=0.0):
        return RunResult(mode, 1 if mode == "baseline" else 4, mask=mask, losses={i: v + dev for i, v in LOSSES.items()},
                         times_ms=TIMES, bytes_per_step=max(rank_bytes, default=0), rank_work=work,
                         rank_bytes=rank_bytes)
    runs = [run("baseline", "docs", [], []), run("ring", "docs", [4, 4, 4, 4], [100, 100, 100, 100], 1e-7),
            run("baseline", "docs-zigzag", [], []), run("ring", "docs-zigzag", [2, 4, 4, 6], [50, 100, 100, 150], 3e-7)]
    text = write_report(runs, str(tmp_path), "title", baseline="baseline")
    assert "| ring | docs | 4 | - | 1.00e-07 | 325.9 | 100 B | 1.00 | - | 1.00 | 1.00 |" in text
    assert "| ring | docs-zigzag | 4 | - | 3.00e-07 | 325.9 | 150 B | 1.00 | - | 1.50 | 1.50 |" in text
    assert "documents: balanced vs zigzag layout" in text
    assert "| ring | 100 B | 150 B | 1.00 | 1.50 | 1.00 | 1.50 | 325.9 | 325.9 | 1.00e-07 | 3.00e-07 |" in text
    assert "| baseline | -" not in text.split("balanced vs zigzag")[1].split("Loss per iteration")[0]  # CP 1: no layout
    rows = list(csv.DictReader(open(tmp_path / "report.csv")))
    assert rows[3]["work_max_over_mean"] == "1.5" and rows[3]["attention_bytes_per_rank"] == "50 100 100 150"
    assert rows[0]["work_max_over_mean"] == ""  # no per-rank metrics at CP 1
    assert (tmp_path / "ranks.png").exists() and (tmp_path / "ranks.png").stat().st_size > 0


def test_report_without_matplotlib_keeps_the_tables(tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    runs = [RunResult("baseline", 1, losses=LOSSES, times_ms=TIMES, bytes_per_step=0),
            RunResult("ring", 4, losses=LOSSES, times_ms=TIMES, bytes_per_step=400)]
    text = write_report(runs, str(tmp_path), "title", baseline="baseline")
    assert (tmp_path / "report.md").read_text() == text
    assert "| ring | none | 4 | - | 0.00e+00 | 325.9 | 400 B | 1.00 |" in text
    assert text.rstrip().endswith(PLOTTING_MISSING) and "pip install matplotlib" in PLOTTING_MISSING
    assert [r["mode"] for r in csv.DictReader(open(tmp_path / "report.csv"))] == ["baseline", "ring"]
    assert not list(tmp_path.glob("*.png"))
