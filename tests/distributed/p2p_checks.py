"""Checks of the transfer layer alone on two real gloo ranks (run from worker.py).

Rank 0 sends, rank 1 receives. Each check returns what it saw; the pytest side asserts.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from ds_vshape.runtime.comm import ACT, P2P, Recv


def _p2p(*, dynamic: bool = False) -> P2P:
    return P2P(global_rank_of=[0, 1], num_stages=2, micro_batches=4, seq_chunks=1, device=torch.device("cpu"),
               timeout_s=20, my_rank=int(os.environ["RANK"]), dynamic_shape=dynamic)


def _payload(mb: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.full((rows, 3), float(mb)), torch.arange(rows, dtype=torch.int64) + mb


def _exchange(p2p: P2P, send_order: list[tuple[int, int, bool]], plan: tuple[Recv, ...]) -> list[list[Any]]:
    """One step: rank 0 sends (micro-batch, rows, header) in order; rank 1 receives ``plan``."""
    p2p.start_step(plan if dist.get_rank() == 1 else ())
    got = []
    if dist.get_rank() == 0:
        for mb, rows, header in send_order:
            p2p.send_activations(_payload(mb, rows), stage=1, micro_batch=mb, seq_chunk=0, peer=1, header=header)
    else:
        posted_at_start = len(p2p._posted)
        for r in plan:
            tensors = p2p.recv(r)
            got.append([r.micro_batch, [t.tolist() for t in tensors], [str(t.dtype) for t in tensors]])
        got.append(["posted_at_start", posted_at_start])
    p2p.drain()
    dist.barrier()
    return got


def run_p2p_case(case: dict[str, Any]) -> dict[str, Any]:
    p2p = _p2p()
    # The header rides on micro-batch 2, which the sender sends first and the receiver wants last.
    plan = tuple(Recv(ACT, 1, mb, 0, 0, mb == 2) for mb in (0, 1, 2))
    out_of_order = _exchange(p2p, [(2, 4, True), (0, 4, False), (1, 4, False)], plan)
    # Shapes may change between steps: the next step announces them again.
    plan2 = tuple(Recv(ACT, 1, mb, 0, 0, mb == 0) for mb in (0, 1))
    next_step = _exchange(p2p, [(0, 6, True), (1, 6, False)], plan2)
    # Within a step, without dynamic_shape, a change of shape is refused on the sending side.
    refused = None
    p2p.start_step(())
    if dist.get_rank() == 0:
        p2p.send_activations(_payload(0, 4), stage=1, micro_batch=0, seq_chunk=0, peer=1, header=True)
        try:
            p2p.send_activations(_payload(1, 5), stage=1, micro_batch=1, seq_chunk=0, peer=1, header=False)
        except ValueError as err:
            refused = str(err)
    else:
        p2p.recv(Recv(ACT, 1, 0, 0, 0, True))
    p2p.drain()
    dist.barrier()
    # With dynamic_shape every transfer carries its shapes.
    dynamic = _exchange(_p2p(dynamic=True), [(0, 4, True), (1, 7, False)], plan2)
    return {"out_of_order": out_of_order, "next_step": next_step, "refused": refused, "dynamic": dynamic}
