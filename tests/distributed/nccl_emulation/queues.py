"""Emulated NCCL communicators on one rank: Work handles, one ordered queue each, the transport.

A communicator here is what ProcessGroupNCCL keeps per process group (or, lazily, per pair):
one stream on this rank, on which entries run strictly in issue order, each to completion
before the next starts. An entry is one unbatched p2p op, one whole batch, or one collective.
Point-to-point data travels over gloo on the default group with global ranks, on three reserved
tags per communicator (derived from its key: data, ready tokens, first-contact greetings), so
that messages of different communicators never match each other and, per communicator, the
i-th send A->B meets the i-th receive at B.
"""

from __future__ import annotations

import queue
import threading
import zlib
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable

import torch

__all__ = ["CommKey", "Communicator", "EmulatedWork", "Lane", "P2P", "Transport", "in_worker"]

_TAG_BASE = 0x4E00_0000  # reserved range: gloo tags are int32; user tags are small
_LOCAL = threading.local()  # .worker is set on communicator threads


def in_worker() -> bool:
    """True on a communicator's worker thread: calls made there run inline (they are the entry)."""
    return getattr(_LOCAL, "worker", False)


class EmulatedWork:
    """Work-like handle of one queue entry: completes when its communicator has run it.

    ``wait()`` blocks the host (NCCL's would only order the current stream) until the entry is
    done, then raises its error if it failed; after ``timeout`` (else the installed default) it
    raises ``RuntimeError`` naming the op, its peers, the communicator and the mode.
    """

    def __init__(self, label: str, communicator: str, default_timeout: Callable[[], float], mode: str) -> None:
        self.label = label
        self.communicator = communicator
        self.mode = mode
        self._default_timeout = default_timeout
        self._done = threading.Event()
        self._error: BaseException | None = None

    def _finish(self, error: BaseException | None) -> None:
        self._error = error  # written before the event is set, read only after it is seen set
        self._done.set()

    def is_completed(self) -> bool:
        """Finished, successfully or not (as torch's Work)."""
        return self._done.is_set()

    def is_success(self) -> bool:
        return self._done.is_set() and self._error is None

    def exception(self) -> BaseException | None:
        return self._error

    def wait(self, timeout: timedelta | float | None = None) -> bool:
        seconds = _seconds(timeout, self._default_timeout())
        if not self._done.wait(seconds):
            raise RuntimeError(
                f"nccl_emulation ({self.mode} init): {self.label} on communicator {self.communicator} timed out "
                f"after {seconds:g} s; under NCCL this would hang (an earlier entry on that communicator's queue, "
                "or the peer's matching op, never completed)"
            )
        if self._error is not None:
            raise RuntimeError(f"nccl_emulation ({self.mode} init): {self.label} on communicator "
                               f"{self.communicator} failed: {self._error}") from self._error
        return True


def _seconds(timeout: timedelta | float | None, default: float) -> float:
    # c10d's Work.wait treats a zero timedelta as "no timeout given": so do we.
    if isinstance(timeout, timedelta):
        timeout = timeout.total_seconds()
    return default if not timeout else float(timeout)


@dataclass(frozen=True)
class CommKey:
    """Names a communicator the same way on every rank: its process group, and for lazy
    unbatched p2p the pair of global ranks it was made for."""

    group: str  # the process group's group_name (agreed by all ranks)
    pair: tuple[int, int] | None = None

    def __str__(self) -> str:
        if self.pair is None:
            return f"'group {self.group}'"
        return f"'pair {self.pair[0]}-{self.pair[1]} of group {self.group}'"

    def tags(self) -> tuple[int, int, int]:
        """(data tag, ready-token tag, greeting tag): the same on every rank, distinct per communicator."""
        slot = zlib.crc32(repr((self.group, self.pair)).encode()) & 0x7F_FFFF
        return _TAG_BASE + 3 * slot, _TAG_BASE + 3 * slot + 1, _TAG_BASE + 3 * slot + 2


@dataclass(eq=False)
class P2P:
    kind: str  # "send" or "recv"
    tensor: torch.Tensor
    peer: int  # global rank


class Lane:
    """One ordered queue of entries and the daemon thread that drains it: a stream of one
    communicator, or, under the one-queue rule, the rank's one hardware queue."""

    def __init__(self, name: str) -> None:
        self._entries: queue.SimpleQueue[tuple[Callable[[], Any], EmulatedWork]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self.unfinished = 0  # entries issued and not yet completed (or failed)
        threading.Thread(target=self._run, name=f"nccl-emulation {name}", daemon=True).start()

    def put(self, run: Callable[[], Any], work: EmulatedWork) -> None:
        with self._lock:
            self.unfinished += 1
        self._entries.put((run, work))

    def _run(self) -> None:
        _LOCAL.worker = True
        while True:
            run, work = self._entries.get()
            error: BaseException | None = None
            try:
                run()
            except BaseException as err:  # handed to whoever waits on the entry's work
                error = err
            with self._lock:
                self.unfinished -= 1
            work._finish(error)  # a failed entry is done; NCCL would wedge the stream, later ones may hang


class Communicator:
    """One emulated communicator on this rank: its tags and its own lane (its stream)."""

    def __init__(self, key: CommKey) -> None:
        self.key = key
        self.data_tag, self.token_tag, self.greeting_tag = key.tags()
        self.lane = Lane(str(key))

    @property
    def unfinished(self) -> int:
        return self.lane.unfinished

    def put(self, run: Callable[[], Any], work: EmulatedWork) -> None:
        self.lane.put(run, work)


class Transport:
    """Rendezvous p2p over gloo: a receiver posts its data receive, then sends a one-byte ready
    token; a sender sends its data only once the peer's token for it arrived (tokens arrive in
    the peer's receive order, so the i-th token is for the i-th send). Gloo 2.13's tcp send also
    waits for a posted receive, but that is its transport's choice, not a promise: the token
    keeps the rule whatever gloo does."""

    def __init__(self, isend: Callable[..., Any], irecv: Callable[..., Any]) -> None:
        self._isend, self._irecv = isend, irecv
        self._lock = threading.Lock()  # one gloo post at a time; posts never block

    def _post(self, kind: str, tensor: torch.Tensor, peer: int, tag: int) -> Any:
        with self._lock:
            return (self._isend if kind == "send" else self._irecv)(tensor, peer, tag=tag)

    def greet(self, peers: list[int], tag: int, timeout_s: float) -> tuple[list[int], list[Any]]:
        """First contact: tell each peer that this rank made its first call with it on a
        communicator (``tag``: its greeting tag), and wait, on the host, for each peer's own.

        Returns the peers not heard from within ``timeout_s`` and, then, the gloo works still
        open (kept referenced by the caller: their buffers must outlive them). The gloo works
        are waited on by a listener thread without a timeout: a gloo wait that times out closes
        the pair between the two processes, and every later message between them would fail."""
        answers = [(peer, self._post("recv", torch.zeros(1, dtype=torch.uint8), peer, tag)) for peer in peers]
        sent = [self._post("send", torch.ones(1, dtype=torch.uint8), peer, tag) for peer in peers]
        heard: list[int] = []
        done = threading.Event()

        def listen() -> None:
            try:
                for peer, work in answers:
                    work.wait()
                    heard.append(peer)
                for work in sent:  # each peer's receive is posted before its greeting: prompt
                    work.wait()
            finally:
                done.set()

        threading.Thread(target=listen, name=f"nccl-emulation greeting {peers}", daemon=True).start()
        if done.wait(timeout_s) and len(heard) == len(peers):
            return [], []
        return [peer for peer in peers if peer not in heard], [work for _, work in answers] + sent

    def exchange(self, ops: list[P2P], comm: Communicator) -> None:
        """Run one entry's ops together; return once all of them completed."""
        pending: list[Any] = []  # gloo works: data receives, tokens sent, data sends
        tokens: list[tuple[P2P, Any]] = []  # each send with its token receive
        for op in ops:  # everything that does not wait first, in issue order
            if op.kind == "recv":
                pending.append(self._post("recv", op.tensor, op.peer, comm.data_tag))
                pending.append(self._post("send", torch.ones(1, dtype=torch.uint8), op.peer, comm.token_tag))
            else:
                tokens.append((op, self._post("recv", torch.zeros(1, dtype=torch.uint8), op.peer, comm.token_tag)))
        self._send_when_ready(tokens, pending, comm.data_tag)
        for work in pending:
            work.wait()

    def _send_when_ready(self, tokens: list[tuple[P2P, Any]], pending: list[Any], data_tag: int) -> None:
        # The sends of one batch progress independently: a late token from one peer must not
        # hold back the send to another, so each peer's sends get a thread of their own (gloo's
        # is_completed() on a receive is not set until it is waited on: no polling). Per peer,
        # tokens arrive in order, so its data leaves in issue order.
        chains: dict[int, list[tuple[P2P, Any]]] = {}
        for op, token in tokens:
            chains.setdefault(op.peer, []).append((op, token))
        if len(chains) <= 1:
            for chain in chains.values():
                self._send_chain(chain, pending, data_tag)
            return
        errors: list[BaseException] = []
        threads = [threading.Thread(target=self._send_chain, args=(chain, pending, data_tag, errors), daemon=True)
                   for chain in chains.values()]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            raise errors[0]

    def _send_chain(self, chain: list[tuple[P2P, Any]], pending: list[Any], data_tag: int,
                    errors: list[BaseException] | None = None) -> None:
        try:
            for op, token in chain:
                token.wait()  # the peer's receive for this send runs
                pending.append(self._post("send", op.tensor, op.peer, data_tag))  # list.append is atomic
        except BaseException as err:
            if errors is None:
                raise
            errors.append(err)
