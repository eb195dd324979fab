#!/usr/bin/env python
"""Run the same pretraining job under several context-parallel modes and write a side-by-side
report (Markdown table, CSV, PNG plots) of loss, time per iteration, attention bytes per rank
per step and peak memory.

Each mode is one real Megatron ``pretrain()`` run of the plugin's entry script, started with
torchrun (``python -m torch.distributed.run``) from this process; every run writes its metrics as
JSON lines (``--cp-metrics-dir``), which the report reads:

* ``baseline``  -- CP = 1 on one process (the reference loss curve),
* ``ring``, ``tasp``, ``mesh:auto``, ``mesh:AxB`` -- the plugin's modes at CP = --cp,
* ``p2p``, ``a2a``, ``all_gather``, ``a2a+p2p`` -- Transformer Engine's modes (GPU + TE only).

    python scripts/compare_cp_modes.py --config configs/gpt_tiny_cpu_compare.yaml --cp 4 --iters 6
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megatron_mesh.launch import free_port, kill_process_tree, training_command  # noqa: E402
from megatron_mesh.megatron import PLUGIN_MODES, TE_MODES  # noqa: E402 -- does not import Megatron
from megatron_mesh.report import RunResult, read_metrics, write_report  # noqa: E402


def _have_te() -> bool:
    probe = "import transformer_engine.pytorch"  # TE raises RuntimeError without CUDA: any failure means no
    return subprocess.run([sys.executable, "-c", probe], capture_output=True).returncode == 0


def default_modes(cp: int) -> list[str]:
    modes = ["baseline", "ring", "mesh:auto"]
    square = max(a for a in range(1, cp + 1) if cp % a == 0 and a * a <= cp)
    if square > 1:
        modes.append(f"mesh:{square}x{cp // square}")
    modes.append("tasp")
    if _have_te():
        modes += list(TE_MODES)
    return modes


def command(mode: str, args, metrics: str) -> tuple[list[str], dict[str, str], list[str]]:
    """The torchrun command, environment and the flags added to the config's for one mode's run."""
    name, _, tile = mode.partition(":")
    if name != "baseline" and name not in PLUGIN_MODES + TE_MODES:
        raise SystemExit(f"unknown mode {mode!r}; allowed: baseline, ring, tasp, mesh[:auto|:AxB], {', '.join(TE_MODES)}")
    cp = 1 if name == "baseline" else args.cp
    environ = dict(os.environ, CP=str(cp), NPROC=str(cp), MASTER_PORT=str(free_port()))
    environ.pop("CP_COMM_TYPE", None)
    flags = ["--train-iters", str(args.iters), "--cp-metrics-dir", metrics]
    if name != "baseline":
        environ["CP_COMM_TYPE"] = name
    if name == "mesh" and tile not in ("", "auto"):
        flags += ["--mesh-tile-shape", tile]
    if name == "a2a+p2p":
        flags += ["--hierarchical-context-parallel-sizes", "2", str(cp // 2)]
    flags += args.megatron_args
    torchrun_args, env = training_command("pretrain", [args.config, *flags], environ)
    return [sys.executable, "-m", "torch.distributed.run", *torchrun_args], env, flags


def run_mode(mode: str, args, out_dir: str) -> RunResult:
    safe = mode.replace(":", "_").replace("+", "_")
    metrics = os.path.join(out_dir, "metrics", safe)
    cmd, env, flags = command(mode, args, metrics)
    cp = int(env["CP"])
    log_path = os.path.join(out_dir, f"{safe}.log")
    print(f"[{mode}] CP={cp} CP_COMM_TYPE={env.get('CP_COMM_TYPE', '(config)')}: scripts/pretrain_gpt.sh "
          f"{args.config} {' '.join(flags)}", flush=True)
    start = time.monotonic()
    timed_out = threading.Event()
    progress = _Progress(mode, metrics, args.iters)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
        stop = lambda: kill_process_tree(proc.pid)  # noqa: E731 -- torchrun and every rank, on timeout or Ctrl-C
        timer = threading.Timer(args.run_timeout, lambda: (timed_out.set(), stop())) if args.run_timeout else None
        if timer:
            timer.start()
        try:
            for line in proc.stdout:
                log.write(line)
                progress.poll()
            proc.wait()
        except BaseException:
            stop()
            raise
        finally:
            if timer:
                timer.cancel()
    progress.poll(every=0)
    m = read_metrics(metrics)
    res = RunResult(mode=mode, cp=cp, tile=m.tile, losses=m.losses, times_ms=m.times_ms,
                    bytes_per_step=m.bytes_per_step, peak_memory=m.peak_memory, memory_kind=m.memory_kind)
    if timed_out.is_set():
        res.ok, res.error = False, f"stopped after --run-timeout {args.run_timeout:g} s; log {log_path}"
    elif proc.returncode != 0 or len(m.losses) < args.iters:
        with open(log_path) as f:
            tail = " / ".join(f.read().strip().splitlines()[-3:])
        res.ok, res.error = False, f"exit code {proc.returncode}; log {log_path}: {tail[-300:]}"
    print(f"[{mode}] {'done' if res.ok else 'FAILED'} in {time.monotonic() - start:.0f} s", flush=True)
    return res


class _Progress:
    """Prints each iteration's loss as the run's metrics record it."""

    def __init__(self, mode: str, metrics: str, iters: int):
        self.mode, self.metrics, self.iters, self.shown, self.last = mode, metrics, iters, set(), 0.0

    def poll(self, every: float = 0.5) -> None:
        if time.monotonic() - self.last < every:
            return
        self.last = time.monotonic()
        losses = read_metrics(self.metrics).losses
        for it in sorted(set(losses) - self.shown):
            print(f"[{self.mode}]   iteration {it}/{self.iters}  lm loss {losses[it]:.6f}", flush=True)
            self.shown.add(it)


def _machine_note() -> str:
    gpus = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout.strip().splitlines() \
        if shutil.which("nvidia-smi") else []
    if gpus:
        return f"Machine: {len(gpus)} GPU(s) ({gpus[0].split('(')[0].strip()}), NCCL."
    return (f"Machine: CPU only ({os.cpu_count()} cores), gloo; the CP runs put several processes on each core, so "
            "their times say nothing about GPU speed -- compare losses and bytes here, times on GPUs.")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=os.path.join(ROOT, "configs", "gpt_tiny_cpu_compare.yaml"))
    ap.add_argument("--cp", type=int, default=4, help="context-parallel size of the compared modes (default 4)")
    ap.add_argument("--modes", nargs="+", help="default: baseline ring mesh:auto mesh:<square> tasp (+ TE modes with TE)")
    ap.add_argument("--iters", type=int, default=6, help="training iterations per run (default 6)")
    ap.add_argument("--run-timeout", type=float, default=None,
                    help="stop a run (and report it failed) after this many seconds (default: no limit)")
    ap.add_argument("--out", default=None, help="report directory (default reports/cp_modes_<time>)")
    ap.add_argument("megatron_args", nargs=argparse.REMAINDER, help="extra Megatron flags after --")
    args = ap.parse_args(argv)
    if args.megatron_args and args.megatron_args[0] == "--":
        args.megatron_args = args.megatron_args[1:]
    modes = args.modes or default_modes(args.cp)
    out_dir = args.out or os.path.join(ROOT, "reports", time.strftime("cp_modes_%Y%m%d_%H%M%S"))
    os.makedirs(out_dir, exist_ok=True)
    print(f"comparing {len(modes)} modes at CP={args.cp} ({args.iters} iterations each); report -> {out_dir}", flush=True)
    runs = [run_mode(m, args, out_dir) for m in modes]
    title = f"CP modes side by side: {os.path.basename(args.config)}, CP={args.cp}, {args.iters} iterations"
    notes = (_machine_note(),)
    print("\n" + write_report(runs, out_dir, title, baseline="baseline" if "baseline" in modes else None,
                              notes=notes))
    print(f"report: {os.path.join(out_dir, 'report.md')} (+ report.csv, *.png)")
    return 0 if all(r.ok for r in runs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
