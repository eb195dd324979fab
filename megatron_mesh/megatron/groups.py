"""Process groups for the plugin modes, built from Megatron's context-parallel (CP) groups.

* Mesh: for tile (a, b) every CP group splits into Q rings (a ranks each) and KV rings (b ranks
  each) -- :class:`megatron_mesh.plan.TileMap` says which CP ranks form each ring.
* TASP: the CP ranks that share a node (global rank // GPUs per node).

``torch.distributed.new_group`` is collective over the whole world: every rank must create every
group, in the same order, even groups it is not in. :func:`initialize_groups` therefore walks
every CP group of the world (gathered once with ``all_gather_object``, so any rank order --
tp-cp-ep-dp-pp or with TP/DP/PP > 1 -- is handled) in one fixed order, and caches the result.
The spec functions call it on every rank at the same point; core-attention modules only look
groups up (creating them there too if nobody did, which is safe when every rank builds its
layers at the same time, i.e. without pipeline parallelism).

Worked example: world 8 = TP 2 x CP 4, Mesh tile 2x2 (contiguous="q"). Megatron's CP groups are
the global ranks [0, 2, 4, 6] and [1, 3, 5, 7] (stride = TP size). For the first, CP ranks
{0, 1} and {2, 3} are the Q rings -> global {0, 2}, {4, 6}; CP ranks {0, 2} and {1, 3} are the KV
rings -> global {0, 4}, {2, 6}. Rank 2 (CP rank 1) routes its Q-ring peer (CP rank 0) through
group {0, 2} and its KV-ring peer (CP rank 3) through group {2, 6}.
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch
import torch.distributed as dist

from ..comm.alltoall import AllToAllCommunicator
from ..comm.torch_dist import TorchDistCommunicator
from ..plan import TileMap
from .args import gpus_per_node, layer_modes, node_blocks, plugin_settings, ranks_per_node, resolve_tile

__all__ = ["initialize_groups", "destroy_groups", "mesh_communicator", "tasp_communicator",
           "cp_communicator", "alltoall_communicator", "node_blocks"]

_CP_GROUPS: dict[tuple[int, ...], list[tuple[int, ...]]] = {}  # my CP ranks -> every CP group
_CREATED: dict[tuple, dict[int, dist.ProcessGroup]] = {}  # request -> {my group's peer: sub-group}
_OWNED: list[dist.ProcessGroup] = []  # groups this rank is in (for destroy_groups)
_COMMS: dict[tuple, "TorchDistCommunicator | AllToAllCommunicator"] = {}


def _ranks(group) -> tuple[int, ...]:
    return tuple(dist.get_process_group_ranks(group))


def _cp_group(cp_group=None):
    if cp_group is not None:
        return cp_group
    from megatron.core import parallel_state

    return parallel_state.get_context_parallel_group()


def _all_cp_groups(cp_group) -> list[tuple[int, ...]]:
    """Every CP group of the world (sorted), gathered once; collective on the first call."""
    mine = _ranks(cp_group)
    if mine not in _CP_GROUPS:
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        _CP_GROUPS[mine] = sorted(set(gathered))
    return _CP_GROUPS[mine]


def _requests(config, cp_size: int) -> list[tuple]:
    """The sub-group families ``config``'s plugin layers need (all layers, not only this
    pipeline stage's, so every rank asks for the same)."""
    modes = set(layer_modes(config.cp_comm_type))
    s = plugin_settings(config)
    out = []
    if "mesh" in modes:
        out.append(("mesh", *resolve_tile(cp_size, config)))
    if "tasp" in modes:
        out.append(("tasp", gpus_per_node(s)))
    return out


def _rings(request, size: int, cp_ranks: tuple[int, ...]) -> list[tuple[int, ...]]:
    """The sub-groups (as CP-rank index tuples) of one request for one CP group."""
    if request[0] == "mesh":
        (a, b), contiguous = request[1], request[2]
        tiles = TileMap(a, b, contiguous)
        rings = {tuple(sorted(tiles.q_group(r))) for r in range(size)}
        rings |= {tuple(sorted(tiles.kv_group(r))) for r in range(size)}
        return sorted(rings)
    return node_blocks(cp_ranks, request[1])


def initialize_groups(config, cp_group=None) -> None:
    """Create, once and on every rank, the sub-groups ``config``'s plugin layers need (collective:
    call it on all ranks, e.g. from the spec function; later calls are free)."""
    if cp_group is None and config.context_parallel_size == 1:
        return
    if not {"mesh", "tasp"} & set(layer_modes(config.cp_comm_type)):
        return  # ring needs no sub-groups
    cp_group = _cp_group(cp_group)
    size = dist.get_world_size(cp_group)
    if size == 1:
        return
    me = dist.get_rank()
    for request in _requests(config, size):
        key = (_ranks(cp_group), *request)
        if key in _CREATED:
            continue
        from megatron.core import parallel_state

        routes: dict[int, dist.ProcessGroup] = {}
        mine = []
        for cp_ranks in _all_cp_groups(cp_group):
            for ring in _rings(request, size, cp_ranks):
                if len(ring) < 2 or len(ring) == size:
                    continue  # no peers, or the whole CP group (use it directly)
                members = [cp_ranks[i] for i in ring]
                group = parallel_state.create_group(members, pg_options=parallel_state.get_nccl_options("cp", {}),
                                                    group_desc=f"MEGATRON_MESH_{request[0].upper()}")
                if me in members:
                    mine.append(group)
                    routes.update({cp_ranks.index(g): group for g in members if g != me})
        _warm_up(mine)
        _OWNED.extend(mine)
        _CREATED[key] = routes


def _warm_up(groups: Iterable[dist.ProcessGroup]) -> None:
    # NCCL creates a communicator at its first operation, which all members must join; a Mesh
    # round need not involve every member of a ring, so run one all-reduce per group up front.
    # Every rank warms its groups in the same global (creation) order, so the earliest group not
    # yet warmed always has all its members waiting on it: no deadlock.
    for group in groups:
        if dist.get_backend(group) == "nccl":
            dist.all_reduce(torch.zeros(1, device=torch.device("cuda", torch.cuda.current_device())), group=group)


def _routes(config, cp_group, request) -> dict[int, dist.ProcessGroup]:
    key = (_ranks(cp_group), *request)
    if key not in _CREATED:
        initialize_groups(config, cp_group)
    if key not in _CREATED:
        raise RuntimeError(f"no process groups for {request} on CP group {key[0]}: the config's "
                           f"cp_comm_type {config.cp_comm_type!r} does not ask for them")
    return _CREATED[key]


def _communicator(cp_group, routes: dict[int, dist.ProcessGroup]) -> TorchDistCommunicator:
    key = (_ranks(cp_group), tuple(sorted((p, id(g)) for p, g in routes.items())))
    if key not in _COMMS:
        _COMMS[key] = TorchDistCommunicator(cp_group, routes=routes)
    return _COMMS[key]


def cp_communicator(cp_group) -> TorchDistCommunicator:
    """P2P over the whole CP group (ring attention)."""
    return _communicator(cp_group, {})


def mesh_communicator(config, cp_group, tile: tuple[int, int], contiguous: str) -> TorchDistCommunicator:
    """P2P over the CP group with Q-ring and KV-ring peers routed through their ring groups."""
    return _communicator(cp_group, _routes(config, cp_group, ("mesh", tuple(tile), contiguous)))


def tasp_communicator(config, cp_group) -> TorchDistCommunicator:
    """P2P over the CP group with same-node peers routed through their node group."""
    return _communicator(cp_group, _routes(config, cp_group, ("tasp", gpus_per_node(plugin_settings(config)))))


def alltoall_communicator(cp_group) -> AllToAllCommunicator:
    """One all-to-all collective per round over the CP group (TASP's ``alltoall`` transport)."""
    key = ("alltoall", _ranks(cp_group))
    if key not in _COMMS:
        _COMMS[key] = AllToAllCommunicator(cp_group)
    return _COMMS[key]


def cp_ranks_per_node(config, cp_group) -> Optional[int]:
    """CP ranks per node for TASP (None: the whole CP group shares one node)."""
    return ranks_per_node(_ranks(cp_group), gpus_per_node(plugin_settings(config)))


def destroy_groups() -> None:
    """Forget (and destroy) every group made here -- for tests that re-initialise parallel state."""
    for group in _OWNED:
        try:
            dist.destroy_process_group(group)
        except Exception:  # noqa: BLE001 -- already gone with the default group
            pass
    _OWNED.clear()
    _CREATED.clear()
    _CP_GROUPS.clear()
    _COMMS.clear()
