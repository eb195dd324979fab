"""The plugin's start-up checks on Megatron's parsed arguments: a bad or inapplicable setting is
one ValueError naming the flag, the value and what is allowed, before anything is built.

What applies where comes from the settings schema (:func:`.settings.flags`: every flag knows the
layer modes it applies to); what a mode accepts from the mode registry. The checks take what they
need as parameters -- whether the entry script hands the layers document boundaries
(``entry_packs_documents``), whether Transformer Engine is usable -- and read no process state;
the file system (the datasets the flags name, the metrics directory) is :mod:`.data_checks`'s.

Example: ``--cp-comm-type ring --mesh-tile-shape 2x2`` fails with "--mesh-tile-shape 2x2 is given,
but no layer runs mesh or a2a+mesh at CP > 1 (--cp-comm-type ring); leave the flag out". A setting
that matters only at CP > 1 is accepted at CP 1, so one config serves the CP 1 baseline and the CP
runs: ``--context-parallel-size 1 --cp-comm-type mesh --mesh-tile-shape 2x2`` passes, and
:func:`validate_args` returns "--mesh-tile-shape 2x2" among the settings unused there (the
start-up logs them once).

The plugin's settings are read from the arguments once (:class:`~.settings.PluginSettings`, which
checks their values) and the run's attention problem with them (:func:`~.settings.problem_of`:
heads, sizes, Ulysses degree, window); the checks read those, and Megatron's other flags.
"""

from __future__ import annotations

import os
import warnings

from ..plan.layouts import DEFAULT_LAYOUT, LAYOUTS, REFERENCE_LAYOUT, cp_layout_names
from ..plan.megatron_problem import CHUNK_FLAG, THD_DOCUMENTS, MegatronProblem
from ..plan.modes import HYBRID_PREFIX, get_mode
from . import TE_MODES, cp_modes, plugin_modes
from .layout_decision import layout_sample
from .placement import resolve_placement
from .settings import (ALL_PLUGIN_MODES, BATCH_DOCUMENTS, HIERARCHY_FLAG, NODES_FLAG, PluginSettings, flags,
                       layer_modes, plugin_modes_of, problem_of)

__all__ = ["validate_args", "check_modes", "have_transformer_engine", "uses_plugin_spec"]


def have_transformer_engine() -> tuple[bool, str]:
    """(installed and usable, why not). TE raises RuntimeError/OSError, not only ImportError,
    when its CUDA libraries are missing, so anything it raises means 'not usable'."""
    try:
        import transformer_engine  # noqa: F401
        from megatron.core.extensions.transformer_engine import HAVE_TE
    except Exception as e:  # noqa: BLE001
        return False, f"{type(e).__name__}: {e}"
    return bool(HAVE_TE), "" if HAVE_TE else "megatron.core reports HAVE_TE=False"




def check_modes(modes, num_layers: int, cp_size: int, have_te: bool, te_reason: str = "") -> None:
    """ValueError unless every mode is known, the list fits the layers, and TE modes have TE."""
    for m in modes:
        if m not in cp_modes():
            hint = " (Transformer Engine spells it 'all_gather')" if m == "allgather" else ""
            raise ValueError(f"--cp-comm-type {m!r} is not a context-parallel mode{hint}; allowed: plugin modes "
                             f"{', '.join(plugin_modes())}; Transformer Engine modes {', '.join(TE_MODES)}")
    if len(modes) not in (0, 1, num_layers):
        raise ValueError(f"--cp-comm-type has {len(modes)} values; give one mode, or one per layer "
                         f"({num_layers} layers)")
    te_used = sorted({m for m in modes if m in TE_MODES})
    if cp_size > 1 and te_used and not have_te:
        instead = ("use ring (the same algorithm: zigzag ring attention)" if te_used == ["p2p"]
                   else f"use one of {', '.join(plugin_modes())}")
        default = " (also Megatron's default where --cp-comm-type is not given)" if te_used[0] == "p2p" else ""
        raise ValueError(f"--cp-comm-type {te_used[0]}{default} is a Transformer Engine mode, but Transformer Engine "
                         f"is not usable here ({te_reason or 'not installed'}); {instead}")




def uses_plugin_spec(args) -> bool:
    """Whether ``--spec`` names one of this package's spec functions."""
    return bool(args.spec) and str(args.spec[0]).startswith("megatron_mesh.")


def validate_args(args, have_te: bool | None = None, *, entry_packs_documents: bool = False,
                  batch_documents: bool = False, have_cuda: bool | None = None) -> list[str]:
    """Check the plugin flags and the Megatron flags they depend on, as parsed by Megatron (before
    its own validation); ValueError names the value and what is allowed. ``have_te``: None detects
    Transformer Engine; ``entry_packs_documents``: the entry script hands the layers document
    boundaries (megatron_mesh's own does); ``batch_documents``: :mod:`.batch_layout` takes them from
    the script's batches (``run_script``: Megatron-LM's own scripts); ``have_cuda``: None asks
    torch (the run's tensors are on CUDA devices where it has them). Works on arguments without
    the plugin's flags too. Returns the settings given that matter only at CP > 1, at CP 1 (e.g.
    ``["--cp-layout zigzag"]``): accepted, for the caller to say once that they go unused."""
    te_reason = ""
    if have_te is None:
        have_te, te_reason = have_transformer_engine()
    if have_cuda is None:
        import torch

        have_cuda = torch.cuda.is_available()
    cp = args.context_parallel_size
    seq = getattr(args, "seq_length", None)
    if cp > 1 and isinstance(seq, int) and seq % (2 * cp):  # Megatron asserts it later, once per rank
        raise ValueError(f"--seq-length {seq} must be divisible by 2 x --context-parallel-size ({2 * cp}): each CP rank "
                         f"holds two equal halves of the sequence (e.g. --seq-length {seq // (2 * cp) * 2 * cp or 2 * cp})")
    modes = layer_modes(args.cp_comm_type)
    check_modes(modes, args.num_layers, cp, have_te, te_reason)
    if uses_plugin_spec(args) and args.transformer_impl == "transformer_engine" and not have_te:
        raise ValueError("--transformer-impl transformer_engine (Megatron's default) needs Transformer Engine, which "
                         f"is not usable here ({te_reason or 'not installed'}); pass --transformer-impl local")
    _check_plugin_spec(args, have_te, te_reason)
    settings = PluginSettings.from_args(args, entry_packs_documents=entry_packs_documents,
                                        batch_documents=batch_documents)  # ValueError: a value no flag takes
    problem = problem_of(args, settings)
    documents = settings.documents
    active = set(modes) if cp > 1 else set()  # CP 1: Megatron's own attention, whatever the mode
    # at CP 1 the plugin's single-rank attention still runs where a mask needs it (documents, a window, chunks)
    single = cp == 1 and bool(documents or (problem.window_size or problem.chunk_size) and uses_plugin_spec(args))
    _check_chunks(args, problem, cp, modes)  # before the applicability check: it says what chunks need
    unused = _check_applicable(settings, cp, modes, active, single)
    _check_backend(settings.cp_kernel_backend, active, have_cuda)
    _check_window(args, problem, cp, active)
    if cp == 1 and documents and args.attention_dropout:
        raise ValueError(f"--attention-dropout {args.attention_dropout}: packed documents run the plugin's attention "
                         "also at CP 1 (Megatron's own has no document mask without a dense [s, s] mask), which "
                         "supports only 0 (pass --attention-dropout 0)")
    if documents:  # at CP 1 too: documents run the plugin's attention there as well
        _check_schedule_with_documents(args)
    _check_hierarchy(problem, cp, active)
    for mode in sorted(plugin_modes_of(active)):
        _check_placement(args, settings, problem, mode)
    if active & set(plugin_modes()):
        _check_plugin_layers(args, settings, cp, active, entry_packs_documents or batch_documents)
    _check_thd_flags(args, settings, cp, entry_packs_documents)
    te_layers = sorted(active & set(TE_MODES))
    if documents == "eod" and te_layers:
        raise ValueError(f"--reset-attention-mask with Transformer Engine layers (--cp-comm-type {te_layers[0]}): "
                         "megatron_mesh's entry script hands the layers end-of-document boundaries per sample, which "
                         "only the plugin modes read; run plugin modes on every layer, or pack the documents for "
                         "Transformer Engine with --cp-thd-packing")
    unused += _check_layout(args, settings, problem, cp)
    _warn_per_rank_loss(args, settings, cp)
    return unused


def _check_backend(backend: str, active: set, have_cuda: bool) -> None:
    if active and backend.startswith("torch-") and not have_cuda:
        raise ValueError(f"--cp-kernel-backend {backend} runs on CUDA devices, and this machine has none; allowed here: "
                         "auto, torch, math")


def _check_applicable(settings: PluginSettings, cp: int, modes, active: set, single: bool) -> list[str]:
    """A flag given where no layer runs a mode it applies to is an error (never silently unused),
    unless it would apply at CP > 1: at CP 1 it is accepted and returned (the CP 1 baseline of
    the CP runs' config). ``single``: the plugin's single-rank attention runs at CP 1 (the
    general flags of every plugin mode apply to it)."""
    unused = []
    for f in flags():
        applies_to = f.modes()
        if applies_to is None or f.dest not in settings.given or active & set(applies_to):
            continue
        if single and f.applies_to == ALL_PLUGIN_MODES:
            continue
        if cp == 1 and set(modes) & set(applies_to):
            unused.append(settings.shown(f))
            continue
        runs = f"--context-parallel-size {cp}" if cp == 1 else f"--cp-comm-type {' '.join(modes)}"
        which = (f"a plugin mode ({', '.join(applies_to)})" if set(applies_to) == set(plugin_modes())
                 else " or ".join(applies_to))
        raise ValueError(f"{settings.shown(f)} is given, but no layer runs {which} at CP > 1 ({runs}); leave the flag "
                         "out")
    return unused


def _check_placement(args, settings: PluginSettings, problem: MegatronProblem, mode: str) -> None:
    """The mode's own start-up check: resolve (and build) its placement for these arguments -- the
    sequence length, the heads per tensor-parallel rank, the node layout, its options -- so a
    setting the mode refuses stops the run here, naming the flags, not at the first layer."""
    cp = problem.cp
    given = [settings.shown(f) for f in flags()
             if f.option is not None and mode in (f.modes() or ()) and f.dest in settings.given]
    if problem.hierarchy and mode.startswith(HYBRID_PREFIX):  # the errors name its all-to-all degree: say whence
        given.append(f"{HIERARCHY_FLAG} {' '.join(str(x) for x in problem.hierarchy)}")
    if settings.tasp_gpus_per_node is not None and get_mode(mode).uses_nodes:
        given.append(f"{NODES_FLAG} {settings.tasp_gpus_per_node}")
    try:
        placement = resolve_placement(mode, args, tuple(i * problem.tp for i in range(cp)))
        if problem.seq_len:
            placement.build(problem.shape(cp))
    except ValueError as e:
        if "per node" in str(e) and NODES_FLAG not in " ".join(given) and os.environ.get("LOCAL_WORLD_SIZE"):
            given.append(f"{os.environ['LOCAL_WORLD_SIZE']} processes per node")  # where the nodes come from
        setup = f"--cp-comm-type {mode} at --context-parallel-size {cp}" + (f" with {', '.join(given)}" if given else "")
        raise ValueError(f"{setup}: {e}") from None


def _warn_per_rank_loss(args, settings: PluginSettings, cp: int) -> None:
    """Warn when Megatron's loss normalisation makes CP > 1 train differently from CP 1: without
    --calculate-per-token-loss each CP rank divides its loss by its own unmasked tokens, which
    differ between ranks when the loss mask does (--eod-mask-loss, THD padding), so the
    gradients weight the ranks' tokens unequally (any CP mode, Transformer Engine's too)."""
    uneven = [flag for flag, on in (("--eod-mask-loss", getattr(args, "eod_mask_loss", False)),
                                    ("--cp-thd-packing", settings.cp_thd_packing)) if on]
    if cp > 1 and uneven and not getattr(args, "calculate_per_token_loss", False):
        warnings.warn(f"{' and '.join(uneven)} at --context-parallel-size {cp} without --calculate-per-token-loss: "
                      "each CP rank divides its loss by its own token count, so the gradients differ from CP 1's "
                      "(add --calculate-per-token-loss to train as CP 1 does)", stacklevel=2)


def _check_window(args, problem, cp: int, active: set) -> None:
    """--window-size LEFT,RIGHT (token counts >= 0, -1 unlimited: :func:`megatron_mesh.plan.window.megatron_window`)
    and --window-attn-skip-freq (N >= 1: every N-th layer full attention; or a 0/1 list with one
    entry per layer), checked at start-up naming the flag instead of failing while the model is
    built or training silently with a misread window. Where the plugin's layers apply the window --
    plugin modes at CP > 1, and at CP 1 under the plugin's spec (Megatron's own attention has no
    window mask there) -- they are causal, so RIGHT must be 0 or -1, and attention dropout must be 0."""
    if problem.window_size is None:
        return  # Megatron ignores --window-attn-skip-freq then
    plugin = (cp > 1 and active & set(plugin_modes())) or (cp == 1 and uses_plugin_spec(args))
    # the values and the layers that run the window: the check the planner's prediction runs too
    problem.layer_windows(causal=bool(plugin))
    if cp == 1 and plugin and args.attention_dropout:
        raise ValueError(f"--attention-dropout {args.attention_dropout}: a sliding window runs the plugin's attention "
                         "also at CP 1 (Megatron's own has no window mask there), which supports only 0 (pass "
                         "--attention-dropout 0)")


def _check_chunks(args, problem: MegatronProblem, cp: int, modes: list) -> None:
    """--attention-chunk-size (Llama 4's chunked attention: a plugin flag, since neither Megatron's
    own attention nor Transformer Engine's has it): every layer with chunks runs the plugin's
    attention -- a plugin mode at CP > 1, the plugin's spec at CP 1 -- or it would train full
    causal attention, silently. The layers with chunks (--no-rope-freq) and their windows are
    checked by :meth:`MegatronProblem.layer_masks`, the reading the layers and the prediction share."""
    if problem.chunk_size is None:
        return
    chunks = problem.layer_chunks()
    problem.layer_masks(causal=True)
    given = f"{CHUNK_FLAG} {problem.chunk_size}"
    if getattr(args, "multi_latent_attention", False) and problem.no_rope is not None:
        rope = list(problem.no_rope) if isinstance(problem.no_rope, tuple) else problem.no_rope
        raise ValueError(f"{given} with --multi-latent-attention and --no-rope-freq {rope}: Megatron's MLA rotates "
                         "every layer (it does not read --no-rope-freq), so the layers it marks would attend globally "
                         "with RoPE, not as Llama 4's NoPE layers; leave out --no-rope-freq (chunks on every layer)")
    mtp = getattr(args, "mtp_num_layers", None)
    if mtp:
        raise ValueError(f"{given} with --mtp-num-layers {mtp}: Megatron-Core builds the multi-token prediction layers "
                         "from its own layer spec, whose attention has no chunks, so they would attend the whole "
                         "sequence; leave out one of the two")
    if cp == 1:
        if not uses_plugin_spec(args):
            raise ValueError(f"{given}: chunked attention is the plugin's (Megatron's own attention has none), and this "
                             "run builds Megatron's own layers; add --spec megatron_mesh.megatron.spec gpt_layer_spec "
                             "(the plugin's single-rank attention runs at CP 1)")
        if args.attention_dropout:
            raise ValueError(f"--attention-dropout {args.attention_dropout}: chunked attention ({given}) runs the "
                             "plugin's attention also at CP 1, which supports only 0 (pass --attention-dropout 0)")
        return
    per_layer = modes if len(modes) == len(chunks) else (modes or ["p2p"]) * len(chunks)  # None: TE's p2p
    te = next(((n, m) for n, (m, c) in enumerate(zip(per_layer, chunks), 1) if c is not None and m in TE_MODES), None)
    if te is not None:
        default = " (also Megatron's default where --cp-comm-type is not given)" if te[1] == "p2p" else ""
        raise ValueError(f"{given}: layer {te[0]} has chunks and runs --cp-comm-type {te[1]}{default}, a Transformer "
                         f"Engine mode, which has no chunked attention; run the layers with chunks in a plugin mode "
                         f"({', '.join(plugin_modes())})")


def _check_hierarchy(problem: MegatronProblem, cp: int, active: set) -> None:
    """--hierarchical-context-parallel-sizes U M: the all-to-all x inner split of Transformer
    Engine's a2a+p2p and of the plugin's Ulysses hybrids; given where nothing uses it, or missing
    where a layer needs it, is an error (never CP silently off). The hybrid's own constraints
    (heads, U inside a node) are its placement's check."""
    hcp = problem.hierarchy
    hybrids = sorted(m for m in active if m.startswith(HYBRID_PREFIX))
    if hcp and not hybrids:
        raise ValueError(f"--hierarchical-context-parallel-sizes {' '.join(map(str, hcp))} applies only to the "
                         f"all-to-all modes ({', '.join(m for m in cp_modes() if m.startswith(HYBRID_PREFIX))}), "
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


def _check_layout(args, settings: PluginSettings, problem: MegatronProblem, cp: int) -> list[str]:
    """--cp-layout (and --no-cp-layout-lookahead, for a layout of each sample) applies where a
    layout is chosen per sample: documents from the batch (--reset-attention-mask) reaching plugin
    layers at CP > 1; at CP 1 with such documents it is accepted and returned as unused. A layout
    other than Megatron's zigzag (the default ``auto`` too) needs --calculate-per-token-loss, and
    what else follows Megatron's zigzag refuses it: the model's RoPE other than 'rope' (YaRN,
    mRoPE; MLA's own rotary, 'rope' or YaRN, follows the layout unfused) and fused RoPE over
    micro-batches of several samples (Transformer Engine's kernel takes one [s, 1, 1, d] table;
    each sample has its own layout) or with MLA (its fused kernels rotate the zigzag's positions).
    A layout that differs from another only for Ulysses groups needs them."""
    kind, documents, unused = settings.layout, settings.documents, []
    batch = documents in BATCH_DOCUMENTS
    applies = cp > 1 and batch
    if "cp_layout" in settings.given and not applies:
        if not batch:  # wrong at every CP size
            why = ("--cp-thd-packing (Transformer Engine's THD layout)" if documents == THD_DOCUMENTS else
                   "no --reset-attention-mask")
            raise ValueError(f"--cp-layout {kind.name} applies to packed documents (--reset-attention-mask) at CP > 1, "
                             f"not here ({why}); leave the flag out")
        unused.append(f"--cp-layout {kind.name}")
    if "no_cp_layout_lookahead" in settings.given and not (applies and kind.per_sample):
        if not (cp == 1 and batch and kind.per_sample):
            sample = " and ".join(", ".join(n for n in cp_layout_names() if LAYOUTS[n].per_sample).rsplit(", ", 1))
            raise ValueError(f"--no-cp-layout-lookahead applies to --cp-layout {sample} (packed documents, "
                             "--reset-attention-mask, at CP > 1), which this run does not use; leave the flag out")
        unused.append("--no-cp-layout-lookahead")
    if not applies or not kind.per_sample:
        return unused
    which = f"--cp-layout {kind.name}" + ("" if "cp_layout" in settings.given else
                                         " (the default with packed documents at CP > 1)")
    zigzag = f"or pass --cp-layout {REFERENCE_LAYOUT} (Megatron's global zigzag)"
    if kind.varies and problem.ulysses < 2:
        sizes = f"{HIERARCHY_FLAG} {' '.join(map(str, problem.hierarchy))}" if problem.hierarchy else \
            f"no {HIERARCHY_FLAG}"
        hybrids = ", ".join(m for m in plugin_modes() if m.startswith(HYBRID_PREFIX))
        raise ValueError(f"--cp-layout {kind.name} changes only the layouts of the Ulysses groups of the all-to-all modes "
                         f"({hybrids}), and this run has no such group ({sizes}); use --cp-layout {kind.varies}, the "
                         "same layout without them")
    _check_sample_layouts(args, which, zigzag)
    seq = getattr(args, "seq_length", None)
    probe = layout_sample((0, seq if isinstance(seq, int) else 2 * cp), args, settings)  # its documents aside
    why = next((w for m in probe.layer_modes if (w := kind.runs(m)) is not None), None) or \
        kind.refuses(probe, build=False)
    if why is not None:
        raise ValueError(f"{which}: {why}; pass --cp-layout {DEFAULT_LAYOUT} (the default: it runs each sample "
                         f"on the fastest layout its layers' modes run), {zigzag}")
    return unused


def _check_sample_layouts(args, which: str, zigzag: str) -> None:
    """What a layout of each sample needs from Megatron's other flags (:func:`_check_layout`)."""
    if not getattr(args, "calculate_per_token_loss", False):
        raise ValueError(f"{which} needs --calculate-per-token-loss: the ranks hold different documents, so each "
                         "would divide its loss by its own token count; add --calculate-per-token-loss (the loss "
                         f"then is CP 1's, whatever the layout), {zigzag}")
    position = getattr(args, "position_embedding_type", "learned_absolute")
    if position not in ("rope", "learned_absolute", "none"):
        raise ValueError(f"{which} with --position-embedding-type {position}: supported are rope, learned_absolute "
                         f"and none (their positions follow the layout); {zigzag}")
    if getattr(args, "multi_latent_attention", False) and getattr(args, "apply_rope_fusion", False):
        raise ValueError(f"{which} with --multi-latent-attention and fused RoPE: MLA's fused RoPE kernels rotate "
                         f"each rank's zigzag positions; pass --no-rope-fusion (the layout's positions), {zigzag}")
    flag, micro = _largest_micro_batch(args)
    if position == "rope" and getattr(args, "apply_rope_fusion", False) and micro > 1:
        raise ValueError(f"{which} with fused RoPE and {flag} {micro}: each sample has its "
                         "own layout, so its own rotary positions, and Transformer Engine's fused RoPE takes one "
                         f"[s, 1, 1, d] table per batch; pass --no-rope-fusion or {flag} 1, {zigzag}")


def _largest_micro_batch(args) -> tuple[str, int]:
    """(flag, samples) of the larger micro-batch a run makes: training's (--micro-batch-size) or
    evaluation's (Megatron's --eval-micro-batch-size, default training's) -- a check of one alone
    let the run fail at its first evaluation, after training up to it."""
    train = getattr(args, "micro_batch_size", None) or 1
    evaluate = getattr(args, "eval_micro_batch_size", None) or train
    return ("--eval-micro-batch-size", evaluate) if evaluate > train else ("--micro-batch-size", train)


def _check_thd_flags(args, settings: PluginSettings, cp: int, entry_packs_documents: bool) -> None:
    if settings.cp_thd_pad_multiple is not None and not settings.cp_thd_packing:
        raise ValueError(f"--cp-thd-pad-multiple {settings.cp_thd_pad_multiple} applies to --cp-thd-packing, which is "
                         "not given: leave it out")
    if settings.cp_thd_packing:
        if not entry_packs_documents:
            raise ValueError("--cp-thd-packing is an option of megatron_mesh's entry script (scripts/pretrain_gpt.sh); "
                             "this script builds its own batches")
        m = settings.cp_thd_pad_multiple or 2 * cp
        if m % (2 * cp) or args.seq_length % m:
            raise ValueError(f"--cp-thd-pad-multiple {m} must be a multiple of 2 x --context-parallel-size = {2 * cp} "
                             f"and divide --seq-length {args.seq_length} (Transformer Engine's THD layout pads every "
                             "sequence to a multiple of 2 x CP)")
        flag, micro = _largest_micro_batch(args)
        if micro != 1:
            raise ValueError(f"--cp-thd-packing packs one sequence per micro-batch: {flag} must be 1, got {micro}")


def _check_plugin_spec(args, have_te: bool, te_reason: str | None) -> None:
    """What the plugin's spec (``--spec megatron_mesh.megatron.spec FUNCTION``) cannot build, at any CP
    size, in one line before anything is built (stop 81's review: each was a traceback per rank):
    Megatron's hybrid (Mamba) models, whose scripts take ``--spec`` as the stack of their layers,
    not a GPT layer; the Transformer Engine spec without Transformer Engine."""
    if not uses_plugin_spec(args):
        return
    spec = " ".join(str(x) for x in args.spec)
    pattern = getattr(args, "hybrid_layer_pattern", None) or getattr(args, "hybrid_override_pattern", None)
    if pattern or getattr(args, "is_hybrid_model", False):
        raise ValueError(f"--spec {spec} builds GPT layers (the plugin's attention in Megatron's GPT layer), not the "
                         f"layers of a hybrid (Mamba) model{f' (--hybrid-layer-pattern {pattern})' if pattern else ''}: "
                         "run the plugin's CP modes with a GPT script (pretrain_gpt.py, scripts/pretrain_gpt.sh)")
    if args.spec[-1] == "gpt_te_layer_spec" and not have_te:
        reason = te_reason or "not installed"
        raise ValueError(f"--spec {spec} needs Transformer Engine, which is not usable here ({reason}); use --spec "
                         "megatron_mesh.megatron.spec gpt_layer_spec (Megatron's local layers under --transformer-impl "
                         "local)")


def _check_plugin_layers(args, settings: PluginSettings, cp: int, active: set, passes_documents: bool) -> None:
    """What layers running a plugin mode at CP > 1 need from the rest of the command line
    (``passes_documents``: the entry hands them document boundaries)."""
    plugin = ", ".join(m for m in plugin_modes() if m in active)
    if not args.spec or args.spec[0] == "local" or str(args.spec[0]).split(".")[0] == "megatron":
        given = f" (given: --spec {' '.join(str(x) for x in args.spec)}, Megatron's own)" if args.spec else ""
        raise ValueError(f"--cp-comm-type {plugin} needs the plugin's layer spec: add --spec megatron_mesh.megatron.spec "
                         f"gpt_layer_spec (Megatron's own spec has no plugin attention){given}")
    if args.attention_dropout:
        raise ValueError(f"--attention-dropout {args.attention_dropout}: the plugin modes "
                         f"({', '.join(plugin_modes())}) support only 0 at CP > 1 (pass --attention-dropout 0)")
    backend = getattr(args, "attention_backend", None)
    if backend is not None and getattr(backend, "name", backend) != "auto":
        raise ValueError(f"--attention-backend {getattr(backend, 'name', backend)}: the {plugin} layers run the plugin's "
                         "own kernels (choose them with --cp-kernel-backend); --attention-backend selects Transformer "
                         "Engine's or Megatron's attention, which these layers do not use: leave it at auto")
    mtp = getattr(args, "mtp_num_layers", None)
    if mtp:
        raise ValueError(f"--mtp-num-layers {mtp} with --cp-comm-type {plugin} at CP {cp}: Megatron-Core builds "
                         "the multi-token prediction layers from its own layer spec (Megatron's attention, not the "
                         "plugin's), and its roll of the tokens, labels and loss mask one position along the sequence "
                         "passes one token between the zigzag's neighbouring chunks (on the balanced layout a token's "
                         "successor may be on any CP rank); allowed: --mtp-num-layers at CP 1 or with Transformer "
                         "Engine's modes")
    for flag in ("sft", "hybrid_context_parallel", "dataloader_inter_document_masking"):
        if getattr(args, flag, False):
            raise ValueError(f"--{flag.replace('_', '-')}: Megatron's {flag.replace('_', ' ')} batches are not supported by "
                             "the plugin modes; pack documents with megatron_mesh's entry script instead "
                             "(--reset-attention-mask: documents at end-of-document tokens, or --cp-thd-packing: "
                             "Transformer Engine's THD layout)")
    if getattr(args, "reset_attention_mask", False) or settings.cp_thd_packing:
        _check_schedule_with_documents(args)
    if getattr(args, "reset_attention_mask", False) and not passes_documents:
        raise ValueError("--reset-attention-mask: this entry script passes the documents as a dense [s, s] attention mask, "
                         "which the plugin modes do not read; use megatron_mesh's entry script (scripts/pretrain_gpt.sh), "
                         "or run this script through scripts/run_megatron_script.sh: both hand the layers the document "
                         "boundaries")


def _check_schedule_with_documents(args) -> None:
    """Packed documents: each forward and backward step makes its micro-batch's documents current
    (:mod:`.pipeline` at PP > 1; at PP 1 ``get_batch`` before each forward, whose backward --
    and any recomputation -- runs before the next). Megatron's combined 1F1B schedule
    (``--overlap-moe-expert-parallel-comm``) runs a micro-batch's forward together with another's
    backward, in steps of its own: a recomputed layer (any PP), or a stage without batches (PP > 1),
    would read another micro-batch's documents."""
    if not getattr(args, "overlap_moe_expert_parallel_comm", False):
        return
    # --recompute-activations becomes --recompute-granularity selective only in Megatron's own
    # validation, which runs after these checks
    recompute = getattr(args, "recompute_granularity", None) or (
        "selective (--recompute-activations)" if getattr(args, "recompute_activations", False) else None)
    pp = args.pipeline_model_parallel_size
    if pp > 1 or recompute:
        why = f"--pipeline-model-parallel-size {pp}" if pp > 1 else f"--recompute-granularity {recompute}"
        raise ValueError(f"--overlap-moe-expert-parallel-comm with packed documents (--reset-attention-mask / "
                         f"--cp-thd-packing) and {why}: its combined 1F1B schedule runs one micro-batch's forward "
                         "together with another's backward, so a layer could read the other micro-batch's documents; "
                         "leave out --overlap-moe-expert-parallel-comm, or "
                         + ("pipeline parallelism" if pp > 1 else "recomputation"))
