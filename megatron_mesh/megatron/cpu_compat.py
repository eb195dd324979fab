"""Every workaround needed to run Megatron-Core 0.19 on a CPU-only torch build (gloo backend).

Only CPU runs load this module: the pretraining entry script imports it when
``torch.cuda.is_available()`` is False, and the CPU tests import it directly. Nothing on the GPU
path imports it. Each patch names the Megatron code it works around and why; all are idempotent.

Two levels:

* :func:`install_model_patches` -- enough to build a ``GPTModel`` and run forward/backward with CP
  (RoPE slicing, the RNG tracker, ``torch.cuda.current_device()``, the local attention's mask).
* :func:`install_training_patches` -- additionally Megatron's argument validation, schedules,
  DDP, optimizer and the ``pretrain()`` loop (CUDA tensors redirected to the CPU, stream stubs).

Example::

    from megatron_mesh.megatron import cpu_compat
    cpu_compat.install_training_patches()   # before megatron.training.pretrain(...)
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import os
import sys
import warnings

import torch

__all__ = ["install_model_patches", "install_training_patches"]

def install_model_patches() -> None:
    """Patches for building and running Megatron-Core models on the CPU."""
    if torch.cuda.is_available():
        raise RuntimeError("megatron_mesh.megatron.cpu_compat is for CPU-only runs; CUDA is available")
    _compile_on_first_call()  # first: before anything imports megatron.core.jit
    _quiet_missing_library_warnings()
    _rng_tracker()
    _current_device()
    _rope_cp_slice()
    _causal_masks()
    _torch_norm_sequence_parallel()


def install_training_patches() -> None:
    """Model patches plus those for argument validation, schedules, DDP and ``pretrain()``."""
    install_model_patches()
    _arch_version()
    _cuda_redirect()
    _pretrain_loop()


# Megatron's warnings, at import and while it builds the layer specs, that an optional library is
# missing: Transformer Engine and Apex, which cannot be installed without CUDA, and absl (which
# could be, but Megatron falls back to Python's logging without it). Every process printed ten of
# them, 20 lines a rank, of which a CPU run has nothing to learn. Only these messages, and only where
# the user has not asked for warnings himself (python -W / PYTHONWARNINGS: then Python's own
# settings apply)
MISSING_LIBRARY_WARNINGS = (
    r"Transformer Engine and Apex are not installed",
    r"Apex is not installed",
    r"absl\.logging is not installed",
    r"Only transformer-engine>=1\.7\.0 supports MoE experts, but your version is 0\.0\.0",
)


@functools.cache  # each patch once per process
def _quiet_missing_library_warnings() -> None:
    if sys.warnoptions:
        return
    for message in MISSING_LIBRARY_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=UserWarning)


@functools.cache  # each patch once per process
def _compile_on_first_call() -> None:
    # megatron/core/jit.py: `jit_fuser = torch.compile` decorates the bias+activation and
    # bias+dropout+add fusions (and a few more) when megatron.core is imported, and torch.compile
    # imports torch._dynamo and inductor right then: 2-4 s of every CPU process's start-up, most of
    # a small test run's CPU time. CPU runs turn those fusions off (and skip their warm-up, see
    # _pretrain_loop), so a decorated function is compiled at its first call instead -- when
    # torch.compile would compile it anyway; only the import moves. Modules and other objects go
    # to torch.compile at once. Effective only where megatron.core.jit is not imported yet
    # (bootstrap.prepare_runtime runs this first in every entry).
    real = torch.compile

    def compile(model=None, **options):  # noqa: A001 -- torch.compile's signature
        if model is None:  # @torch.compile(...) with options
            return lambda fn: compile(fn, **options)
        if not inspect.isfunction(model):
            return real(model, **options)
        compiled = None

        @functools.wraps(model)
        def compiled_on_first_call(*args, **kwargs):
            nonlocal compiled
            if compiled is None:
                compiled = real(model, **options)
            return compiled(*args, **kwargs)

        return compiled_on_first_call

    torch.compile = compile


@functools.cache
def _rng_tracker() -> None:
    # tensor_parallel/random.py: CudaRNGStatesTracker.add()/fork() read and write the CUDA
    # generator (torch.cuda.get_rng_state) -- used by model_parallel_cuda_manual_seed, the local
    # DotProductAttention's dropout fork and activation checkpointing. Keep CPU generator states.
    from megatron.core.tensor_parallel import random as mrandom

    class CpuRNGStatesTracker(mrandom.CudaRNGStatesTracker):
        def add(self, name, seed):
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            self._is_initialized = True
            self.seeds_.add(seed)
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                self.states_[name] = torch.get_rng_state()

        @contextlib.contextmanager
        def fork(self, name=mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME):
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            outer = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(outer)

    mrandom._CUDA_RNG_STATE_TRACKER = CpuRNGStatesTracker()
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True  # initialize_rng_tracker() keeps ours
    # Activation recompute (tensor_parallel.checkpoint, full and selective) saves and restores
    # "all RNG states": the CPU generator, the CUDA generator and the tracker's states. On a CPU the
    # CPU generator is the only one and is restored on its own, so the CUDA part is a placeholder.
    mrandom._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda *args, **kwargs: None


@functools.cache  # each patch once per process
def _current_device() -> None:
    # ~25 places pass device=torch.cuda.current_device() (GlobalMemoryBuffer, RoPE's inv_freq,
    # tensor-parallel mappings, GPTModel, Attention): make that the CPU.
    torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment]


@functools.cache  # each patch once per process
def _rope_cp_slice() -> None:
    # rope_utils.get_pos_emb_on_this_cp_rank builds its index with pin_memory=True and .cuda().
    # Same zigzag selection (chunks r and 2*cp-1-r), on the embedding's device. rotary_pos_embedding
    # and yarn_rotary_pos_embedding (MLA's YaRN) imported the function by name, so they get the
    # replacement too.
    from megatron.core.models.common.embeddings import rope_utils, rotary_pos_embedding, yarn_rotary_pos_embedding

    def get_pos_emb_on_this_cp_rank(pos_emb, seq_dim, cp_group):
        if cp_group is None:
            raise ValueError("cp_group must be provided to get positional embedding per CP rank")
        cp_size, cp_rank = cp_group.size(), cp_group.rank()
        index = torch.tensor([cp_rank, 2 * cp_size - cp_rank - 1], device=pos_emb.device)
        pos_emb = pos_emb.view(*pos_emb.shape[:seq_dim], 2 * cp_size, -1, *pos_emb.shape[seq_dim + 1:])
        pos_emb = pos_emb.index_select(seq_dim, index)
        return pos_emb.view(*pos_emb.shape[:seq_dim], -1, *pos_emb.shape[seq_dim + 2:])

    rope_utils.get_pos_emb_on_this_cp_rank = get_pos_emb_on_this_cp_rank
    rotary_pos_embedding.get_pos_emb_on_this_cp_rank = get_pos_emb_on_this_cp_rank
    yarn_rotary_pos_embedding.get_pos_emb_on_this_cp_rank = get_pos_emb_on_this_cp_rank


@functools.cache  # each patch once per process
def _causal_masks() -> None:
    # transformer/utils.get_default_causal_mask (used by the local DotProductAttention's softmax)
    # allocates with device="cuda"; fused_softmax imported it by name.
    from megatron.core.fusions import fused_softmax
    from megatron.core.transformer import utils as tutils

    @functools.lru_cache(maxsize=32)
    def get_default_causal_mask(sq: int) -> torch.Tensor:
        return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)

    def get_sliding_window_causal_mask(sq, skv, window_size):
        m = torch.ones(sq, skv, dtype=torch.bool)
        upper = torch.triu(m, diagonal=skv - sq - window_size[0])
        return ~torch.tril(upper, diagonal=skv - sq + window_size[1])

    for mod in (tutils, fused_softmax):
        mod.get_default_causal_mask = get_default_causal_mask
        mod.get_sliding_window_causal_mask = get_sliding_window_causal_mask


@functools.cache  # each patch once per process
def _torch_norm_sequence_parallel() -> None:
    # transformer/torch_norm.WrappedTorchNorm (the norm of the local spec without apex) asserts
    # `not config.sequence_parallel`: with sequence parallelism each TP rank normalises its own
    # slice of the sequence, so the norm's weight gradients are partial sums that
    # finalize_model_grads must all-reduce over TP -- which it does for parameters marked
    # `sequence_parallel` (apex's and TE's norms mark theirs). Build the torch norm and mark it.
    from megatron.core.transformer import torch_norm

    build = torch_norm.WrappedTorchNorm.__new__

    def __new__(cls, config, hidden_size, eps=1e-5, **kwargs):
        sequence_parallel = config.sequence_parallel
        if sequence_parallel:
            config = copy.copy(config)
            config.sequence_parallel = False
        norm = build(cls, config, hidden_size, eps, **kwargs)
        for param in norm.parameters():
            param.sequence_parallel = sequence_parallel
        return norm

    torch_norm.WrappedTorchNorm.__new__ = __new__


@functools.cache  # each patch once per process
def _arch_version() -> None:
    # arguments.validate_args asks torch.cuda.get_device_properties for the GPU generation when
    # TP > 1 or CP > 1 and then requires CUDA_DEVICE_MAX_CONNECTIONS=1 (pre-Blackwell rule).
    from megatron.training import arguments
    from megatron.training.utils import common_utils

    arguments.get_device_arch_version = lambda: 9
    common_utils.get_device_arch_version = lambda: 9
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")


class _Stream:
    """Stand-in for torch.cuda.Stream/Event: the CPU runs everything in program order."""

    def __init__(self, *args, **kwargs):
        pass

    def __getattr__(self, name):  # wait_stream, wait_event, record, synchronize, query, ...
        results = {"query": True, "record_event": _Stream()}
        return lambda *args, **kwargs: results.get(name)


@functools.cache  # each patch once per process
def _cuda_redirect() -> None:
    # Schedules (torch.zeros(..., device="cuda")), DDP buffers, the optimizer and clip_grads
    # create CUDA tensors and use streams. A process-wide TorchFunctionMode turns device="cuda"
    # into the CPU, Tensor.cuda() into identity and pin_memory into False.
    from torch.overrides import TorchFunctionMode

    def cpu_device(dev):
        if isinstance(dev, int):
            return torch.device("cpu")
        if isinstance(dev, (str, torch.device)) and torch.device(dev).type == "cuda":
            return torch.device("cpu")
        return dev

    class CudaToCpu(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func is torch.Tensor.cuda:
                return args[0]
            if func is torch.Tensor.type and len(args) == 1 and not kwargs:
                # The mixed-precision and distributed optimizers and clip_grads check
                # param.type() against 'torch.cuda.{Float,Half,BFloat16}Tensor'.
                return func(*args).replace("torch.", "torch.cuda.", 1)
            kwargs = dict(kwargs or {})
            if "device" in kwargs:
                kwargs["device"] = cpu_device(kwargs["device"])
            if kwargs.get("pin_memory"):
                kwargs["pin_memory"] = False
            return func(*args, **kwargs)

    mode = CudaToCpu()
    mode.__enter__()  # active for the rest of the process
    torch.cuda.Stream = torch.cuda.Event = _Stream  # type: ignore[misc]
    torch.cuda.current_stream = torch.cuda.default_stream = lambda *a, **k: _Stream()  # type: ignore[assignment]
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()  # type: ignore[assignment]
    torch.cuda.synchronize = torch.cuda.empty_cache = lambda *a, **k: None  # type: ignore[assignment]


@functools.cache  # each patch once per process
def _pretrain_loop() -> None:
    from megatron.training import initialize, training

    # initialize_megatron asserts torch.cuda.is_available() unless allow_no_cuda=True, which
    # pretrain() never passes.
    training.initialize_megatron = functools.partial(initialize.initialize_megatron, allow_no_cuda=True)
    # _initialize_distributed only initialises parallel_state `if torch.cuda.device_count() > 0`,
    # and then calls torch.cuda.set_device.
    torch.cuda.device_count = lambda: 1  # type: ignore[assignment]
    torch.cuda.set_device = lambda *a, **k: None  # type: ignore[assignment]
    # The rerun state machine and checkpoints save/restore the CUDA generator.
    torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()  # type: ignore[assignment]
    torch.cuda.set_rng_state = lambda *a, **k: None  # type: ignore[assignment]
    # _warmup_jit_function runs the torch.compile'd bias+activation and bias+dropout+add fusions on
    # random CUDA tensors: on a CPU that is ~15 s of inductor compilation per process for fusions a
    # CPU run turns off, and (redirected to the CPU) its torch.rand calls, shaped by the CP size,
    # would consume the CPU generator and make the initial weights depend on CP. Skip it.
    initialize._warmup_jit_function = lambda *args, **kwargs: None
