"""The side-by-side report: Megatron log parsing, per-rank metrics, Markdown/CSV/PNG output."""

import csv
import json

from megatron_mesh.report import RunResult, parse_megatron_log, read_metrics, write_report

LOG = """\
 [2026-11-22 06:13:05.1] iteration        1/       3 | consumed samples:            2 | elapsed time per iteration (ms): 3326.7 | learning rate: 1.000000E-03 | global batch size:     2 | lm loss: 4.876635E+00 | loss scale: 1.0 | number of skipped iterations:   0 | number of nan iterations:   0 |
 [2026-11-22 06:13:05.4] iteration        2/       3 | consumed samples:            4 | elapsed time per iteration (ms): 331.2 | learning rate: 5.500000E-04 | global batch size:     2 | lm loss: 4.812610E+00 | loss scale: 1.0 | number of skipped iterations:   0 | number of nan iterations:   0 |
some other line
 [2026-11-22 06:13:05.7] iteration        3/       3 | consumed samples:            6 | elapsed time per iteration (ms): 320.6 | learning rate: 1.000000E-04 | global batch size:     2 | lm loss: 4.649817E+00 | loss scale: 1.0 | number of skipped iterations:   0 | number of nan iterations:   0 |
"""


def png_size(path) -> tuple[int, int]:
    """(width, height) in pixels from a PNG's IHDR chunk (no image library needed)."""
    head = open(path, "rb").read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR", head
    return int.from_bytes(head[16:20], "big"), int.from_bytes(head[20:24], "big")


def test_parse_megatron_log():
    losses, times = parse_megatron_log(LOG)
    assert losses == {1: 4.876635, 2: 4.81261, 3: 4.649817}
    assert times == {1: 3326.7, 2: 331.2, 3: 320.6}


def _metrics(tmp_path, name, per_rank_steps, peak):
    d = tmp_path / name
    d.mkdir()
    for rank, steps in enumerate(per_rank_steps):
        total, recs = 0, []
        for it, b in enumerate([0] + steps):  # the exit record closes the last iteration
            total += b
            recs.append({"iteration": it if it < len(steps) else -1, "bytes_sent": total, "bytes_received": total,
                         "peak_memory": peak + rank, "memory_kind": "max RSS"})
        (d / f"rank{rank}.jsonl").write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    return str(d)


def test_read_metrics_takes_max_rank_mean_step(tmp_path):
    path = _metrics(tmp_path, "m", [[100, 100, 100], [200, 200, 200]], peak=1000)
    assert read_metrics(path) == (200.0, 1001, "max RSS")
    assert read_metrics(str(tmp_path / "missing")) == (None, None, "")


def test_write_report(tmp_path):
    losses, times = parse_megatron_log(LOG)
    runs = [RunResult("baseline", 1, losses=losses, times_ms=times, bytes_per_step=0, peak_memory=10),
            RunResult("ring", 4, tile="", losses=losses, times_ms=times, bytes_per_step=400, peak_memory=12),
            RunResult("mesh:2x2", 4, tile="2x2", losses={i: v + 1e-6 for i, v in losses.items()}, times_ms=times,
                      bytes_per_step=300, peak_memory=11),
            RunResult("tasp", 4, ok=False, error="exit code 1")]
    text = write_report(runs, str(tmp_path), "title", baseline="baseline")
    assert "| mesh:2x2 | 4 | 2x2 | 1.00e-06 | 325.9 | 300 B | 0.75 |" in text
    assert "**tasp failed**: exit code 1" in text
    with open(tmp_path / "report.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["mode"] for r in rows] == ["baseline", "ring", "mesh:2x2", "tasp"]
    assert float(rows[2]["bytes_vs_ring"]) == 0.75 and rows[0]["bytes_vs_ring"] == ""  # CP 1: no ratio
    assert "| baseline | 1 | - | baseline | 325.9 | 0 B | - |" in text
    # loss: figsize (6, 4), the others (6, 3.5), at 110 dpi
    assert png_size(tmp_path / "loss.png") == (660, 440)
    for png in ("time.png", "bytes.png", "memory.png"):
        assert png_size(tmp_path / png) == (660, 385), png
