"""Checks of the transfer layer alone on two real gloo ranks (run from worker.py).

Mostly rank 0 sends and rank 1 receives, posting in the sender's order (the pair order
lowering fixes) and consuming in its own. Each check returns what it saw; pytest asserts.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from ds_vshape.runtime.transfers.comm import ACT, GRAD, P2P, Recv
from ds_vshape.runtime.transfers.p2p_groups import pair_groups


def _p2p(*, dynamic: bool = False) -> P2P:
    me = int(os.environ["RANK"])
    return P2P(global_rank_of=[0, 1], groups=pair_groups([[0, 1]], [(0, 1)], me), device=torch.device("cpu"),
               timeout_s=20, my_rank=me, dynamic_shape=dynamic)


def _payload(mb: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.full((rows, 3), float(mb)), torch.arange(rows, dtype=torch.int64) + mb


def _exchange(p2p: P2P, send_order: list[tuple[int, int, bool]], consume: list[int]) -> list[list[Any]]:
    """One step: rank 0 sends (micro-batch, rows, header) in order; rank 1 posts in that
    order, consumes in ``consume`` order, then answers with one gradient."""
    p2p.start_step()
    got: list[list[Any]] = []
    answer = Recv(GRAD, 0, 0, 0, 1, True)
    if dist.get_rank() == 0:
        for mb, rows, header in send_order:
            p2p.send(ACT, _payload(mb, rows), stage=1, micro_batch=mb, seq_chunk=0, peer=1, header=header)
        p2p.post(answer)
        held = p2p.inflight_bytes
        p2p.recv(answer)
        # The answer was sent after every payload was received: the sends are released.
        got.append(["inflight_before_and_after_answer", held, p2p.inflight_bytes])
    else:
        for mb, _rows, header in send_order:
            p2p.post(Recv(ACT, 1, mb, 0, 0, header))
        for mb in consume:
            header = next(h for m, _r, h in send_order if m == mb)
            tensors = p2p.recv(Recv(ACT, 1, mb, 0, 0, header))
            got.append([mb, [t.tolist() for t in tensors], [str(t.dtype) for t in tensors]])
        p2p.send(GRAD, (torch.zeros(1),), stage=0, micro_batch=0, seq_chunk=0, peer=0, header=True)
    p2p.drain()
    dist.barrier()
    return got


def _crossing(p2p: P2P) -> list[float]:
    """Both ranks send to each other at once: each posts its receive in one group with its send."""
    me = dist.get_rank()
    direction_in, direction_out = (GRAD, ACT) if me == 0 else (ACT, GRAD)
    p2p.start_step()
    # First transfer of each link carries the shapes, in an order both agree on.
    if me == 0:
        p2p.send(ACT, (torch.zeros(2),), stage=1, micro_batch=0, seq_chunk=0, peer=1, header=True)
        p2p.post(Recv(GRAD, 0, 0, 0, 1, True))
        p2p.recv(Recv(GRAD, 0, 0, 0, 1, True))
    else:
        p2p.post(Recv(ACT, 1, 0, 0, 0, True))
        p2p.send(GRAD, (torch.zeros(2),), stage=0, micro_batch=0, seq_chunk=0, peer=0, header=True)
        p2p.recv(Recv(ACT, 1, 0, 0, 0, True))
    stage_in, stage_out = (0, 1) if me == 0 else (1, 0)
    p2p.post(Recv(direction_in, stage_in, 1, 0, 1 - me, False), with_next=True)
    p2p.send(direction_out, (torch.full((2,), 10.0 + me),), stage=stage_out, micro_batch=1, seq_chunk=0, peer=1 - me, header=False)
    out = p2p.recv(Recv(direction_in, stage_in, 1, 0, 1 - me, False))[0].tolist()
    p2p.drain()
    return out


def run_p2p_case(case: dict[str, Any]) -> dict[str, Any]:
    p2p = _p2p()
    # The header rides on micro-batch 2, which the sender sends first and the receiver wants last.
    out_of_order = _exchange(p2p, [(2, 4, True), (0, 4, False), (1, 4, False)], [0, 1, 2])
    # Shapes may change between steps: the next step announces them again.
    next_step = _exchange(p2p, [(0, 6, True), (1, 6, False)], [0, 1])
    # Within a step, without dynamic_shape, a change of shape is refused on the sending side.
    refused = None
    p2p.start_step()
    if dist.get_rank() == 0:
        p2p.send(ACT, _payload(0, 4), stage=1, micro_batch=0, seq_chunk=0, peer=1, header=True)
        try:
            p2p.send(ACT, _payload(1, 5), stage=1, micro_batch=1, seq_chunk=0, peer=1, header=False)
        except ValueError as err:
            refused = str(err)
    else:
        p2p.post(Recv(ACT, 1, 0, 0, 0, True))
        p2p.recv(Recv(ACT, 1, 0, 0, 0, True))
    p2p.drain()
    dist.barrier()
    # With dynamic_shape every transfer carries its shapes.
    dynamic = _exchange(_p2p(dynamic=True), [(0, 4, True), (1, 7, False)], [1, 0])
    crossing = _crossing(_p2p())
    return {"out_of_order": out_of_order, "next_step": next_step, "refused": refused, "dynamic": dynamic, "crossing": crossing}
