"""Hostile distributed calls, run on the whole default group of the shared spawn (see
test_api_distributed.py): ranks that disagree on the plan (mode, documents with a cached plan on
some ranks and a new one on others, same-shape plans, softmax scale, dtype, local shape, window,
a hybrid, the Megatron adapter's wrapped communicator, one rank's bad input, one rank's own process
settings -- the check's switch, the mask piece -- and grad mode), a rank calling with a
group it is not in, and a process group destroyed and re-created with the ranks swapped."""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

import megatron_mesh as mm
from megatron_mesh.kernels import reference_attention
from megatron_mesh.plan import Mask


def _inputs(world: int, rank: int, T: int = 8, heads: int = 4, kv: int = 2, mask: Mask | None = None):
    g = torch.Generator().manual_seed(7)
    S = world * T
    full = [torch.randn(S, 1, h, 8, generator=g, dtype=torch.float64) for h in (heads, kv, kv)]
    ref = reference_attention(*full, mask=mask)
    return [mm.zigzag_shard(x, rank, world) for x in full], mm.zigzag_shard(ref, rank, world)


def _outcome(fn) -> str:
    try:
        fn()
        return "ok"
    except Exception as e:  # noqa: BLE001 -- the test asserts on the type and message
        return f"{type(e).__name__}: {e}"


# documents of a 32-token sequence: B, C and D move A's first boundary by one or two tokens (under
# ring, A's and B's transfers have the same shapes: a rank running the other plan would not fail)
DOCS = {"A": [0, 13, 20, 32], "B": [0, 14, 20, 32], "C": [0, 12, 20, 32], "D": [0, 15, 20, 32]}


OTHER_SOURCE = "000000000000"  # the plan layer's source digest of "another plugin version"


def _other_plan_code(other: bool, fn):
    """Run ``fn`` as a rank whose plan layer has other source files (``other``): a node with
    another plugin version. Same inputs, same plan digest: only the plan code differs."""
    from megatron_mesh.runtime import agreement

    if not other:
        return fn()
    real = agreement._source_digest
    agreement._source_digest = lambda: OTHER_SOURCE
    try:
        return fn()
    finally:
        agreement._source_digest = real


def _with_env(here: bool, name: str, value: str, fn):
    """Run ``fn`` with the environment variable ``name`` set to ``value`` on this rank (``here``)."""
    if not here:
        return fn()
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        return fn()
    finally:
        if old is None:
            del os.environ[name]
        else:
            os.environ[name] = old


def _trains(q, k, v, no_grad: bool):
    """Rank 2's view of a training step with ``no_grad``: the forward only (torch.no_grad()), the
    others' forward and backward."""
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    if no_grad:
        with torch.no_grad():
            return mm.ring_attention(q, k, v)
    mm.ring_attention(q, k, v).sum().backward()


def _matches(out, want):
    assert (out - want).abs().max().item() < 1e-12


def process_settings(rank: int, world: int, q, k, v, want) -> dict:
    """One rank's own process settings and grad mode: the check's switch, the mask piece (and its
    old name), torch.no_grad(): name -> call (see disagreements)."""
    from megatron_mesh.runtime import agreement

    ring = lambda: mm.ring_attention(q, k, v)  # noqa: E731
    documents = lambda: mm.ring_attention(q, k, v, cu_seqlens=DOCS["A"])  # noqa: E731 -- masked blocks: mask pieces
    return {
        "agreement_off_on_one_rank": lambda: _with_env(rank == 2, agreement.ENV, "0", ring),
        "agreement_bad_on_one_rank": lambda: _with_env(rank == 2, agreement.ENV, "yes", ring),
        "mask_piece_bad_on_one_rank": lambda: _with_env(rank == 2, "MEGATRON_MESH_MASK_PIECE", "0", documents),
        "no_grad_on_one_rank": lambda: _trains(q, k, v, no_grad=rank == 2),
        # every rank without the check: the first call agrees on that, the second runs no check
        "agreement_off_everywhere": lambda: _with_env(True, agreement.ENV, "0", lambda: [
            _matches(mm.ring_attention(q, k, v), want) for _ in range(2)]),
    }


def disagreements(rank: int, world: int) -> dict:
    """Calls on which the ranks disagree, in order (plans built by earlier calls stay cached):
    name -> (outcome on this rank, seconds). Each must raise on every rank; the "*_agree" calls
    in between must run."""
    from megatron_mesh.comm.torch_dist import TorchDistCommunicator
    from megatron_mesh.megatron.telemetry import TimedCommunicator, Timing
    from megatron_mesh.plan import AttentionShape, resolve

    T = 32 // world
    (q, k, v), want = _inputs(world, rank, T=T)

    def ring(odd: int, theirs: str, rest: str):  # rank `odd` passes documents `theirs`, the others `rest`
        return lambda: mm.ring_attention(q, k, v, cu_seqlens=DOCS[theirs if rank == odd else rest])

    half = (q.repeat(1, 2, 1, 1), k.repeat(1, 2, 1, 1), v.repeat(1, 2, 1, 1))  # batch 2
    wide = tuple(torch.cat([x, x], dim=-1) for x in (q, k, v))  # head dim 16
    shape = AttentionShape(T, 1, 4, 2, 8, 8)
    adapter = TimedCommunicator(TorchDistCommunicator(None), Timing())  # what core_attention.py hands attention()
    placement = resolve("mesh", world, shape, tile=(2, world // 2))
    calls = {
        "documents_agree_A": ring(0, "A", "A"),
        "documents_cached_vs_new": ring(0, "A", "B"),  # rank 0 reuses A's plan, the others build B's
        "documents_new_vs_cached": ring(0, "B", "A"),  # rank 0 builds B's plan, the others reuse A's
        "documents_agree_B": ring(0, "B", "B"),
        "documents_same_shape": ring(3, "B", "A"),  # both plans cached everywhere, same transfer shapes
        "documents_unseen": ring(0, "C", "D"),  # new on every rank, different
        "softmax_scale": lambda: mm.ring_attention(q, k, v, softmax_scale=0.5 if rank == 0 else None),
        "dtype": lambda: mm.mesh_attention(*(x.bfloat16() if rank == 0 else x.float() for x in (q, k, v)),
                                           tile=(2, world // 2)),
        "local_shape": lambda: mm.mesh_attention(*(half if rank == 0 else wide if rank == 1 else (q, k, v)),
                                                 tile=(2, world // 2)),
        "window": lambda: mm.mesh_attention(q, k, v, tile=(2, world // 2), window=(3 if rank == 0 else 4, 0)),
        # mask kinds: another chunk size on rank 0, another prefix length on rank 4
        "chunk_size": lambda: mm.ring_attention(q, k, v, mask=mm.masks.chunked(3 if rank == 0 else 5)),
        "prefix_length": lambda: mm.mesh_attention(q, k, v, tile=(2, world // 2), mask=mm.masks.documents(DOCS["A"]) &
                                                   mm.masks.prefix(2 if rank == 4 else 3)),
        "chunked_agree": lambda: mm.tasp_attention(q, k, v, mask=mm.masks.documents(DOCS["A"]) & mm.masks.chunked(5)),
        "hybrid_agree": lambda: mm.hybrid_attention(q, k, v, ulysses_size=2, tile=(1, world // 2), window=(3, 0)),
        "hybrid_window": lambda: mm.hybrid_attention(q, k, v, ulysses_size=2, tile=(1, world // 2),
                                                     window=(4 if rank == world - 3 else 3, 0)),
        "adapter": lambda: mm.attention(q, k, v, mode="mesh", placement=placement, comm=adapter,
                                        cu_seqlens=DOCS["A" if rank else "B"]),
        "bad_input_on_one_rank": lambda: mm.ring_attention(q, k, v, window=(-1, 0) if rank == 2 else None),
        # the wrappers' own arguments: checked where the failing rank still joins the agreement check
        "bad_inner_on_one_rank": lambda: mm.hybrid_attention(q, k, v, ulysses_size=2,
                                                             inner="bogus" if rank == 2 else "mesh"),
        "bad_gpus_per_node_on_one_rank": lambda: mm.mesh_attention(q, k, v, gpus_per_node=0 if rank == 2 else None),
        # one rank's balanced layout sets apart the hybrid's first and last documents, the others' not
        "balanced_hide": lambda: mm.hybrid_attention(q, k, v, ulysses_size=2, tile=(1, world // 2),
                                                     layout=mm.balanced_layout(DOCS["A"], world, group=2,
                                                                               hide=rank == 1)),
        "plan_code": lambda: _other_plan_code(rank == 0, lambda: mm.ring_attention(q, k, v)),
        # attention sinks: learnable on rank 1, off-by-one (fixed zeros) on the others (every rank trains: a
        # backward follows everywhere); none on rank 2
        "sinks": lambda: mm.ring_attention(*(x.detach().requires_grad_() for x in (q, k, v)),
                                           softmax_offset=torch.zeros(4, dtype=q.dtype).requires_grad_(rank == 1)),
        "sinks_on_some_ranks": lambda: mm.hybrid_attention(q, k, v, ulysses_size=2, inner="ring",
                                                           softmax_offset=None if rank == 2 else torch.zeros(4)),
        # MLA on rank 0 (values of head dim 6), the others' values of q's and k's head dim 8
        "value_head_dim": lambda: mm.ring_attention(q, k, v[..., :6] if rank == 0 else v),
        "sinks_agree": lambda: mm.mesh_attention(q, k, v[..., :6], tile=(2, world // 2), softmax_offset=torch.zeros(4)),
        "bad_offset_on_one_rank": lambda: mm.ring_attention(q, k, v, softmax_offset=torch.zeros(3 if rank == 2 else 4)),
        **process_settings(rank, world, q, k, v, want),
    }
    out = {}
    for name, fn in calls.items():
        start = time.perf_counter()
        out[name] = (_outcome(fn), time.perf_counter() - start)
    # the group still works, and the result is right
    mask = Mask.from_cu_seqlens(DOCS["A"], 32)
    (q, k, v), want = _inputs(world, rank, T=T, mask=mask)
    out["after"] = (mm.ring_attention(q, k, v, cu_seqlens=DOCS["A"]) - want).abs().max().item(), 0.0
    return out


def hostile(rank: int, world: int) -> dict:
    """Runs on the whole default group (world >= 4, even); destroys and re-creates it at the end."""
    out = {}
    (q, k, v), _ = _inputs(world, rank)
    # 1. rank 0 asks for tile 2 x P/2, the others for 1 x P: every rank must raise at once, not hang
    out["disagree"] = _outcome(lambda: mm.mesh_attention(q, k, v, tile=(2, world // 2) if rank == 0 else (1, world)))
    # the same call with matching settings still works afterwards
    out["agree"] = _outcome(lambda: mm.mesh_attention(q, k, v, tile=(1, world)))
    out["disagreements"] = disagreements(rank, world)
    # 2. a group this rank is not in
    pair = dist.new_group([0, 1])
    if rank >= 2:
        (q2, k2, v2), _ = _inputs(2, 0)
        out["not_member"] = _outcome(lambda: mm.ring_attention(q2, k2, v2, group=pair))
    dist.barrier()
    dist.destroy_process_group(pair)
    dist.barrier()
    # 2b. check_plans_over (the plan check over a gloo twin of an NCCL group) given on rank 0 alone:
    # it raises there after its wait, naming the ranks that did not come -- the others would check
    # their calls on the group, rank 0 on the twin, and every rank would wait for ever
    from megatron_mesh.runtime.state import RUNTIME

    world_group, ranks = dist.group.WORLD, list(range(world))
    twin = dist.new_group(ranks, backend="gloo")
    if rank == 0:
        out["twin_on_one_rank"] = _outcome(lambda: mm.check_plans_over(world_group, twin, wait_s=2))
        out["twin_on_one_rank_kept"] = RUNTIME.checks.check_group(world_group) is twin
    dist.barrier()
    dist.destroy_process_group(twin)  # its barrier's unanswered messages go with it
    # given on every rank: the calls are checked over the twin, a disagreement still raises everywhere
    twin = dist.new_group(ranks, backend="gloo")
    out["twin_on_every_rank"] = _outcome(lambda: mm.check_plans_over(world_group, twin, wait_s=60))
    out["twin_kept"] = RUNTIME.checks.check_group(world_group) is twin
    out["twin_agree"] = _outcome(lambda: mm.ring_attention(q, k, v))
    out["twin_disagree"] = _outcome(lambda: mm.ring_attention(q, k, v, softmax_scale=0.5 if rank == 1 else None))
    RUNTIME.checks.forget_cpu_group(world_group)
    dist.barrier()
    dist.destroy_process_group(twin)
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
