"""Megatron's real pretrain() loop through scripts/pretrain_gpt.sh on configs/gpt_tiny_cpu.yaml
(gloo, CPU): three iterations at CP 1 and at CP 4 under each plugin mode log the same losses; a
checkpoint written under CP 4 / mesh resumes under CP 2 with the per-layer list "mesh tasp" and
logs the same next-iteration loss; pipeline parallelism 2 x CP 2 logs the losses of PP 2 x CP 1;
a bad flag stops the script with a clear error.

The runs are the expensive part (each process imports Megatron), so one module-scoped fixture
runs them all once and the tests assert on its logs.
"""

import os
import re
import sys

import pytest
from scripts_util import ROOT, free_port, run_script

pytest.importorskip("megatron.core", reason="needs megatron-core (scripts/setup_env.sh installs it)")

# the fixture's runs (up to 150 s each) count against the first test's timeout
pytestmark = [pytest.mark.megatron, pytest.mark.slow, pytest.mark.timeout(1200)]

SCRIPT = os.path.join(ROOT, "scripts", "pretrain_gpt.sh")
CONFIG = os.path.join(ROOT, "configs", "gpt_tiny_cpu.yaml")
ITERS = 3
_ITERATION = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?\| lm loss: ([0-9.E+-]+) \|")


def run(nproc: int, cp: int, modes: str, *flags: str, timeout: float = 150) -> tuple[int, str]:
    """Run the shell script; return (exit status, combined output)."""
    env = dict(os.environ, NPROC=str(nproc), CP=str(cp), CP_COMM_TYPE=modes, MASTER_PORT=str(free_port()),
               PYTHON=sys.executable, OMP_NUM_THREADS="1")
    env.pop("BACKEND", None)
    return run_script(["bash", SCRIPT, CONFIG, "--train-iters", str(ITERS), *flags], env, timeout)


def losses(output: str) -> dict[int, float]:
    """Iteration -> 'lm loss' from Megatron's iteration log lines (printed with 7 digits)."""
    found: dict[int, float] = {}
    for it, loss in _ITERATION.findall(output):
        found.setdefault(int(it), float(loss))
    return found


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp("ckpt"))
    plan = {
        "cp1": (1, 1, "mesh"),
        "mesh": (4, 4, "mesh", "--mesh-tile-shape", "2x2", "--save", ckpt, "--save-interval", "2"),
        "tasp": (4, 4, "tasp"),
        "ring": (4, 4, "ring"),
        "resume": (2, 2, "mesh tasp", "--load", ckpt, "--ckpt-step", "2"),
        # pipeline stages initialise their layers from their own seeds: compare PP 2 with PP 2
        "pp2_cp1": (2, 1, "ring", "--pipeline-model-parallel-size", "2"),
        "pp2_cp2": (4, 2, "mesh tasp", "--pipeline-model-parallel-size", "2"),
    }
    out = {}
    for name, (nproc, cp, modes, *flags) in plan.items():
        rc, text = run(nproc, cp, modes, *flags)
        out[name] = (rc, text)
    return out


def _ok(runs, name):
    rc, text = runs[name]
    assert rc == 0, f"{name} run failed (exit {rc}):\n{text[-6000:]}"
    return text


def test_cp1_run_logs_every_iteration(runs):
    text = _ok(runs, "cp1")
    assert sorted(losses(text)) == list(range(1, ITERS + 1))
    assert "megatron_mesh: layer 1 runs single-rank attention (CP 1" in text


@pytest.mark.parametrize("mode, detail", [("mesh", "mesh (CP 4, tile 2x2"), ("tasp", "tasp (CP 4"),
                                          ("ring", "ring (CP 4")])
def test_cp4_losses_equal_cp1(runs, mode, detail):
    text = _ok(runs, mode)
    want = losses(_ok(runs, "cp1"))
    got = losses(text)
    assert sorted(got) == sorted(want), got
    for it in want:
        assert got[it] == pytest.approx(want[it], rel=2e-6), (mode, it, got[it], want[it])
    assert f"megatron_mesh: layer 1 runs {detail}" in text and f"megatron_mesh: layer 2 runs {detail}" in text


def test_pipeline_parallel_with_cp_losses_equal_cp1(runs):
    """PP 2 x CP 2 (one plugin layer per stage, "mesh tasp") logs the losses of PP 2 x CP 1."""
    text = _ok(runs, "pp2_cp2")
    want, got = losses(_ok(runs, "pp2_cp1")), losses(text)
    assert sorted(got) == sorted(want) == list(range(1, ITERS + 1)), (got, want)
    for it in want:
        assert got[it] == pytest.approx(want[it], rel=2e-6), (it, got[it], want[it])
    assert "megatron_mesh: layer 1 runs mesh (CP 2" in text and "megatron_mesh: layer 2 runs tasp (CP 2" in text


def test_checkpoint_resumes_under_other_mode_and_cp(runs):
    saved = _ok(runs, "mesh")
    assert "saving checkpoint at iteration       2" in saved
    text = _ok(runs, "resume")
    assert "loading distributed checkpoint" in text and "at iteration 2" in text
    assert "megatron_mesh: layer 1 runs mesh (CP 2" in text and "megatron_mesh: layer 2 runs tasp (CP 2" in text
    got, want = losses(text), losses(_ok(runs, "cp1"))
    assert sorted(got) == [3], got  # only the iteration after the checkpoint runs
    assert got[3] == pytest.approx(want[3], rel=2e-6)
    assert got[3] == pytest.approx(losses(saved)[3], rel=2e-6)


def test_bad_flag_stops_the_script_with_a_clear_error():
    rc, text = run(1, 1, "allgather", timeout=180)
    assert rc != 0
    assert ("megatron_mesh: error: --cp-comm-type 'allgather' is not a context-parallel mode (Transformer Engine "
            "spells it 'all_gather')") in text
    assert "training ..." not in text  # it stopped before Megatron initialised anything
