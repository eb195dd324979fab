#!/usr/bin/env python
"""Run the same pretraining job under several context-parallel modes and write a side-by-side
report (Markdown table, CSV, PNG plots) of loss, time per iteration, attention bytes per rank
per step and peak memory.

Each mode is one real Megatron ``pretrain()`` run of the plugin's entry script, started with
torchrun (``python -m torch.distributed.run``) from this process; every run writes its metrics as
JSON lines (``--cp-metrics-dir``), which the report reads:

* ``baseline``  -- CP = 1 on one process (the reference loss curve; always run, first, unless
  ``--no-baseline``),
* ``ring``, ``tasp``, ``mesh:auto``, ``mesh:AxB`` -- the plugin's modes at CP = --cp, with their
  settings as the mode registry reads them (:func:`megatron_mesh.plan.modes.parse_mode_spec`:
  ``mesh:AxB`` the tile, ``tasp:N`` N CP ranks per node), each run by its Megatron flag
  (``--mesh-tile-shape AxB``, ``--tasp-gpus-per-node N``: :func:`megatron_mesh.megatron.settings.mode_flags`);
  a setting no flag sets is refused, never dropped,
* ``a2a+mesh[:U]``, ``a2a+tasp[:U]``, ``a2a+ring[:U]`` -- the Ulysses hybrids (all-to-all over U
  ranks, default 2, x the inner mode over CP / U; in the defaults when CP >= 4),
* ``p2p``, ``a2a``, ``all_gather``, ``a2a+p2p[:U]`` -- Transformer Engine's modes (GPU + TE only).

and each mode under each mask of ``--masks`` (the report puts them side by side, every mask with
its own CP = 1 baseline):

* ``none``   -- the config as it is (causal),
* ``docs``   -- packed documents: the same model on documents of mixed lengths (mean: a quarter of
  the sequence; written by scripts/make_doc_dataset.py into the report directory unless
  ``--doc-data`` names a dataset: each document repeats a span of its own, so the loss falls and
  attention inside a document pays), cut at end-of-document tokens (``--reset-attention-mask``,
  loss normalised per token as at CP 1), split over the CP ranks by the layout ``--cp-layout auto``
  (the default with documents) picks per sample and mode: the plugin's balanced layout, or the
  zigzag where the balanced one would not be faster,
* ``docs-zigzag`` -- the same documents under Megatron's zigzag layout (``--cp-layout zigzag``);
  its CP 1 baseline is the ``docs`` one (CP 1 has no layout),
* ``window`` -- a sliding window of ``--window`` tokens (default: a quarter of a zigzag half,
  seq / (8 CP), so most key blocks are empty).

    python scripts/compare_cp_modes.py --config configs/gpt_tiny_cpu_compare.yaml --cp 4 --iters 6
    python scripts/compare_cp_modes.py --long      # 8K tokens: configs/gpt_tiny_cpu_long.yaml, every mask
    python scripts/compare_cp_modes.py --cp 4 --modes ring mesh:2x2 --masks none window --window 32
"""

from __future__ import annotations

import argparse
import functools
import os
import signal
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import replace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megatron_mesh.tools import yaml_args  # noqa: E402
from megatron_mesh.megatron.launch import free_port, kill_process_tree, training_command  # noqa: E402
from megatron_mesh.megatron import TE_MODES, plugin_modes  # noqa: E402 -- does not import Megatron
from megatron_mesh.megatron.settings import HIERARCHY_FLAG, mode_flags  # noqa: E402 -- nor does this
from megatron_mesh.plan.modes import HYBRID_PREFIX, get_mode, option_specs, parse_mode_spec, resolve  # noqa: E402
from megatron_mesh.tools import predict  # noqa: E402 -- pure Python: the planner
from megatron_mesh.tools.report import RunResult, read_metrics, write_report  # noqa: E402

MASKS = ("none", "docs", "docs-zigzag", "window")
DEFAULT_MASKS = ("none", "docs", "window")  # docs-zigzag would add a run per mode to the quick job
DOC_MASKS = ("docs", "docs-zigzag")  # the masks that train on the documents
# --long: the long-context preset (2K tokens per rank at CP 4), every mask
LONG_CONFIG = os.path.join(ROOT, "configs", "gpt_tiny_cpu_long.yaml")
LONG_ITERS = 4
DEFAULT_CONFIG = os.path.join(ROOT, "configs", "gpt_tiny_cpu_compare.yaml")
DEFAULT_ITERS = 6
# what a documents run adds to the config (its --mock-data goes): boundaries at end-of-document
# tokens reach the plugin layers; the loss skips EOD tokens and is normalised over every CP rank's
# tokens, as at CP 1 (see docs/megatron.md, "Masks")
DOC_FLAGS = {"--reset-attention-mask": True, "--reset-position-ids": True, "--eod-mask-loss": True,
             "--calculate-per-token-loss": True, "--split": "100,0,0", "--mock-data": None}


def refuse(message: str):
    """A bad command line: one line, status 2 (as the plugin's other tools), before any training."""
    print(f"compare_cp_modes: error: {' '.join(message.split())}", file=sys.stderr, flush=True)  # a YAML error spans lines
    raise SystemExit(2)


class Interrupted(Exception):
    """SIGTERM (a scheduler's stop) as an exception: the job stops its run and still writes the report."""


def preset(args) -> None:
    """Fill the options left unset: the long-context preset's (--long) or the quick job's."""
    config, masks, iters = (LONG_CONFIG, MASKS, LONG_ITERS) if args.long else (DEFAULT_CONFIG, DEFAULT_MASKS,
                                                                                 DEFAULT_ITERS)
    args.config = config if args.config is None else args.config
    args.masks = list(masks if args.masks is None else args.masks)
    args.iters = iters if args.iters is None else args.iters
    if args.iters < 1:
        refuse(f"--iters must be >= 1, got {args.iters}")


def reused_baseline(runs: list[RunResult], mode: str, mask: str) -> RunResult | None:
    """docs-zigzag's CP 1 baseline: the docs baseline's run, when there is one (CP 1 splits nothing,
    so the layout cannot change it: running it again would only cost time)."""
    if mode != "baseline" or mask != "docs-zigzag":
        return None
    same = next((r for r in runs if r.mode == "baseline" and r.mask == "docs"), None)
    if same is None:
        return None
    print("[baseline [docs-zigzag]] the [docs] baseline's run (CP 1 has no layout)", flush=True)
    return replace(same, mask=mask)


@functools.lru_cache(maxsize=1)
def _have_te() -> tuple[bool, str]:
    """(Transformer Engine usable, why not): TE raises RuntimeError without CUDA, so any failure means no."""
    probe = subprocess.run([sys.executable, "-c", "import transformer_engine.pytorch"], capture_output=True, text=True)
    lines = probe.stderr.strip().splitlines()
    return probe.returncode == 0, lines[-1] if lines else f"exit status {probe.returncode}"


def default_modes(cp: int) -> list[str]:
    modes = ["baseline", "ring", "mesh:auto"]
    square = max(a for a in range(1, cp + 1) if cp % a == 0 and a * a <= cp)
    if square > 1:
        modes.append(f"mesh:{square}x{cp // square}")
    modes.append("tasp")
    if cp >= 4 and cp % 2 == 0:
        modes.append("a2a+mesh:2")
    if _have_te()[0]:
        modes += list(TE_MODES)
    return modes


def check_te_modes(modes: list[str]) -> None:
    """Transformer Engine's modes named where it is not usable: refused now, not in each of their runs."""
    te = [m for m in modes if m.partition(":")[0] in TE_MODES]
    usable, why = _have_te() if te else (True, "")
    if not usable:
        refuse(f"--modes {', '.join(te)}: Transformer Engine's modes, and Transformer Engine is not usable here "
               f"({why}); the plugin's ring is p2p's algorithm (zigzag ring attention)")


def check_doc_data(prefix: str | None, masks: list[str]) -> None:
    """--doc-data names a dataset the documents runs can read (else every one of them fails at start-up)."""
    if prefix is None or not set(masks) & set(DOC_MASKS):
        return
    missing = [prefix + ext for ext in (".bin", ".idx") if not os.path.isfile(prefix + ext)]
    if missing:
        refuse(f"--doc-data {prefix}: no dataset there, {', '.join(missing)} not found; give the prefix of a Megatron "
               "indexed dataset (PREFIX.bin + PREFIX.idx, e.g. written by scripts/make_doc_dataset.py), or leave it "
               "out (the job writes its documents)")


def check_megatron_flags(flags: list[str]) -> None:
    """The Megatron flags after ``--``, parsed by Megatron's parser with the plugin's flags
    (:func:`megatron_mesh.megatron.args.parse_flags`, in a process of its own: it imports Megatron,
    ~10 s, so only when there are such flags): an unknown flag or a bad value stops the job now,
    not every run at its start-up."""
    if not flags:
        return
    proc = subprocess.run([sys.executable, "-m", "megatron_mesh.megatron.args", *flags], capture_output=True,
                          text=True, cwd=ROOT)
    if proc.returncode != 0:
        lines = proc.stderr.strip().splitlines()
        said = [line.split("error: ", 1)[1] for line in lines if line.startswith("megatron_mesh: error: ")]
        refuse(f"the Megatron flags after --: {said[0] if said else lines[-1] if lines else proc.returncode}")


def _seq_length(config: str) -> int:
    try:
        return int(yaml_args.load(config)["MODEL_ARGS"]["--seq-length"])
    except (OSError, KeyError, TypeError, ValueError) as e:  # a missing file, no MODEL_ARGS, no --seq-length
        refuse(f"--config {config}: cannot read its MODEL_ARGS' --seq-length ({type(e).__name__}: {e}); give a "
               "Megatron YAML config as configs/gpt_tiny_cpu_compare.yaml")


def mask_config(config: str, mask: str, doc_data: str | None, out_dir: str) -> str:
    """The config a run under ``mask`` reads: ``config`` itself, or (documents) a copy in
    ``out_dir`` that reads ``doc_data`` instead of mock data."""
    if mask not in DOC_MASKS:
        return config
    import yaml

    doc = yaml_args.load(config)
    doc["MODEL_ARGS"] = {**doc["MODEL_ARGS"], **DOC_FLAGS, "--data-path": doc_data}
    path = os.path.join(out_dir, "configs", f"docs_{os.path.basename(config)}")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(f"# {os.path.basename(config)} on packed documents (written by scripts/compare_cp_modes.py)\n")
        yaml.safe_dump(doc, f, sort_keys=False)
    return path


def doc_mean_length(seq: int) -> int:
    """Mean document length of the docs runs: a quarter of the sequence, so a sample holds a few
    documents and most cross a rank's chunk."""
    return max(2, seq // 4)


def make_doc_data(args, out_dir: str) -> str:
    """Documents for the ``docs`` runs: mean length a quarter of the sequence, enough tokens for
    every iteration's samples twice over."""
    seq = _seq_length(args.config)
    prefix = os.path.join(out_dir, "data", "docs")
    mean = doc_mean_length(seq)
    documents = max(64, 2 * args.iters * 16 * (seq + 1) // mean)
    subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "make_doc_dataset.py"), prefix, "--mean-length",
                    str(mean), "--max-length", str(2 * seq), "--documents", str(documents), "--chunk",
                    str(seq // (2 * args.cp))], check=True)
    return prefix


DEFAULT_ULYSSES = 2  # a hybrid's all-to-all degree where its mode spec names none


def mode_settings(mode: str) -> tuple[str, dict]:
    """(mode name, settings) of a plugin --modes entry, read by the mode registry's parser
    (``tasp:4`` -> ranks_per_node 4, ``a2a+mesh:2:1x2`` -> ulysses_size 2, tile 1x2; a hybrid's
    degree defaults to 2)."""
    try:
        name, settings = parse_mode_spec(mode)
    except ValueError as e:
        refuse(f"{mode}: {e}")
    if "ulysses_size" in {o.name for o in option_specs(get_mode(name).Options)}:
        settings.setdefault("ulysses_size", DEFAULT_ULYSSES)
    return name, settings


def _mode_flags(mode: str, cp: int) -> tuple[str | None, list[str]]:
    """(cp_comm_type (None: the baseline), the Megatron flags that run a --modes entry at CP
    ``cp``): a plugin mode's settings each by its own flag (:func:`mode_settings`,
    :func:`~megatron_mesh.megatron.settings.mode_flags`), Transformer Engine's a2a+p2p degree U;
    any other setting is refused in one line, never dropped."""
    name, _, option = mode.partition(":")
    if name in plugin_modes():
        name, settings = mode_settings(mode)
        try:
            return name, mode_flags(name, settings, cp)
        except ValueError as e:
            refuse(f"{mode}: {e}")
    if name != "baseline" and name not in TE_MODES:
        refuse(f"unknown mode {mode!r}; allowed: baseline, {', '.join(plugin_modes())} (settings after ':' as "
               f"megatron-mesh-plan takes them: mesh:AxB, tasp:N, a2a+mesh:U:AxB, ...), {', '.join(TE_MODES)}")
    if not name.startswith(HYBRID_PREFIX):  # the baseline, Transformer Engine's p2p, a2a, all_gather
        if option:
            refuse(f"{mode}: {name} takes no settings after its name")
        return (None if name == "baseline" else name), []
    ulysses = int(option or DEFAULT_ULYSSES) if (option or "2").isdigit() else 0  # Transformer Engine's a2a+p2p
    if ulysses < 2 or cp % ulysses:
        refuse(f"{mode}: the all-to-all degree {option or DEFAULT_ULYSSES} must be an integer >= 2 dividing the CP "
               f"size {cp}")
    return name, [HIERARCHY_FLAG, str(ulysses), str(cp // ulysses)]


def check_placement(mode: str, args) -> None:
    """A plugin mode's settings resolved as its runs will resolve them, for the job's model at --cp
    (a tile that does not fit, ranks per node that do not divide the CP size, a degree the heads
    refuse): refused now, not in every run after the baselines have trained."""
    name, settings = mode_settings(mode)
    rpn = settings.pop("ranks_per_node", None)
    try:
        resolve(name, args.cp, args.cpu_problem.shape, ranks_per_node=rpn, **settings)
    except ValueError as e:
        refuse(f"{mode}: {e}")


def command(mode: str, args, metrics: str, mask: str = "none", config: str | None = None
            ) -> tuple[list[str], dict[str, str], list[str]]:
    """The torchrun command, environment and the flags added to the config's for one mode's run
    under ``mask`` (``config``: the mask's config, default --config)."""
    cp = 1 if mode == "baseline" else args.cp
    comm_type, mode_args = _mode_flags(mode, cp)
    environ = dict(os.environ, CP=str(cp), NPROC=str(cp), MASTER_PORT=str(free_port()))
    environ.pop("CP_COMM_TYPE", None)
    flags = ["--train-iters", str(args.iters), "--cp-metrics-dir", metrics] + mode_args
    if comm_type is not None:
        environ["CP_COMM_TYPE"] = comm_type
    if mask == "window":
        flags += ["--window-size", f"{args.window},0"]
    if mask == "docs-zigzag":  # at CP 1 too: one config for the baseline and the CP runs (CP 1 leaves it unused)
        flags += ["--cp-layout", "zigzag"]
    flags += args.megatron_args
    try:
        torchrun_args, env = training_command("pretrain", [config or args.config, *flags], environ)
    except ValueError as e:  # the launcher's checks of the command line (e.g. a world size CP does not divide)
        refuse(f"{mode}: {e}")
    return [sys.executable, "-m", "torch.distributed.run", *torchrun_args], env, flags


def run_mode(mode: str, args, out_dir: str, mask: str = "none", config: str | None = None) -> RunResult:
    label = mode if mask == "none" else f"{mode} [{mask}]"
    safe = (mode if mask == "none" else f"{mode}_{mask}").replace(":", "_").replace("+", "_")
    metrics = os.path.join(out_dir, "metrics", safe)
    cmd, env, flags = command(mode, args, metrics, mask, config)
    cp = int(env["CP"])
    log_path = os.path.join(out_dir, f"{safe}.log")
    print(f"[{label}] CP={cp} CP_COMM_TYPE={env.get('CP_COMM_TYPE', '(config)')}: scripts/pretrain_gpt.sh "
          f"{config or args.config} {' '.join(flags)}", flush=True)
    start = time.monotonic()
    timed_out = threading.Event()
    progress = _Progress(label, metrics, args.iters)
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
        except BaseException:  # Ctrl-C, SIGTERM: stop torchrun and its ranks (a second Ctrl-C must not cut that short)
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            stop()
            raise
        finally:
            if timer:
                timer.cancel()
    progress.poll(every=0)
    m = read_metrics(metrics)
    res = RunResult(mode=mode, cp=cp, mask=mask, tile=m.tile, losses=m.losses, times_ms=m.times_ms,
                    bytes_per_step=m.bytes_per_step, planned_bytes_per_step=m.planned_bytes_per_step,
                    peak_memory=m.peak_memory, memory_kind=m.memory_kind,
                    rank_bytes=m.rank_bytes, rank_work=m.rank_work, bytes_matrix=m.bytes_matrix)
    if timed_out.is_set():
        res.ok, res.error = False, f"stopped after --run-timeout {args.run_timeout:g} s; log {log_path}"
    elif proc.returncode != 0 or len(m.losses) < args.iters:
        with open(log_path) as f:
            lines = f.read().strip().splitlines()
        # a start-up check's own line says why; torchrun's last lines only that a rank failed
        said = [line for line in lines if line.startswith("megatron_mesh: error:")]
        tail = said[0] if said else " / ".join(lines[-3:])
        res.ok, res.error = False, f"exit code {proc.returncode}; log {log_path}: {tail[-300:]}"
    print(f"[{label}] {'done' if res.ok else 'FAILED'} in {time.monotonic() - start:.0f} s", flush=True)
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


def report_sections(runs: list[RunResult], args) -> tuple[str, ...]:
    """The report's planner sections: the measured-vs-planned bytes of this run (CP > 1), then the
    GPU prediction of each --predict config."""
    sections = []
    if args.cpu_problem is not None:
        doc_mean = doc_mean_length(args.cpu_problem.seq_len)  # what make_doc_data writes (with --doc-data: a guess)
        sections.append(predict.measured_vs_planned_section(runs, args.cpu_problem, window=args.window,
                                                            doc_mean=doc_mean))
    sections += [predict.prediction_section(path) for path in args.predict_configs]
    return tuple(sections)


def _machine_note() -> str:
    gpus = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout.strip().splitlines() \
        if shutil.which("nvidia-smi") else []
    if gpus:
        return f"Machine: {len(gpus)} GPU(s) ({gpus[0].split('(')[0].strip()}), NCCL."
    return (f"Machine: CPU only ({os.cpu_count()} cores), gloo; the CP runs put several processes on each core, so "
            "their times say nothing about GPU speed -- compare losses and bytes here, times on GPUs.")


def parse_args(argv=None) -> argparse.Namespace:
    """The job's options with the preset's defaults filled in, the modes and masks resolved, and
    every config the report plans for read (``cpu_problem``: the job's own; ``predict_configs``)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=None,
                    help="Megatron YAML config of the job (default configs/gpt_tiny_cpu_compare.yaml; with --long "
                         "configs/gpt_tiny_cpu_long.yaml)")
    ap.add_argument("--long", action="store_true",
                    help=f"the long-context preset: configs/gpt_tiny_cpu_long.yaml (8192 tokens, 2048 per rank at CP 4), "
                         f"every mask ({' '.join(MASKS)}), {LONG_ITERS} iterations (each overridable)")
    ap.add_argument("--cp", type=int, default=4, help="context-parallel size of the compared modes (default 4)")
    ap.add_argument("--modes", nargs="+",
                    help="default: baseline ring mesh:auto mesh:<square> tasp, a2a+mesh:2 at CP >= 4 (+ TE modes with TE)")
    ap.add_argument("--no-baseline", action="store_true",
                    help="leave out the CP 1 baseline, which --modes gets unless it names it (the report then has "
                         "no loss deviations: the loss check is the job's point)")
    ap.add_argument("--masks", nargs="+", default=None, choices=MASKS,
                    help=f"run every mode under each of these masks (default: {' '.join(DEFAULT_MASKS)}; with --long "
                         f"{' '.join(MASKS)})")
    ap.add_argument("--window", type=int, default=None,
                    help="window of the 'window' runs in tokens (default seq / (8 CP): a quarter of a zigzag half)")
    ap.add_argument("--doc-data", default=None,
                    help="dataset prefix (.bin/.idx) of the 'docs' runs (default: written by scripts/make_doc_dataset.py "
                         "into the report directory)")
    ap.add_argument("--iters", type=int, default=None,
                    help=f"training iterations per run (default {DEFAULT_ITERS}; with --long {LONG_ITERS})")
    ap.add_argument("--run-timeout", type=float, default=None,
                    help="stop a run (and report it failed) after this many seconds (default: no limit)")
    ap.add_argument("--predict", action="append", default=None, metavar="CONFIG.yaml",
                    help="a Megatron config (repeatable) whose attention the planner predicts on GPUs, in the report "
                         "next to the CPU rows (default: configs/llama3_8b_128k_cp16.yaml, gpt_oss_20b_128k_cp16.yaml, "
                         "deepseek_v3_128k_cp16.yaml and llama4_scout_128k_cp16.yaml)")
    ap.add_argument("--no-predict", action="store_true", help="leave the GPU prediction out of the report")
    ap.add_argument("--out", default=None, help="report directory (default reports/cp_modes_<time>)")
    ap.add_argument("megatron_args", nargs=argparse.REMAINDER, help="extra Megatron flags after --")
    args = ap.parse_args(argv)
    if args.cp < 1:
        refuse(f"--cp must be >= 1, got {args.cp}")
    if args.run_timeout is not None and not 0 < args.run_timeout <= threading.TIMEOUT_MAX:  # NaN too
        refuse(f"--run-timeout must be a number of seconds > 0 and at most {threading.TIMEOUT_MAX:.0f}, got "
               f"{args.run_timeout:g} (leave it out for no limit)")
    preset(args)
    if args.megatron_args and args.megatron_args[0] == "--":
        args.megatron_args = args.megatron_args[1:]
    args.modes = list(dict.fromkeys(args.modes or default_modes(args.cp)))  # a mode named twice runs once
    if args.cp == 1 and set(args.modes) - {"baseline"}:
        refuse(f"--cp 1: the compared modes ({', '.join(m for m in args.modes if m != 'baseline')}) split nothing at "
               "CP 1 (Megatron's own attention runs); give --cp 2 or more")
    if args.no_baseline:
        if "baseline" in args.modes:
            refuse("--no-baseline and --modes baseline exclude each other")
    elif "baseline" not in args.modes:  # every mode's loss is checked against CP 1's
        args.modes = ["baseline", *args.modes]
    args.masks = list(dict.fromkeys(args.masks))
    seq = _seq_length(args.config)
    if args.window is None:
        args.window = max(1, seq // (8 * args.cp))
    elif args.window < 1:
        refuse(f"--window must be >= 1 token, got {args.window}")
    elif args.window >= seq - 1 and "window" in args.masks:
        refuse(f"--window {args.window} reaches across the whole sequence of {seq} tokens: the window runs would be "
               f"the unmasked ones; give at most {seq - 2}")
    if args.no_predict and args.predict:
        refuse("--predict and --no-predict exclude each other")
    args.predict_configs = [] if args.no_predict else (args.predict or list(predict.DEFAULT_CONFIGS))
    check_before_runs(args)
    return args


def check_before_runs(args) -> None:
    """What would fail in the runs (or in the report, after them), refused now: every mode's
    command, Transformer Engine's modes, the documents' data, every config the report plans for
    (``cpu_problem``: the job's own), the Megatron flags after ``--``."""
    for mode in args.modes:  # each mode's command once, before the first training: a bad one fails now
        command(mode, args, os.devnull)
    check_te_modes(args.modes)
    check_doc_data(args.doc_data, args.masks)
    try:  # read every config before the first training: a bad one fails in seconds, not after the runs
        for path in args.predict_configs:
            predict.read_config(path)
        args.cpu_problem = predict.read_config(args.config, cp=args.cp) if args.cp > 1 else None
    except ValueError as e:
        refuse(str(e))
    for mode in args.modes:
        if mode.partition(":")[0] in plugin_modes():
            check_placement(mode, args)
    check_megatron_flags(args.megatron_args)  # last: the only check that takes seconds


def report_directory(out: str | None) -> str:
    """--out, made (default reports/cp_modes_<time>): refused in one line before any training
    where it cannot be (a file there, a path under a file, no permission)."""
    out = out or os.path.join(ROOT, "reports", time.strftime("cp_modes_%Y%m%d_%H%M%S"))
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as e:
        refuse(f"--out {out}: cannot make the report directory ({e.strerror or e})")
    if not os.access(out, os.W_OK):
        refuse(f"--out {out}: the report directory is not writable")
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    modes, masks = args.modes, args.masks
    out_dir = report_directory(args.out)
    print(f"comparing {len(modes)} modes x masks {', '.join(masks)} at CP={args.cp} ({args.iters} iterations each); "
          f"report -> {out_dir}", flush=True)
    configs = {}

    def on_sigterm(signum, frame):
        raise Interrupted()

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:  # the documents and the configs first: stopped there, no run has started and no report is due
        doc_data = (args.doc_data or make_doc_data(args, out_dir)) if set(masks) & set(DOC_MASKS) else None
        for mask in masks:
            configs[mask] = mask_config(args.config, mask, doc_data if mask in DOC_MASKS else None, out_dir)
    except (KeyboardInterrupt, Interrupted) as e:
        signal.signal(signal.SIGTERM, previous)
        stopped = "SIGINT" if isinstance(e, KeyboardInterrupt) else "SIGTERM"
        print(f"compare_cp_modes: interrupted ({stopped}) before the first run: no report", file=sys.stderr, flush=True)
        return 130 if stopped == "SIGINT" else 143
    runs, stopped = [], None
    at = (modes[0], masks[0])
    try:
        for mask in masks:
            for m in modes:
                at = (m, mask)
                runs.append(reused_baseline(runs, m, mask) or run_mode(m, args, out_dir, mask, configs[mask]))
    except (KeyboardInterrupt, Interrupted) as e:  # the runs so far still get their report
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        stopped = "SIGINT" if isinstance(e, KeyboardInterrupt) else "SIGTERM"
        m, mask = at
        runs.append(RunResult(mode=m, cp=1 if m == "baseline" else args.cp, mask=mask, ok=False,
                              error=f"interrupted ({stopped}); the runs after it did not start"))
        print(f"compare_cp_modes: interrupted ({stopped}): stopped the {m} run; writing the report of the runs so far",
              file=sys.stderr, flush=True)
    finally:
        signal.signal(signal.SIGTERM, previous)
    title = f"CP modes side by side: {os.path.basename(args.config)}, CP={args.cp}, {args.iters} iterations"
    if "window" in masks:
        title += f" (window {args.window})"
    notes = (_machine_note(),)
    if args.no_baseline:
        notes += ("No CP 1 baseline (--no-baseline): the loss columns have no deviation to show.",)
    own = args.cpu_problem
    if "none" in masks and own is not None and (own.documents is not None or len(own.layer_kinds) > 1 or
                                                own.layer_kinds[0][0] != predict.FULL):
        notes += ("Mask none adds none of the job's masks: the runs train the config's own attention "
                  f"({own.describe()}).",)
    if "docs-zigzag" in masks and "docs" in masks and "baseline" in modes:
        notes += ("docs-zigzag's baseline is the docs baseline's run: CP 1 splits nothing, so it has no layout.",)
    planned = True
    try:
        sections = report_sections(runs, args)
    except ValueError as e:  # the tables of the runs are written whatever the planner says
        print(f"compare_cp_modes: the planner's sections failed: {e}", file=sys.stderr, flush=True)
        sections, planned = (f"**The planner's sections failed**: {e}",), False
    print("\n" + write_report(runs, out_dir, title, baseline="baseline" if "baseline" in modes else None,
                              notes=notes, sections=sections))
    print(f"report: {os.path.join(out_dir, 'report.md')} (+ report.csv, *.png)")
    if stopped:
        return 130 if stopped == "SIGINT" else 143
    return 0 if planned and all(r.ok for r in runs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
