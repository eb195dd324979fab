"""Running the project's shell scripts from tests: a timeout kills torchrun and every rank it
started, not only the shell, and fails the test."""

from __future__ import annotations

import os
import socket
import subprocess

import pytest

from megatron_mesh.launch import kill_process_tree

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
