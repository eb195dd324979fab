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


class HungRunRetried(UserWarning):
    """A training run hung and was run again (:func:`run_script`'s ``retries_after_hang``): the
    warnings summary at the end of pytest's output carries where each of its processes waited."""


def run_script(cmd: list[str], env: dict[str, str], timeout: float, retries_after_hang: int = 0) -> tuple[int, str]:
    """(exit status, stdout + stderr) of ``cmd`` run from the repository root; fails the test, with
    the output's tail, if it runs longer than ``timeout`` seconds -- and with where each of its
    processes waited: every Python process in it prints its threads' stacks first
    (:func:`dump_stacks`), and the message ends with each one's innermost frames, named by its
    role (a CI log keeps only the tail of a failure). ``retries_after_hang``: how many times a run
    that hangs is started again before the test fails, each hang reported as a
    :class:`HungRunRetried` warning with those frames. Why: one training run in ~100 of a CI
    suite hung once in 80 stops (stop 79: a rank waited for its data-loader worker for 300 s, 9
    tests errored, nothing landed) and hundreds of local runs never reproduced it; a run that
    hangs twice still fails, and the warning keeps the first hang's evidence in the log."""
    env = dict(env, PYTHONFAULTHANDLER="1")
    with subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as p:
        try:
            out, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            dumped = dump_stacks(p.pid)
            kill_process_tree(p.pid)
            out, _ = p.communicate()
            where = where_each_waited(out, dumped)
            if retries_after_hang > 0:
                import warnings

                warnings.warn(HungRunRetried(f"{' '.join(cmd)} hung for {timeout:g} s and was run again; "
                                             f"its output ended:\n{out[-3000:]}\n{where}"))
                if "MASTER_PORT" in env:  # the hung run's store may still hold its port
                    env = dict(env, MASTER_PORT=str(free_port()))
                return run_script(cmd, env, timeout, retries_after_hang - 1)
            pytest.fail(f"{' '.join(cmd)} did not finish in {timeout:g} s (each process's stacks at the end):\n"
                        f"{out[-60000:]}\n{where}")
    return p.returncode, out


def dump_stacks(pid: int, wait: float = 3.0, each: float = 0.15) -> list[str]:
    """SIGABRT to every Python process from ``pid`` down (a training run's launcher, ranks and their
    data-loader workers), one after the other ``each`` seconds apart, children before their parents,
    the others frozen (SIGSTOP) meanwhile: signalled at once, their dumps came out interleaved; one
    by one unfrozen, the first death tore the rest down undumped (torchrun's teardown, the
    data-loader's SIGCHLD). Under PYTHONFAULTHANDLER each prints every thread's Python stack to its
    stderr as it dies, so a hung run says where each rank waits (a collective, a receive, a lock).
    Returns each signalled process's role, in signal order; what is left runs on (to be killed)."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []
    named = []  # every role first: a parent's death hands its children to another
    for proc in reversed(procs):  # the deepest first
        try:
            if _is_python(proc):
                named.append((proc, _role(proc, procs)))
            proc.send_signal(signal.SIGSTOP)
        except psutil.NoSuchProcess:
            pass
    roles = []
    for proc, role in named:
        try:
            proc.send_signal(signal.SIGABRT)  # pending until SIGCONT, then handled before anything else
            proc.send_signal(signal.SIGCONT)
            roles.append(role)
            time.sleep(each)
        except psutil.NoSuchProcess:
            pass
    for proc in procs:  # the rest (a shell) runs on, to be killed
        try:
            proc.send_signal(signal.SIGCONT)
        except psutil.NoSuchProcess:
            pass
    time.sleep(wait)
    return roles


def _is_python(proc) -> bool:
    """A Python process, PyTorch's data-loader workers included (they rename themselves
    'pt_data_worker')."""
    try:
        return "python" in os.path.basename(proc.cmdline()[0]).lower() or "python" in proc.name().lower()
    except (IndexError, Exception):  # noqa: BLE001 -- gone or unreadable: not one to dump
        return False


def _role(proc, procs) -> str:
    """'rank 2 (pid 123)', 'child of rank 2 (pid 456)' (a data-loader worker, a checkpoint writer)
    or the command line's start: how a stack dump names the process it came from."""
    try:
        rank = proc.environ().get("RANK")
        parent = proc.parent()
        parent_rank = parent.environ().get("RANK") if parent is not None and parent in procs else None
    except Exception:  # noqa: BLE001 -- gone, or not ours to read: the command line says enough
        rank = parent_rank = None
    if parent_rank is not None and parent_rank == rank:
        return f"child of rank {rank} (pid {proc.pid}: a data-loader worker or a checkpoint helper)"
    if rank is not None:
        return f"rank {rank} (pid {proc.pid})"
    try:
        return f"pid {proc.pid}: {' '.join(proc.cmdline())[:100]}".replace("\n", " ")
    except Exception:  # noqa: BLE001
        return f"pid {proc.pid}"


def where_each_waited(out: str, roles: list[str], frames: int = 3) -> str:
    """Where each faulthandler dump in ``out`` had its main thread (the one whose stack starts at
    ``<module>``; else the thread the signal hit): its innermost ``frames`` and its innermost frame
    in megatron_mesh or Megatron, under the role of the process that printed it
    (:func:`dump_stacks`' order); processes of one kind waiting at the same place share a line."""
    dumps = out.split("Fatal Python error: Aborted")[1:]
    lines = [f"where each process waited ({len(dumps)} dumps, {len(roles)} processes signalled; innermost first):"]
    groups: list[tuple[str, str, list[str]]] = []  # (kind, place, roles)
    for i, dump in enumerate(dumps):
        role = roles[i] if len(dumps) == len(roles) else f"dump {i + 1}"
        place = _main_thread_place(dump, frames)
        kind = role.split(" (pid")[0]
        if groups and groups[-1][:2] == (kind, place):
            groups[-1][2].append(role)
        else:
            groups.append((kind, place, [role]))
    for kind, place, members in groups:
        who = members[0] if len(members) == 1 else f"{kind} x{len(members)} ({', '.join(m.split('(')[1].split(')')[0].split(':')[0] for m in members)})"
        lines.append(f"  {who}: {place}")
    return "\n".join(lines)


_FRAME = re.compile(r'File "([^"]+)", line (\d+) in (\S+)')


def _main_thread_place(dump: str, frames: int) -> str:
    threads = [t for t in re.split(r"\n(?:Current thread|Thread) 0x[0-9a-f]+ \(most recent call first\):", dump)[1:]]
    stacks = [[(os.path.basename(f), ln, fn, "megatron" in f) for f, ln, fn in _FRAME.findall(t.split("\n\n")[0])]
              for t in threads]
    stacks = [st for st in stacks if st]
    if not stacks:
        return "(no stack)"
    current = next((st for st, t in zip(stacks, threads) if t is threads[-1]), stacks[-1])
    main = next((st for st in stacks if any(fn == "<module>" for *_, fn, _ in st)), current)
    text = " <- ".join(f"{f}:{ln} {fn}" for f, ln, fn, _ in main[:frames])
    ours = next(((f, ln, fn) for f, ln, fn, m in main[frames:] if m), None)
    return text + (f" <- ... {ours[0]}:{ours[1]} {ours[2]}" if ours else "")


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
    return run_script(["bash", *head, *flags], full_env, timeout, retries_after_hang=1)


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
