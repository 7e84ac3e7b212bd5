"""A transfer stuck behind a stream-ordered wait surfaces as a named timeout, not a silent hang.

On NCCL the engine waits for received data on the stream (``StreamWaits``): the host runs on,
and a stuck transfer would first be felt by a host read of the device, a ``.item()`` in the
step's tail (global gradient norm, fp16 overflow agreement, post-validation), which would
block forever with no name. ``P2P.settle_waits``, called at the tail's first op, polls every
stream-ordered wait of the step to its deadline and raises ``P2PTimeoutError`` naming the rank
and the transfer. Pure: ``torch.distributed``'s batch call stood in for by NCCL-like Works
(``wait()`` returns at once; complete only when the test says) and a clock the test moves.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist

from ds_vshape.runtime.transfers import comm
from ds_vshape.runtime.transfers.comm import ACT, P2P, P2PTimeoutError, Recv

from tests.unit.test_p2p_waits import Clock, NcclLikeWork


def _engine_side(monkeypatch: pytest.MonkeyPatch, *, payload_done: bool) -> tuple[P2P, Clock, list[NcclLikeWork]]:
    works: list[NcclLikeWork] = []

    def batch_isend_irecv(ops: list[Any]) -> list[NcclLikeWork]:
        work = NcclLikeWork()
        header = [op.tensor for op in ops if op.tensor.dtype == torch.int64 and op.tensor.numel() == 64]
        if header:  # the peer's header arrives at once: a (2, 3) float32 payload
            header[0].copy_(comm._encode_header([torch.zeros(2, 3)], torch.device("cpu")))
            work.done = True
        else:
            work.done = payload_done
        works.append(work)
        return [work]

    monkeypatch.setattr(dist, "P2POp", lambda op, tensor, peer, group: SimpleNamespace(op=op, tensor=tensor, peer=peer, group=group))
    monkeypatch.setattr(dist, "batch_isend_irecv", batch_isend_irecv)
    p2p = P2P(global_rank_of=[0, 1], groups={0: "pair-group"}, device=torch.device("cpu"), timeout_s=5.0, my_rank=1,
              dynamic_shape=True, stream_waits=True, one_queue=False)
    clock = Clock()
    p2p._waits.clock = clock
    p2p._waits.sleep = lambda s: setattr(clock, "now", clock.now + s)
    return p2p, clock, works


def _receive(p2p: P2P) -> Recv:
    r = Recv(ACT, stage=1, micro_batch=3, seq_chunk=0, peer=0, header=True)
    p2p.start_step()
    p2p.post(r)
    p2p.recv(r)  # stream-ordered: returns at once, the payload still in flight
    return r


def test_a_stuck_receive_behind_a_stream_wait_is_named_before_the_tail_reads_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    p2p, clock, _ = _engine_side(monkeypatch, payload_done=False)
    _receive(p2p)
    with pytest.raises(P2PTimeoutError) as err:
        p2p.settle_waits("the start of the step's tail (reduce_tied_grads)")
    message = str(err.value)
    for needle in ("pipeline rank 1", "activations for stage 1 micro-batch 3", "from pipeline rank 0", "within 5 s",
                   "step's tail", "p2p_timeout_s"):
        assert needle in message, message
    assert 5.0 < clock.now < 5.1  # raised at the deadline, not later


def test_settling_returns_once_the_transfers_completed(monkeypatch: pytest.MonkeyPatch) -> None:
    p2p, clock, works = _engine_side(monkeypatch, payload_done=False)
    _receive(p2p)
    works[-1].done = True
    p2p.settle_waits("the start of the step's tail (reduce_tied_grads)")
    assert clock.now == 0.0
    p2p.drain()


def test_host_waits_have_nothing_to_settle(monkeypatch: pytest.MonkeyPatch) -> None:
    # gloo: every wait already blocked the host with the timeout; settling is a no-op.
    p2p = P2P(global_rank_of=[0, 1], groups={0: "g"}, device=torch.device("cpu"), timeout_s=5.0, my_rank=1, stream_waits=False)
    p2p.settle_waits("anywhere")


def test_the_tail_settles_stream_waits_first() -> None:
    # The engine's first tail op (every train program ends reduce_tied_grads, reduce_grads, step).
    import inspect

    from ds_vshape.runtime.zero.zero_engine import ZeroPipelineMixin
    from ds_vshape.schedules import generate
    from ds_vshape.schedules.lowering import lower
    from ds_vshape.schedules.ops import OpKind

    source = inspect.getsource(ZeroPipelineMixin._exec_reduce_tied_grads)
    assert source.index("settle_waits") < source.index("_zero_reducer is None")
    for name in ("1f1b", "v-zb", "interleaved"):
        tail = [op.kind for op in lower(generate(name, 4, 8), 0)][-3:]
        assert tail == [OpKind.REDUCE_TIED_GRADS, OpKind.REDUCE_GRADS, OpKind.OPTIMIZER_STEP], (name, tail)
