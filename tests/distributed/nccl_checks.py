"""Self-checks of the NCCL emulation (nccl_emulation.py) on real gloo ranks (run from worker.py).

Ranks 0 and 1 check the four rules; ranks 2 and 3, when the launch has them, show that the
per-pair queue alone deadlocks two ranks that both receive before they send. Each check
returns what it saw; the pytest side asserts. The deadlock checks wedge their pair for good,
so they run last and this case must be the launch's last.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

import deepspeed.comm as ds_comm

from tests.distributed import nccl_emulation

__all__ = ["run_nccl_selfcheck"]

BIG = 1 << 22  # 16 MiB of float32: far past any eager-send threshold
WAIT_S = 20.0  # for ops that must complete
DEADLOCK_WAIT_S = 3.0  # for ops that must not


def _tags_ignored(me: int) -> dict[str, Any]:
    """Receives posted under other tags still get the sends in order; via deepspeed.comm too."""
    if me == 0:
        works = [ds_comm.isend(torch.full((3,), 1.0), 1, tag=5), ds_comm.isend(torch.full((3,), 2.0), 1, tag=7)]
        dist.send(torch.full((3,), 3.0), 1, tag=9)
        for work in works:
            work.wait(timeout=WAIT_S)
        return {"work_type": type(works[0]).__name__}
    bufs = [torch.zeros(3) for _ in range(3)]
    works = [ds_comm.irecv(bufs[0], 0, tag=7), ds_comm.irecv(bufs[1], 0, tag=5)]
    src = dist.recv(bufs[2], 0, tag=11)
    for work in works:
        work.wait(timeout=WAIT_S)
    return {"work_type": type(works[0]).__name__, "received": [b[0].item() for b in bufs], "recv_returned": src}


def _pair_order(me: int) -> dict[str, Any]:
    """Rank 0 posts irecv then isend; rank 1 answers a second later with one batch."""
    mine, theirs = torch.full((4,), float(me + 10)), torch.zeros(4)
    if me == 1:
        time.sleep(1.0)
        for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, mine, 0), dist.P2POp(dist.irecv, theirs, 0)]):
            work.wait(timeout=WAIT_S)
        return {"received": theirs.tolist()}
    start = time.monotonic()
    recv, send = dist.irecv(theirs, 1), dist.isend(mine, 1)
    done: dict[str, float] = {}
    send_before_recv = False
    while len(done) < 2 and time.monotonic() - start < WAIT_S:
        recv_done, send_done = recv.is_completed(), send.is_completed()  # recv read first: no false alarm
        send_before_recv |= send_done and not recv_done
        for name, flag in (("recv", recv_done), ("send", send_done)):
            if flag and name not in done:
                done[name] = time.monotonic() - start
        time.sleep(0.001)
    recv.wait(timeout=WAIT_S)
    send.wait(timeout=WAIT_S)
    return {"received": theirs.tolist(), "done_after_s": done, "send_before_recv": send_before_recv}


def _batched_exchange(me: int, peer: int) -> dict[str, Any]:
    """Both ranks send a big tensor to each other in one group: no deadlock (rule 4)."""
    out, into = torch.full((BIG,), float(me)), torch.empty(BIG)
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend, out, peer), dist.P2POp(dist.irecv, into, peer)])
    for work in works:
        work.wait(timeout=WAIT_S)
    return {"completed": all(w.is_completed() for w in works), "received_ok": bool((into == float(peer)).all())}


def _deadlock(me: int, peer: int, *, send_first: bool, size: int) -> dict[str, Any]:
    """Both ranks issue the same two plain ops to each other: NCCL hangs, so must we."""
    out, into = torch.full((size,), float(me)), torch.empty(size)
    if send_first:
        first, second = dist.isend(out, peer), dist.irecv(into, peer)
    else:
        first, second = dist.irecv(into, peer), dist.isend(out, peer)
    try:
        first.wait(timeout=DEADLOCK_WAIT_S)
        error = None
    except RuntimeError as err:
        error = str(err)
    return {"error": error, "second_completed": second.is_completed()}


def run_nccl_selfcheck(case: dict[str, Any]) -> dict[str, Any]:
    me = dist.get_rank()
    result: dict[str, Any] = {"installed": nccl_emulation.installed()}
    if me >= 4:
        return result
    peer = me ^ 1
    if me < 2:
        result["tags"] = _tags_ignored(me)
        result["order"] = _pair_order(me)
        result["batched"] = _batched_exchange(me, peer)
        result["deadlock"] = _deadlock(me, peer, send_first=True, size=BIG)
    elif peer < dist.get_world_size():
        # Small tensors and receives posted first: only the per-pair queue (rule 2) hangs this.
        result["deadlock"] = _deadlock(me, peer, send_first=False, size=4)
    return result
