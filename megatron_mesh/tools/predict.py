"""What the planner predicts for a Megatron config on GPUs, and how the CPU run's measured bytes
compare with the planner's (pure Python, no torch).

The side-by-side job (scripts/compare_cp_modes.py) trains a tiny model on CPU processes, where
times say nothing about GPUs. Its report connects the run to the user's cluster with two
Markdown sections built here from the planner (:mod:`megatron_mesh.tools.planner`):

* :func:`prediction_section` -- for a Megatron YAML config (e.g. configs/llama3_8b_128k_cp16.yaml):
  the attention problem of one CP rank (query / KV heads per tensor-parallel rank, head dim,
  sequence per CP rank, micro-batch, dtype, window, documents of the config's data if it resets
  attention at end-of-document tokens) on the planner's assumed GPU machine (its defaults:
  :class:`~megatron_mesh.plan.topology.Topology`, 8 GPUs per node, tensor parallelism inside a
  node), per mode the bytes each rank sends, the predicted forward + backward time and the work
  balance, which mode ``auto`` picks, and the compute floor;
* :func:`measured_vs_planned_section` -- for the CPU run: per (mode, mask) run, the planner's
  bytes per rank per step for the run's own plan (its mode, all-to-all degree and tile resolved as
  the runtime resolves them; layers x micro-batches x one layer's forward + backward, the busiest
  rank: :func:`~megatron_mesh.plan.autotile.evaluate_plan`, the number the planner reports and
  tests/test_plan_bytes_vs_measured.py checks against comm_counter) next to the bytes measured,
  and their ratio.
"""

from __future__ import annotations

import dataclasses
import os
import struct
from collections import Counter
from dataclasses import dataclass, replace
from typing import Iterable, Iterator

from ..plan.autotile import TIE_RULE, evaluate_plan
from ..plan.balance import balanced_layout
from ..plan.mask import Mask
from ..plan.maskkinds import MaskKind, MaskStack
from ..plan.megatron_problem import MegatronProblem
from ..plan.modes import REFERENCE_MODE, get_mode, parse_mode_spec, resolve
from ..plan.shape import AttentionShape
from ..plan.simulate import BACKWARD_FLOPS
from ..plan.topology import Topology
from ..plan.units import format_bytes
from . import yaml_args
from .plan_args import document_bounds
from .layout_rows import layout_rows
from .plan_budget import BUDGET_S, Budget
from .planner import ModeResult, allowed_pairs, compute_floor, evaluate

__all__ = ["Problem", "read_config", "machine", "predict", "prediction_section", "measured_vs_planned_section",
           "PREDICT_MODES", "DEFAULT_CONFIG", "DEFAULT_CONFIGS"]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_CONFIG = os.path.join(ROOT, "configs", "llama3_8b_128k_cp16.yaml")
# the main job's predictions: Llama-3-8B, gpt-oss-20b (sinks, 128-token windows alternating with full
# layers), DeepSeek-V3's attention (MLA: query/key dim 192, value dim 128) and Llama 4 Scout's (chunks of
# 8192 tokens on three layers of four, the fourth global), each at 128K tokens
DEFAULT_CONFIGS = tuple(os.path.join(ROOT, "configs", f"{name}_128k_cp16.yaml")
                        for name in ("llama3_8b", "gpt_oss_20b", "deepseek_v3", "llama4_scout"))
# the rows of the prediction: each mode's fastest placement, the hybrids per all-to-all degree,
# Ulysses and USP by formula (dense attention only), and auto
PREDICT_MODES = ("ring", "mesh-auto", "tasp", "a2a+ring", "a2a+mesh-auto", "a2a+tasp", "ulysses", "usp", "auto")
# Megatron's default rank order puts tensor parallelism innermost: a CP group's neighbours are TP
# ranks apart, so a node of GPUS_PER_NODE GPUs holds GPUS_PER_NODE / TP ranks of each CP group
GPUS_PER_NODE = Topology().gpus_per_node
_EVERY_LAYER = object()  # predict()'s default layer mask: the one every layer of the config has
FULL = Mask(True)  # a causal layer without a window or chunks


@dataclass(frozen=True)
class Problem:
    """The attention of one Megatron config as the planner sees it (per CP rank): the run's
    :class:`~megatron_mesh.plan.megatron_problem.MegatronProblem` (the one derivation, shared with
    the training's start-up and layers), named, with one sample's documents."""

    name: str
    run: MegatronProblem
    documents: tuple[int, ...] | None = None  # cu_seqlens of one sample; None: one sequence

    layers = property(lambda self: self.run.layers)
    heads = property(lambda self: self.run.heads, doc="query heads of the model (all TP ranks)")
    kv_heads = property(lambda self: self.run.kv_heads)
    head_dim = property(lambda self: self.run.head_dim)
    seq_len = property(lambda self: self.run.seq_len)
    cp = property(lambda self: self.run.cp)
    tp = property(lambda self: self.run.tp)
    micro_batch = property(lambda self: self.run.micro_batch)
    dtype = property(lambda self: self.run.dtype)

    @property
    def micro_batches(self) -> int:
        """Micro-batches per step with data parallelism 1 (global batch / micro-batch)."""
        return max(1, (self.run.global_batch or self.micro_batch) // self.micro_batch)

    @property
    def layer_windows(self) -> tuple:
        """Each layer's window (left, 0) on the causal layers, None for full attention (no window,
        or an unlimited left side): :meth:`MegatronProblem.layer_windows`, the one reading of
        --window-size and --window-attn-skip-freq."""
        return tuple(None if w is None or w[0] is None else (w[0], 0) for w in self.run.layer_windows(causal=True))

    @property
    def layer_masks(self) -> tuple[MaskKind, ...]:
        """Each layer's mask without documents: Llama 4's chunks (``Chunked``) where the run has
        them (:meth:`MegatronProblem.layer_chunks`), else its window on a causal layer
        (``Mask(True, (left, 0))``) or :data:`FULL` (:attr:`layer_windows`)."""
        chunks = self.run.layer_chunks()  # a chunk as long as the sequence is causal attention: the full layers'
        return tuple(c.normalized(self.seq_len) if c is not None else Mask(True, w) if w is not None else FULL
                     for w, c in zip(self.layer_windows, chunks))

    @property
    def layer_kinds(self) -> list[tuple[MaskKind, int]]:
        """(mask, layers with it) of each different layer mask, in the order the layers first
        run it: gpt-oss-20b's [(window 127, 12), (FULL, 12)]; a uniform stack one entry."""
        return list(Counter(self.layer_masks).items())

    @property
    def shape(self) -> AttentionShape:
        """One CP rank's attention: its TP rank's heads (KV heads replicated when fewer than TP),
        query/key and value head dims (MLA's differ: K and V move different bytes)."""
        return self.run.shape(batch=self.micro_batch)

    @property
    def cu_seqlens(self) -> list[int]:
        return list(self.documents) if self.documents is not None else [0, self.seq_len]

    def mask(self, kind: MaskKind = FULL, documents: bool = True) -> MaskKind:
        """The mask of the layers with ``kind`` (one of :attr:`layer_kinds`'), inside this
        problem's documents (``documents``: where it has them)."""
        if kind.is_band and documents and self.documents is not None:
            return Mask.from_cu_seqlens(self.cu_seqlens, self.seq_len, True, _window(kind)).normalized(self.seq_len)
        if documents and self.documents is not None:
            return (Mask(False, None, tuple(zip(self.cu_seqlens, self.cu_seqlens[1:]))) & kind).normalized(self.seq_len)
        return kind.normalized(self.seq_len)

    def layers_text(self) -> str:
        """The layers' masks in words: 'window 16 tokens' (every layer the same), '12 of 24 layers
        window 127 tokens, 12 of 24 layers full', '36 of 48 layers chunks of 8192 tokens, 12 of 48
        layers full'."""
        def what(kind):
            return "full" if kind == FULL else f"window {kind.window[0]} tokens" if kind.is_band else \
                f"chunks of {kind.size} tokens"
        if len(self.layer_kinds) == 1:
            return what(self.layer_kinds[0][0])
        return ", ".join(f"{n} of {self.layers} layers {what(k)}" for k, n in self.layer_kinds)

    def describe(self) -> str:
        sh = self.shape
        tp = f", TP {self.tp} -> {sh.heads} / {sh.kv_heads} per rank" if self.tp > 1 else ""
        what = "causal" + ("" if self.layer_kinds == [(FULL, self.layers)] else f", {self.layers_text()}")
        if self.documents is not None:
            n = len(self.documents) - 1
            what += f", {n} documents of mean {self.seq_len / n:,.0f} tokens (the first sample of its data)"
        return (f"{self.layers} layers, {self.heads} query / {self.kv_heads} KV heads, {sh.dims_text}{tp}; "
                f"{self.seq_len:,} tokens at CP {self.cp} ({sh.seq_local:,} per rank), micro-batch "
                f"{self.micro_batch}, {self.dtype}, {what}")


def _flags(path: str) -> dict[str, object]:
    """MODEL_ARGS of a Megatron YAML config as flag -> value (True for a bare flag; a string, or a
    list of strings for several values), ${VAR}s expanded as the launcher expands them."""
    if not os.path.isfile(path):
        raise ValueError(f"config {path!r}: no such file (give a Megatron YAML config, e.g. {DEFAULT_CONFIG})")
    doc = yaml_args.load(path)
    try:
        argv = yaml_args.model_args(doc, {**os.environ, **yaml_args.environment(doc)})
    except ValueError as e:  # a ${VAR} set nowhere: which of the configs says it
        raise ValueError(f"config {path!r}: {e}") from None
    flags: dict[str, object] = {}
    for token in argv:
        if token.startswith("--"):
            key, given, value = token.partition("=")  # --window-size=-1,0: a value that starts with '-'
            flags[key] = value if given else True
        else:
            old = flags[key]
            flags[key] = token if old is True else (old + [token] if isinstance(old, list) else [old, token])
    return flags


def _data_prefix(flags: dict, path: str) -> str:
    data = flags.get("--data-path")
    if data is None or data is True:
        raise ValueError(f"config {path!r}: --reset-attention-mask (packed documents) without --data-path: the "
                         "documents to plan for come from the data's index (PREFIX.idx)")
    if isinstance(data, list):  # blended data: "W1 PREFIX1 W2 PREFIX2 ..." or "PREFIX1 PREFIX2 ..."
        data = data[1] if len(data) > 1 and _is_number(data[0]) else data[0]
    return str(data)


def _is_number(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


HEADER = 34  # bytes of an index's header: magic (9), version (8), dtype code (1), sequences (8), documents (8)
LENGTHS_READ = 1 << 16  # sequence lengths read at a time: a sample needs the first few


def document_lengths(prefix: str) -> Iterator[int]:
    """Sequence lengths of a Megatron indexed dataset (PREFIX.idx, the format of Megatron-LM's
    tools/preprocess_data.py and scripts/make_doc_dataset.py), read without Megatron, in order and
    only as far as they are asked for. ValueError naming the file when it is no index, or holds
    fewer lengths than its header announces (checked against its size before any is read)."""
    path = prefix + ".idx"
    try:
        f = open(path, "rb")
    except OSError as e:
        raise ValueError(f"documents: cannot read {path!r} ({e.strerror}); write it with scripts/make_doc_dataset.py "
                         "or give the config's --data-path") from None
    with f:
        head = f.read(HEADER)
        if len(head) < HEADER or head[:9] != b"MMIDIDX\x00\x00":
            raise ValueError(f"{path}: not a Megatron indexed dataset index (no MMIDIDX header)")
        (count,) = struct.unpack("<Q", head[18:26])
        held = (os.fstat(f.fileno()).st_size - HEADER) // 4
        if held < count:
            raise ValueError(f"{path}: announces {count} sequences, but holds the lengths of {held} (4 bytes each): "
                             "truncated, or not an index")
        for start in range(0, count, LENGTHS_READ):
            n = min(LENGTHS_READ, count - start)
            yield from struct.unpack(f"<{n}i", f.read(4 * n))


def _sample_bounds(lengths: Iterable[int], seq_len: int) -> tuple[int, ...]:
    """cu_seqlens of the first sample: the documents in order, the last one cut at the sequence end
    (Megatron's GPTDataset concatenates documents the same way, in a shuffled order)."""
    cu = [0]
    for n in lengths:
        if n > 0:
            cu.append(min(seq_len, cu[-1] + n))
        if cu[-1] == seq_len:
            return tuple(cu)
    raise ValueError(f"documents: {cu[-1]} tokens in all, fewer than one sample of --seq-length {seq_len}")


def read_config(path: str, cp: int | None = None) -> Problem:
    """The planner's problem of a Megatron YAML config (``cp`` overrides --context-parallel-size):
    its attention by :meth:`MegatronProblem.from_flags` and checked as a run would be, at CP >= 2 on
    the planner's nodes; the first sample's documents where it resets attention at end-of-document
    tokens. ValueError naming the config and the flag when one is missing or unusable."""
    flags = _flags(path)
    try:
        run = MegatronProblem.from_flags(flags)
        run = replace(run, cp=cp) if cp is not None else run
        if run.cp < 2:
            raise ValueError(f"context-parallel size {run.cp}: the CP modes need --context-parallel-size >= 2")
        run.check()
        if GPUS_PER_NODE % run.tp:
            raise ValueError(f"--tensor-model-parallel-size {run.tp} must divide the {GPUS_PER_NODE} GPUs of a node")
    except ValueError as e:
        raise ValueError(f"config {path!r}: {e}") from None
    documents = None
    if run.documents is not None:
        documents = _sample_bounds(document_lengths(_data_prefix(flags, path)), run.seq_len)
    return Problem(name=os.path.basename(path), run=run, documents=documents)


def machine(problem: Problem, gpus_per_node: int = GPUS_PER_NODE, **links) -> Topology:
    """The planner's assumed GPU machine for ``problem``: its default links and throughput, nodes of
    ``gpus_per_node`` GPUs of which each CP group holds gpus_per_node / TP consecutive ranks."""
    return Topology.for_cp(problem.cp, max(1, gpus_per_node // problem.tp), **links)


def _window(kind: MaskKind):
    """The window (left, 0) of a band layer mask, None for :data:`FULL`."""
    return None if kind == FULL else kind.window


def predict(problem: Problem, topo: Topology, modes=PREDICT_MODES, kind=_EVERY_LAYER
            ) -> tuple[list[ModeResult], list[dict], float]:
    """The planner's rows for the layers of ``problem`` with the mask ``kind`` (one of its
    :attr:`~Problem.layer_kinds`; default: the one every layer has -- ValueError where the layers'
    masks differ) on ``topo`` (one attention layer, forward + backward), the modes that cannot
    run, and the compute floor in seconds. Documents: the plugin's balanced layout (its default
    for packed documents). The rows share the planner's default planning budget
    (:data:`~.plan_budget.BUDGET_S`): those past it are left out, named."""
    if kind is _EVERY_LAYER:
        (kind, _), *others = problem.layer_kinds
        if others:
            raise ValueError(f"{problem.name}: its layers run different masks ({problem.describe()}); predict each "
                             "with kind= (Problem.layer_kinds)")
    shape = problem.shape
    budget = Budget(BUDGET_S)
    window, other = (_window(kind), None) if kind.is_band else (None, kind)
    if problem.documents is None:
        rows, skipped = evaluate(problem.cp, shape, topo, modes=modes, mask=problem.mask(kind), work=True,
                                 budget=budget)
    else:
        rows, skipped = layout_rows(problem.cp, shape, topo, problem.cu_seqlens, window=window, kind=other,
                                    modes=modes, layouts=("balanced",), budget=budget)
    floor = compute_floor(allowed_pairs(problem.cu_seqlens, True, window, mask=other), problem.cp, shape, topo)
    return rows, skipped, floor


def _machine_line(problem: Problem, topo: Topology) -> str:
    tp = f", TP {problem.tp} inside a node, so {topo.gpus_per_node} CP ranks per node" if problem.tp > 1 else ""
    return (f"Assumed machine (megatron_mesh.plan.topology.Topology; the planner's defaults unless its flags said "
            "otherwise): "
            f"{topo.gpus_per_node * problem.tp} GPUs per node{tp}: CP {problem.cp} spans {topo.nodes_used(problem.cp)} "
            "node(s); "
            f"NVLink {topo.intra_bandwidth / 1e9:g} GB/s and {topo.intra_latency * 1e6:g} us inside a node, network "
            f"{topo.inter_bandwidth / 1e9:g} GB/s and {topo.inter_latency * 1e6:g} us between nodes (per GPU per "
            f"direction); attention {topo.attention_flops / 1e12:g} TFLOP/s per GPU (backward {BACKWARD_FLOPS}x the "
            f"forward's FLOPs), {topo.kernel_latency * 1e6:g} us per kernel launch, the host "
            f"{topo.host_op_time * 1e6:g} us per torch op the executor issues ({topo.host_view_time * 1e6:g} per "
            "view). Other machines: "
            "`megatron-mesh-plan --help` (e.g. --inter-bandwidth, --tflops).")


def _per_layer_flags(picks: list, cp: int) -> str:
    """The Megatron flags that run each kind of layer on its pick (``picks``: (mode, all-to-all
    degree, layers, what) per kind): ``--cp-comm-type`` takes one mode per layer, and one
    ``--hierarchical-context-parallel-sizes U M`` serves every hybrid layer, so picks of two
    degrees cannot run together (said so)."""
    said = ", ".join(f"{mode}{f' (all-to-all {u})' if u > 1 else ''} on the {n} layers with {what}"
                     for mode, u, n, what in picks)
    degrees = sorted({u for _, u, _, _ in picks if u > 1})
    if len(degrees) > 1:
        return (f"{said} -- not one run's flags: one --hierarchical-context-parallel-sizes serves every hybrid layer "
                f"(degrees {' and '.join(map(str, degrees))} here)")
    hcp = f" and `--hierarchical-context-parallel-sizes {degrees[0]} {cp // degrees[0]}`" if degrees else ""
    return f"{said}; run it with a `--cp-comm-type` listing each layer's pick, in layer order{hcp}"


def _kind_lines(rows: list[ModeResult], skipped: list[dict], floor: float) -> list[str]:
    """The floor, auto's pick and the table of one layer mask's rows."""
    ring = next((r for r in rows if r.mode == REFERENCE_MODE), None)
    auto = next((r for r in rows if r.mode == "auto"), None)
    lines = [f"Compute floor: **{floor * 1e3:.2f} ms** per layer (every allowed query-key pair spread evenly over the "
             "CP ranks at that throughput, forward + backward; no mode beats it).", ""]
    if auto is not None:
        lines += [f"`auto` picks **{auto.detail.split(':')[0]}**" + (f" (all-to-all {auto.ulysses})" if auto.ulysses > 1
                                                                      else "")
                  + (f", tile {auto.tile[0]}x{auto.tile[1]}" if auto.tile else "")
                  + f": {auto.time_s * 1e3:.2f} ms per layer, {auto.time_s / floor:.2f}x the floor (the fastest, "
                    f"{TIE_RULE}).", ""]
    lines += ["| mode | all-to-all | tile | bytes sent per rank (one layer, fwd+bwd) | vs ring | predicted fwd+bwd "
              "time (ms, one layer) | exposed comm (ms) | x floor | work max/mean |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        vs = f"{r.bytes_per_rank / ring.bytes_per_rank:.2f}" if ring and ring.bytes_per_rank else "-"
        work = r.extra.get("forward_work_max_over_mean")
        lines.append(f"| {r.mode}{' (formula)' if r.by_formula else ''} | {r.ulysses if r.ulysses > 1 else '-'} | "
                     f"{f'{r.tile[0]}x{r.tile[1]}' if r.tile else '-'} | {format_bytes(r.bytes_per_rank)} | {vs} | "
                     f"{r.time_s * 1e3:.2f} | {r.exposed_comm_s * 1e3:.2f} | {r.time_s / floor:.2f} | "
                     f"{'-' if work is None else f'{work:.2f}'} |")
    return lines + ([""] if skipped else []) + [f"Not available: {s['mode']}: {s['reason']}" for s in skipped]


def prediction_section(path: str = DEFAULT_CONFIG, topo: Topology | None = None) -> str:
    """Markdown: the planner's prediction for the Megatron config at ``path`` on the assumed GPU
    machine (default :func:`machine`), assumptions first; one table per layer mask where the
    layers' masks differ (alternating window / full layers), with the stack's total."""
    problem = read_config(path)
    topo = topo or machine(problem)
    kinds = problem.layer_kinds
    lines = [f"## Prediction for {problem.name} on GPUs (the planner)", "", f"Model: {problem.describe()}.", "",
             _machine_line(problem, topo), ""]
    stack, picks = [], []
    for kind, layers in kinds:
        rows, skipped, floor = predict(problem, topo, kind=kind)
        what = "full attention" if kind == FULL else f"a {kind.window[0]}-token window" if kind.is_band else \
            f"chunks of {kind.size} tokens"
        if len(kinds) > 1:
            lines += [f"### The {layers} layers with {what}", ""]
        lines += _kind_lines(rows, skipped, floor) + [""]
        auto = next((r for r in rows if r.mode == "auto"), None)
        stack.append(None if auto is None else layers * auto.time_s)
        picks.append(None if auto is None else (auto.detail.split(":")[0], auto.ulysses, layers, what))
    if len(kinds) > 1 and None not in stack:
        lines += [f"The stack: **{sum(stack) * 1e3:.2f} ms** of attention per micro-batch, forward + backward, with "
                  f"`auto`'s pick on each kind of layer: {_per_layer_flags(picks, problem.cp)}.", ""]
    lines += [f"Per step a rank sends each layer's bytes ({problem.layers} layers) x its micro-batches (more with "
              "activation recompute, which repeats the forward); sinks (--softmax-type) add no bytes. Work max/mean: "
              "the busiest rank's attention work over the mean (1.00 = balanced); the formula rows (Ulysses and USP "
              "priced analytically) have none."]
    return "\n".join(lines)


# -- the CPU run: measured vs planned ------------------------------------------------------------------
def _tile(text: str) -> tuple[int, int] | None:
    if not text or "," in text:  # no Mesh layer, or layers with different tiles
        return None
    a, b = text.split("x")
    return int(a), int(b)


def _placement(mode: str, tile: str, problem: Problem):
    """The run's placement as the runtime resolves it: its mode and settings ('a2a+mesh:2' -> the
    hybrid with all-to-all degree 2, the job's default when none is given), and the tile it reported
    for a mode that takes one (None: such a run that did not report one tile)."""
    name, settings = parse_mode_spec(mode)
    options = {f.name for f in dataclasses.fields(get_mode(name).Options)}
    if "ulysses_size" in options:
        settings.setdefault("ulysses_size", 2)  # compare_cp_modes' all-to-all degree when the mode names none
    if "tile" in options:
        if _tile(tile) is None:
            return None
        settings["tile"] = _tile(tile)
    return resolve(name, problem.cp, problem.shape, **settings)


def _planned_bytes(placement, problem: Problem, mask: str, window: int | None, cu_seqlens) -> int:
    """The planner's bytes (busiest rank, one micro-batch, forward + backward) of ``placement`` under
    the run's ``mask``, summed over the layers, each with its own window (:attr:`Problem.layer_kinds`:
    the 'window' mask replaces --window-size, as the run's flag does, and keeps the layers that run
    it); documents (``cu_seqlens``) under Megatron's zigzag (docs-zigzag) or else the balanced layout
    of the layers' summed work (per Ulysses group, as the runtime balances them:
    megatron/layout_decision.layer_masks)."""
    topo = Topology.for_cp(problem.cp, problem.cp)  # one machine: every rank on one "node", as the gloo run
    if mask == "window":
        problem = replace(problem, run=replace(problem.run, window_size=(window, 0)))
    shape, layout = problem.shape, None
    if cu_seqlens is not None and mask != "docs-zigzag":  # one layout for every layer: their summed work
        stack = MaskStack.of(k for k, layers in problem.layer_kinds for _ in range(layers))
        layout = balanced_layout(cu_seqlens, problem.cp, group=placement.ulysses, mask=stack)
    total = 0
    for k, layers in problem.layer_kinds:
        if cu_seqlens is None or layout is not None:
            m = k
        elif k.is_band:
            m = Mask.from_cu_seqlens(cu_seqlens, problem.seq_len, True, _window(k))
        else:
            m = Mask(False, None, tuple(zip(cu_seqlens, cu_seqlens[1:]))) & k
        total += layers * evaluate_plan(placement.build(shape, m, layout, topology=topo), shape, topo).bytes_per_rank
    return total


def _planned_text(problem: Problem, draws: int, doc_mean: int | None) -> str:
    """What the measured-vs-planned table's planned bytes are."""
    sh = problem.shape
    own = " (or the first sample of the config's own documents)" if problem.documents is not None else ""
    return (f"Planned: the planner's bytes for the busiest rank of the run's own plan (its mode, all-to-all degree "
            f"and tile; {sh.heads} / {sh.kv_heads} heads, {sh.dims_text}, {sh.seq_local} tokens per rank at CP "
            f"{problem.cp}, {problem.dtype}), summed over the {problem.layers} layers, each with its own mask "
            f"({problem.layers_text()}; the window runs: their width on the same layers), x {problem.micro_batches} "
            "micro-batch(es) per step, forward + backward; "
            "measured: comm_counter's bytes of the busiest rank, mean over the iterations. Documents change from "
            "sample to sample (and the bytes with them): the documents runs are compared with the bytes of the plans "
            "their calls ran (the metrics record them), or, for metrics without them, planned for "
            f"{draws} draws of the job's length distribution (lognormal, mean {doc_mean} tokens){own}: an estimate.")


def measured_vs_planned_section(runs, problem: Problem, window: int | None = None, doc_mean: int | None = None,
                                draws: int = 8) -> str:
    """Markdown: for each CP run (``runs``: the report's RunResults -- mode, mask, cp, tile,
    bytes_per_step), the planner's bytes per rank per step for ``problem`` (the CPU job's config
    at its CP size) next to the measured ones, each layer planned with its own mask. Runs on one
    sequence are planned here from the config, independently of the run; documents differ from
    sample to sample, so a documents run (the docs masks, or a config with its own documents) is
    compared with the bytes of the plans its calls ran (``planned_bytes_per_step``, from the
    metrics), or -- metrics without them -- planned for ``draws`` draws of the job's length
    distribution (lognormal, mean ``doc_mean``, sigma 1) or the config's first sample: an estimate."""
    runs = [r for r in runs if r.cp > 1 and r.ok and r.bytes_per_step is not None]
    if not runs:  # every CP run failed: a heading over nothing would read as a missing table
        return ("## Measured vs planned bytes (this CPU run)\n\nNo CP run finished, so there is nothing measured to "
                "set beside the plans.")
    if any(r.mask in ("docs", "docs-zigzag") for r in runs) and doc_mean is None:
        raise ValueError("planning the documents runs needs their mean length (doc_mean)")
    if any(r.mask == "window" for r in runs) and window is None:
        raise ValueError("planning the window runs needs the window's width (window)")
    draws_cu = [document_bounds(f"lognormal:{doc_mean},1", problem.seq_len, seed) for seed in range(draws)] \
        if doc_mean is not None else []
    lines = ["## Measured vs planned bytes (this CPU run)", "", _planned_text(problem, draws, doc_mean), "",
             "| run | planned bytes per rank per step | measured | measured / planned | note |",
             "|---|---|---|---|---|"]
    for r in runs:
        label = r.mode if r.mask == "none" else f"{r.mode} [{r.mask}]"
        placement = _placement(r.mode, r.tile, problem)
        if placement is None:
            lines.append(f"| {label} | - | {format_bytes(r.bytes_per_step)} | - | no single Mesh tile reported "
                         f"({r.tile or 'none'}) |")
            continue
        samples = draws_cu if r.mask in ("docs", "docs-zigzag") else \
            [problem.documents] if problem.documents is not None else None
        if samples is not None and r.planned_bytes_per_step is not None:
            plan, note = r.planned_bytes_per_step, "the plans the run's calls ran: each batch's own documents"
        elif samples is not None:
            one = [_planned_bytes(placement, problem, r.mask, window, cu) for cu in samples]
            plan = problem.micro_batches * sum(one) / len(one)
            note = f"estimate: mean of {len(one)} document draws" if len(one) > 1 else \
                "estimate: the first sample of the config's data"
        else:
            plan = problem.micro_batches * _planned_bytes(placement, problem, r.mask, window, None)
            note = "the run's own plan: equal when the run moves what it plans"
        ratio = f"{r.bytes_per_step / plan:.3f}" if plan else "-"
        lines.append(f"| {label} | {format_bytes(plan)} | {format_bytes(r.bytes_per_step)} | {ratio} | {note} |")
    return "\n".join(lines)
