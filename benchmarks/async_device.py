"""An asynchronous emulated accelerator: the host enqueues passes and runs ahead, as with a GPU.

The sync device (``emulated.DeviceClock``) makes the host sleep through every pass, so the
host's own Python work adds to every pass. A GPU does not work that way: the host enqueues
kernels onto a stream and only waits where it needs a result. This module models that.

* ``DeviceStream``: one per rank. ``enqueue`` plans the pass at once (start = the latest of
  now, the end of the previous pass, and any data arrival the stream must wait for; end =
  start + its time) and hands it to a worker thread that sleeps to each pass's end, in
  order, and marks it done. The host returns immediately. ``synchronize`` is the host
  waiting for everything enqueued (the optimizer step).
* Transfers: a tensor that leaves a pass is *published* in a table shared by the ranks
  (``ReadyTable``, a small file in /dev/shm keyed by a hash of the tensor's bytes) with the
  time the producing stream will have finished everything enqueued so far: a send on a GPU
  waits for the compute stream on the device side, never on the host. The rank that
  receives the same bytes looks them up; its stream starts its next pass no earlier than
  ready + ``TransferModel.seconds(nbytes)`` (latency + bytes / bandwidth). Its host does not
  wait for that (a GPU's compute stream waits on the receive, not the host).
* Communicator streams: ds_vshape puts each pair of neighbouring ranks on a 2-rank process
  group of its own, and NCCL runs a communicator's transfers one after another on its stream.
  So the transfers a rank receives from one peer are serialized: one starts no earlier than
  the end of the previous transfer from that peer (``AsyncDevice._pair_free``), whatever
  their readiness. Transfers from different peers overlap, as separate communicators do.

Keys are content hashes because the pipeline systems send the layer's own output (and the
stage input's gradient) byte for byte: no pipeline system needs to be patched, and
DeepSpeed, torch.distributed.pipelining and ds_vshape all run through the same layers.
Clock: ``time.perf_counter`` is CLOCK_MONOTONIC on Linux, one clock for all local ranks.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import queue
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch

__all__ = ["AsyncDevice", "DeviceStream", "Pass", "ReadyTable", "TransferModel", "default_table_path", "tensor_key"]


@dataclass
class Pass:
    """One pass on a device stream, with the times planned for it when it was enqueued."""

    kind: str
    seconds: float
    start: float
    end: float
    done: threading.Event = field(default_factory=threading.Event)
    finished_at: float | None = None  # when the worker marked it done (>= end)


class DeviceStream:
    """An in-order device queue; a worker thread sleeps to each pass's planned end."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter, history: int = 256) -> None:
        self._clock = clock
        self._queue: queue.SimpleQueue[Pass | None] = queue.SimpleQueue()
        self._tail_end = 0.0  # planned end of the last enqueued pass
        self._not_before = 0.0  # latest data arrival the next pass must wait for
        self._last: Pass | None = None
        self.history: deque[Pass] = deque(maxlen=history)  # finished passes, in finishing order
        self._worker = threading.Thread(target=self._run, name="emulated-device-stream", daemon=True)
        self._worker.start()

    @property
    def tail_end(self) -> float:
        """When the device will have finished everything enqueued so far."""
        return self._tail_end

    def enqueue(self, seconds: float, kind: str) -> Pass:
        """Plan a pass after everything before it and return at once (the host runs ahead).

        Planning at enqueue (deadlines) rather than timing the worker's sleeps keeps the
        device's clock free of the worker thread's late wake-ups under CPU contention.
        """
        start = max(self._clock(), self._tail_end, self._not_before)
        item = Pass(kind, seconds, start, start + seconds)
        self._tail_end = item.end
        self._last = item
        self._queue.put(item)
        return item

    def wait_for(self, t: float) -> None:
        """Device-side wait: passes enqueued from now on start no earlier than ``t``."""
        self._not_before = max(self._not_before, t)

    def synchronize(self) -> None:
        """The host waits for every enqueued pass and every awaited arrival."""
        self.enqueue(0.0, "sync").done.wait()

    def close(self) -> None:
        self._queue.put(None)
        self._worker.join()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            delay = item.end - self._clock()
            if delay > 0:
                time.sleep(delay)
            item.finished_at = self._clock()
            self.history.append(item)
            item.done.set()


@dataclass(frozen=True)
class TransferModel:
    """Time of one point-to-point transfer: ``latency_s + nbytes / bandwidth_bps``."""

    latency_s: float = 10e-6
    bandwidth_bps: float = 25e9  # bytes per second

    def seconds(self, nbytes: int) -> float:
        return self.latency_s + nbytes / self.bandwidth_bps


def tensor_key(t: torch.Tensor) -> int:
    """A 63-bit hash of the tensor's bytes (the same in every process, unlike ``hash``)."""
    data = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy() if t.numel() else np.zeros(0, np.uint8)
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") >> 1


_SLOT = np.dtype([("key", "<i8"), ("rank", "<i8"), ("ready", "<f8")])


def default_table_path(run_id: str) -> Path:
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    return base / f"ds_vshape_emulated_{run_id}"


class ReadyTable:
    """When each published tensor is ready on its producer's device; shared through a file.

    A fixed hash table (slot = key mod size, latest write wins): an entry overwritten by an
    unrelated tensor is only a missed lookup, i.e. no wait, which the key check detects.
    """

    def __init__(self, path: Path, slots: int = 1 << 16) -> None:
        self.path, self.slots = Path(path), slots
        size = slots * _SLOT.itemsize
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size < size:  # every rank asks for the same size: no data lost
                os.ftruncate(fd, size)
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self._slots = np.frombuffer(self._map, dtype=_SLOT, count=slots)

    def publish(self, key: int, rank: int, ready: float) -> None:
        self._slots[key % self.slots] = (key, rank, ready)

    def lookup(self, key: int) -> tuple[int, float] | None:
        entry = self._slots[key % self.slots].copy()
        if int(entry["key"]) != key:
            return None
        return int(entry["rank"]), float(entry["ready"])

    def unlink(self) -> None:
        self.path.unlink(missing_ok=True)


class AsyncDevice:
    """One rank's stream plus its view of the other ranks' transfers."""

    def __init__(self, rank: int, table: ReadyTable, transfer: TransferModel = TransferModel(), stream: DeviceStream | None = None) -> None:
        self.rank, self.table, self.transfer = rank, table, transfer
        self.stream = stream if stream is not None else DeviceStream()
        self._pair_free: dict[int, float] = {}  # peer -> end of the last transfer on that pair's stream

    def run(self, seconds: float, kind: str) -> Pass:
        return self.stream.enqueue(seconds, kind)

    def produced(self, t: torch.Tensor) -> None:
        """``t`` may be sent now: it is ready when the stream has done all work enqueued so far."""
        if t.device.type != "meta":
            self.table.publish(tensor_key(t), self.rank, self.stream.tail_end)

    def consumed(self, t: torch.Tensor) -> None:
        """``t`` is about to be used; if another rank made it, wait (device side) for its transfer."""
        if t.device.type == "meta":
            return
        hit = self.table.lookup(tensor_key(t))
        if hit is not None and hit[0] != self.rank:
            peer, ready = hit
            start = max(ready, self._pair_free.get(peer, 0.0))  # the pair's communicator runs one transfer at a time
            end = start + self.transfer.seconds(t.numel() * t.element_size())
            self._pair_free[peer] = end
            self.stream.wait_for(end)

    def synchronize(self) -> None:
        self.stream.synchronize()
