"""Megatron's real pretrain() loop on configs/gpt_tiny_cpu.yaml (gloo, CPU), through both entry
scripts: the plugin's own (scripts/pretrain_gpt.sh) and Megatron-LM's pretrain_gpt.py run by
scripts/run_megatron_script.sh with the plugin's flags on its command line.

* in Megatron-LM's script, CP 4 under Mesh 1x4 lockstep + ring logs the losses of CP 1 (bit for
  bit in fp32); the run also shows the per-stage summary, the CP attention timers and bytes in
  Megatron's log, and writes a torch_dist checkpoint (whose writer spawns a process that re-imports
  the script);
* that checkpoint resumes under the plugin's entry at CP 2 with "mesh tasp", same next loss;
* bf16 + distributed optimizer + full recompute at CP 4 (Mesh 2x2) matches the same at CP 1 within
  bf16 tolerance, and its metrics JSON lines carry the losses, bytes and tiles;
* PP 2 x CP 2 logs the losses of PP 2 x CP 1;
* bad settings stop both scripts at start-up with one message and status 2, so does a missing
  dataset; killing the launcher kills every rank; Ctrl-C (or SIGTERM) stops them with one line and
  status 130 (143).

(TASP with selective recompute, masks and the Ulysses hybrids through pretrain(): see
tests/megatron/test_megatron_pretrain_masks.py.)

The runs are the expensive part (each process imports Megatron), so one module-scoped fixture
runs them all once and the tests assert on their logs. ``--megatron-matrix`` adds every plugin
mode x {bf16 + distributed optimizer + full recompute, fp16 + selective recompute, TP 2 + sequence
parallelism + distributed optimizer} through both scripts.

``MEGATRON_LM_DIR=/path/to/Megatron-LM`` runs that checkout's pretrain_gpt.py instead of
tests/megatron/megatron_lm/pretrain_gpt.py, a small stand-in written for these tests (the megatron-core
wheel and source distribution do not ship the file).
"""

import json
import os
import re
import signal
import subprocess
import sys
import time

import psutil
import pytest
from helpers import (assert_losses_equal, run_ok, MEGATRON_LM_SCRIPT, PRETRAIN, ROOT, free_port, kill_process_tree, losses, run_all,
                          run_config)

pytest.importorskip("megatron.core", reason="needs megatron-core (scripts/setup_env.sh installs it)")

# the fixture's runs count against the first test's timeout
pytestmark = [pytest.mark.megatron, pytest.mark.slow, pytest.mark.timeout(1500)]

CONFIG = os.path.join(ROOT, "configs", "gpt_tiny_cpu.yaml")
ITERS = 3
BF16 = ("--bf16", "--use-distributed-optimizer", "--recompute-granularity", "full", "--recompute-method", "uniform",
        "--recompute-num-layers", "1")
FP32_RTOL = 2e-6  # fp32: CP changes the summation order only
BF16_RTOL = 2e-3  # bf16 has 8 significant bits; the loss itself is computed in fp32


def run(entry: str, nproc: int, cp: int, modes: str, *flags: str, timeout: float = 240) -> tuple[int, str]:
    """Run an entry script ("pretrain": the plugin's, "megatron-lm": Megatron-LM's pretrain_gpt.py)
    on configs/gpt_tiny_cpu.yaml for ITERS iterations; return (exit status, combined output)."""
    script = () if entry == "pretrain" else (MEGATRON_LM_SCRIPT,)
    return run_config(CONFIG, nproc, cp, modes, "--train-iters", str(ITERS), *flags, script=script, timeout=timeout)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp("ckpt"))
    metrics = str(tmp_path_factory.mktemp("metrics"))
    plan = {
        "cp1": ("pretrain", 1, 1, "mesh"),
        # a torch_dist checkpoint at iteration 2 (its writer spawns a process that re-imports the script)
        "megatron-lm": ("megatron-lm", 4, 4, "mesh ring", "--mesh-tile-shape", "1x4", "--mesh-schedule", "lockstep",
                        "--save", ckpt, "--save-interval", "2", "--timing-log-level", "2", "--log-cp-attention-bytes"),
        "resume": ("pretrain", 2, 2, "mesh tasp", "--load", ckpt, "--ckpt-step", "2"),
        "cp1_bf16": ("pretrain", 1, 1, "mesh", *BF16),
        "mesh_bf16": ("pretrain", 4, 4, "mesh", "--mesh-tile-shape", "2x2", *BF16, "--cp-metrics-dir", metrics),
        # pipeline stages initialise their layers from their own seeds: compare PP 2 with PP 2
        "pp2_cp1": ("pretrain", 2, 1, "ring", "--pipeline-model-parallel-size", "2"),
        "pp2_cp2": ("pretrain", 4, 2, "mesh tasp", "--pipeline-model-parallel-size", "2"),
        # bad settings: each must stop its script at start-up
        "bad_mode": ("pretrain", 1, 1, "allgather"),
        "bad_tile": ("megatron-lm", 2, 2, "mesh", "--mesh-tile-shape", "3x2"),
    }
    out = run_all(run, plan, together=("cp1", "cp1_bf16", "bad_mode", "bad_tile"), then_together=("resume", "pp2_cp1"))
    out["metrics_dir"] = metrics
    return out


def test_cp1_runs_megatrons_own_attention(runs):
    """CP 1 under the plugin's spec is Megatron's own attention: nothing of the plugin's runs."""
    text = run_ok(runs, "cp1")
    assert sorted(losses(text)) == list(range(1, ITERS + 1))
    assert "megatron_mesh: pipeline stage" not in text


def test_megatron_lm_script_takes_the_plugin_flags(runs):
    """Megatron-LM's pretrain_gpt.py, unmodified, with --mesh-tile-shape 1x4 --mesh-schedule lockstep
    on its command line: the summary names them, the losses are CP 1's, the timers and bytes are
    in Megatron's log, and the torch_dist checkpoint is written."""
    text = run_ok(runs, "megatron-lm")
    want = losses(run_ok(runs, "cp1"))
    assert_losses_equal(losses(text), want, rel=FP32_RTOL)
    assert ("megatron_mesh: pipeline stage 1/1: layer 1: mesh (CP 4, tile 1x4, schedule lockstep, backward auto, "
            "contiguous q, kernel auto); layer 2: ring (CP 4, zigzag ring, kernel auto)") in text
    for timer in ("cp-attention-compute", "cp-attention-comm"):  # (min, max) over ranks, per iteration
        assert len(re.findall(rf"{timer} \.+: \((\d+\.\d+), (\d+\.\d+)\)", text)) == ITERS, timer
    # Mesh 1x4 and ring move the same bytes on every rank: 2 layers x 2 micro-batches, forward + backward
    sent = re.findall(r"cp attention bytes per iteration \(min, max\) across ranks: sent \(([\d.]+ \w+), ([\d.]+ \w+)\)",
                      text)
    assert len(sent) == ITERS and all(lo == hi == sent[0][0] != "0 B" for lo, hi in sent), sent
    assert "successfully saved checkpoint from iteration       2" in text


def test_checkpoint_of_megatron_lm_script_resumes_under_other_mode_and_cp(runs):
    text = run_ok(runs, "resume")
    assert "loading distributed checkpoint" in text and "at iteration 2" in text
    assert "layer 1: mesh (CP 2" in text and "layer 2: tasp (CP 2" in text
    got = losses(text)
    assert sorted(got) == [3], got  # only the iteration after the checkpoint runs
    assert got[3] == pytest.approx(losses(run_ok(runs, "cp1"))[3], rel=2e-6)


def test_bf16_distributed_optimizer_full_recompute_match_cp1(runs):
    want, got = losses(run_ok(runs, "cp1_bf16")), losses(run_ok(runs, "mesh_bf16"))
    assert_losses_equal(got, want, rel=BF16_RTOL)
    fp32 = losses(run_ok(runs, "cp1"))
    assert want[2] != fp32[2]  # the bf16 runs did run in bf16
    assert "use_distributed_optimizer=True" in runs["mesh_bf16"][1]


def test_metrics_json_lines_carry_loss_time_bytes_and_tiles(runs):
    text = run_ok(runs, "mesh_bf16")
    files = sorted(os.listdir(runs["metrics_dir"]))
    assert files == [f"rank{r}.jsonl" for r in range(4)], files
    logged = losses(text)
    for name in files:
        with open(os.path.join(runs["metrics_dir"], name)) as f:
            recs = [json.loads(line) for line in f]
        layers = [r for r in recs if r["kind"] == "layer"]
        assert [(r["layer"], r["mode"], r["cp"], r["tile"]) for r in layers] == [(1, "mesh", 4, "2x2"), (2, "mesh", 4, "2x2")]
        its = [r for r in recs if r["kind"] == "iteration"]
        assert [r["iteration"] for r in its] == list(range(1, ITERS + 1))
        loss = {r["iteration"]: r["losses"]["lm loss"] for r in its}
        # each iteration's own loss; Megatron's log line at iteration 2 averages iterations 1 and 2
        # (its first log line does not reset the running sums)
        assert loss[1] == pytest.approx(logged[1], rel=1e-6) and loss[3] == pytest.approx(logged[3], rel=1e-6)
        assert (loss[1] + loss[2]) / 2 == pytest.approx(logged[2], rel=1e-6)
        for r in its:
            assert r["time_ms"] > 0 and r["peak_memory"] > 0 and r["memory_kind"] == "max RSS"
        # every iteration moves the same attention bytes (full recompute runs the attention twice)
        assert len({r["bytes_sent"] for r in its}) == 1 and its[0]["bytes_sent"] > 0


def test_pipeline_parallel_with_cp_losses_equal_cp1(runs):
    """PP 2 x CP 2 (one plugin layer per stage, "mesh tasp") logs the losses of PP 2 x CP 1; each
    stage prints its own summary line."""
    text = run_ok(runs, "pp2_cp2")
    assert_losses_equal(losses(text), losses(run_ok(runs, "pp2_cp1")), rel=FP32_RTOL)
    assert "pipeline stage 1/2: layer 1: mesh (CP 2" in text and "pipeline stage 2/2: layer 2: tasp (CP 2" in text


def test_bad_flag_stops_the_plugin_entry_with_one_message(runs):
    rc, text = runs["bad_mode"]
    assert rc == 2, text[-3000:]  # the ranks' start-up error status, returned by the launcher
    assert text.count("megatron_mesh: error:") == 1
    assert ("megatron_mesh: error: --cp-comm-type 'allgather' is not a context-parallel mode (Transformer Engine "
            "spells it 'all_gather')") in text
    assert "training ..." not in text  # it stopped before Megatron initialised anything
    assert_start_up_error_alone(text)


def test_megatron_lm_script_bad_tile_fails_once_at_startup(runs):
    """Two ranks, CP 2 with tile 3x2: rank 0 prints the error once, before anything is
    initialised; every rank that gets there exits 2 (the other is stopped by torchrun), and so
    does the launcher."""
    rc, text = runs["bad_tile"]
    assert rc == 2, text[-3000:]
    assert text.count("megatron_mesh: error:") == 1, text[-3000:]
    assert ("megatron_mesh: error: --cp-comm-type mesh at --context-parallel-size 2 with --mesh-tile-shape 3x2: tile 3x2 "
            "does not fit CP size 2: a * b must equal the CP size; allowed tiles: 1x2, 2x1") in text
    assert "initializing torch distributed" not in text and "Traceback" not in text
    assert_start_up_error_alone(text)


def assert_start_up_error_alone(text: str) -> None:
    """Nothing around a start-up error's one line that repeats it: not torchrun's stopping of the
    other ranks and status line, nor Megatron's warnings that TE / Apex are not installed (which a
    CPU machine cannot install: cpu_compat hides them)."""
    for noise in ("closing signal", "failed (exitcode", "UserWarning", "is not installed"):
        assert noise not in text, text[-3000:]


def test_missing_dataset_stops_at_start_up_with_one_line(tmp_path):
    """The document config before scripts/make_doc_dataset.py has written its data: one line names
    the missing files and the command that writes them, status 2 -- not an AssertionError per rank
    while Megatron builds the datasets."""
    prefix = str(tmp_path / "tiny_docs")
    rc, text = run_config(os.path.join(ROOT, "configs", "gpt_tiny_cpu_docs.yaml"), 2, 2, "mesh", "--train-iters", "1",
                          env={"DOC_DATA": prefix}, timeout=180)
    assert rc == 2, text[-3000:]
    assert text.count("megatron_mesh: error:") == 1, text[-3000:]
    assert (f"megatron_mesh: error: --data-path {prefix}: no dataset there, {prefix}.bin, {prefix}.idx not found; write "
            f"the documents first: ") in text and f"scripts/make_doc_dataset.py {prefix} (DOC_DATA" in text
    assert "Traceback" not in text and "AssertionError" not in text and "initializing torch distributed" not in text
    assert_start_up_error_alone(text)


def test_killing_the_launcher_kills_every_rank(tmp_path):
    """kill -9 of the process scripts/pretrain_gpt.sh became (torchrun's launcher) takes its ranks
    with it, although torchrun starts each in a session of its own."""
    env = dict(os.environ, NPROC="2", CP="2", CP_COMM_TYPE="ring", MASTER_PORT=str(free_port()),
               PYTHON=sys.executable, OMP_NUM_THREADS="1")
    cmd = ["bash", PRETRAIN, CONFIG, "--train-iters", "100000", "--cp-metrics-dir", str(tmp_path)]
    launcher = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline, workers = time.monotonic() + 120, []
        while time.monotonic() < deadline and len(workers) < 2:
            time.sleep(0.5)
            workers = [p for p in psutil.Process(launcher.pid).children(recursive=True)
                       if "megatron_mesh.megatron.pretrain_gpt" in " ".join(p.cmdline())]
        assert len(workers) == 2, "the ranks did not start"
        time.sleep(3)  # past their start-up
        assert all(w.is_running() for w in workers)
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait(timeout=30)
        gone, alive = psutil.wait_procs(workers, timeout=30)
        assert not alive, f"ranks outlived their launcher: {[p.pid for p in alive]}"
    finally:
        kill_process_tree(launcher.pid)


def _iterations_started(path, launcher, timeout: float = 180) -> None:
    """Wait until the run writing its output to ``path`` has logged iteration 2 (past its start-up)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and launcher.poll() is None:
        with open(path) as f:
            if re.search(r"iteration\s+2/", f.read()):
                return
        time.sleep(0.5)
    pytest.fail(f"the run did not reach iteration 2 (exit {launcher.poll()}):\n{open(path).read()[-3000:]}")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_stops_every_rank_with_one_line(tmp_path, sig):
    """Ctrl-C (SIGINT to the launcher, which torchrun forwards to the ranks) or SIGTERM during
    training: every rank stops, the launcher says so in one line and exits 128 + the signal (130,
    143); no rank prints a traceback, nor does torchrun."""
    env = dict(os.environ, NPROC="2", CP="2", CP_COMM_TYPE="ring", MASTER_PORT=str(free_port()),
               PYTHON=sys.executable, OMP_NUM_THREADS="1")
    log = tmp_path / "out.log"
    with open(log, "w") as out:
        launcher = subprocess.Popen(["bash", PRETRAIN, CONFIG, "--train-iters", "100000"], cwd=ROOT, env=env,
                                    stdout=out, stderr=subprocess.STDOUT)
    try:
        _iterations_started(log, launcher)
        ranks = [p for p in psutil.Process(launcher.pid).children()
                 if "megatron_mesh.megatron.pretrain_gpt" in " ".join(p.cmdline())]
        assert len(ranks) == 2, ranks
        below = psutil.Process(launcher.pid).children(recursive=True)  # the ranks and their data-loader workers
        before = log.stat().st_size
        os.kill(launcher.pid, sig)
        rc = launcher.wait(timeout=60)
        gone, alive = psutil.wait_procs(below, timeout=30)
        assert not alive, f"processes outlived the interrupt: {[(p.pid, p.name()) for p in alive]}"
        text = log.read_text()
        tail = text[before:] if text[before - 1:before] == "\n" else text[before:].partition("\n")[2]  # whole lines
        after = [line for line in tail.splitlines() if not re.search(r"iteration\s+\d+/", line)]
        assert rc == 128 + sig, (rc, after)
        assert after == [f"megatron_mesh.megatron.launch: interrupted ({sig.name}): stopped torchrun and its 2 rank(s)"], \
            after[-40:]
    finally:
        kill_process_tree(launcher.pid)


# -- opt-in: the whole matrix -----------------------------------------------------------------------------
MATRIX = {  # name -> (flags for every run of the row, processes per CP rank)
    "bf16-distopt-fullrecompute": (BF16, 1),
    "fp16-selectiverecompute": (("--fp16", "--initial-loss-scale", "4096", "--recompute-granularity", "selective"), 1),
    "tp2-sp-distopt": (("--tensor-model-parallel-size", "2", "--sequence-parallel", "--use-distributed-optimizer"), 2),
}
_REFERENCES: dict = {}


@pytest.mark.megatron_matrix
@pytest.mark.parametrize("entry", ["pretrain", "megatron-lm"])
@pytest.mark.parametrize("mode", ["mesh", "tasp", "ring"])
@pytest.mark.parametrize("row", sorted(MATRIX))
def test_matrix_cp4_matches_cp1(row, mode, entry):
    flags, per_cp = MATRIX[row]
    if row not in _REFERENCES:
        rc, text = run("pretrain", per_cp, 1, "mesh", *flags)
        assert rc == 0, text[-6000:]
        _REFERENCES[row] = losses(text)
    rc, text = run(entry, 4 * per_cp, 4, mode, *flags, timeout=400)
    assert rc == 0, text[-6000:]
    assert_losses_equal(losses(text), _REFERENCES[row], rel=BF16_RTOL)
    assert f"layers 1-2: {mode} (CP 4" in text
