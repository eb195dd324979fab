"""TASP transports on CPU/gloo: batched P2P (isend/irecv) vs one all_to_all_single per round.

    OMP_NUM_THREADS=1 python scripts/bench_tasp_transport.py --world 4 8 --seq-local 1024

For each CP size it times (median over iterations, transports alternating, slowest rank) the rounds of a TASP plan alone
(forward rounds; no compute) and a whole TASP attention forward + backward, with each transport;
the bytes are identical (checked). CPU/gloo only says what the transports cost there, not on
NVLink/NCCL; see docs/algorithms/tasp.md.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def _bench(rank: int, world: int, seq_local: int, iters: int) -> dict:
    import megatron_mesh as mm
    from megatron_mesh.comm.alltoall import AllToAllCommunicator
    from megatron_mesh.comm.torch_dist import TorchDistCommunicator
    from megatron_mesh.plan import AttentionShape, Post, Wait, build_tasp_plan

    torch.manual_seed(rank)
    B, H, Hkv, D = 1, 8, 2, 64
    shape = AttentionShape(seq_local, B, H, Hkv, D, 4)
    plan = build_tasp_plan(world, shape)
    rounds = [op for op in plan.round_ops(rank, "forward") if isinstance(op, (Post, Wait))]
    comms = {"p2p": TorchDistCommunicator(), "alltoall": AllToAllCommunicator()}

    def rounds_only(comm) -> None:
        pending = {}
        for op in rounds:
            if isinstance(op, Post):
                def bufs(transfers):
                    return [(t.peer, x) for t in transfers
                            for x in (torch.empty(B, Hkv, plan.tokens(t.key), D) for _ in range(2))]
                pending[op.round] = comm.start(bufs(op.sends), bufs(op.recvs))
            else:
                pending.pop(op.round).wait()

    q = torch.randn(seq_local, B, H, D, requires_grad=True)
    k = torch.randn(seq_local, B, Hkv, D, requires_grad=True)
    v = torch.randn(seq_local, B, Hkv, D, requires_grad=True)
    out: dict = {}
    times: dict = {f"{what}/{name}": [] for what in ("rounds", "attention") for name in comms}
    for i in range(iters + 1):  # the transports alternate, so drift in machine load hits both alike
        for name, comm in comms.items():
            torch.distributed.barrier()
            t = time.perf_counter()
            rounds_only(comm)
            times[f"rounds/{name}"].append(time.perf_counter() - t)
        for name in comms:
            torch.distributed.barrier()
            t = time.perf_counter()
            with mm.comm_counter() as c:
                mm.tasp_attention(q, k, v, transport=name).sum().backward()
            times[f"attention/{name}"].append(time.perf_counter() - t)
            out[f"bytes/{name}"] = c.bytes_sent
    out.update({key: statistics.median(ts[1:]) for key, ts in times.items()})
    return out


def main(argv: list[str] | None = None) -> dict[int, dict]:
    """Print one line per CP size; return {CP size: {"rounds/p2p": seconds, ..., "bytes": per rank}}."""
    from megatron_mesh.comm.spawn import spawn

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--seq-local", type=int, default=1024)
    ap.add_argument("--iters", type=int, default=5)
    a = ap.parse_args(argv)
    out = {}
    for world in a.world:
        res = spawn(_bench, world, a.seq_local, a.iters, timeout=600)
        if len({r["bytes/p2p"] for r in res} | {r["bytes/alltoall"] for r in res}) != 1:
            raise SystemExit(f"P={world}: the transports moved different bytes: {res}")
        slowest = {key: max(r[key] for r in res) for key in res[0] if not key.startswith("bytes")}
        print(f"P={world} seq_local={a.seq_local}: " + "  ".join(f"{k} {v * 1e3:.1f} ms" for k, v in slowest.items())
              + f"  bytes/rank {res[0]['bytes/p2p']}")
        out[world] = dict(slowest, bytes=res[0]["bytes/p2p"])
    return out


if __name__ == "__main__":
    main()
