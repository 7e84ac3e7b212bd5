"""One-hop latency of plain gloo send/recv and of ds_vshape's own transfer path between two
ranks, which the simulator's calibrated rows add per transfer (``bench_emulated.py``)."""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


from ds_vshape.runtime.transfers.comm import ACT, GRAD, P2P, Recv  # noqa: E402
from ds_vshape.runtime.transfers.p2p_groups import pair_groups  # noqa: E402


def hop_latency(rank: int, numel: int, iters: int = 200) -> dict[str, float]:
    """One-way latency of a small message between pipeline ranks 0 and 1 (ping-pong / 2).

    ``ds_vshape_p2p`` is the engine's own path within a step: shapes sent with the first
    transfer only, each receive posted before the send it follows in the pair order, isend, wait.
    """
    res: dict[str, float] = {}
    buf = torch.zeros(numel)
    for name in ("gloo_send_recv", "ds_vshape_p2p"):
        dist.barrier()
        times = []
        if rank in (0, 1):
            times = _ping_pong(name, rank, buf, iters)
        if rank == 0:
            res[name + "_s"] = statistics.median(times[iters // 10 :]) / 2
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(50):
        dist.barrier()
    res["barrier_s"] = (time.perf_counter() - t0) / 50
    got = [res]
    dist.broadcast_object_list(got, src=0)
    return got[0]


def _ping_pong(name: str, rank: int, buf: torch.Tensor, iters: int) -> list[float]:
    peer = 1 - rank
    times = []
    if name == "gloo_send_recv":
        for _ in range(iters):
            t0 = time.perf_counter()
            dist.send(buf, peer) if rank == 0 else dist.recv(buf, peer)
            dist.recv(buf, peer) if rank == 0 else dist.send(buf, peer)
            times.append(time.perf_counter() - t0)
        return times
    world = list(range(dist.get_world_size()))
    groups = pair_groups([world], [(a, a + 1) for a in world[:-1]], rank)
    p2p = P2P(global_rank_of=world, groups=groups, device=torch.device("cpu"), timeout_s=60, my_rank=rank)
    # Rank 1 receives activations into stage 1; rank 0 receives gradients into stage 0.
    p2p.start_step()
    if rank == 1:
        p2p.post(Recv(ACT, 1, 0, 0, peer, True))
    for i in range(iters):
        t0 = time.perf_counter()
        if rank == 0:
            p2p.send(ACT, (buf,), stage=1, micro_batch=i, seq_chunk=0, peer=peer, header=i == 0)
            grad = Recv(GRAD, 0, i, 0, peer, i == 0)
            p2p.post(grad)
            p2p.recv(grad)
        else:
            p2p.recv(Recv(ACT, 1, i, 0, peer, i == 0))
            p2p.send(GRAD, (buf,), stage=0, micro_batch=i, seq_chunk=0, peer=peer, header=i == 0)
            if i + 1 < iters:  # the pair order: the next activation comes after this gradient
                p2p.post(Recv(ACT, 1, i + 1, 0, peer, False))
        times.append(time.perf_counter() - t0)
    p2p.drain()
    return times
