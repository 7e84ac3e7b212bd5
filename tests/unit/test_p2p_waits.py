"""How a rank waits for transfers: stream-ordered on NCCL with named hangs, host waits on gloo.

Pure tests of ``runtime/transfers/p2p_waits.py`` with Work stand-ins that behave as torch's do
(NCCL: ``wait()`` returns at once, ``wait(timeout)`` blocks; gloo: a receive waited twice
waits for a second message) and a clock the test moves, so no test sleeps.
"""

from __future__ import annotations

from datetime import timedelta

import pytest

from ds_vshape.runtime.transfers.p2p_waits import Batch, HostWaits, P2PTimeoutError, StreamWaits


class NcclLikeWork:
    """Completes when the test says; wait() without timeout never blocks (stream-ordered)."""

    def __init__(self) -> None:
        self.done = False
        self.stream_waits = 0
        self.host_waits = 0

    def is_completed(self) -> bool:
        return self.done

    def wait(self, timeout: timedelta | None = None) -> bool:
        if timeout is None:
            self.stream_waits += 1
            return True
        self.host_waits += 1
        if not self.done:
            raise RuntimeError("timed out")
        return True


class GlooRecvLikeWork:
    """A gloo receive: the first wait consumes the message; a second one would wait for another."""

    def __init__(self) -> None:
        self.messages = 1

    def is_completed(self) -> bool:
        return False  # gloo says complete only once waited

    def wait(self, timeout: timedelta | None = None) -> bool:
        if self.messages == 0:
            raise RuntimeError("Timed out waiting for recv operation to complete")
        self.messages -= 1
        return True


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def _stream(clock: Clock, timeout_s: float = 10.0) -> StreamWaits:
    return StreamWaits(timeout_s=timeout_s, my_rank=3, clock=clock, sleep=clock.sleep)


def test_stream_waits_leave_the_host_free_and_name_a_hang_after_the_deadline() -> None:
    clock, work = Clock(), NcclLikeWork()
    waits = _stream(clock)
    waits.for_data(Batch([work], "b"), "receive of gradients for stage 2 micro-batch 5")
    assert (work.stream_waits, work.host_waits) == (1, 0)
    clock.now = 9.0
    waits.check()  # within the deadline: nothing to say yet
    clock.now = 10.5
    with pytest.raises(P2PTimeoutError, match="pipeline rank 3: receive of gradients for stage 2 micro-batch 5 did not complete within 10 s"):
        waits.check()


def test_a_completed_transfer_leaves_the_watch_list() -> None:
    clock, work = Clock(), NcclLikeWork()
    waits = _stream(clock)
    waits.for_data(Batch([work], "b"), "late receive")
    work.done = True
    clock.now = 100.0
    waits.check()
    waits.settle([])


def test_header_reads_poll_on_the_host_until_done_or_deadline() -> None:
    clock, work = Clock(), NcclLikeWork()
    waits = _stream(clock, timeout_s=2.0)
    with pytest.raises(P2PTimeoutError, match="header of stage 1"):
        waits.on_host(Batch([work], "x"), "header of stage 1")
    assert clock.now > 2.0 and work.host_waits == 0  # polled is_completed, never blocked in wait(timeout)
    work.done = True
    waits.on_host(Batch([work], "x"), "header of stage 1")


def test_settle_names_the_send_still_open_at_the_end_of_the_step() -> None:
    clock, work = Clock(), NcclLikeWork()
    waits = _stream(clock, timeout_s=1.0)
    with pytest.raises(P2PTimeoutError, match="send of activations"):
        waits.settle([Batch([work], "send of activations for stage 1 micro-batch 0")])


def test_host_waits_give_every_work_of_a_batch_the_timeout() -> None:
    works = [NcclLikeWork(), NcclLikeWork()]
    for w in works:
        w.done = True
    HostWaits(timeout_s=5, my_rank=0).for_data(Batch(works, "b"), "b")
    assert [w.host_waits for w in works] == [1, 1]


def test_a_gloo_receive_is_waited_once_even_when_its_batch_is_waited_again() -> None:
    # A send batch that carries a grouped receive: recv() waits the batch for the receive,
    # the send's release waits it again. A second wait on the gloo receive would hang.
    recv, send = GlooRecvLikeWork(), NcclLikeWork()
    send.done = True
    batch = Batch([recv, send], "grouped")
    waits = HostWaits(timeout_s=5, my_rank=0)
    waits.for_data(batch, "receive")
    waits.for_data(batch, "send release")
    assert batch.unwaited() == []


class DoneAtWork(NcclLikeWork):
    """Completes once the test's clock reaches ``at`` (a header or send landing while the host polls)."""

    def __init__(self, clock: Clock, at: float) -> None:
        super().__init__()
        self.clock, self.at = clock, at

    def is_completed(self) -> bool:
        return self.clock.now >= self.at


class CountingClock(Clock):
    def __init__(self) -> None:
        super().__init__()
        self.sleeps = 0

    def sleep(self, seconds: float) -> None:
        self.sleeps += 1
        super().sleep(seconds)


@pytest.mark.parametrize("lands_at", [0.0003, 0.003, 0.0065, 0.05, 1.0])
def test_a_host_poll_notices_a_done_transfer_within_a_millisecond(lands_at: float) -> None:
    """Header reads and the step's last sends are waited by polling on the host (NCCL): the poll
    must notice completion within 1 ms, however long the wait (a back-off to 10 ms overslept by
    up to 10 ms, on the critical path of a host-bound step), and poll no more than every 0.2 ms."""
    clock = CountingClock()
    work = DoneAtWork(clock, lands_at)
    _stream(clock, timeout_s=10.0).on_host(Batch([work], "x"), "header of stage 1")
    assert lands_at <= clock.now <= lands_at + 0.001 + 1e-9
    assert clock.sleeps <= lands_at / 0.001 + 4  # about one poll a millisecond once backed off
    assert work.host_waits == 0
