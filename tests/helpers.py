"""What many tests share: numerical tolerances, running the project's shell scripts (a timeout kills
torchrun and every rank it started, not only the shell, and fails the test), reading their losses,
and reading PNG sizes. One module, so a tolerance or a log format changes in one place."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

from megatron_mesh.megatron.launch import free_port, kill_process_tree  # noqa: F401 -- free_port for the tests

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Transformer Engine's context-parallel test tolerances (atol, rtol); bf16 looser for GQA/MQA, where
# several query heads' gradients are summed into one KV head
TOLERANCES = {torch.float32: (2e-5, 2e-5), torch.float64: (1e-10, 1e-10), torch.float16: (5e-3, 5e-3)}


def tolerance(dtype: torch.dtype, heads: int = 4, kv_heads: int = 4) -> tuple[float, float]:
    """(atol, rtol) for outputs and gradients of ``dtype``."""
    if dtype == torch.bfloat16:
        return (2.5e-2, 2.5e-2) if heads == kv_heads else (3.5e-2, 3.5e-2)
    return TOLERANCES[dtype]


def png_size(path) -> tuple[int, int]:
    """(width, height) in pixels from a PNG's IHDR chunk (no image library needed)."""
    head = open(path, "rb").read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR", head
    return int.from_bytes(head[16:20], "big"), int.from_bytes(head[20:24], "big")


def run_script(cmd: list[str], env: dict[str, str], timeout: float) -> tuple[int, str]:
    """(exit status, stdout + stderr) of ``cmd`` run from the repository root; fails the test,
    with the output's tail, if it runs longer than ``timeout`` seconds -- and with where each of its
    processes waited: every Python process in it prints its threads' stacks first
    (:func:`dump_stacks`)."""
    env = dict(env, PYTHONFAULTHANDLER="1")
    with subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as p:
        try:
            out, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            dump_stacks(p.pid)
            kill_process_tree(p.pid)
            out, _ = p.communicate()
            pytest.fail(f"{' '.join(cmd)} did not finish in {timeout:g} s (each process's stacks at the end):\n"
                        f"{out[-60000:]}")
    return p.returncode, out


def dump_stacks(pid: int, wait: float = 3.0) -> None:
    """SIGABRT to every Python process below ``pid`` (a training run's launcher, ranks and their
    data-loader workers; ``pid`` itself where it has none): under PYTHONFAULTHANDLER each prints
    every thread's Python stack to its stderr as it dies, so a hung run says where each rank waits
    (a collective, a receive, a lock)."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = root.children(recursive=True) or [root]
    except psutil.NoSuchProcess:
        return
    for proc in procs:
        try:
            if "python" in proc.name().lower() or proc is root:
                proc.send_signal(signal.SIGABRT)
        except psutil.NoSuchProcess:
            pass
    time.sleep(wait)


PRETRAIN = os.path.join(ROOT, "scripts", "pretrain_gpt.sh")
RUN_SCRIPT = os.path.join(ROOT, "scripts", "run_megatron_script.sh")
# Megatron-LM's pretrain_gpt.py: the checkout's when MEGATRON_LM_DIR names one, else the tests' stand-in
MEGATRON_LM_SCRIPT = (os.path.join(os.environ["MEGATRON_LM_DIR"], "pretrain_gpt.py") if os.environ.get("MEGATRON_LM_DIR")
                      else os.path.join(ROOT, "tests", "megatron", "megatron_lm", "pretrain_gpt.py"))
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


def run_nodes(config: str, nproc: int, cp: int, nodes: list[tuple[str, tuple[str, ...]]],
              env: dict[str, str] | None = None, timeout: float = 240, during=None) -> list[tuple[int, str]]:
    """[(exit status, output)] of one training run over ``len(nodes)`` "nodes" on this machine: one
    scripts/pretrain_gpt.sh per node (NNODES, NODE_RANK, one MASTER_PORT), ``nproc`` processes
    each, started together; ``nodes``: each node's (CP_COMM_TYPE, extra flags) -- as a user starts
    a job on several machines, the same command on each unless the test says otherwise. ``during``:
    called with the launchers' processes once all have started (e.g. to kill one of their ranks)."""
    port = str(free_port())
    procs = []
    for rank, (modes, flags) in enumerate(nodes):
        full_env = dict(os.environ, NPROC=str(nproc), CP=str(cp), CP_COMM_TYPE=modes, MASTER_PORT=port,
                        MASTER_ADDR="127.0.0.1", NNODES=str(len(nodes)), NODE_RANK=str(rank), PYTHON=sys.executable,
                        OMP_NUM_THREADS="1", **(env or {}))
        full_env.pop("BACKEND", None)
        procs.append(subprocess.Popen(["bash", PRETRAIN, config, *flags], cwd=ROOT, env=full_env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    out = []
    deadline = time.monotonic() + timeout  # one for the whole job, not one per node
    try:
        if during is not None:
            during(procs)
        for p in procs:
            text, _ = p.communicate(timeout=max(0.0, deadline - time.monotonic()))
            out.append((p.returncode, text))
    except subprocess.TimeoutExpired:
        tails = []
        for p in procs:
            kill_process_tree(p.pid)
            tails.append(p.communicate()[0][-3000:])
        pytest.fail(f"{len(nodes)} nodes of {config} did not finish in {timeout:g} s:\n" + "\n---\n".join(tails))
    return out


def losses(output: str) -> dict[int, float]:
    """Iteration -> 'lm loss' from Megatron's iteration log lines (printed with 7 digits)."""
    found: dict[int, float] = {}
    for it, loss in _ITERATION.findall(output):
        found.setdefault(int(it), float(loss))
    return found


def run_all(run, plan: dict, together: tuple[str, ...] = (), then_together: tuple[str, ...] = ()) -> dict:
    """``{name: run(*plan[name])}``; the runs named in ``together`` (single-process references,
    one core each, and runs that stop at start-up) run two at a time first, then the others one
    after the other, then those in ``then_together`` two at a time (two-process runs, among them
    the resumes of checkpoints the others wrote: two at once took ~5 s less than one after the
    other on 2 cores; 4-process runs keep both cores busy, two at once gained ~3 s)."""
    from concurrent.futures import ThreadPoolExecutor

    def two_at_a_time(names):
        with ThreadPoolExecutor(2) as pool:
            futures = {name: pool.submit(run, *plan[name]) for name in names}
            return {name: f.result() for name, f in futures.items()}

    out = two_at_a_time(together)
    out.update({name: run(*spec) for name, spec in plan.items() if name not in (*together, *then_together)})
    out.update(two_at_a_time(then_together))
    return out


def run_ok(runs: dict, name: str) -> str:
    """The output of run ``name`` of ``runs`` ({name: (exit status, output)}); fails the test with
    the output's tail if the run failed."""
    rc, text = runs[name]
    assert rc == 0, f"{name} run failed (exit {rc}):\n{text[-6000:]}"
    return text


def assert_losses_equal(got: dict, want: dict, rel: float, iterations=None) -> None:
    """``got`` has exactly ``iterations`` (default: ``want``'s) with losses equal to ``want``'s
    within relative ``rel``."""
    iterations = iterations or sorted(want)
    assert sorted(got) == list(iterations), (got, want)
    for it in iterations:
        assert got[it] == pytest.approx(want[it], rel=rel), (it, got[it], want[it])


def assert_blocks_exact(mask, layout) -> None:
    """Every block (query chunk i x key chunk j of ``layout``) classified under ``mask``: the kept
    rows and columns hold every allowed pair, the kind's pattern on them is exactly the mask."""
    from megatron_mesh.plan import classify_block

    P = layout.world_size
    pos = [[a + t for _, a, n in layout.runs(r) for t in range(n)] for r in range(P)]
    for i in range(P):
        for j in range(P):
            c = classify_block(mask, tuple((a, n) for _, a, n in layout.runs(i)),
                               (tuple((a, n) for _, a, n in layout.runs(j)),))
            allowed = {(x, y) for x in pos[i] for y in pos[j] if mask.allows(x, y)}
            if c is None:
                assert not allowed, (i, j, mask)
                continue
            rows = [pos[i][t] for a, b in c.rows for t in range(a, b)]
            cols = [pos[j][t] for a, b in c.cols[0] for t in range(a, b)]
            if c.kind == "full":
                computed = {(x, y) for x in rows for y in cols}
            elif c.kind == "causal":
                assert rows == cols
                computed = {(x, y) for r, x in enumerate(rows) for y in cols[:r + 1]}
            else:
                computed = {(x, y) for x in rows for y in cols if mask.allows(x, y)}
            assert computed == allowed and c.pairs == len(allowed), (i, j, c, mask)


PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "megatron_mesh")


def str_literals(node) -> list[str]:
    """The string constants of an AST node that is one, or a tuple / list / set of them."""
    import ast

    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [x for e in node.elts for x in str_literals(e)]
    return []


def package_nodes(outside: str | None = None):
    """Every AST node of the package's files outside the folder ``outside`` (e.g. ``plan/modes``;
    None: all of them), with its ``path:line``."""
    import ast

    for root, _, files in os.walk(PACKAGE):
        if outside is not None and os.path.join(*outside.split("/")) in root:
            continue
        for f in sorted(x for x in files if x.endswith(".py")):
            path = os.path.join(root, f)
            for node in ast.walk(ast.parse(open(path).read())):
                yield f"{os.path.relpath(path, PACKAGE)}:{getattr(node, 'lineno', 0)}", node


def package_comparisons(outside: str):
    """Every comparison (``==``, ``in``, ...) and ``startswith`` / ``endswith`` call outside the
    folder ``outside`` (:func:`package_nodes`): (``path:line``, node, operands) -- what a registry
    test searches for names compared outside their owner's files."""
    import ast

    for where, node in package_nodes(outside):
        if isinstance(node, ast.Compare):
            yield where, node, [node.left, *node.comparators]
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", "") in ("startswith", "endswith"):
            yield where, node, [node.func.value, *node.args]
