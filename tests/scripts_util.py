"""Running the project's shell scripts from tests: a timeout kills torchrun and every rank it
started, not only the shell, and fails the test."""

from __future__ import annotations

import os
import subprocess

import pytest

from megatron_mesh.launch import free_port, kill_process_tree  # noqa: F401 -- free_port for the tests

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
