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
import functools
import os

import torch

__all__ = ["install_model_patches", "install_training_patches"]

_DONE: set[str] = set()


def _once(fn):
    @functools.wraps(fn)
    def wrapper():
        if fn.__name__ not in _DONE:
            fn()
            _DONE.add(fn.__name__)
    return wrapper


def install_model_patches() -> None:
    """Patches for building and running Megatron-Core models on the CPU."""
    if torch.cuda.is_available():
        raise RuntimeError("megatron_mesh.megatron.cpu_compat is for CPU-only runs; CUDA is available")
    _rng_tracker()
    _current_device()
    _rope_cp_slice()
    _causal_masks()


def install_training_patches() -> None:
    """Model patches plus those for argument validation, schedules, DDP and ``pretrain()``."""
    install_model_patches()
    _arch_version()
    _cuda_redirect()
    _pretrain_loop()


@_once
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


@_once
def _current_device() -> None:
    # ~25 places pass device=torch.cuda.current_device() (GlobalMemoryBuffer, RoPE's inv_freq,
    # tensor-parallel mappings, GPTModel, Attention): make that the CPU.
    torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment]


@_once
def _rope_cp_slice() -> None:
    # rope_utils.get_pos_emb_on_this_cp_rank builds its index with pin_memory=True and .cuda().
    # Same zigzag selection (chunks r and 2*cp-1-r), on the embedding's device. rotary_pos_embedding
    # imported the function by name, so both modules get the replacement.
    from megatron.core.models.common.embeddings import rope_utils, rotary_pos_embedding

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


@_once
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


@_once
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


@_once
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


@_once
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
    # _warmup_jit_function draws torch.rand(..., device="cuda") with shapes that depend on the CP
    # size; redirected to the CPU it would consume the CPU generator and make the initial weights
    # depend on CP. Run it on a forked generator.
    warmup = initialize._warmup_jit_function

    def forked_warmup(*args, **kwargs):
        with torch.random.fork_rng(devices=[]):
            return warmup(*args, **kwargs)

    initialize._warmup_jit_function = forked_warmup
