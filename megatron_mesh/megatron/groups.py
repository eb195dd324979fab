"""Process groups for the plugin modes, built from Megatron's context-parallel (CP) groups.

A mode's :class:`~megatron_mesh.plan.Placement` names the sub-groups its transfers use
(``Placement.groups()``: Mesh's Q and KV rings, TASP's nodes, a hybrid's all-to-all groups and
its inner rings); this module creates them for every CP group of the world and routes each peer
through the smallest one holding both ranks. Nothing here knows a mode by name.

``torch.distributed.new_group`` is collective over the whole world: every rank must create every
group, in the same order, even groups it is not in. :meth:`CPGroups.initialize` therefore walks
every CP group of the world (gathered once with ``all_gather_object``, so any rank order --
tp-cp-ep-dp-pp or with TP/DP/PP > 1 -- is handled) and every plugin mode of the config in one
fixed order, and keeps the result in a :class:`CPGroups` object: the process's own is
:data:`PROCESS_GROUPS`, which the spec functions fill on every rank at the same point and hand to
every plugin layer they build (a test may make its own). Core-attention modules only look groups up (creating them there too if nobody did, which is
safe when every rank builds its layers at the same time, i.e. without pipeline parallelism).

Worked example: world 8 = TP 2 x CP 4, Mesh tile 2x2 (contiguous="q"). Megatron's CP groups are
the global ranks [0, 2, 4, 6] and [1, 3, 5, 7] (stride = TP size). For the first, CP ranks
{0, 1} and {2, 3} are the Q rings -> global {0, 2}, {4, 6}; CP ranks {0, 2} and {1, 3} are the KV
rings -> global {0, 4}, {2, 6}. Rank 2 (CP rank 1) routes its Q-ring peer (CP rank 0) through
group {0, 2} and its KV-ring peer (CP rank 3) through group {2, 6}.
"""

from __future__ import annotations

import os
import sys
from typing import Iterable

import torch
import torch.distributed as dist

from ..comm.alltoall import AllToAllCommunicator
from ..comm.torch_dist import TorchDistCommunicator
from ..plan.modes import Placement
from ..runtime.agreement import differences
from ..runtime.state import RUNTIME
from .errors import SettingsMismatchError
from .settings import HIERARCHY_FLAG, flags, layer_modes, plugin_modes_of, plugin_settings, problem_of
from .placement import resolve_placement

__all__ = ["CPGroups", "PROCESS_GROUPS", "cp_ranks", "SettingsMismatchError", "local_device", "needs_cpu_check_group"]


def local_device() -> torch.device:
    """The device this rank's collectives and batch tensors use: its current GPU, else the CPU
    (gloo on the CPU runs)."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def cp_ranks(group) -> tuple[int, ...]:
    return tuple(dist.get_process_group_ranks(group))


def needs_cpu_check_group(group) -> bool:
    """Whether the plan check of calls on ``group`` runs over a gloo twin of it: on an NCCL group
    the check's result, read by the host, would wait for the GPU's queue once per call
    (:mod:`megatron_mesh.runtime.agreement`)."""
    return dist.get_backend(group) == "nccl"


def _cp_group(cp_group=None):
    if cp_group is not None:
        return cp_group
    from megatron.core import parallel_state

    return parallel_state.get_context_parallel_group()


# plugin flags that only change what one rank writes or when it works, never a collective: a rank
# may differ there (e.g. a metrics directory on each node's local disk)
LOCAL_FLAGS = ("--cp-metrics-dir", "--no-cp-layout-lookahead")


# Megatron's own arguments every rank must share too, where an entry script parsed them: when the
# collectives happen (iterations, batches, evaluation, checkpoints, exit) and what is trained (the
# seed, the learning rate). Two nodes started with different values hung at the end of training
# (--train-iters 3 and 5: both waited until the distributed timeout without a word) or trained
# another model than either asked for (--seed) -- stop 79, a reviewer's two-node runs. Paths are
# left out: a dataset may lie at another path on each node.
SHARED_ARGS = ("seed", "train_iters", "train_samples", "global_batch_size", "micro_batch_size", "rampup_batch_size",
               "lr", "min_lr", "lr_decay_style", "lr_warmup_iters", "split", "eval_interval", "eval_iters",
               "save_interval", "exit_interval")


def shared_args() -> dict:
    """:data:`SHARED_ARGS` by flag, as the entry script parsed them; empty for a model built in
    Python (Megatron's arguments never parsed, or megatron.training not imported)."""
    global_vars = sys.modules.get("megatron.training.global_vars")
    try:
        args = global_vars.get_args() if global_vars is not None else None
    except AssertionError:  # imported, never parsed
        args = None
    if args is None:
        return {}
    out = {"--" + name.replace("_", "-"): getattr(args, name, None) for name in SHARED_ARGS}
    out.update(dataset_contents(args))
    return out


FINGERPRINT_BYTES = 1 << 20  # of an index file's start and of its end: its size and these stand for its content


def dataset_contents(args) -> dict:
    """{"the dataset <flag> (its files' content)": what each prefix holds} for each dataset list
    the arguments name: each prefix's blend weight (where given), .bin and .idx sizes and a hash of
    its .idx's first and last :data:`FINGERPRINT_BYTES` (the index lists every document's size).
    Not the paths, nor the prefixes' names (a path that differs shows up as Megatron's index cache
    missing, :func:`.errors.index_cache_missing_is_one_line`). Two nodes given different datasets
    (another DOC_DATA) otherwise failed at the first attention call, a PlanMismatchError traceback
    per rank (other documents, other plans), never naming --data-path. A file that is not there
    is "missing" (its own check names it); --mock-data and object-store paths add nothing.

    Example: ``--data-path data/tiny_docs`` -> {"the dataset --data-path (its files' content)":
    ".bin 44098 B, .idx 40042 B #3333f48f33"}."""
    import hashlib

    from .data_checks import data_blends

    if getattr(args, "mock_data", False):
        return {}
    out = {}
    for given, prefixes in data_blends(args):
        held = []
        values = given.split()[1:]
        weights = values[0::2] if len(values) == 2 * len(prefixes) and values[1::2] == prefixes else [""] * len(prefixes)
        for weight, prefix in ((w, p) for w, p in zip(weights, prefixes) if "://" not in p):
            try:
                bin_size, idx_size = os.path.getsize(prefix + ".bin"), os.path.getsize(prefix + ".idx")
                with open(prefix + ".idx", "rb") as f:
                    digest = hashlib.sha1(f.read(FINGERPRINT_BYTES))
                    f.seek(max(FINGERPRINT_BYTES, idx_size - FINGERPRINT_BYTES))
                    digest.update(f.read(FINGERPRINT_BYTES))
                held.append(f"{weight + ' x ' if weight else ''}.bin {bin_size} B, .idx {idx_size} B "
                            f"#{digest.hexdigest()[:10]}")
            except OSError:
                held.append(f"{weight + ' x ' if weight else ''}missing")
        if held:  # a --per-split-data-args-path file gives three lists: one entry, " | " between them
            key = f"the dataset {given.split()[0]} (its files' content)"
            out[key] = f"{out[key]} | {'; '.join(held)}" if key in out else "; ".join(held)
    return out


def settings_of(config) -> dict:
    """The context-parallel settings of ``config`` that every rank must share, by the flag that
    sets each: the CP size, the layers' modes, the hierarchical sizes, every plugin flag but
    :data:`LOCAL_FLAGS`, the processes per node (TASP's rings, the hybrids' groups and the balanced
    layout follow the nodes) and what the 'auto' choices are made for (the sequence length, heads,
    head size, parameter dtype and TP size: ranks that differ there could pick different tiles)."""
    modes = layer_modes(config.cp_comm_type)
    settings = plugin_settings(config)  # as they apply: a flag left out and one given its default agree
    problem = problem_of(config, settings)
    out = {"--context-parallel-size": config.context_parallel_size,
           "--cp-comm-type": " ".join(modes),
           HIERARCHY_FLAG: problem.hierarchy}
    for f in flags():
        if f.name not in LOCAL_FLAGS:
            out[f.name] = getattr(settings, f.dest)
    if plugin_modes_of(modes):
        out["processes (GPUs) per node (--tasp-gpus-per-node, else torchrun's LOCAL_WORLD_SIZE)"] = \
            settings.gpus_per_node
        out.update({"--seq-length": problem.seq_len, "--num-attention-heads": problem.heads,
                    "--num-query-groups": problem.kv_heads, "--kv-channels": problem.head_dim,
                    "--tensor-model-parallel-size": problem.tp, "parameter dtype (--bf16, --fp16)": problem.dtype})
    out["documents (--reset-attention-mask, --reset-position-ids, --cp-thd-packing)"] = settings.documents
    if "NNODES" in os.environ:  # the launcher's: a node given another one trained, then hung at torchrun's exit
        out["NNODES (the job's nodes)"] = os.environ["NNODES"]
    out.update(shared_args())
    # plain values as they are; anything else as its repr -- hashable and printable by the report,
    # whatever a Python user put on the config -- a list as the tuple it equals (Megatron's parser
    # gives lists, a config built in Python may hold tuples)
    return {k: v if v is None or isinstance(v, (str, int, float, bool)) else
            repr(tuple(v)) if isinstance(v, (list, tuple)) else repr(v) for k, v in out.items()}


def check_settings_agree(config) -> None:
    """SettingsMismatchError on every rank, naming the settings and the ranks that hold each value,
    where the ranks of the world do not share :func:`settings_of` -- e.g. two nodes started with
    different ``--cp-comm-type``, which would otherwise wait for each other for ever in the first
    process group one of them creates. Collective over the world at every call (so that no rank
    can skip it while another waits), made where every rank builds its layers."""
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, settings_of(config))
    parts = differences(gathered)
    if parts:
        raise SettingsMismatchError("the ranks were started with different settings (every rank, on "
                                    "every node, must get the same flags and the same number of processes per node; "
                                    "otherwise they wait for each other for ever or train different models): " + "; ".join(parts))


def _warm_up(groups: Iterable[dist.ProcessGroup]) -> None:
    # NCCL creates a communicator at its first operation, which all members must join; a round
    # need not involve every member of a group, so run one all-reduce per group up front. Every
    # rank warms its groups in the same global (creation) order, so the earliest group not yet
    # warmed always has all its members waiting on it: no deadlock.
    for group in groups:
        if dist.get_backend(group) == "nccl":
            dist.all_reduce(torch.zeros(1, device=torch.device("cuda", torch.cuda.current_device())), group=group)


class CPGroups:
    """The sub-groups made for the plugin's layers and the communicators routed through them.
    Process groups are the process's: a copy of a layer spec (Megatron deep-copies some) shares
    this object."""

    def __init__(self):
        self.cp_groups: dict[tuple[int, ...], list[tuple[int, ...]]] = {}  # my CP ranks -> every CP group
        self.groups: dict[tuple[int, ...], dist.ProcessGroup] = {}  # global members -> the group made for them
        self.done: set = set()  # (my CP ranks, placement) whose groups exist (a mode's tile may change between models)
        self.owned: list[dist.ProcessGroup] = []  # groups made here (for destroy)
        self.comms: dict[tuple, "TorchDistCommunicator | AllToAllCommunicator"] = {}
        self.cpu_groups: dict[tuple[int, ...], dist.ProcessGroup] = {}  # CP ranks -> the gloo twin its check runs on
        self.checked: list = []  # the CP groups whose check was moved to a twin (for destroy)

    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self

    def _all_cp_groups(self, cp_group) -> list[tuple[int, ...]]:
        """Every CP group of the world (sorted), gathered once; collective on the first call."""
        mine = cp_ranks(cp_group)
        if mine not in self.cp_groups:
            gathered: list = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, mine)
            self.cp_groups[mine] = sorted(set(gathered))
        return self.cp_groups[mine]

    def initialize(self, config, cp_group=None) -> None:
        """Create, once and on every rank, the sub-groups ``config``'s plugin layers need
        (collective over the world: call it on all ranks at the same point, e.g. from the spec
        function, as Megatron builds every rank's layers). First every rank checks that all share
        the context-parallel settings (:func:`check_settings_agree`; also at CP 1, where a node
        started with another CP size would otherwise skip it)."""
        if cp_group is None and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            check_settings_agree(config)
        if cp_group is None and config.context_parallel_size == 1:
            return
        modes = sorted(plugin_modes_of(layer_modes(config.cp_comm_type)))
        if not modes:
            return
        cp_group = _cp_group(cp_group)
        if dist.get_world_size(cp_group) == 1:
            return
        mine = cp_ranks(cp_group)
        self._check_groups(cp_group)
        todo = [m for m in modes if (mine, resolve_placement(m, config, mine)) not in self.done]
        if not todo:
            return
        from megatron.core import parallel_state

        me, made = dist.get_rank(), []
        for ranks in self._all_cp_groups(cp_group):
            for mode in todo:
                for members in resolve_placement(mode, config, ranks).groups():
                    glob = tuple(sorted(ranks[i] for i in members))
                    if glob in self.groups:
                        continue
                    group = parallel_state.create_group(list(glob),
                                                        pg_options=parallel_state.get_nccl_options("cp", {}),
                                                        group_desc="MEGATRON_MESH_CP_SUBGROUP")
                    self.groups[glob] = group
                    self.owned.append(group)
                    if me in glob:
                        made.append(group)
        _warm_up(made)
        self.done.update((mine, resolve_placement(m, config, mine)) for m in todo)

    def _check_groups(self, cp_group) -> None:
        """On an NCCL CP group, a gloo twin of every CP group of the world, made once on every rank
        (collective over the world, like the sub-groups), and this rank's group's plan check moved
        onto its twin (:meth:`~megatron_mesh.runtime.state.GroupChecks.use_cpu_group`): the hosts
        agree on each call without waiting for the GPU. Nothing on gloo (the CPU runs)."""
        if not needs_cpu_check_group(cp_group):
            return
        from megatron.core import parallel_state

        for ranks in self._all_cp_groups(cp_group):
            if ranks not in self.cpu_groups:
                group = parallel_state.create_group(list(ranks), backend="gloo", group_desc="MEGATRON_MESH_CP_CHECK")
                self.cpu_groups[ranks] = group
                self.owned.append(group)
        self._check_over_twin(cp_group)

    def _check_over_twin(self, cp_group) -> None:
        twin = self.cpu_groups.get(cp_ranks(cp_group))
        if twin is not None and RUNTIME.checks.check_group(cp_group) is not twin:
            RUNTIME.checks.use_cpu_group(cp_group, twin)
            self.checked.append(cp_group)

    def communicator(self, config, cp_group, placement: Placement):
        """The transport of ``placement`` over ``cp_group``: P2P with each peer routed through the
        smallest sub-group holding both ranks (the whole CP group otherwise) -- a hybrid's Ulysses
        peers through their group's, so each all-to-all round is one collective there
        (:meth:`~megatron_mesh.comm.torch_dist.TorchDistCommunicator.exchange`) -- or one
        all-to-all collective per round for TASP's ``alltoall`` transport."""
        ranks = cp_ranks(cp_group)
        self._check_over_twin(cp_group)  # the layers' group object may be another than initialize's
        if placement.transport == "alltoall":
            key = ("alltoall", ranks)
            if key not in self.comms:
                self.comms[key] = AllToAllCommunicator(cp_group)
            return self.comms[key]
        if placement.world_size > 1 and (ranks, placement) not in self.done:
            self.initialize(config, cp_group)
        me = ranks.index(dist.get_rank())
        routes: dict[int, tuple] = {}
        for members in placement.groups():
            if me not in members:
                continue
            glob = tuple(sorted(ranks[i] for i in members))
            for peer in members:
                if peer != me and (peer not in routes or len(glob) < len(routes[peer])):
                    routes[peer] = glob
        missing = [g for g in routes.values() if g not in self.groups]
        if missing:
            raise RuntimeError(f"no process group for CP ranks {missing[0]}: CPGroups.initialize(config) did not make "
                               f"the groups of {placement.describe()}")
        key = (ranks, tuple(sorted(routes.items())))
        if key not in self.comms:
            self.comms[key] = TorchDistCommunicator(cp_group, routes={p: self.groups[g] for p, g in routes.items()})
        return self.comms[key]

    def destroy(self) -> None:
        """Forget (and destroy) every group made here -- for tests that re-initialise parallel state."""
        for group in self.checked:
            RUNTIME.checks.forget_cpu_group(group)
        for group in self.owned:
            try:
                dist.destroy_process_group(group)
            except Exception:  # noqa: BLE001 -- already gone with the default group
                pass
        self.__init__()


PROCESS_GROUPS = CPGroups()  # the process's groups: what the spec functions create and hand to the layers
