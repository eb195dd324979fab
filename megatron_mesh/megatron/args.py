"""The plugin's command-line flags, their validation, and the config that carries them.

Flags are added through Megatron's ``extra_args_provider`` hook (:func:`add_args`) and checked by
:func:`validate_args` at start-up, before Megatron initialises anything. Whatever the entry
script, the spec functions put the settings and the real sequence length from Megatron's parsed
arguments on the transformer config (:func:`apply_args`), which modules read with
:func:`plugin_settings` (defaults for what a config does not carry).

A plugin flag left out is ``None`` on the arguments (so a flag given but unable to apply -- a Mesh
flag without a Mesh layer -- is an error) and its default on the config.

Example (CP 4, 4 layers: Mesh tile 2x2 for the first two, TASP for the last two)::

    --context-parallel-size 4 --cp-comm-type mesh mesh tasp tasp --mesh-tile-shape 2x2
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from megatron.core.transformer.transformer_config import TransformerConfig

from ..kernels import KERNEL_BACKENDS
from ..plan import BACKWARD_CHUNKS, CONTIGUOUS, SCHEDULES, AttentionShape, Topology, parse_tile
from ..plan.autotile import pick_best, rank_tiles
from ..plan.modes import TRANSPORTS as TASP_TRANSPORTS
from ..plan.tasp import build_tasp_plan, tasp_rings
from . import CP_MODES, PLUGIN_MODES, TE_MODES

__all__ = ["MeshTransformerConfig", "PluginSettings", "add_args", "validate_args", "apply_args", "plugin_settings",
           "layer_modes", "resolve_tile", "have_transformer_engine", "uses_plugin_spec", "TASP_TRANSPORTS"]


@dataclass
class MeshTransformerConfig(TransformerConfig):
    """TransformerConfig plus the plugin's settings (one field per flag of :func:`add_args`)."""

    mesh_tile_shape: str = "auto"
    """Mesh tile 'AxB' (A query chunks x B key/value chunks per rank, A*B = CP size) or 'auto'."""
    mesh_schedule: str = "greedy"
    """Order of the Mesh pulls: 'greedy' (compute unlocked per byte) or 'lockstep'."""
    mesh_backward_chunks: str = "refetch"
    """'refetch' Q/KV chunks in the backward (less memory) or 'keep' them from the forward."""
    mesh_contiguous: str = "auto"
    """Which Mesh ring is made of consecutive CP ranks (shares a node): 'q', 'kv' or 'auto'."""
    tasp_gpus_per_node: Optional[int] = None
    """GPUs per node for TASP's node-aware rings; None: torchrun's LOCAL_WORLD_SIZE."""
    tasp_transport: str = "p2p"
    """TASP transfers as point-to-point sends ('p2p') or all-to-all collectives ('alltoall')."""
    cp_kernel_backend: str = "auto"
    """Block attention kernel of the plugin modes (see megatron_mesh.kernels.KERNEL_BACKENDS)."""
    cp_seq_length: Optional[int] = None
    """Global sequence length (from --seq-length), for the time model behind the 'auto' choices."""


# flag -> PluginSettings field, default
_FIELDS = {"mesh_tile_shape": ("tile", "auto"), "mesh_schedule": ("schedule", "greedy"),
           "mesh_backward_chunks": ("backward_chunks", "refetch"), "mesh_contiguous": ("contiguous", "auto"),
           "tasp_gpus_per_node": ("tasp_gpus_per_node", None), "tasp_transport": ("tasp_transport", "p2p"),
           "cp_kernel_backend": ("kernel", "auto")}
# the layer modes a flag applies to (at CP > 1)
_APPLIES_TO = {"mesh_tile_shape": ("mesh",), "mesh_schedule": ("mesh",), "mesh_backward_chunks": ("mesh",),
               "mesh_contiguous": ("mesh",), "tasp_transport": ("tasp",),
               "tasp_gpus_per_node": ("tasp", "mesh"),  # the node layout: TASP's rings, Mesh's 'auto' choices
               "cp_kernel_backend": PLUGIN_MODES, "log_cp_attention_bytes": PLUGIN_MODES}


@dataclass(frozen=True)
class PluginSettings:
    tile: str = "auto"
    schedule: str = "greedy"
    backward_chunks: str = "refetch"
    contiguous: str = "auto"
    tasp_gpus_per_node: Optional[int] = None
    tasp_transport: str = "p2p"
    kernel: str = "auto"


def plugin_settings(config) -> PluginSettings:
    """The plugin settings carried by ``config`` (defaults for fields it lacks or leaves None)."""
    values = {}
    for name, (field, default) in _FIELDS.items():
        value = getattr(config, name, None)
        values[field] = default if value is None else value
    values["tile"] = str(values["tile"])
    return PluginSettings(**values)


def add_args(parser):
    """``extra_args_provider`` for ``megatron.training.arguments.parse_and_validate_args``.

    Defaults are None ("not given"): :func:`plugin_settings` supplies the real defaults, and
    :func:`validate_args` rejects a flag given for a mode no layer runs."""
    g = parser.add_argument_group("megatron_mesh", "context-parallel attention modes mesh, tasp, ring "
                                  "(--cp-comm-type mesh|tasp|ring, one value or one per layer)")
    g.add_argument("--mesh-tile-shape", default=None,
                   help="Mesh tile AxB: each CP rank computes A query chunks x B key/value chunks "
                        "(A*B = CP size; 1xCP is ring attention), or 'auto' (default): the tile the planner "
                        "predicts fastest (python -m megatron_mesh.plan shows why)")
    g.add_argument("--mesh-schedule", default=None, choices=SCHEDULES,
                   help="order of the Mesh pulls (default greedy)")
    g.add_argument("--mesh-backward-chunks", default=None, choices=BACKWARD_CHUNKS,
                   help="re-communicate Q/KV chunks in the backward (refetch, default) or keep them (more memory)")
    g.add_argument("--mesh-contiguous", default=None, choices=CONTIGUOUS + ("auto",),
                   help="which Mesh ring is made of consecutive CP ranks, i.e. stays inside a node "
                        "('auto', default: the planner's faster one)")
    g.add_argument("--tasp-gpus-per-node", type=int, default=None,
                   help="GPUs per node for TASP's node-aware rings and Mesh's 'auto' choices "
                        "(default: torchrun's LOCAL_WORLD_SIZE)")
    g.add_argument("--tasp-transport", default=None, choices=TASP_TRANSPORTS,
                   help="TASP transfers as point-to-point sends (p2p, default) or all-to-all collectives")
    g.add_argument("--cp-kernel-backend", default=None, choices=KERNEL_BACKENDS,
                   help="block attention kernel of the plugin modes (default auto)")
    g.add_argument("--log-cp-attention-bytes", action="store_true",
                   help="log the plugin's attention bytes per iteration (min and max over ranks) at every "
                        "--log-interval, and write them to TensorBoard when a writer is set up")
    g.add_argument("--cp-metrics-dir", default=None,
                   help="write per-rank JSON lines (rank<R>.jsonl) to this directory: the mode and tile of "
                        "every layer, then loss, time, attention bytes and peak memory per iteration")
    return parser


def have_transformer_engine() -> tuple[bool, str]:
    """(installed and usable, why not). TE raises RuntimeError/OSError, not only ImportError,
    when its CUDA libraries are missing, so anything it raises means 'not usable'."""
    try:
        import transformer_engine  # noqa: F401
        from megatron.core.extensions.transformer_engine import HAVE_TE
    except Exception as e:  # noqa: BLE001
        return False, f"{type(e).__name__}: {e}"
    return bool(HAVE_TE), "" if HAVE_TE else "megatron.core reports HAVE_TE=False"


def layer_modes(cp_comm_type) -> list:
    """cp_comm_type as a list (a single mode -> one entry); None -> []."""
    if cp_comm_type is None:
        return []
    return [cp_comm_type] if isinstance(cp_comm_type, str) else list(cp_comm_type)


def check_modes(modes, num_layers: int, cp_size: int, have_te: bool, te_reason: str = "") -> None:
    """ValueError unless every mode is known, the list fits the layers, and TE modes have TE."""
    for m in modes:
        if m not in CP_MODES:
            hint = " (Transformer Engine spells it 'all_gather')" if m == "allgather" else ""
            raise ValueError(f"--cp-comm-type {m!r} is not a context-parallel mode{hint}; allowed: plugin modes "
                             f"{', '.join(PLUGIN_MODES)}; Transformer Engine modes {', '.join(TE_MODES)}")
    if len(modes) not in (0, 1, num_layers):
        raise ValueError(f"--cp-comm-type has {len(modes)} values; give one mode, or one per layer "
                         f"({num_layers} layers)")
    te_used = sorted({m for m in modes if m in TE_MODES})
    if cp_size > 1 and te_used and not have_te:
        instead = ("use ring (the same algorithm: zigzag ring attention)" if te_used == ["p2p"]
                   else f"use one of {', '.join(PLUGIN_MODES)}")
        raise ValueError(f"--cp-comm-type {te_used[0]} is a Transformer Engine mode, but Transformer Engine is "
                         f"not usable here ({te_reason or 'not installed'}); {instead}")


def uses_plugin_spec(args) -> bool:
    """Whether ``--spec`` names one of this package's spec functions."""
    return bool(args.spec) and str(args.spec[0]).startswith("megatron_mesh.")


def _given(args, name: str) -> bool:
    value = getattr(args, name, None)
    return value is not None and value is not False


def validate_args(args, have_te: bool | None = None) -> None:
    """Check the plugin flags and the Megatron flags they depend on, as parsed by Megatron (before
    its own validation); ValueError names the value and what is allowed. ``have_te``: None detects
    Transformer Engine. Works on arguments without the plugin's flags too (none given)."""
    te_reason = ""
    if have_te is None:
        have_te, te_reason = have_transformer_engine()
    cp = args.context_parallel_size
    modes = layer_modes(args.cp_comm_type)
    check_modes(modes, args.num_layers, cp, have_te, te_reason)
    if uses_plugin_spec(args) and args.transformer_impl == "transformer_engine" and not have_te:
        raise ValueError("--transformer-impl transformer_engine (Megatron's default) needs Transformer Engine, which "
                         f"is not usable here ({te_reason or 'not installed'}); pass --transformer-impl local")
    active = set(modes) if cp > 1 else set()  # CP 1: Megatron's own attention, whatever the mode
    for name, applies_to in _APPLIES_TO.items():
        if _given(args, name) and not active & set(applies_to):
            flag = f"--{name.replace('_', '-')}"
            value = "" if getattr(args, name) is True else f" {getattr(args, name)}"
            runs = f"--context-parallel-size {cp}" if cp == 1 else f"--cp-comm-type {' '.join(modes)}"
            raise ValueError(f"{flag}{value} is given, but no layer runs {' or '.join(applies_to)} at CP > 1 "
                             f"({runs}); leave the flag out")
    _check_values(args, cp if "mesh" in active else None)
    if active & set(PLUGIN_MODES):
        _check_plugin_layers(args, cp, active, have_te, te_reason)
    hcp = getattr(args, "hierarchical_context_parallel_sizes", None)
    if hcp and "a2a+p2p" not in active:
        raise ValueError(f"--hierarchical-context-parallel-sizes {' '.join(map(str, hcp))} applies only to "
                         "Transformer Engine's a2a+p2p, which no layer runs here; the plugin modes take their layout "
                         "from --mesh-tile-shape (mesh) and --tasp-gpus-per-node (tasp): leave it out")


def _check_values(args, mesh_cp: Optional[int]) -> None:
    """The plugin flags' own values (choices are also argparse's, for arguments built elsewhere)."""
    tile = getattr(args, "mesh_tile_shape", None)
    if tile is not None:
        try:
            parse_tile(tile, mesh_cp if mesh_cp else _tile_area(tile))
        except ValueError as e:
            raise ValueError(f"--mesh-tile-shape {tile!r}: {e}") from None
    for name, allowed in (("mesh_schedule", SCHEDULES), ("mesh_backward_chunks", BACKWARD_CHUNKS),
                          ("mesh_contiguous", CONTIGUOUS + ("auto",)), ("tasp_transport", TASP_TRANSPORTS),
                          ("cp_kernel_backend", KERNEL_BACKENDS)):
        value = getattr(args, name, None)
        if value is not None and value not in allowed:
            raise ValueError(f"--{name.replace('_', '-')} {value!r}: allowed {', '.join(allowed)}")
    gpus = getattr(args, "tasp_gpus_per_node", None)
    if gpus is not None and gpus < 1:
        raise ValueError(f"--tasp-gpus-per-node must be >= 1, got {gpus}")


def _check_plugin_layers(args, cp: int, active: set, have_te: bool, te_reason: str) -> None:
    """What layers running mesh / tasp / ring at CP > 1 need from the rest of the command line."""
    plugin = ", ".join(m for m in PLUGIN_MODES if m in active)
    if not args.spec or args.spec[0] == "local":
        raise ValueError(f"--cp-comm-type {plugin} needs the plugin's layer spec: add --spec megatron_mesh.megatron.spec "
                         "gpt_layer_spec (Megatron's own spec has no plugin attention)")
    if args.attention_dropout:
        raise ValueError(f"--attention-dropout {args.attention_dropout}: the {'/'.join(PLUGIN_MODES)} modes "
                         "support only 0 at CP > 1 (pass --attention-dropout 0)")
    backend = getattr(args, "attention_backend", None)
    if backend is not None and getattr(backend, "name", backend) != "auto":
        raise ValueError(f"--attention-backend {getattr(backend, 'name', backend)}: the {plugin} layers run the plugin's "
                         "own kernels (choose them with --cp-kernel-backend); --attention-backend selects Transformer "
                         "Engine's or Megatron's attention, which these layers do not use: leave it at auto")
    if getattr(args, "window_size", None) is not None:
        raise ValueError(f"--window-size {args.window_size}: sliding-window attention is not supported by "
                         "the plugin modes")
    softmax = getattr(args, "softmax_type", "vanilla")
    if softmax != "vanilla":
        raise ValueError(f"--softmax-type {softmax}: the plugin modes support only vanilla")
    for flag in ("sft", "hybrid_context_parallel", "dataloader_inter_document_masking", "reset_attention_mask"):
        if getattr(args, flag, False):
            raise ValueError(f"--{flag.replace('_', '-')}: packed or document-masked sequences are not supported by "
                             "the plugin modes (they attend over whole sequences)")
    if "tasp" in active:
        _check_tasp(args, cp)


def _check_tasp(args, cp: int) -> None:
    """TASP's node layout and minimum sequence length, checked at start-up rather than at the
    first TASP layer. Uses Megatron's default rank order (TP innermost, then CP: CP group 0 is
    ranks 0, tp, 2*tp, ...); other orders are checked when the groups are built."""
    tp = args.tensor_model_parallel_size
    gpus = gpus_per_node(PluginSettings(tasp_gpus_per_node=getattr(args, "tasp_gpus_per_node", None)))
    try:
        per_node = ranks_per_node(tuple(i * tp for i in range(cp)), gpus)
        if per_node is not None and per_node < cp:
            tasp_rings(cp, per_node)  # raises where chained Hamiltonian paths do not exist
    except ValueError as e:
        raise ValueError(f"--tasp-gpus-per-node {gpus} with --context-parallel-size {cp} and "
                         f"--tensor-model-parallel-size {tp}: {e}") from None
    seq = getattr(args, "seq_length", None)
    if seq:
        shape = AttentionShape(seq_local=seq // cp, batch=1, heads=1, kv_heads=1, head_dim=1, itemsize=4)
        try:
            build_tasp_plan(cp, shape, gpus_per_node=per_node if per_node and per_node < cp else None)
        except ValueError as e:
            raise ValueError(f"--seq-length {seq} with --context-parallel-size {cp}: {e}") from None


def node_blocks(cp_ranks: tuple[int, ...], gpus: Optional[int]) -> list[tuple[int, ...]]:
    """The CP ranks (indices into ``cp_ranks``, global ranks) that share a node, node by node."""
    if not gpus:
        return [tuple(range(len(cp_ranks)))]
    nodes: dict[int, list[int]] = {}
    for i, g in enumerate(cp_ranks):
        nodes.setdefault(g // gpus, []).append(i)
    return [tuple(v) for _, v in sorted(nodes.items())]


def ranks_per_node(cp_ranks: tuple[int, ...], gpus: Optional[int]) -> Optional[int]:
    """CP ranks per node for TASP (None: the whole CP group shares one node). Nodes must hold
    equal, consecutive blocks of CP ranks -- Megatron's rank order gives that."""
    blocks = node_blocks(cp_ranks, gpus)
    if len(blocks) == 1:
        return None
    n = len(blocks[0])
    if any(block != tuple(range(i * n, (i + 1) * n)) for i, block in enumerate(blocks)):
        raise ValueError(f"CP group {list(cp_ranks)} spans nodes unevenly ({blocks} by CP rank); TASP needs the "
                         "same number of consecutive CP ranks on every node (check --tasp-gpus-per-node)")
    return n


def _tile_area(tile) -> int:
    """a*b of an 'AxB' string (syntax check only; the CP size is checked where a mesh layer runs)."""
    if isinstance(tile, str) and tile != "auto":
        parts = tile.lower().split("x")
        if len(parts) == 2 and all(p.strip().isdigit() for p in parts):
            return int(parts[0]) * int(parts[1])
    return 1


def apply_args(args, config) -> None:
    """Put the plugin settings of Megatron's parsed ``args`` (defaults for flags it lacks) and the
    global sequence length on ``config`` -- a plain TransformerConfig too: what any entry script
    builds with ``core_transformer_config_from_args(args)``."""
    for name in _FIELDS:
        setattr(config, name, getattr(args, name, None))
    config.cp_seq_length = getattr(args, "seq_length", None)


def shape_from_config(config) -> AttentionShape:
    """Per-rank attention shape implied by ``config`` (sequence length 2: byte counts are linear in
    it, so the best tile does not depend on it)."""
    tp = config.tensor_model_parallel_size
    heads = max(1, config.num_attention_heads // tp)
    groups = config.num_query_groups or config.num_attention_heads
    kv_heads = max(1, groups // tp)
    itemsize = 4 if str(config.params_dtype) == "torch.float32" else 2
    return AttentionShape(seq_local=2, batch=1, heads=heads, kv_heads=kv_heads,
                          head_dim=config.kv_channels, itemsize=itemsize)


# Time-model defaults when the flags do not say: a sequence length per rank for configs built
# outside the entry script (bytes scale linearly with it; the fastest tile depends on it mildly).
_DEFAULT_SEQ_LOCAL = 8192


def resolve_tile(cp_size: int, config) -> tuple[tuple[int, int], str]:
    """The Mesh tile and rank order ("q"/"kv") of ``config`` for a CP group of ``cp_size``.

    The ONE place that chooses them. An 'AxB' tile and a 'q'/'kv' order are taken as given; for
    'auto' the planner's simulator (as :func:`megatron_mesh.plan.autotile.choose_tile`) predicts every
    candidate on the machine -- CP ranks per node from --tasp-gpus-per-node or torchrun's
    LOCAL_WORLD_SIZE divided by the TP size, H100 NVLink / 400 Gb/s InfiniBand defaults -- and the
    fastest allowed one wins. Deterministic: every rank computes the same answer.
    """
    s = plugin_settings(config)
    tile = parse_tile(s.tile, cp_size)
    if tile != "auto" and s.contiguous != "auto":
        return tile, s.contiguous
    shape = shape_from_config(config)
    seq_length = getattr(config, "cp_seq_length", None)
    seq_local = seq_length // cp_size if seq_length else _DEFAULT_SEQ_LOCAL
    shape = AttentionShape(seq_local=max(2, seq_local - seq_local % 2), batch=1, heads=shape.heads,
                           kv_heads=shape.kv_heads, head_dim=shape.head_dim, itemsize=shape.itemsize)
    allowed = [c for c in rank_tiles(cp_size, shape, _topology(cp_size, config, s), backward_chunks=s.backward_chunks,
                                     schedule=s.schedule)
               if (tile == "auto" or c.tile == tile) and s.contiguous in ("auto", c.contiguous)]
    best = pick_best(allowed)  # the same tie-breaks as plan.autotile.choose_tile
    return best.tile, best.contiguous


def _topology(cp_size: int, config, settings: "PluginSettings") -> Topology:
    """The CP group as nodes x CP ranks per node (consecutive CP ranks share a node: Megatron's
    tp-cp-... rank order puts TP ranks innermost, so a node holds GPUs / TP consecutive CP ranks)."""
    gpus = gpus_per_node(settings)
    tp = getattr(config, "tensor_model_parallel_size", 1) or 1
    per_node = max(1, min(cp_size, gpus // tp)) if gpus else cp_size
    if cp_size % per_node:
        per_node = cp_size  # uneven split: model the group as one node
    return Topology(nodes=cp_size // per_node, gpus_per_node=per_node)


def gpus_per_node(settings: PluginSettings) -> Optional[int]:
    """GPUs per node for TASP: the flag, else torchrun's LOCAL_WORLD_SIZE, else None (one node)."""
    if settings.tasp_gpus_per_node is not None:
        return settings.tasp_gpus_per_node
    local = os.environ.get("LOCAL_WORLD_SIZE")
    return int(local) if local else None
