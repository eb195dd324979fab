"""The main job end to end: scripts/compare_cp_modes.py runs Megatron's real pretrain() for the
CP=1 baseline and the Ulysses x Mesh hybrid a2a+mesh (CP 4 = all-to-all 2 x Mesh 2) on the default
job's config and iterations, without a mask and on packed documents (data written by the job), and
writes the report (Markdown, CSV, the PNG figures, the heatmap's totals = the bytes the ranks
measured) -- from the runs' metrics JSON lines, not their logs -- whose losses match each mask's
baseline, whose documents' loss falls as the unmasked one does, whose unmasked attention bytes per
step equal what the plan predicts (and the report's measured-vs-planned section says so), whose
masked runs move fewer bytes, and which ends with the planner's prediction for the Llama-3 128K
config on GPUs. Then the job on the tiny gpt-oss- and DeepSeek-style configs (one small run each),
with the predictions for gpt-oss-20b and DeepSeek-V3 at 128K."""

import csv
import os
import re
import sys

import psutil
import pytest
from helpers import HungRunRetried, free_port, run_script

from megatron_mesh.plan import AttentionShape, Mask, plan_bytes, resolve

pytest.importorskip("megatron.core", reason="needs megatron-core (scripts/setup_env.sh installs it)")

pytestmark = [pytest.mark.megatron, pytest.mark.slow]


def test_compare_cp_modes_writes_the_report_with_masks(tmp_path):
    out = tmp_path / "report"
    env = dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS="1", MASTER_PORT=str(free_port()))
    # the default job's config (configs/gpt_tiny_cpu_compare.yaml: 1024 tokens) and iterations (6)
    rc, text = run_script([sys.executable, "scripts/compare_cp_modes.py", "--cp", "4", "--modes", "baseline",
                           "a2a+mesh:2", "--masks", "none", "docs", "--run-timeout", "200", "--out", str(out)], env,
                          timeout=600)
    assert rc == 0, text[-6000:]
    assert "[a2a+mesh:2 [docs]]   iteration 6/6" in text  # progress while it runs
    for name in ("report.md", "report.csv", "loss.png", "time.png", "bytes.png", "memory.png"):
        assert (out / name).stat().st_size > 0, name
    rows = {(r["mode"], r["mask"]): r for r in csv.DictReader(open(out / "report.csv"))}
    assert rows.keys() == {(m, k) for m in ("baseline", "a2a+mesh:2") for k in ("none", "docs")}, rows.keys()
    assert all(r["status"] == "ok" for r in rows.values()), rows
    for mask in ("none", "docs"):
        hybrid = rows["a2a+mesh:2", mask]
        assert hybrid["tile"] in ("1x2", "2x1") and float(hybrid["max_loss_deviation"]) <= 1e-5, hybrid
        assert float(rows["baseline", mask]["attention_bytes_per_rank_per_step"]) == 0
    # the documents change the losses (the mask is real) and let the plans skip blocks
    assert rows["baseline", "docs"]["loss_iter1"] != rows["baseline", "none"]["loss_iter1"]
    unmasked = float(rows["a2a+mesh:2", "none"]["attention_bytes_per_rank_per_step"])
    assert 0 < float(rows["a2a+mesh:2", "docs"]["attention_bytes_per_rank_per_step"]) < unmasked
    # the documents repeat spans of themselves: their loss falls in every mode, as the unmasked one does
    for (mode, mask), row in rows.items():
        first, last = float(row["loss_iter1"]), float(row["loss_iter6"])
        assert last <= 0.95 * first, (mode, mask, first, last)
    # gpt_tiny_cpu_compare.yaml: 2 layers, 2 micro-batches of 1 per step, seq 1024 (256 per rank), 4/2 heads of 16,
    # fp32
    shape = AttentionShape(seq_local=256, batch=1, heads=4, kv_heads=2, head_dim=16, itemsize=4)
    tile = tuple(int(x) for x in rows["a2a+mesh:2", "none"]["tile"].split("x"))
    plan = resolve("a2a+mesh", 4, shape, ulysses_size=2, tile=tile).build(shape, Mask(causal=True))
    assert unmasked == 2 * 2 * max(b.sent for b in plan_bytes(plan, shape))
    report = (out / "report.md").read_text()
    assert "| a2a+mesh:2 | docs | 4 |" in report and "![loss.png](loss.png)" in report
    assert "| mode | bytes [none] | bytes [docs] | ms [none] | ms [docs] |" in report
    # the planner's sections: its bytes next to the measured ones (the same, unmasked), the GPU prediction
    checked = report.split("## Measured vs planned")[1].split("\n## ")[0]
    hybrid_row = next(line for line in checked.splitlines() if line.startswith("| a2a+mesh:2 |"))
    assert "| 1.000 | the run's own plan" in hybrid_row, hybrid_row
    docs_row = next(line for line in checked.splitlines() if line.startswith("| a2a+mesh:2 [docs] |"))
    assert "| 1.000 | the plans the run's calls ran" in docs_row, docs_row  # each batch's own documents, exactly
    assert "## Prediction for llama3_8b_128k_cp16.yaml on GPUs" in report and "`auto` picks **" in report
    _check_per_rank_figures(out, rows)


@pytest.mark.parametrize("config, mode, extra", [
    ("gpt_oss_tiny_cpu.yaml", "mesh:auto", []),
    ("deepseek_tiny_cpu.yaml", "ring", ["--no-predict", "--", "--cp-layout", "balanced"]),  # MLA on the balanced layout
    ("llama4_tiny_cpu.yaml", "tasp", ["--no-predict"]),  # Llama 4's chunked layers and a global one
])
def test_the_main_job_runs_the_gpt_oss_and_deepseek_configs(tmp_path, doc_data, config, mode, extra):
    """The main job on configs/gpt_oss_tiny_cpu.yaml (learnable sinks, 5-token windows on layers 1
    and 3, GQA, its EOD documents) and configs/deepseek_tiny_cpu.yaml (MLA: query/key dim 24, value
    dim 12, YaRN, its EOD documents): one small run each (CP 2, 2 iterations, one mode next to the
    baseline) whose loss is CP 1's, whose bytes are the plans' the layers ran, and -- the gpt-oss
    job, with the default --predict -- whose report ends with the GPU predictions of gpt-oss-20b (a
    table for its window layers and one for its full layers), DeepSeek-V3 and Llama 4 Scout at 128K
    tokens; configs/llama4_tiny_cpu.yaml (chunks of 12 tokens on layers 1-3, layer 4 global): its
    planned bytes price each layer with its own mask, and equal the measured."""
    out = tmp_path / "report"
    env = dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS="1", MASTER_PORT=str(free_port()),
               DOC_DATA=doc_data)
    rc, text = run_script([sys.executable, "scripts/compare_cp_modes.py", "--config", f"configs/{config}", "--cp", "2",
                           "--iters", "2", "--modes", "baseline", mode, "--masks", "none", "--run-timeout", "200",
                           "--out", str(out), *extra], env, timeout=400)
    assert rc == 0, text[-6000:]
    rows = {r["mode"]: r for r in csv.DictReader(open(out / "report.csv"))}
    assert float(rows[mode]["max_loss_deviation"]) <= 1e-5 and rows[mode]["status"] == "ok", rows
    report = (out / "report.md").read_text()
    checked = report.split("## Measured vs planned")[1].split("\n## ")[0]
    row = next(line for line in checked.splitlines() if line.startswith(f"| {mode} |"))
    assert "| 1.000 | the plans the run's calls ran" in row, row
    if config.startswith("gpt_oss"):
        assert "summed over the 4 layers, each with its own mask (2 of 4 layers window 5 tokens, 2 of 4 layers full;" \
            in checked, checked
        gpt_oss = report.split("## Prediction for gpt_oss_20b_128k_cp16.yaml on GPUs")[1].split("\n## ")[0]
        assert "### The 12 layers with a 127-token window" in gpt_oss and "### The 12 layers with full" in gpt_oss
        assert "The stack: **" in gpt_oss and gpt_oss.count("`auto` picks **") == 2
        deepseek = report.split("## Prediction for deepseek_v3_128k_cp16.yaml on GPUs")[1].split("\n## ")[0]
        assert "head dim 192 (values 128)" in deepseek and "`auto` picks **" in deepseek
        scout = report.split("## Prediction for llama4_scout_128k_cp16.yaml on GPUs")[1].split("\n## ")[0]
        assert "### The 36 layers with chunks of 8192 tokens" in scout and "### The 12 layers with full" in scout
    elif config.startswith("llama4"):
        assert "summed over the 4 layers, each with its own mask (3 of 4 layers chunks of 12 tokens, 1 of 4 layers " \
            "full;" in checked, checked
        assert "Mask none adds none of the job's masks: the runs train the config's own attention (4 layers, 4 query " \
               "/ 2 KV heads, head dim 16; 64 tokens at CP 2 (32 per rank), micro-batch 1, fp32, causal, 3 of 4 " \
               "layers chunks of 12 tokens, 1 of 4 layers full, " in report, report[:3000]
    else:
        assert "heads, head dim 24 (values 12)" in checked and "## Prediction" not in report


def _check_per_rank_figures(out, rows):
    """The per-rank figures exist, and the heatmap shows what the ranks measured: each rank's row
    sums to the bytes_sent of its metrics lines, a2a+mesh:2 sends to its all-to-all partner (r^1)
    and its inner ring partner (r^2) only, and the unmasked work is balanced."""
    import json

    from megatron_mesh.tools.figures import heatmap_fig
    from megatron_mesh.tools.report import RunResult, read_metrics

    for name in ("ranks.png", "heatmap.png"):
        assert (out / name).stat().st_size > 0 and f"![{name}]({name})" in (out / "report.md").read_text(), name
    metrics = out / "metrics" / "a2a_mesh_2"
    measured = {}
    for f in metrics.glob("rank*.jsonl"):
        its = [r for r in map(json.loads, f.read_text().splitlines()) if r["kind"] == "iteration"]
        measured[its[-1]["cp_rank"]] = sum(r["bytes_sent"] for r in its) / len(its)
    m = read_metrics(str(metrics))
    assert m.rank_bytes == [measured[r] for r in range(4)] == [sum(row) for row in m.bytes_matrix]
    assert [[p for p in range(4) if row[p]] for row in m.bytes_matrix] == [sorted((r ^ 1, r ^ 2)) for r in range(4)]
    assert float(rows["a2a+mesh:2", "none"]["work_max_over_mean"]) == 1.0 and min(m.rank_work) > 0
    fig = heatmap_fig([RunResult("a2a+mesh:2", 4, rank_bytes=m.rank_bytes, bytes_matrix=m.bytes_matrix)])
    (image,) = fig.axes[0].get_images()
    scale = 1 / 1024 if max(max(row) for row in m.bytes_matrix) < 2**20 else 1 / 2**20  # the figure's unit
    assert float(image.get_array().sum()) == pytest.approx(sum(measured.values()) * scale)


def test_a_run_past_its_timeout_is_stopped_and_reported(tmp_path):
    out = tmp_path / "report"
    env = dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS="1", MASTER_PORT=str(free_port()))
    rc, text = run_script([sys.executable, "scripts/compare_cp_modes.py", "--config", "configs/gpt_tiny_cpu.yaml",
                           "--cp", "2", "--iters", "2", "--modes", "baseline", "--masks", "none", "--run-timeout", "3",
                           "--out", str(out)], env, timeout=120)
    assert rc == 1, text[-3000:]
    assert "[baseline] FAILED" in text
    rows = list(csv.DictReader(open(out / "report.csv")))
    assert rows[0]["status"].startswith("FAILED: stopped after --run-timeout 3 s"), rows
    # torchrun puts its workers in sessions of their own: none of them may outlive the run
    left = [(p.info["pid"], " ".join(p.info["cmdline"])[:120]) for p in psutil.process_iter(["pid", "cmdline"])
            if any(str(out) in part for part in p.info["cmdline"] or ())]  # the ranks carry --cp-metrics-dir OUT/...
    assert not left, left


@pytest.mark.parametrize("signum, status", [(15, 143), (2, 130)])
def test_an_interrupted_job_stops_its_run_and_still_writes_the_report(tmp_path, signum, status):
    """SIGTERM (a scheduler) or Ctrl-C mid-run: the run's torchrun and ranks stop, the report of
    the runs so far is written with that run marked interrupted, status 128 + N (before: no report,
    and Ctrl-C a traceback)."""
    import signal
    import subprocess
    import time

    out = tmp_path / "report"
    env = dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS="1", MASTER_PORT=str(free_port()))
    proc = subprocess.Popen([sys.executable, "scripts/compare_cp_modes.py", "--config", "configs/gpt_tiny_cpu.yaml",
                             "--cp", "2", "--iters", "100000", "--modes", "baseline", "--masks", "none", "--no-predict",
                             "--out", str(out)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                            # Ctrl-C as in a terminal, also where this test runs with SIGINT ignored (a job put
                            # in the background by a shell without job control: its children inherit that)
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    text, deadline = "", time.monotonic() + 120
    try:
        for line in proc.stdout:  # the first iteration's loss: the run is training
            text += line
            if "iteration 1/100000" in line or time.monotonic() > deadline:
                break
        assert "iteration 1/100000" in text, text[-3000:]
        proc.send_signal(signum)
        rest, _ = proc.communicate(timeout=60)
        text += rest
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == status, text[-3000:]
    name = signal.Signals(signum).name
    assert f"compare_cp_modes: interrupted ({name}): stopped the baseline run" in text and "Traceback" not in text
    rows = list(csv.DictReader(open(out / "report.csv")))
    assert rows[0]["status"].startswith(f"FAILED: interrupted ({name})"), rows
    left = [(p.info["pid"], " ".join(p.info["cmdline"])[:120]) for p in psutil.process_iter(["pid", "cmdline"])
            if any(str(out) in part for part in p.info["cmdline"] or ())]
    assert not left, left


def test_a_hung_run_fails_saying_where_each_process_waits():
    """Every training-run test runs under run_script's timeout: a run that hangs fails the test with
    each process's Python stack (faulthandler, on the SIGABRT the timeout sends), not only the log."""
    code = "import threading\nlock = threading.Lock()\nlock.acquire()\ndef wait_here():\n    lock.acquire()\nwait_here()\n"
    with pytest.raises(pytest.fail.Exception) as e:
        run_script(["bash", "-c", f'"{sys.executable}" -c "$CODE"'], dict(os.environ, CODE=code), timeout=3)
    assert "did not finish in 3 s (each process's stacks at the end)" in str(e.value)
    assert 'File "<string>", line 5 in wait_here' in str(e.value), str(e.value)[-2000:]
    # the message ends with each process's innermost frames (a CI log keeps only a failure's tail)
    tail = str(e.value).rsplit("where each process waited", 1)[-1]
    assert "(1 dumps, 1 processes signalled" in tail and "<string>:5 wait_here <- <string>:6 <module>" in tail, tail


def test_a_run_that_hangs_once_is_run_again_and_the_hang_is_a_warning(tmp_path):
    """run_config's runs get one more start after a hang (a rare hang of the environment must not
    sink the suite): the second start's result is returned, the hang reported as a warning with
    where it waited; a run that hangs every time still fails the test."""
    hang = "import threading; lock = threading.Lock(); lock.acquire(); lock.acquire()"
    script = f'if [ -e "$MARK" ]; then echo "second start on $MASTER_PORT"; else touch "$MARK"; "{sys.executable}" -c "{hang}"; fi'
    env = dict(os.environ, MARK=str(tmp_path / "started"), MASTER_PORT="1")
    with pytest.warns(HungRunRetried, match="hung for 3 s and was run again") as caught:
        rc, out = run_script(["bash", "-c", script], env, timeout=3, retries_after_hang=1)
    assert rc == 0 and out.startswith("second start on ") and "on 1\n" not in out, out  # a new port
    assert "where each process waited (1 dumps" in str(caught[0].message)
    os.remove(tmp_path / "started")
    with pytest.warns(HungRunRetried), pytest.raises(pytest.fail.Exception, match="did not finish in 3 s"):
        run_script(["bash", "-c", f'"{sys.executable}" -c "{hang}"'], env, timeout=3, retries_after_hang=1)


def test_a_hung_training_run_names_each_rank_and_its_children_in_the_summary():
    """Two "ranks" (RANK set) and a child one of them forked, all waiting: the summary names each by
    its role, in the order they were signalled, with its innermost frame."""
    code = ("import os, threading, time\n"
            "lock = threading.Lock(); lock.acquire()\n"
            "def rank_waits():\n    lock.acquire()\n"
            "def child_waits():\n    time.sleep(60)\n"
            "if os.environ['RANK'] == '0' and os.fork() == 0:\n    child_waits()\n"
            "rank_waits()\n")
    script = f'RANK=0 "{sys.executable}" -c "$CODE" & RANK=1 "{sys.executable}" -c "$CODE" & wait'
    with pytest.raises(pytest.fail.Exception) as e:
        run_script(["bash", "-c", script], dict(os.environ, CODE=code), timeout=3)
    tail = str(e.value).rsplit("where each process waited", 1)[-1]
    assert "(3 dumps, 3 processes signalled" in tail, tail
    assert re.search(r"rank 0 \(pid \d+\): <string>:4 rank_waits", tail), tail
    assert re.search(r"rank 1 \(pid \d+\): <string>:4 rank_waits", tail), tail
    assert re.search(r"child of rank 0 \(pid \d+: a data-loader worker or a checkpoint helper\): <string>:6 child_waits", tail), tail
