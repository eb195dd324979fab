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

import warnings
from dataclasses import dataclass
from typing import Optional

from megatron.core.transformer.transformer_config import TransformerConfig

from ..kernels import KERNEL_BACKENDS
from ..plan import BACKWARD_CHUNKS, CONTIGUOUS, SCHEDULES, AttentionShape, parse_tile
from ..plan.layout import check_ulysses_heads
from ..plan.modes import HYBRID_PREFIX
from ..plan.modes import TRANSPORTS as TASP_TRANSPORTS
from ..plan.tasp import build_tasp_plan, tasp_rings
from . import CP_MODES, PLUGIN_MODES, TE_MODES
from .placement import gpus_per_node, ranks_per_node

__all__ = ["MeshTransformerConfig", "PluginSettings", "add_args", "validate_args", "apply_args", "plugin_settings",
           "layer_modes", "plugin_modes_of", "have_transformer_engine", "uses_plugin_spec", "TASP_TRANSPORTS",
           "megatron_window"]

_MESH = ("mesh", HYBRID_PREFIX + "mesh")
_NODE_AWARE = tuple(m for m in PLUGIN_MODES if m != "ring")


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
    cp_documents: Optional[str] = None
    """Where batches carry document boundaries: 'eod' (from end-of-document tokens, our entry
    script's --reset-attention-mask), 'thd' (packed sequences) or None (whole sequences)."""


# flag -> PluginSettings field, default
_FIELDS = {"mesh_tile_shape": ("tile", "auto"), "mesh_schedule": ("schedule", "greedy"),
           "mesh_backward_chunks": ("backward_chunks", "refetch"), "mesh_contiguous": ("contiguous", "auto"),
           "tasp_gpus_per_node": ("tasp_gpus_per_node", None), "tasp_transport": ("tasp_transport", "p2p"),
           "cp_kernel_backend": ("kernel", "auto")}
# the layer modes a flag applies to (at CP > 1)
_APPLIES_TO = {"mesh_tile_shape": _MESH, "mesh_schedule": _MESH, "mesh_backward_chunks": _MESH,
               "mesh_contiguous": _MESH, "tasp_transport": ("tasp",),
               "tasp_gpus_per_node": _NODE_AWARE,  # the node layout: TASP's rings, Mesh's 'auto' choices, hybrids
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
    g.add_argument("--cp-thd-packing", action="store_true",
                   help="megatron_mesh's entry script: pack each sample's end-of-document-delimited documents "
                        "into Transformer Engine's THD layout (packed_seq_params, qkv_format thd), every document "
                        "padded to a multiple of --cp-thd-pad-multiple; needs --micro-batch-size 1")
    g.add_argument("--cp-thd-pad-multiple", type=int, default=None,
                   help="padding multiple of --cp-thd-packing (a multiple of 2 x CP size; default 2 x CP size)")
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


def plugin_modes_of(modes) -> set:
    """The plugin's modes among ``modes``."""
    return {m for m in modes if m in PLUGIN_MODES}


def megatron_window(window_size) -> tuple | None:
    """Megatron's ``window_size`` (left, right), -1 meaning unlimited, as the plugin's window
    ((left, right), None meaning unlimited), or None for no window."""
    if window_size is None:
        return None
    left, right = window_size
    return (None if left < 0 else int(left), None if right < 0 else int(right))


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
            which = (f"a plugin mode ({', '.join(applies_to)})" if set(applies_to) == set(PLUGIN_MODES)
                     else " or ".join(applies_to))
            raise ValueError(f"{flag}{value} is given, but no layer runs {which} at CP > 1 "
                             f"({runs}); leave the flag out")
    _check_values(args, _mesh_size(args, cp, active))
    _check_window(args, cp, active)
    if cp == 1 and _documents(args) and args.attention_dropout:
        raise ValueError(f"--attention-dropout {args.attention_dropout}: packed documents run the plugin's attention "
                         "also at CP 1 (Megatron's own has no document mask without a dense [s, s] mask), which "
                         "supports only 0 (pass --attention-dropout 0)")
    if active & set(PLUGIN_MODES):
        _check_plugin_layers(args, cp, active, have_te, te_reason)
    _check_hierarchy(args, cp, active)
    _check_thd_flags(args, cp)
    te_layers = sorted(active & set(TE_MODES))
    if _documents(args) == "eod" and te_layers:
        raise ValueError(f"--reset-attention-mask with Transformer Engine layers (--cp-comm-type {te_layers[0]}): "
                         "megatron_mesh's entry script hands the layers end-of-document boundaries per sample, which "
                         "only the plugin modes read; run plugin modes on every layer, or pack the documents for "
                         "Transformer Engine with --cp-thd-packing")
    _warn_per_rank_loss(args, cp)


def _warn_per_rank_loss(args, cp: int) -> None:
    """Warn when Megatron's loss normalisation makes CP > 1 train differently from CP 1: without
    --calculate-per-token-loss each CP rank divides its loss by its own unmasked tokens, which
    differ between ranks when the loss mask does (--eod-mask-loss, THD padding), so the
    gradients weight the ranks' tokens unequally (any CP mode, Transformer Engine's too)."""
    uneven = [flag for flag, name in (("--eod-mask-loss", "eod_mask_loss"), ("--cp-thd-packing", "cp_thd_packing"))
              if getattr(args, name, False)]
    if cp > 1 and uneven and not getattr(args, "calculate_per_token_loss", False):
        warnings.warn(f"{' and '.join(uneven)} at --context-parallel-size {cp} without --calculate-per-token-loss: "
                      "each CP rank divides its loss by its own token count, so the gradients differ from CP 1's "
                      "(add --calculate-per-token-loss to train as CP 1 does)", stacklevel=2)


def _check_window(args, cp: int, active: set) -> None:
    """--window-size LEFT,RIGHT (token counts >= 0, -1 unlimited) and --window-attn-skip-freq
    (N >= 1: every N-th layer full attention; or a 0/1 list with one entry per layer), checked at
    start-up naming the flag instead of failing while the model is built or training silently
    with a misread window. Where the plugin's layers apply the window -- plugin modes at CP > 1,
    and at CP 1 under the plugin's spec (Megatron's own attention has no window mask there) --
    they are causal, so RIGHT must be 0 or -1, and attention dropout must be 0."""
    window = getattr(args, "window_size", None)
    skip = getattr(args, "window_attn_skip_freq", None)
    if window is None:
        return  # Megatron ignores --window-attn-skip-freq then
    text = ",".join(str(w) for w in window)
    if len(window) != 2:
        raise ValueError(f"--window-size {text}: give two values LEFT,RIGHT (keys before and after a query; -1: "
                         "unlimited), e.g. --window-size 4096,0")
    for side, value in zip(("LEFT", "RIGHT"), window):
        if value < -1:
            raise ValueError(f"--window-size {text}: {side} {value} is not allowed; each side is a number of tokens "
                             ">= 0, or -1 (unlimited)")
    if isinstance(skip, int) and skip < 1:
        raise ValueError(f"--window-attn-skip-freq {skip}: an integer N must be >= 1 (every N-th layer runs full "
                         "attention), or give a list of 0/1 per layer, e.g. '[1,1,1,0]'")
    if isinstance(skip, list):
        if len(skip) != args.num_layers:
            raise ValueError(f"--window-attn-skip-freq {skip}: the list needs one entry per layer ({args.num_layers} "
                             f"layers, --num-layers), got {len(skip)}")
        if any(v not in (0, 1) or isinstance(v, bool) for v in skip):
            raise ValueError(f"--window-attn-skip-freq {skip}: entries must be 1 (sliding window) or 0 (full "
                             "attention)")
    plugin = (cp > 1 and active & set(PLUGIN_MODES)) or (cp == 1 and uses_plugin_spec(args))
    if plugin and window[1] not in (-1, 0):  # GPT layers are causal: no later key is attended anyway
        raise ValueError(f"--window-size {text}: the plugin's causal layers attend no later key, so the right side "
                         "must be 0 (or -1, unlimited)")
    if cp == 1 and plugin and args.attention_dropout:
        raise ValueError(f"--attention-dropout {args.attention_dropout}: a sliding window runs the plugin's attention "
                         "also at CP 1 (Megatron's own has no window mask there), which supports only 0 (pass "
                         "--attention-dropout 0)")


def _check_hierarchy(args, cp: int, active: set) -> None:
    """--hierarchical-context-parallel-sizes U M: the all-to-all x inner split of Transformer
    Engine's a2a+p2p and of the plugin's Ulysses hybrids (a2a+mesh, a2a+tasp, a2a+ring); given
    where nothing uses it, or missing where a layer needs it, is an error (never CP silently off)."""
    hcp = getattr(args, "hierarchical_context_parallel_sizes", None)
    hybrids = sorted(m for m in active if m.startswith(HYBRID_PREFIX))
    if hcp and not hybrids:
        raise ValueError(f"--hierarchical-context-parallel-sizes {' '.join(map(str, hcp))} applies only to the "
                         "all-to-all modes (Transformer Engine's a2a+p2p, the plugin's a2a+mesh, a2a+tasp, a2a+ring), "
                         "which no layer runs here at CP > 1: leave it out")
    if not hybrids:
        return
    if not hcp or len(hcp) != 2:
        raise ValueError(f"--cp-comm-type {hybrids[0]} needs --hierarchical-context-parallel-sizes U M (the all-to-all "
                         f"degree U inside a node and the inner CP size M, U * M = --context-parallel-size {cp}); got "
                         f"{'none' if not hcp else ' '.join(map(str, hcp))}")
    U, M = hcp
    if U * M != cp:
        raise ValueError(f"--hierarchical-context-parallel-sizes {U} {M}: U * M must equal --context-parallel-size {cp}")
    plugin_hybrids = [m for m in hybrids if m in PLUGIN_MODES]
    if not plugin_hybrids:
        return  # Transformer Engine's a2a+p2p checks its own
    tp = args.tensor_model_parallel_size
    if getattr(args, "num_attention_heads", None):
        heads = args.num_attention_heads // tp
        groups = args.num_query_groups if getattr(args, "group_query_attention", False) else None
        kv = max(1, (groups or args.num_attention_heads) // tp)
        try:
            check_ulysses_heads(U, heads, kv)
        except ValueError as e:
            raise ValueError(f"--hierarchical-context-parallel-sizes {U} {M} with {heads} query / {kv} key-value heads per "
                             f"tensor-parallel rank: {e}") from None
    gpus = gpus_per_node(PluginSettings(tasp_gpus_per_node=getattr(args, "tasp_gpus_per_node", None)))
    per_node = (gpus // tp) if gpus else None
    if per_node and per_node < cp and per_node % U:
        raise ValueError(f"--hierarchical-context-parallel-sizes {U} {M}: an all-to-all group of {U} CP ranks must stay "
                         f"inside a node of {per_node} CP ranks (GPUs per node {gpus} / TP {tp})")


def _documents(args) -> Optional[str]:
    """How the batches carry documents to the plugin layers: "thd" (--cp-thd-packing), "eod"
    (--reset-attention-mask under megatron_mesh's entry script, which passes the boundaries), or
    None. Another script's --reset-attention-mask is a dense mask: Megatron's own attention reads
    it at CP 1, and the plugin modes refuse it at CP > 1 (see _check_plugin_layers)."""
    from . import bootstrap

    if getattr(args, "cp_thd_packing", False):
        return "thd"
    if getattr(args, "reset_attention_mask", False) and bootstrap.ENTRY_PACKS_DOCUMENTS:
        return "eod"
    return None


def _check_thd_flags(args, cp: int) -> None:
    from . import bootstrap

    if getattr(args, "cp_thd_pad_multiple", None) is not None and not getattr(args, "cp_thd_packing", False):
        raise ValueError(f"--cp-thd-pad-multiple {args.cp_thd_pad_multiple} applies to --cp-thd-packing, which is "
                         "not given: leave it out")
    m = getattr(args, "cp_thd_pad_multiple", None)
    if m is not None and m < 1:  # argparse gives an int
        raise ValueError(f"--cp-thd-pad-multiple must be a positive multiple of 2 x --context-parallel-size "
                         f"= {2 * cp}, got {m!r}")
    if getattr(args, "cp_thd_packing", False):
        if not bootstrap.ENTRY_PACKS_DOCUMENTS:
            raise ValueError("--cp-thd-packing is an option of megatron_mesh's entry script (scripts/pretrain_gpt.sh); "
                             "this script builds its own batches")
        m = args.cp_thd_pad_multiple or 2 * cp
        if m % (2 * cp) or args.seq_length % m:
            raise ValueError(f"--cp-thd-pad-multiple {m} must be a multiple of 2 x --context-parallel-size = {2 * cp} "
                             f"and divide --seq-length {args.seq_length} (Transformer Engine's THD layout pads every "
                             "sequence to a multiple of 2 x CP)")
        if args.micro_batch_size != 1:
            raise ValueError(f"--cp-thd-packing packs one sequence per micro-batch: --micro-batch-size must be 1, got "
                             f"{args.micro_batch_size}")


def _mesh_size(args, cp: int, active: set) -> Optional[int]:
    """The CP size a Mesh tile must fit: the CP size, or a hybrid's inner size M (None: no Mesh)."""
    if "mesh" in active:
        return cp
    hcp = getattr(args, "hierarchical_context_parallel_sizes", None)
    if HYBRID_PREFIX + "mesh" in active and hcp and len(hcp) == 2:
        return hcp[1]
    return None


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
        raise ValueError(f"--attention-dropout {args.attention_dropout}: the plugin modes "
                         f"({', '.join(PLUGIN_MODES)}) support only 0 at CP > 1 (pass --attention-dropout 0)")
    backend = getattr(args, "attention_backend", None)
    if backend is not None and getattr(backend, "name", backend) != "auto":
        raise ValueError(f"--attention-backend {getattr(backend, 'name', backend)}: the {plugin} layers run the plugin's "
                         "own kernels (choose them with --cp-kernel-backend); --attention-backend selects Transformer "
                         "Engine's or Megatron's attention, which these layers do not use: leave it at auto")
    softmax = getattr(args, "softmax_type", "vanilla")
    if softmax != "vanilla":
        raise ValueError(f"--softmax-type {softmax}: the plugin modes support only vanilla")
    for flag in ("sft", "hybrid_context_parallel", "dataloader_inter_document_masking"):
        if getattr(args, flag, False):
            raise ValueError(f"--{flag.replace('_', '-')}: Megatron's {flag.replace('_', ' ')} batches are not supported by "
                             "the plugin modes; pack documents with megatron_mesh's entry script instead "
                             "(--reset-attention-mask: documents at end-of-document tokens, or --cp-thd-packing: "
                             "Transformer Engine's THD layout)")
    from . import bootstrap

    documents = getattr(args, "reset_attention_mask", False) or getattr(args, "cp_thd_packing", False)
    if documents and args.pipeline_model_parallel_size > 1:
        raise ValueError(f"--pipeline-model-parallel-size {args.pipeline_model_parallel_size} with packed documents "
                         "(--reset-attention-mask / --cp-thd-packing): the document boundaries reach only the first and "
                         "last pipeline stages' batches; use pipeline parallelism 1")
    if getattr(args, "reset_attention_mask", False) and not bootstrap.ENTRY_PACKS_DOCUMENTS:
        raise ValueError("--reset-attention-mask: this entry script passes the documents as a dense [s, s] attention mask, "
                         "which the plugin modes do not read; use megatron_mesh's entry script (scripts/pretrain_gpt.sh), "
                         "which hands them the document boundaries")
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
    config.cp_documents = _documents(args)
