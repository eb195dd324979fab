"""Running the project's shell scripts from tests: a timeout kills torchrun and every rank it
started, not only the shell, and fails the test."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from megatron_mesh.megatron.launch import free_port, kill_process_tree  # noqa: F401 -- free_port for the tests

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_script(cmd: list[str], env: dict[str, str], timeout: float) -> tuple[int, str]:
    """(exit status, stdout + stderr) of ``cmd`` run from the repository root; fails the test,
    with the output's tail, if it runs longer than ``timeout`` seconds."""
    with subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as p:
        try:
            out, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_process_tree(p.pid)
            out, _ = p.communicate()
            pytest.fail(f"{' '.join(cmd)} did not finish in {timeout:g} s:\n{out[-4000:]}")
    return p.returncode, out


PRETRAIN = os.path.join(ROOT, "scripts", "pretrain_gpt.sh")
RUN_SCRIPT = os.path.join(ROOT, "scripts", "run_megatron_script.sh")
# Megatron-LM's pretrain_gpt.py: the checkout's when MEGATRON_LM_DIR names one, else the tests' stand-in
MEGATRON_LM_SCRIPT = (os.path.join(os.environ["MEGATRON_LM_DIR"], "pretrain_gpt.py") if os.environ.get("MEGATRON_LM_DIR")
                      else os.path.join(ROOT, "tests", "megatron_lm", "pretrain_gpt.py"))
_ITERATION = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?\| lm loss: ([0-9.E+-]+) \|")


def run_config(config: str, nproc: int, cp: int, modes: str, *flags: str, script: tuple[str, ...] = (),
               env: dict[str, str] | None = None, timeout: float = 240) -> tuple[int, str]:
    """(exit status, output) of one training run on ``config``: the plugin's scripts/pretrain_gpt.sh,
    or with ``script=(SCRIPT.py,)`` scripts/run_megatron_script.sh on that Megatron script; NPROC,
    CP and CP_COMM_TYPE from the arguments, a free port, this interpreter; ``env`` adds variables."""
    full_env = dict(os.environ, NPROC=str(nproc), CP=str(cp), CP_COMM_TYPE=modes, MASTER_PORT=str(free_port()),
                    PYTHON=sys.executable, OMP_NUM_THREADS="1", **(env or {}))
    full_env.pop("BACKEND", None)
    head = [RUN_SCRIPT, *script, config] if script else [PRETRAIN, config]
    return run_script(["bash", *head, *flags], full_env, timeout)


def losses(output: str) -> dict[int, float]:
    """Iteration -> 'lm loss' from Megatron's iteration log lines (printed with 7 digits)."""
    found: dict[int, float] = {}
    for it, loss in _ITERATION.findall(output):
        found.setdefault(int(it), float(loss))
    return found


def run_all(run, plan: dict, together: tuple[str, ...] = ()) -> dict:
    """``{name: run(*plan[name])}``; the runs named in ``together`` (single-process references,
    one core each) run two at a time, the others one after the other."""
    from concurrent.futures import ThreadPoolExecutor

    plan = dict(plan)
    with ThreadPoolExecutor(2) as pool:
        futures = {name: pool.submit(run, *plan.pop(name)) for name in together}
        out = {name: f.result() for name, f in futures.items()}
    out.update({name: run(*spec) for name, spec in plan.items()})
    return out
