"""The attention of a Megatron run as the plugin plans it, derived in one place from Megatron's
parsed arguments, a transformer config, or the MODEL_ARGS of a YAML config (pure Python: the
start-up checks, the layers and the per-sample layout decision read it from Megatron's objects,
the planner's prediction from a YAML file).

It reads Megatron's own settings only: heads and KV heads (``--num-attention-heads``,
``--group-query-attention --num-query-groups``), the head dims (``--kv-channels`` or hidden /
heads; MLA: ``--qk-head-dim`` + ``--qk-pos-emb-head-dim`` and ``--v-head-dim``), the dtype
(``--bf16`` / ``--fp16``, or a config's ``params_dtype``), ``--seq-length``, the CP, TP and
Ulysses sizes (``--hierarchical-context-parallel-sizes U M``: read here and nowhere else), the
window (``--window-size``) and which layers run it (``--window-attn-skip-freq``: :meth:`MegatronProblem.
layer_windows`, the one reading of the per-layer masks that the report's plans and the prediction share)
and where documents come from (:func:`documents_of`); and, for Llama 4's chunked attention (a
plugin flag, :data:`CHUNK_FLAG`: Megatron has none), which layers attend globally
(``--no-rope-freq``: Llama 4's NoPE layers; :meth:`MegatronProblem.layer_masks`). The plugin's
other flags are :mod:`megatron_mesh.megatron.settings`'s. Sinks (``--softmax-type``) change no plan: each rank adds its
heads' sink logits once after the merge, nothing more is sent.

Example: Llama-3 8B at CP 16, TP 2 (32 / 8 heads of 128, bf16, 128K tokens) -> per CP rank
``shape() == AttentionShape(8192, 1, 16, 4, 128, 2)``; ``ulysses`` 1. gpt-oss-20b's layers
(``--window-size 127,0 --window-attn-skip-freq 2``, 24 layers) -> ``layer_windows()`` = ((127, 0), None,
(127, 0), None, ...): a window on the odd layers, full attention on the even ones. Llama 4's
(``--attention-chunk-size 8192 --no-rope-freq 4``, 48 layers) -> ``layer_masks()`` = (chunked=8192,
chunked=8192, chunked=8192, causal, ...): three chunked RoPE layers, then a global NoPE layer.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from types import SimpleNamespace

from .maskkinds import Chunked, Mask, MaskKind
from .shape import AttentionShape
from .units import as_int
from .window import megatron_window

__all__ = ["MegatronProblem", "layer_window", "layer_chunked", "documents_of", "BATCH_DOCUMENTS", "THD_DOCUMENTS",
           "DEFAULT_SEQ_LOCAL", "CHUNK_FLAG"]

# Llama 4's chunked attention (its config's attention_chunk_size): the plugin's flag, since Megatron
# has none; the settings schema (megatron/settings.py) names it by this constant
CHUNK_FLAG = "--attention-chunk-size"

# where the layers' documents come from: each sample of the batch (end-of-document tokens,
# position-id resets; such samples get a CP layout each) or Transformer Engine's THD packing
BATCH_DOCUMENTS = ("eod", "positions")
THD_DOCUMENTS = "thd"
# tokens per rank for configs built outside an entry script that set no sequence length
# (Megatron-Core from Python): the fastest tile depends on it mildly
DEFAULT_SEQ_LOCAL = 8192
_ITEMSIZE = {"bf16": 2, "fp16": 2, "fp32": 4}


def documents_of(ns, *, thd_packing: bool = False, entry_packs_documents: bool = False,
                 batch_documents: bool = False) -> str | None:
    """Where the plugin layers' documents come from: "thd" (``thd_packing``, the plugin's
    ``--cp-thd-packing``), "eod" (the end-of-document tokens of --reset-attention-mask, under an
    entry script that passes the boundaries or through the batch split of Megatron-LM's scripts),
    "positions" (the position-id resets of --reset-position-ids, through that batch split:
    exactly where --reset-attention-mask cuts), or None. Another script's --reset-attention-mask
    is a dense mask: Megatron's own attention reads it at CP 1, the plugin modes refuse it."""
    if thd_packing:
        return THD_DOCUMENTS
    if not getattr(ns, "reset_attention_mask", False):
        return None
    if entry_packs_documents:
        return "eod"
    if batch_documents:
        return "positions" if getattr(ns, "reset_position_ids", False) else "eod"
    return None


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def _int(ns, dest: str, default=None, low: int = 1):
    """Megatron's integer setting ``dest`` (an int, or its text in a YAML config); ValueError
    naming the flag for anything else."""
    value = getattr(ns, dest, None)
    if value is None:
        return default
    number = as_int(value) if not isinstance(value, str) else int(value) if value.strip().lstrip("-").isdigit() \
        else None
    if number is None or number < low:
        raise ValueError(f"{_flag(dest)} {value!r} must be an integer >= {low}")
    return number


def _pattern(text: str, flag: str) -> tuple[int, ...]:
    """Megatron's layer pattern text (``[1,1,0]``, ``([1]*3+[0])*2``: lists, integers, + and *),
    evaluated without eval; ValueError naming ``flag`` for anything else."""
    def value(node):
        if isinstance(node, ast.List):
            return [value(e) for e in node.elts]
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
            a, b = value(node.left), value(node.right)
            return a + b if isinstance(node.op, ast.Add) else a * b
        raise ValueError
    try:
        layers = value(ast.parse(text.strip(), mode="eval").body)
    except (SyntaxError, ValueError, TypeError):
        layers = None
    if not isinstance(layers, list) or not all(type(v) is int for v in layers):
        raise ValueError(f"{flag} {text!r} must be an integer N or a list pattern of 0/1 per layer, e.g. '[1,1,0]' "
                         "or '([1]*3+[0])*2'")
    return tuple(layers)


def _layer_pattern(ns, dest: str):
    """A per-layer flag of Megatron's (``--window-attn-skip-freq``; ``--no-rope-freq``, whose
    ``no_rope_freq_type`` reads it alike) as Megatron reads it: an int N, a tuple of 0/1 per layer
    (its pattern text evaluated; a config holds the list its ``__post_init__`` made), or None."""
    value = getattr(ns, dest, None)
    if value is None or isinstance(value, int):
        return value
    if isinstance(value, (list, tuple)):
        return tuple(value)
    text = str(value)
    return _pattern(text, _flag(dest)) if "[" in text else _int(ns, dest)


def layer_chunked(chunk_size, no_rope, layer_number: int) -> MaskKind | None:
    """Llama 4's chunked attention on layer ``layer_number`` (from 1), or None: ``chunk_size``
    (:data:`CHUNK_FLAG`) on every layer but those ``--no-rope-freq`` ``no_rope`` marks as NoPE
    layers (N: each N-th; a 0/1 list: where it says 1), which attend globally -- Llama 4's
    interleaved RoPE (chunked) and NoPE (global) layers, as Hugging Face's Llama4 config derives
    its ``layer_types``. The one owner of that rule: the layers apply it
    (megatron/core_attention.py), the layout balances and the prediction prices the layers'
    masks (:meth:`MegatronProblem.layer_masks`)."""
    if chunk_size is None:
        return None
    listed = isinstance(no_rope, (list, tuple))
    if no_rope is not None and (no_rope[layer_number - 1] if listed else layer_number % no_rope == 0):
        return None
    return Chunked(chunk_size)


def layer_window(window_size, skip, layer_number: int, causal: bool = False):
    """The plugin window (left, right) of layer ``layer_number`` (from 1), or None: Megatron's
    ``--window-size`` on the layers ``--window-attn-skip-freq`` ``skip`` leaves windowed, by
    Megatron's own rule (``is_layer_window_attention``: no skip, every layer; N, all but each N-th;
    a 0/1 list, where it says 1). The one owner of a layer's mask: the layers apply it
    (megatron/core_attention.py), the layout balances the layers' (megatron/layout_decision.py),
    the report's plans and the prediction price them (:meth:`MegatronProblem.layer_windows`)."""
    if not window_size:
        return None
    listed = isinstance(skip, (list, tuple))
    if skip is not None and (not skip[layer_number - 1] if listed else layer_number % skip == 0):
        return None
    return megatron_window(window_size, causal=causal)


def _ints(ns, dest: str, form: str = "integers"):
    """A tuple of integers (``--window-size 4096,0`` as text or a tuple; ``--hierarchical-context-
    parallel-sizes 2 4`` as a list); None when not given."""
    value = getattr(ns, dest, None)
    if value is None or value is False:
        return None
    items = str(value).strip("()[]").replace(",", " ").split() if isinstance(value, str) else list(value)
    try:
        return tuple(int(x) for x in items)
    except (TypeError, ValueError):
        raise ValueError(f"{_flag(dest)} {value!r} must be {form}") from None


@dataclass(frozen=True)
class MegatronProblem:
    """A Megatron run's attention (see the module docstring): the model's heads (every TP rank),
    head dims, the global sequence length (None: not known), sizes, dtype, Ulysses split, window
    and documents."""

    heads: int = 1
    kv_heads: int = 1
    head_dim: int = 1
    v_head_dim: int | None = None
    seq_len: int | None = None
    cp: int = 1
    tp: int = 1
    micro_batch: int = 1
    global_batch: int | None = None
    layers: int = 1
    dtype: str = "fp32"
    hierarchy: tuple[int, ...] | None = None  # --hierarchical-context-parallel-sizes as given
    window_size: tuple | None = None  # --window-size as given (LEFT, RIGHT; -1 unlimited), None: no window
    window_skip: int | tuple | None = None  # --window-attn-skip-freq: N, or 0/1 per layer; None: every layer
    documents: str | None = None  # documents_of
    chunk_size: int | None = None  # CHUNK_FLAG (the plugin's): Llama 4's chunked attention; None: none
    no_rope: int | tuple | None = None  # --no-rope-freq: N, or 0/1 per layer (1: NoPE, global attention)

    @property
    def itemsize(self) -> int:
        return _ITEMSIZE[self.dtype]

    @property
    def ulysses(self) -> int:
        """The Ulysses all-to-all degree U of ``--hierarchical-context-parallel-sizes U M`` (1: none)."""
        return self.hierarchy[0] if self.hierarchy else 1

    def shape(self, cp: int | None = None, batch: int = 1) -> AttentionShape:
        """One CP rank's attention over ``cp`` ranks (default the run's): its TP rank's heads (KV
        heads replicated when fewer than TP), the sequence over the CP ranks (an even count; a
        default where the length is not known), ``batch`` sequences."""
        cp = self.cp if cp is None else cp
        seq_local = self.seq_len // cp if self.seq_len else DEFAULT_SEQ_LOCAL
        return AttentionShape(seq_local=max(2, seq_local - seq_local % 2), batch=batch,
                              heads=max(1, self.heads // self.tp), kv_heads=max(1, self.kv_heads // self.tp),
                              head_dim=self.head_dim, itemsize=self.itemsize, v_head_dim=self.v_head_dim)

    def window(self, causal: bool = True) -> tuple | None:
        """The plugin's window ((left, right), None unlimited) of ``--window-size``; None: none."""
        return megatron_window(self.window_size, causal=causal)

    def layer_windows(self, causal: bool = True) -> tuple:
        """The plugin window of each layer in order (None: full attention), by Megatron's rule
        (``is_layer_window_attention``, layer numbers from 1): no --window-size, none; no
        --window-attn-skip-freq, every layer; N, every layer but each N-th; a list, 1 where a
        layer has the window. ValueError naming the flag for a list of another length or values."""
        self.window(causal)  # the values checked, with or without a layer that has the window
        skip = self.window_skip
        if isinstance(skip, tuple) and len(skip) != self.layers:
            raise ValueError(f"--window-attn-skip-freq {list(skip)}: the list needs one entry per layer ({self.layers} "
                             f"layers, --num-layers), got {len(skip)}")
        if isinstance(skip, tuple) and any(v not in (0, 1) or isinstance(v, bool) for v in skip):
            raise ValueError(f"--window-attn-skip-freq {list(skip)}: entries must be 1 (sliding window) or 0 (full "
                             "attention)")
        if not isinstance(skip, tuple) and skip is not None and skip < 1:
            raise ValueError(f"--window-attn-skip-freq {skip}: an integer N must be >= 1 (every N-th layer runs full "
                             "attention), or give a list of 0/1 per layer, e.g. '[1,1,1,0]'")
        return tuple(layer_window(self.window_size, skip, n, causal) for n in range(1, self.layers + 1))

    def layer_chunks(self) -> tuple:
        """Each layer's chunked attention (:func:`layer_chunked`: a ``Chunked`` mask) or None.
        ValueError naming the flags for a chunk size below 1, a ``--no-rope-freq`` list of
        another length or values, or an N that leaves no layer chunked."""
        if self.chunk_size is None:
            return (None,) * self.layers
        if as_int(self.chunk_size) is None or self.chunk_size < 1:
            raise ValueError(f"{CHUNK_FLAG} {self.chunk_size!r} must be an integer >= 1 (tokens per chunk)")
        rope = self.no_rope
        if isinstance(rope, tuple) and (len(rope) != self.layers or any(v not in (0, 1) or isinstance(v, bool)
                                                                        for v in rope)):
            raise ValueError(f"--no-rope-freq {list(rope)}: the list needs one entry per layer ({self.layers} layers, "
                             "--num-layers), each 1 (no RoPE: global attention) or 0 (RoPE: "
                             f"{CHUNK_FLAG}'s chunked attention)")
        if not isinstance(rope, tuple) and rope is not None and (rope < 1 or self.layers % rope):
            raise ValueError(f"--no-rope-freq {rope}: an integer N must be >= 1 and divide --num-layers "
                             f"{self.layers} (every N-th layer without RoPE), or give a list of 0/1 per layer")
        chunks = tuple(layer_chunked(self.chunk_size, rope, n) for n in range(1, self.layers + 1))
        if all(c is None for c in chunks):
            shown = rope if not isinstance(rope, tuple) else list(rope)
            raise ValueError(f"{CHUNK_FLAG} {self.chunk_size} with --no-rope-freq {shown}: "
                             "every layer is a NoPE layer (global attention), so no layer is chunked; leave "
                             f"{CHUNK_FLAG} out, or mark fewer layers")
        return chunks

    def layer_masks(self, causal: bool = True) -> tuple[MaskKind, ...]:
        """Each layer's mask, without documents: chunked attention (:meth:`layer_chunks`), else
        the layer's window (:meth:`layer_windows`: ``Mask(causal, window)``), else ``Mask(causal)``.
        ValueError naming the flags where a layer would have both a window and chunks (the
        two do not combine: :func:`~.maskkinds.base.intersect`)."""
        windows, chunks = self.layer_windows(causal), self.layer_chunks()
        both = [n for n, (w, c) in enumerate(zip(windows, chunks), 1) if w is not None and c is not None]
        if both:
            window = ",".join(map(str, self.window_size))
            raise ValueError(f"{CHUNK_FLAG} {self.chunk_size} with --window-size {window}: "
                             f"layer {both[0]} would have both, and chunked attention does not combine with a sliding "
                             "window; give the window to the layers without chunks (--window-attn-skip-freq, with "
                             "--no-rope-freq marking the global layers), or leave one flag out")
        return tuple(c if c is not None else Mask(causal, w) for w, c in zip(windows, chunks))

    def check(self) -> None:
        """ValueError naming the flags where the model's sizes do not fit together (what Megatron
        would refuse later, said before any training): KV heads dividing the heads, the sequence
        split in 2 x CP halves, TP dividing the heads and sharing or splitting the KV heads."""
        if self.heads % self.kv_heads:
            raise ValueError(f"--num-query-groups {self.kv_heads} must divide --num-attention-heads {self.heads} "
                             "(each KV head serves the same number of query heads)")
        if self.seq_len is not None and self.seq_len % (2 * self.cp):
            raise ValueError(f"--seq-length {self.seq_len} must be divisible by 2 x CP = {2 * self.cp}")
        if self.heads % self.tp:
            raise ValueError(f"--tensor-model-parallel-size {self.tp} must divide the heads ({self.heads})")
        if self.kv_heads % self.tp and self.tp % self.kv_heads:  # each TP rank holds whole KV heads, or shares one
            raise ValueError(f"--num-query-groups {self.kv_heads} must be a multiple or a divisor of "
                             f"--tensor-model-parallel-size {self.tp}")

    @classmethod
    def from_namespace(cls, ns, *, seq_len: int | None = None, documents: str | None = None,
                       chunk_size: int | None = None) -> "MegatronProblem":
        """The problem of Megatron's parsed arguments or a transformer config (``seq_len``: the
        global sequence length where ``ns`` carries none, as a config does; ``documents``: where
        they come from, :func:`documents_of`; ``chunk_size``: the plugin's :data:`CHUNK_FLAG`,
        from its settings). Arguments checked before Megatron's own validation may leave the model
        out: they read as one head."""
        heads = _int(ns, "num_attention_heads", 1)
        gqa = getattr(ns, "group_query_attention", None)  # arguments; a config has num_query_groups alone
        kv = _int(ns, "num_query_groups", heads) if gqa or gqa is None else heads
        if getattr(ns, "multi_latent_attention", False):
            head_dim = _int(ns, "qk_head_dim", 128) + _int(ns, "qk_pos_emb_head_dim", 64, low=0)
            v_head_dim = _int(ns, "v_head_dim", 128)
        else:
            hidden = _int(ns, "hidden_size")
            head_dim = _int(ns, "kv_channels") or (hidden // heads if hidden and hidden >= heads else 1)
            v_head_dim = None
        dtype = getattr(ns, "params_dtype", None)
        dtype = "bf16" if getattr(ns, "bf16", False) else "fp16" if getattr(ns, "fp16", False) else \
            {2: "bf16", 4: "fp32"}.get(getattr(dtype, "itemsize", 4), "fp32")
        seq = _int(ns, "seq_length") if seq_len is None else seq_len
        micro = _int(ns, "micro_batch_size", 1)
        return cls(heads=heads, kv_heads=kv, head_dim=head_dim, v_head_dim=v_head_dim, seq_len=seq,
                   cp=_int(ns, "context_parallel_size", 1), tp=_int(ns, "tensor_model_parallel_size", 1),
                   micro_batch=micro, global_batch=_int(ns, "global_batch_size"), layers=_int(ns, "num_layers", 1),
                   dtype=dtype, hierarchy=_ints(ns, "hierarchical_context_parallel_sizes"),
                   window_size=_ints(ns, "window_size", "LEFT,RIGHT (integers)"),
                   window_skip=_layer_pattern(ns, "window_attn_skip_freq"),
                   documents=documents, chunk_size=chunk_size, no_rope=_layer_pattern(ns, "no_rope_freq"))

    @classmethod
    def from_flags(cls, flags: dict) -> "MegatronProblem":
        """The problem of a YAML config's MODEL_ARGS (flag -> text, True for a bare flag, a list
        for several values; ``${VAR}`` expanded), run by the plugin's entry script (documents at
        end-of-document tokens under --reset-attention-mask). ValueError names a flag that is
        missing or unusable."""
        missing = [f for f in ("--num-layers", "--num-attention-heads", "--seq-length") if f not in flags]
        if "--kv-channels" not in flags and "--hidden-size" not in flags:
            missing.append("--hidden-size (or --kv-channels)")
        if missing:
            raise ValueError(f"MODEL_ARGS lacks {', '.join(missing)} (needed to plan its attention)")
        ns = SimpleNamespace(**{"group_query_attention": False, **{f.lstrip("-").replace("-", "_"): v
                                                                   for f, v in flags.items()}})
        chunk = flags.get(CHUNK_FLAG)  # the plugin's flag, given in the config's MODEL_ARGS
        if chunk is not None and (not str(chunk).strip().isdigit() or isinstance(chunk, bool)):
            raise ValueError(f"{CHUNK_FLAG} {chunk} must be an integer >= 1 (tokens per chunk)")
        problem = cls.from_namespace(ns, documents=documents_of(ns, entry_packs_documents=True),
                                     chunk_size=None if chunk is None else int(str(chunk)))
        if "--kv-channels" not in flags and _int(ns, "hidden_size") % problem.heads:
            raise ValueError(f"--hidden-size {ns.hidden_size} is not a multiple of --num-attention-heads "
                             f"{problem.heads}; give --kv-channels")
        problem.layer_masks(causal=True)  # the window and chunks checked as the training start-up checks them
        return problem
