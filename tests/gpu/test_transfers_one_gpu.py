"""The transfer layer on real NCCL with one GPU: one rank exchanging with itself.

NCCL refuses two ranks of a communicator on one GPU, so one GPU tests one rank: a world of
one, whose batched self send/receive is legal. What only real NCCL can show:

* a ``batch_isend_irecv`` of several tensors returns ONE Work, and ``p2p_waits.Batch``
  covers every tensor of it;
* ``StreamWaits.for_data`` returns while the device is still busy (the host stays free),
  and the data is right once the stream has run;
* ``StreamWaits.settle`` polls to completion within the deadline.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from ds_vshape.runtime.transfers.p2p_waits import Batch, StreamWaits

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def world_of_one(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    torch.cuda.set_device(0)
    store = dist.FileStore(str(tmp_path_factory.mktemp("store") / "s"), 1)
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=torch.device("cuda", 0))
    yield
    dist.destroy_process_group()


def _busy_device(seconds_of_matmuls: int = 200) -> None:
    a = torch.randn(4096, 4096, device="cuda")
    for _ in range(seconds_of_matmuls):  # queued on the compute stream, the host returns at once
        a = a @ a
        a = a / a.norm()


def test_a_multi_tensor_batch_is_one_work_and_waits_leave_the_host_free(world_of_one: None) -> None:
    sends = [torch.arange(6, device="cuda", dtype=torch.float32), torch.ones(2, 3, device="cuda", dtype=torch.int64)]
    recvs = [torch.empty_like(t) for t in sends]
    _busy_device()
    ops = [dist.P2POp(dist.irecv, r, 0) for r in recvs] + [dist.P2POp(dist.isend, s, 0) for s in sends]
    works = dist.batch_isend_irecv(ops)
    assert len(works) == 1  # NCCL coalesces a batch into one Work
    batch = Batch(works, "self exchange")
    waits = StreamWaits(timeout_s=120, my_rank=0)
    waits.for_data(batch, "self exchange")
    assert not batch.is_completed(), "for_data blocked the host until the transfer finished"
    waits.settle([batch])
    assert batch.is_completed()
    torch.cuda.synchronize()
    assert all(torch.equal(r, s) for r, s in zip(recvs, sends))
