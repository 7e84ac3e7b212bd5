"""The transfer layer on real NCCL with one GPU: one rank exchanging with itself.

NCCL refuses two ranks of a communicator on one GPU, so one GPU tests one rank: a world of
one, whose batched self send/receive is legal. What only real NCCL can show:

* a ``batch_isend_irecv`` of several tensors returns ONE Work, and ``p2p_waits.Batch``
  covers every tensor of it;
* ``StreamWaits.for_data`` returns while the device is still busy (the host stays free),
  and the data is right once the stream has run;
* ``StreamWaits.settle`` polls to completion within the deadline;
* the first exchange on a communicator blocks the host (NCCL connects the pair then, and waits
  for the busy device): on an H100 it returned after 539 ms, the next ones in under 1 ms. The
  runtime's warm-up (``P2P.warm_up``, run at initialize) makes that first exchange, after which
  a batch posts in a small fraction of the device's busy time. Each test here warms up first
  (once per process), so none measures the first contact by accident.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from ds_vshape.runtime.transfers.comm import P2P
from ds_vshape.runtime.transfers.p2p_waits import Batch, StreamWaits

pytestmark = pytest.mark.gpu

_WARM_UP_S: list[float] = []  # how long the first exchange (the warm-up) took, once per process


@pytest.fixture(scope="module")
def world_of_one(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    torch.cuda.set_device(0)
    store = dist.FileStore(str(tmp_path_factory.mktemp("store") / "s"), 1)
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=torch.device("cuda", 0))
    yield
    dist.destroy_process_group()


def _warm_up() -> float:
    """The runtime's warm-up on the world group (this rank's only pair: itself); its seconds."""
    if not _WARM_UP_S:
        p2p = P2P(global_rank_of=[0], groups={0: dist.group.WORLD}, device=torch.device("cuda", 0), timeout_s=120,
                  my_rank=0, stream_waits=True)
        start = time.perf_counter()
        p2p.warm_up([0])
        _WARM_UP_S.append(time.perf_counter() - start)
    return _WARM_UP_S[0]


def _busy_device(seconds_of_matmuls: int = 200) -> None:
    a = torch.randn(4096, 4096, device="cuda")
    for _ in range(seconds_of_matmuls):  # queued on the compute stream, the host returns at once
        a = a @ a
        a = a / a.norm()


def _self_exchange(sends: list[torch.Tensor], recvs: list[torch.Tensor]) -> list[dist.P2POp]:
    return [dist.P2POp(dist.irecv, r, 0) for r in recvs] + [dist.P2POp(dist.isend, s, 0) for s in sends]


def test_a_multi_tensor_batch_is_one_work_and_waits_leave_the_host_free(world_of_one: None) -> None:
    _warm_up()  # a first exchange would block the host until the device drained
    sends = [torch.arange(6, device="cuda", dtype=torch.float32), torch.ones(2, 3, device="cuda", dtype=torch.int64)]
    recvs = [torch.empty_like(t) for t in sends]
    _busy_device()
    works = dist.batch_isend_irecv(_self_exchange(sends, recvs))
    assert len(works) == 1  # NCCL coalesces a batch into one Work
    batch = Batch(works, "self exchange")
    waits = StreamWaits(timeout_s=120, my_rank=0)
    waits.for_data(batch, "self exchange")
    assert not batch.is_completed(), "for_data blocked the host until the transfer finished"
    waits.settle([batch])
    assert batch.is_completed()
    torch.cuda.synchronize()
    assert all(torch.equal(r, s) for r, s in zip(recvs, sends))


def test_after_the_warm_up_a_batch_posts_in_well_under_the_devices_busy_time(
        world_of_one: None, record_property: pytest.RecordProperty) -> None:
    warm_up_s = _warm_up()
    sends = [torch.arange(1 << 20, device="cuda", dtype=torch.float32)]
    recvs = [torch.empty_like(t) for t in sends]
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    _busy_device()
    posting = time.perf_counter()
    works = dist.batch_isend_irecv(_self_exchange(sends, recvs))
    post_s = time.perf_counter() - posting
    end.record()
    StreamWaits(timeout_s=120, my_rank=0).settle([Batch(works, "self exchange")])
    torch.cuda.synchronize()
    busy_s = start.elapsed_time(end) / 1000
    record_property("seconds", {"warm_up": warm_up_s, "post_after_warm_up": post_s, "device_busy": busy_s})
    assert busy_s > 0.1, f"the device was busy for only {busy_s:.3f} s: the check needs a busy device"
    assert post_s < busy_s / 20, f"posting took {post_s:.4f} s of the device's {busy_s:.3f} s busy time"
    assert torch.equal(recvs[0], sends[0])
