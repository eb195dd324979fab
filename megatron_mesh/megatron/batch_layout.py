"""The CP layout of a micro-batch of packed documents in Megatron: which tokens each CP rank holds.

Megatron's layout is the global zigzag (``get_batch_on_this_cp_rank``: chunks r and 2*CP-1-r of
every sequence), and three places of Megatron assume it: the batch split, RoPE
(``get_pos_emb_on_this_cp_rank`` slices the same chunks of the position embedding) and the layers.
With packed documents (``--reset-attention-mask``) ``--cp-layout balanced`` replaces it with
:func:`megatron_mesh.balanced_layout`: per sample, work balanced over the CP ranks and short
documents kept whole on one rank; ``--cp-layout auto`` (the default) does so for each sample
where that is not predicted slower than the zigzag for the layers' mode
(:func:`megatron_mesh.plan.choice.pick_layout`) and keeps the zigzag for the others. This
module is everything that makes Megatron follow it:

* :func:`sample_layout` (:mod:`.layout_decision`) -- THE decision: a sample's layout from its
  document boundaries and the config (CP size, the mode, the Ulysses degree U as ``group``, the
  window when every layer has it). The batch split and the core attention both call it, so they
  cannot disagree (the core attention also checks that its layouts are the batch's);
* :class:`BatchLayout` -- one micro-batch: per sample its boundaries and layout; it splits the
  batch (every tensor with a sequence dimension, each sample by its own layout: S/P tokens per
  rank per sample), gives the layers their boundaries (``packed_seq_params`` sbhd, ``cu_seqlens``
  [b, k]) and RoPE its positions. The batch being fed to the model is the *current* one
  (:func:`set_current` / :func:`current`), for RoPE and for the layers of scripts whose model call
  carries no ``packed_seq_params``;
* :func:`follow_layout` -- RoPE: a forward hook on the model's ``RotaryEmbedding`` (and on the
  one -- plain or YaRN -- each multi-latent attention layer owns and applies itself) replaces its
  zigzag slice with the full embedding gathered at each local token's global position, [s_local,
  b, 1, d] (one row per sample; [s_local, 1, 1, d] when the samples share their layout). The spec
  function installs it through ``GPTModelConfig.pre_wrap_hooks``; Python users call it on their
  model;
* :class:`Lookahead` / :func:`install_lookahead` -- ahead of the step: under Megatron's
  ``RerunDataIterator`` a background thread fetches the next micro-batch and works out its
  layouts, and this rank's plans of them (:func:`megatron_mesh.runtime.api.prebuild`), while
  the current step runs -- so neither is on the step's critical path (both entry scripts);
* :func:`install` -- Megatron-LM's own ``pretrain_gpt.py`` (run by ``run_script``): its
  ``get_batch`` calls ``megatron.core.utils.get_batch_on_this_cp_rank``, which this replaces by a
  function that takes each sample's documents from the batch -- where its position ids restart
  (``--reset-position-ids``), else after its end-of-document tokens -- and splits it by the layout
  (the zigzag for ``--cp-layout zigzag``), so no dense [s, s] mask is needed.

Example (CP 2, one sample of 16 tokens, documents [0, 8), [8, 12), [12, 16)): the zigzag gives
rank 1 positions 4-11 (work 36 of 56); :func:`sample_layout` under ``--cp-layout balanced`` gives
rank 0 [0, 1, 6, 7, 8-11] and rank 1 [2-5, 12-15] (work 28 each), and RoPE on rank 1 uses the
embedding rows 2, 3, 4, 5, 12, ...
"""

from __future__ import annotations

import functools
import logging
import threading
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from ..plan.layout import Layout, ZigzagLayout, positions
from ..plan.layouts import SampleLayoutError
from .errors import fail
from .layout_decision import sample_choice, sample_layout, uses_balanced_layout
from .process import PROCESS, ProcessState
from .settings import BATCH_DOCUMENTS, PluginSettings

__all__ = ["sample_layout", "uses_balanced_layout", "eod_token", "eod_starts", "position_starts", "document_rows",
           "boundary_params", "BatchLayout", "step_layout", "split_batch", "set_current", "current",
           "follow_layout", "add_rope_hook", "install", "Lookahead", "install_lookahead"]

logger = logging.getLogger(__name__)

# batch entries that carry no sequence dimension (Megatron's get_batch_on_this_cp_rank skips them too)
_METADATA_KEYS = ("cu_seqlens", "cu_seqlens_padded", "max_seqlen", "local_cp_size", "hybrid_cp_group")


# -- documents from a batch -----------------------------------------------------------------------------
def eod_starts(tokens_row: Tensor, eod: int) -> list[int]:
    """Where documents start in one sample: 0 and after every end-of-document token (but the last
    position), as Megatron's ``--reset-attention-mask`` cuts them."""
    ends = (tokens_row == eod).nonzero().flatten().tolist()
    return [0] + [i + 1 for i in ends if i + 1 < tokens_row.numel()]


def position_starts(position_row: Tensor) -> list[int]:
    """Where documents start in one sample by its position ids: 0 and wherever a position is not
    its predecessor's + 1 (``--reset-position-ids`` restarts them at 0 after every end-of-document
    token, where ``--reset-attention-mask`` cuts the documents). E.g. [0, 1, 2, 0, 1, 0] -> [0, 3, 5]."""
    jumps = (position_row[1:] != position_row[:-1] + 1).nonzero().flatten()
    return [0] + (jumps + 1).tolist()


def eod_token(documents: Optional[str]) -> Optional[int]:
    """The tokenizer's end-of-document token where ``documents`` come from tokens (``"eod"``, THD
    packing); None where they come from position ids (or there are none)."""
    if documents in (None, "positions"):
        return None
    from megatron.training import get_tokenizer

    return get_tokenizer().eod


def document_rows(batch: dict, source: str, eod: Optional[int] = None) -> tuple[tuple[int, ...], ...]:
    """Each sample's document boundaries (0, starts..., S) in the full (not yet split) ``batch``:
    from its position ids (``source`` "positions") or its end-of-document tokens ("eod", token
    ``eod``)."""
    if source == "positions":
        rows, starts = batch["position_ids"], position_starts
    elif source == "eod":
        rows, starts = batch["tokens"], functools.partial(eod_starts, eod=eod)
    else:
        raise ValueError(f"documents come from 'eod' tokens or 'positions', got {source!r}")
    return tuple(tuple(starts(r)) + (rows.shape[1],) for r in rows)


def boundary_params(rows, device=None):
    """PackedSeqParams (qkv_format 'sbhd') whose cu_seqlens_q is [b, k]: each sample's
    boundaries over the global sequence, rows padded with the sequence length -- what the plugin
    layers read instead of a dense [s, s] mask."""
    from megatron.core.packed_seq_params import PackedSeqParams

    S = rows[0][-1]
    width = max(len(r) for r in rows)
    cu = torch.tensor([tuple(r) + (S,) * (width - len(r)) for r in rows], dtype=torch.int32, device=device)
    return PackedSeqParams(qkv_format="sbhd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=S, max_seqlen_kv=S)


# -- one micro-batch ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class BatchLayout:
    """One micro-batch: per sample its document boundaries over the global sequence (``rows``,
    0 ... S) and its layout (None: Megatron's zigzag), this CP rank and the CP size ``cp`` (the
    zigzag's, for samples that keep it next to balanced ones under ``--cp-layout auto``)."""

    rows: tuple[tuple[int, ...], ...]
    layouts: tuple[Optional[Layout], ...]
    rank: int
    cp: int = 1
    kinds: tuple[str, ...] = ()  # per sample the name of its layout's kind (:func:`.layout_decision.sample_kind`)

    @classmethod
    def of(cls, rows, config, rank: int, settings: Optional[PluginSettings] = None) -> "BatchLayout":
        """Each sample's layout and the name of its kind by :func:`.layout_decision.sample_choice`
        (``settings``: the plugin settings of ``config``, when the caller has them)."""
        rows = tuple(tuple(int(c) for c in r) for r in rows)
        choices = [sample_choice(r, config, settings) for r in rows]
        return cls(rows, tuple(c[0] for c in choices), rank, config.context_parallel_size, tuple(c[1] for c in choices))

    @property
    def balanced(self) -> bool:
        """Whether any sample runs on a layout of its own (else the batch is Megatron's zigzag split)."""
        return any(layout is not None for layout in self.layouts)

    @functools.cached_property
    def index(self) -> Tensor:
        """[b, s_local] global positions of this rank's tokens of each sample, in local order (a
        sample on the zigzag: the zigzag's, as Megatron's split takes them)."""
        return torch.tensor([positions(layout if layout is not None else ZigzagLayout(self.cp, row[-1]), self.rank)
                             for layout, row in zip(self.layouts, self.rows)], dtype=torch.long)

    def rope_positions(self) -> Tensor:
        """[s_local, b] (or [s_local, 1] when every sample has the same layout): the global
        position of each local token, what RoPE rotates it by."""
        same = all(layout is self.layouts[0] for layout in self.layouts)
        return (self.index[:1] if same else self.index).t()

    def shard(self, batch: dict, cp_group) -> dict:
        """This rank's part of the full batch: every tensor with a sequence dimension (dim 1)
        gathered at :attr:`index` (the balanced layout), or Megatron's zigzag split. The dense
        ``attention_mask`` is dropped: the layers take the documents as boundaries. A tensor of
        one value per sample (a blended dataset's ``dataset_id``, [b]) stays as it is: split as a
        sequence, any blended ``--data-path`` stopped every rank with an IndexError (stop 80's
        review)."""
        per_sample = {k: v for k, v in batch.items() if torch.is_tensor(v) and v.dim() < 2 and k not in _METADATA_KEYS}
        batch = {k: v for k, v in batch.items() if k not in per_sample}
        if not self.balanced:
            return {**_megatron_zigzag()(batch, is_hybrid_cp=False, cp_group=cp_group), **per_sample}
        out = dict(per_sample)
        for key, value in batch.items():
            if key == "attention_mask" or value is None or key in _METADATA_KEYS:
                out[key] = None if key == "attention_mask" else value
                continue
            idx = self.index.to(value.device).view(*self.index.shape, *(1,) * (value.dim() - 2))
            out[key] = value.gather(1, idx.expand(-1, -1, *value.shape[2:]))
        return out

    def packed_seq_params(self, device=None):
        """The boundaries for the layers (:func:`boundary_params`)."""
        return boundary_params(self.rows, device)


def _megatron_zigzag():
    """Megatron's own ``get_batch_on_this_cp_rank`` (the one :func:`install` replaced, if it did)."""
    from megatron.core import utils

    split = utils.get_batch_on_this_cp_rank
    return split.__wrapped__ if getattr(split, "megatron_mesh", False) else split


def set_current(batch: Optional[BatchLayout], process: ProcessState = PROCESS) -> None:
    """The micro-batch about to be fed to the model (``get_batch`` sets it; Megatron's schedules
    run its forward -- and any recomputation -- before the next ``get_batch``), kept in
    ``process`` (:attr:`.process.ProcessState.batch`)."""
    process.batch = batch


def current(process: ProcessState = PROCESS) -> Optional[BatchLayout]:
    return process.batch


# -- RoPE ---------------------------------------------------------------------------------------------------
def follow_layout(model, process: ProcessState = PROCESS) -> int:
    """Make the rotary embeddings in ``model`` (a GPTModel, or a list of pipeline stages) follow
    the current batch's layout: a forward hook replaces Megatron's zigzag slice of the embedding by
    the full embedding at each local token's global position. Returns how many it hooked (0:
    the model has no RoPE -- learned absolute positions follow the split position ids by
    themselves). The rotaries are the GPTModel's and those multi-latent attention layers build for
    themselves (``MLASelfAttention.rotary_pos_emb``: RoPE or YaRN, whose YaRN scale the hook keeps);
    ValueError for any other kind (mRoPE).
    ``process`` remembers the hooked ones (:attr:`.process.ProcessState.following`)."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import YarnRotaryEmbedding

    hooked = 0
    for stage in model if isinstance(model, (list, tuple)) else [model]:
        for module in stage.modules():
            if not isinstance(module, RotaryEmbedding):
                continue
            if type(module) not in (RotaryEmbedding, YarnRotaryEmbedding):
                raise ValueError(f"{type(module).__name__}: --cp-layout balanced supports RoPE ('rope', and MLA's "
                                 "own RoPE or YaRN), learned absolute positions and none; pass --cp-layout zigzag")
            if module not in process.following:
                module.register_forward_hook(functools.partial(_gather_rope, process=process), with_kwargs=True)
                process.following.add(module)
            hooked += 1
    return hooked


def _gather_rope(module, args, kwargs, output, process: ProcessState = PROCESS):
    """RotaryEmbedding.forward(max_seq_len, offset=0, packed_seq=False, cp_group=None) returned this
    rank's zigzag chunks (YaRN's: with its scale, (emb, mscale)); return the embedding at the
    positions of ``process``'s current batch instead (the scale as it was)."""
    batch = current(process)
    if batch is None:
        raise RuntimeError("megatron_mesh: the rotary embedding follows the batch's CP layout (--cp-layout balanced), "
                           "but no batch layout is set for this forward: feed the model through megatron_mesh's "
                           "get_batch (scripts/pretrain_gpt.sh, scripts/run_megatron_script.sh) or call "
                           "megatron_mesh.megatron.batch_layout.set_current")
    if not batch.balanced:
        return output  # Megatron's zigzag slice is right
    seq_len = args[0] if args else kwargs["max_seq_len"]
    offset = args[1] if len(args) > 1 else kwargs.get("offset", 0)
    if seq_len != batch.rows[0][-1]:
        raise RuntimeError(f"megatron_mesh: RoPE for {seq_len} tokens, but the current batch layout covers "
                           f"{batch.rows[0][-1]}")
    full = module.forward(seq_len, offset, packed_seq=True)  # [S, 1, 1, d], not sliced (Megatron caches it)
    full, scale = full if isinstance(full, tuple) else (full, None)
    pos = batch.rope_positions().to(full.device)
    local = full[:, 0, 0][pos].unsqueeze(2)  # [s_local, b or 1, 1, d]
    return local if scale is None else (local, scale)


def add_rope_hook(model_config, config) -> None:
    """Where the balanced layout applies (``config``, the transformer config), make the model
    built from ``model_config`` (a GPTModelConfig) follow it: :func:`follow_layout` joins its
    ``pre_wrap_hooks``, which Megatron's model builder runs on the built stages. A plain
    TransformerConfig has no hooks: call :func:`follow_layout` on the model yourself."""
    hooks = getattr(model_config, "pre_wrap_hooks", None)
    if not uses_balanced_layout(config) or hooks is None or _pre_wrap in hooks:
        return
    hooks.append(_pre_wrap)


def _pre_wrap(models):
    follow_layout(models)
    return models


def check_rope_follows(args, process: ProcessState = PROCESS) -> None:
    """A balanced batch for a RoPE model none of whose rotary embeddings follows the layout would
    train with the zigzag's positions: stop instead."""
    rotary = getattr(args, "position_embedding_type", None) == "rope" or getattr(args, "multi_latent_attention", False)
    if rotary and not process.following:
        raise RuntimeError("megatron_mesh: --cp-layout balanced, but the model's rotary embedding does not follow the "
                           "layout (the spec function adds the hook to GPTModelConfig.pre_wrap_hooks; a model built "
                           "another way needs megatron_mesh.megatron.batch_layout.follow_layout(model))")


# -- get_batch: the plugin's entry script, and Megatron-LM's own scripts -------------------------------------
def step_layout(rows, args, rank: int, settings: Optional[PluginSettings] = None,
                process: ProcessState = PROCESS) -> BatchLayout:
    """:meth:`BatchLayout.of` for the micro-batch a training step runs: a sample the layout kind
    cannot lay out (``--cp-layout owners`` on short documents) stops the run in one line per node
    -- every CP rank of the sample raises alike -- instead of a traceback per rank."""
    try:
        return BatchLayout.of(rows, args, rank, settings)
    except SampleLayoutError as e:
        fail(str(e), at_once=True, process=process)


def split_batch(batch: dict, source: str, args, cp_group, eod: Optional[int] = None,
                settings: Optional[PluginSettings] = None, process: ProcessState = PROCESS) -> BatchLayout:
    """The documents of the full micro-batch ``batch`` (from ``source``, see :func:`document_rows`;
    at PP > 1 those the stages share, :mod:`.pipeline`: a stage's batch may lack the tokens)
    and their layouts (under ``args`` and its plugin ``settings``), made current in ``process``;
    returns them (:meth:`BatchLayout.shard` splits the batch). Stops a balanced batch for a RoPE
    model whose rotary embedding does not follow the layout."""
    rank = cp_group.rank() if cp_group is not None else 0
    rows = process.pipeline_rows
    shared = process.batch  # at PP > 1 the step made this micro-batch's layout current (.pipeline): reuse it
    if rows is not None and shared is not None and shared.rows == rows and shared.rank == rank \
            and shared.cp == args.context_parallel_size:
        layout = shared
    else:
        layout = step_layout(document_rows(batch, source, eod) if rows is None else rows, args, rank, settings, process)
    process.layout_kinds.update(layout.kinds)
    if layout.balanced:
        check_rope_follows(args, process)
    set_current(layout, process)
    return layout


def install(process: ProcessState = PROCESS) -> None:
    """Replace ``megatron.core.utils.get_batch_on_this_cp_rank`` -- before the script imports it --
    by :func:`get_batch_on_this_cp_rank` in ``process`` (its flags, its current batch), which
    Megatron's own function serves wherever the batches carry no documents for the plugin layers."""
    from megatron.core import utils

    megatrons = utils.get_batch_on_this_cp_rank
    if getattr(megatrons, "megatron_mesh", False):
        return

    def substitute(batch, is_hybrid_cp=False, cp_group=None, *rest, **kwargs):
        return get_batch_on_this_cp_rank(batch, is_hybrid_cp, cp_group, *rest, process=process, **kwargs)

    functools.update_wrapper(substitute, megatrons)  # __wrapped__: Megatron's, for _megatron_zigzag
    substitute.megatron_mesh = True
    utils.get_batch_on_this_cp_rank = substitute


def get_batch_on_this_cp_rank(batch, is_hybrid_cp=False, cp_group=None, *rest, process: ProcessState = PROCESS,
                              **kwargs):
    """Megatron's ``get_batch_on_this_cp_rank`` where documents reach the plugin layers from the
    batch (``--reset-attention-mask`` through ``run_script``; see :func:`~megatron_mesh.plan.megatron_problem.documents_of`):
    this micro-batch's documents become current and it is split by its layout. Otherwise, or for
    batches Megatron packs itself (``cu_seqlens``, refused at start-up), Megatron's own. ``process``:
    whose flags say where the documents come from and whose current batch it sets."""
    from . import bootstrap

    original = _megatron_zigzag()
    args = bootstrap.megatron_args()
    settings = PluginSettings.from_args(args, batch_documents=process.batch_documents) if args is not None else None
    source = settings.documents if settings is not None else None
    if source not in BATCH_DOCUMENTS or is_hybrid_cp or batch.get("cu_seqlens") is not None \
            or batch.get("tokens") is None and process.pipeline_rows is None:
        return original(batch, is_hybrid_cp, cp_group, *rest, **kwargs)
    return split_batch(batch, source, args, cp_group, eod_token(source), settings, process).shard(batch, cp_group)


# -- ahead of the step ------------------------------------------------------------------------------------
class _Fetch:
    """One item of ``source``, fetched and warmed on a daemon thread (a daemon: a fetch still in
    flight when training ends must not hold the process)."""

    def __init__(self, source, warm):
        self._done = threading.Event()
        self._item = self._error = None
        threading.Thread(target=self._run, args=(source, warm), name="megatron_mesh-lookahead", daemon=True).start()

    def _run(self, source, warm) -> None:
        try:
            self._item = next(source)
        except BaseException as e:  # StopIteration included: raised where the item is asked for
            self._error = e
            self._done.set()
            return
        try:
            warm(self._item)
        except Exception:  # noqa: BLE001 -- the step works the layout out again and raises there, with its context
            pass
        self._done.set()

    def result(self):
        self._done.wait()
        if self._error is not None:
            raise self._error
        return self._item


class Lookahead:
    """An iterator one item ahead of its consumer: while the consumer works on item n, a
    background thread fetches item n + 1 and calls ``warm(item)`` on it. Items come out in the
    same order, each once; an error fetching an item (StopIteration included) is raised when
    that item is asked for, and the next call fetches again.

    Under Megatron's ``RerunDataIterator`` (:func:`install_lookahead` puts it there, below the
    replay buffer, so a rerun replays exactly the micro-batches it handed out) ``warm`` works out
    the next micro-batch's layouts -- the cached objects ``get_batch`` then finds -- and builds
    this rank's plans of them (:func:`megatron_mesh.runtime.api.prebuild`): at 256 ranks and 1M
    tokens of ~300 documents, the ~40 ms of layout and plan per sample leave the step's critical
    path (``scripts/bench_plan_build.py``).

    Example: ``it = Lookahead(iter([b0, b1, b2]), warm)`` -> ``next(it)`` returns b0 (fetched at
    construction) and starts fetching b1, warming it while the step trains on b0."""

    def __init__(self, source, warm):
        self.source, self.warm = source, warm
        self._next = _Fetch(self.source, warm)

    def __iter__(self) -> "Lookahead":
        return self

    def __next__(self):
        fetch = self._next
        try:
            item = fetch.result()
        except StopIteration:
            raise  # the source is done: stay done
        except BaseException:
            self._next = _Fetch(self.source, self.warm)
            raise
        self._next = _Fetch(self.source, self.warm)
        return item


def _warm_layouts(args, settings: PluginSettings, eod: Optional[int]):
    """The warm-up of one full micro-batch (as the data loader gives it, before any split): its
    samples' layouts (cached: ``get_batch`` finds them) and this rank's plans of each layout."""
    from ..runtime.api import prebuild

    said = []

    def warm(batch) -> None:
        seen, plans = set(), 0
        for layout in BatchLayout.of(document_rows(batch, settings.documents, eod), args, 0, settings).layouts:
            if layout is not None and id(layout) not in seen:
                seen.add(id(layout))
                plans += prebuild(layout)
        if plans and not said:  # once, on the first rank: the step's plans are being built ahead
            said.append(True)
            if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
                # says what runs (the lookahead is on); the flag only as the way to turn it off
                logger.info("megatron_mesh: the next micro-batch's layouts (%d) and this rank's plans of them (%d) "
                            "were built ahead of its step, on a background thread while the step before trained "
                            "(--no-cp-layout-lookahead would build them on the step's critical path instead)",
                            len(seen), plans)

    return warm


def _ahead(iterator, warm):
    """``iterator`` (a RerunDataIterator, a list of them, or None) with a :class:`Lookahead`
    under each replay buffer; anything else as it is (nothing to put below)."""
    if isinstance(iterator, (list, tuple)):
        return type(iterator)(_ahead(it, warm) for it in iterator)
    from megatron.core.rerun_state_machine import RerunDataIterator

    if isinstance(iterator, RerunDataIterator) and not isinstance(iterator.iterable, Lookahead):
        iterator.iterable = Lookahead(iterator.iterable, warm)
    return iterator


def install_lookahead(process: ProcessState = PROCESS) -> None:
    """Make Megatron's ``pretrain`` build its data iterators with a :class:`Lookahead` below each
    replay buffer when the balanced layout applies (documents from the batch at CP > 1,
    ``--cp-layout balanced``) and ``--no-cp-layout-lookahead`` is not given. ``pretrain`` looks
    the builder up in its module at call time; the entry script and ``run_script`` call this
    before it. ``process``: whose flags say where the documents come from."""
    from megatron.training import training

    from . import bootstrap

    bootstrap.substitute(training, "build_train_valid_test_data_iterators",
                         lambda build: functools.partial(_build_ahead, build, process))


def _build_ahead(build, process: ProcessState, *a, **kw):
    """Megatron's data iterators (``build``) with the lookahead where it applies (:func:`install_lookahead`)."""
    from . import bootstrap

    iterators = build(*a, **kw)
    args = bootstrap.megatron_args()
    if args is None or args.context_parallel_size == 1:
        return iterators
    settings = PluginSettings.from_args(args, entry_packs_documents=process.entry_packs_documents,
                                        batch_documents=process.batch_documents)
    if settings.no_cp_layout_lookahead or not settings.layout.per_sample or settings.documents not in BATCH_DOCUMENTS:
        return iterators
    warm = _warm_layouts(args, settings, eod_token(settings.documents))
    return tuple(_ahead(it, warm) for it in iterators)
