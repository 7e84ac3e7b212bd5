"""How a pipeline rank waits for its transfers: on the device stream (NCCL) or on the host (gloo).

One ``batch_isend_irecv`` call is one ``Batch``: NCCL returns a single Work for the whole
batch (coalescing), gloo one per operation; a ``Batch`` stands for all of them, so a
multi-tensor transfer is complete only when every tensor of it is.

On NCCL, ``Work.wait()`` makes the current CUDA stream wait and returns at once, while
``wait(timeout=...)`` polls on the host until the transfer is done: the host could not queue
the next passes while a transfer is in flight. ``StreamWaits`` therefore waits on the stream
for data a pass needs and for send buffers, and keeps each unfinished batch on a watch list
with its deadline; the list is checked (``check``) at every transfer call and at the end of
the step (``settle``), which polls ``is_completed`` until the deadline, so a hang is still
named (rank, stage, micro-batch) within ``p2p_timeout_s``. Only header reads block the host
(the shapes are needed there to allocate the payload), by the same deadline polling.

``HostWaits`` (gloo, where ``wait`` always blocks the host) waits with the timeout directly.
Both order later operations the same way: an NCCL operation issued after a stream wait
starts only after it, because its stream waits for the compute stream at issue.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

__all__ = ["Batch", "HostWaits", "P2PError", "P2PTimeoutError", "StreamWaits", "Waits"]

# First and longest sleep between completion polls. The longest bounds how late a poll notices a
# transfer that is done: a header read or the step's last send is on the host's critical path, and
# a host-bound step (tiny passes) cannot hide a 10 ms oversleep; a poll (``is_completed``) costs
# microseconds, so polling every millisecond while waiting costs the host next to nothing.
_POLL_S = (0.0002, 0.001)


class P2PError(RuntimeError):
    """A transfer failed (the peer closed its connection, say); the message names which one."""


class P2PTimeoutError(P2PError):
    """A transfer did not complete in time; the message names who waited for what."""


class Batch:
    """The Work(s) one ``batch_isend_irecv`` call returned, and what the batch carried.

    A Work is dropped once waited: a gloo receive waited a second time would wait for another
    message into its buffer (a send batch may carry grouped receives that ``recv`` waited for).
    """

    def __init__(self, works: list[Any], label: str) -> None:
        self.label = label
        self._works = list(works)

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self._works)

    def unwaited(self) -> list[Any]:
        return list(self._works)

    def waited(self, work: Any) -> None:
        self._works.remove(work)


@dataclass
class Waits:
    """Shared by both policies: the timeout and how errors are named."""

    timeout_s: float
    my_rank: int
    clock: Callable[[], float] = time.monotonic
    sleep: Callable[[float], None] = time.sleep

    def for_data(self, batch: Batch, label: str) -> None:
        """Before a pass reads received data, or before a send buffer may be released."""
        raise NotImplementedError

    def on_host(self, batch: Batch, label: str) -> None:
        """Before the host reads received values (shape headers)."""
        raise NotImplementedError

    def check(self) -> None:
        """Raise if a transfer waited on earlier is past its deadline."""

    def settle(self, batches: Sequence[Batch]) -> None:
        """End of step: every batch given must complete within the deadline."""
        for batch in batches:
            self.on_host(batch, batch.label)

    def _blocking_wait(self, work: Any, label: str, timeout: timedelta | None) -> None:
        try:
            ok = work.wait() if timeout is None else work.wait(timeout=timeout)
        except RuntimeError as err:
            if "closed" in str(err).lower():
                raise P2PError(f"pipeline rank {self.my_rank}: {label} failed, the peer closed its connection ({err})") from err
            raise P2PTimeoutError(self.timeout_message(label, err)) from err
        if ok is False:
            raise P2PTimeoutError(self.timeout_message(label, None))

    def timeout_message(self, label: str, err: Exception | None) -> str:
        why = f" ({err})" if err else ""
        return (
            f"pipeline rank {self.my_rank}: {label} did not complete within {self.timeout_s:g} s{why}. "
            "A peer probably failed or runs a different schedule; raise pipeline.p2p_timeout_s if passes are just slow."
        )


@dataclass
class HostWaits(Waits):
    """gloo: every wait blocks the host, with the timeout."""

    def for_data(self, batch: Batch, label: str) -> None:
        for work in batch.unwaited():
            self._blocking_wait(work, label, timedelta(seconds=self.timeout_s))
            batch.waited(work)

    def on_host(self, batch: Batch, label: str) -> None:
        self.for_data(batch, label)


@dataclass
class StreamWaits(Waits):
    """NCCL: stream-ordered waits, host polling only for header reads and hang detection."""

    _watch: list[tuple[float, Batch, str]] = field(default_factory=list)  # (deadline, batch, label), oldest first

    def for_data(self, batch: Batch, label: str) -> None:
        # Stream-ordered on NCCL (returns at once); the Work stays for the completion polls.
        for work in batch.unwaited():
            self._blocking_wait(work, label, None)
        if not batch.is_completed():
            self._watch.append((self.clock() + self.timeout_s, batch, label))

    def on_host(self, batch: Batch, label: str) -> None:
        self._poll(batch, label, self.clock() + self.timeout_s)
        for work in batch.unwaited():
            self._blocking_wait(work, label, None)

    def check(self) -> None:
        self._watch = [w for w in self._watch if not w[1].is_completed()]
        if self._watch and self._watch[0][0] < self.clock():
            raise P2PTimeoutError(self.timeout_message(self._watch[0][2], None))

    def settle(self, batches: Sequence[Batch]) -> None:
        for deadline, batch, label in self._watch:
            self._poll(batch, label, deadline)
        self._watch.clear()
        super().settle(batches)

    def _poll(self, batch: Batch, label: str, deadline: float) -> None:
        pause = _POLL_S[0]
        while not batch.is_completed():
            if self.clock() > deadline:
                raise P2PTimeoutError(self.timeout_message(label, None))
            self.sleep(pause)
            pause = min(pause * 2, _POLL_S[1])
