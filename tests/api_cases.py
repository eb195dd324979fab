"""Hostile distributed calls, run in one spawned gloo group of 4 (see test_api_distributed.py):
ranks that disagree on the plan, a rank calling with a group it is not in, and a process group
destroyed and re-created with the ranks swapped."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

import megatron_mesh as mm
from megatron_mesh.kernels import reference_attention


def _inputs(world: int, rank: int, T: int = 8, heads: int = 4, kv: int = 2):
    g = torch.Generator().manual_seed(7)
    S = world * T
    full = [torch.randn(S, 1, h, 8, generator=g, dtype=torch.float64) for h in (heads, kv, kv)]
    ref = reference_attention(*full)
    return [mm.zigzag_shard(x, rank, world) for x in full], mm.zigzag_shard(ref, rank, world)


def _outcome(fn) -> str:
    try:
        fn()
        return "ok"
    except Exception as e:  # noqa: BLE001 -- the test asserts on the type and message
        return f"{type(e).__name__}: {e}"


def hostile(rank: int, world: int) -> dict:
    """Runs on the whole default group (world >= 4, even); destroys and re-creates it at the end."""
    out = {}
    (q, k, v), _ = _inputs(world, rank)
    # 1. rank 0 asks for tile 2 x P/2, the others for 1 x P: every rank must raise at once, not hang
    out["disagree"] = _outcome(lambda: mm.mesh_attention(q, k, v, tile=(2, world // 2) if rank == 0 else (1, world)))
    # the same call with matching settings still works afterwards (the check is per plan)
    out["agree"] = _outcome(lambda: mm.mesh_attention(q, k, v, tile=(1, world)))
    # 2. a group this rank is not in
    pair = dist.new_group([0, 1])
    if rank >= 2:
        (q2, k2, v2), _ = _inputs(2, 0)
        out["not_member"] = _outcome(lambda: mm.ring_attention(q2, k2, v2, group=pair))
    dist.barrier()
    dist.destroy_process_group(pair)
    dist.barrier()
    # 3. destroy the default group and make a new one with the ranks reversed; group=None must
    # mean the new group (TASP's all-to-all transport and Mesh's P2P)
    path = [None]
    if rank == 0:
        path[0] = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"megatron_mesh_reinit_{os.getpid()}")
    dist.broadcast_object_list(path, src=0)
    dist.destroy_process_group()
    new_rank = world - 1 - rank
    dist.init_process_group("gloo", store=dist.FileStore(path[0], world), rank=new_rank, world_size=world)
    (q, k, v), want = _inputs(world, new_rank, T=2 * world)  # TASP: a token per ring in each half
    errs = {}
    for name, fn in (("tasp_alltoall", lambda: mm.tasp_attention(q, k, v, transport="alltoall")),
                     ("tasp_p2p", lambda: mm.tasp_attention(q, k, v)),
                     ("mesh", lambda: mm.mesh_attention(q, k, v, tile=(2, world // 2)))):
        try:
            errs[name] = (fn() - want).abs().max().item()
        except Exception as e:  # noqa: BLE001
            errs[name] = f"{type(e).__name__}: {e}"
    out["reinit"] = errs
    return out
