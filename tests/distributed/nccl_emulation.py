"""NCCL point-to-point semantics on gloo, so that CPU tests catch what would hang on GPUs.

Gloo is forgiving where NCCL is not: gloo matches messages by tag, buffers sends eagerly and
runs every operation independently. ``install()`` replaces ``torch.distributed``'s ``send``,
``recv``, ``isend``, ``irecv`` and ``batch_isend_irecv`` (in ``torch.distributed`` and in
``torch.distributed.distributed_c10d``, so ``P2POp`` and ``deepspeed.comm``, which look them up
at call time, use them too) with versions that obey NCCL's rules:

1. Tags are ignored: the i-th send from A to B pairs with the i-th receive posted at B from A.
   All data travels on one reserved gloo tag, on the default group, with global ranks.
2. Per pair, one ordered queue: one daemon worker thread per peer runs that pair's operations
   strictly in issue order, each to completion before the next starts.
3. Rendezvous: a send completes only once the matching receive is posted. The receiver posts
   its data receive, then sends a one-byte ready token (on a second reserved tag); the sender
   waits for that token before it sends.
4. Ops issued together in one ``batch_isend_irecv`` form one queue entry per peer, and the ops
   of an entry run concurrently (every receive and token receive is posted before any wait).

The host thread never blocks on issue; it blocks in ``EmulatedWork.wait()`` (and blocking
``send``/``recv``), which raises ``RuntimeError`` ("... timed out ...", naming the op, the peer
and the emulation) after its timeout: the argument, else ``install``'s, else the env var
``DS_VSHAPE_NCCL_TIMEOUT_S``, else 60 s. An error inside a worker thread is raised by ``wait()``.
After a timeout the pair is wedged, as it would be under NCCL: later ops on it never run.
"""

from __future__ import annotations

import itertools
import os
import queue
import threading
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

__all__ = ["DATA_TAG", "TOKEN_TAG", "TIMEOUT_ENV", "EmulatedWork", "install", "installed", "unfinished_ops", "uninstall"]

DATA_TAG = 0x4E0C_0001  # every payload, whatever tag the caller gave
TOKEN_TAG = 0x4E0C_0002  # receiver -> sender: "my receive is posted"
TIMEOUT_ENV = "DS_VSHAPE_NCCL_TIMEOUT_S"
_PATCHED = ("send", "recv", "isend", "irecv", "batch_isend_irecv")


class EmulatedWork:
    """Work-like handle of one emulated op: completes when the pair's worker has run it."""

    def __init__(self, label: str, default_timeout_s: float) -> None:
        self.label = label
        self._default_timeout_s = default_timeout_s
        self._done = threading.Event()
        self._error: BaseException | None = None

    def _finish(self, error: BaseException | None) -> None:
        self._error = error  # written before the event is set, read only after it is seen set
        self._done.set()

    def is_completed(self) -> bool:
        return self._done.is_set()

    def is_success(self) -> bool:
        return self._done.is_set() and self._error is None

    def exception(self) -> BaseException | None:
        return self._error

    def wait(self, timeout: timedelta | float | None = None) -> bool:
        seconds = _seconds(timeout, self._default_timeout_s)
        if not self._done.wait(seconds):
            raise RuntimeError(
                f"nccl_emulation: {self.label} timed out after {seconds:g} s; under NCCL this would hang "
                "(the pair's earlier ops or the peer's matching op never completed)"
            )
        if self._error is not None:
            raise RuntimeError(f"nccl_emulation: {self.label} failed: {self._error}") from self._error
        return True


def _seconds(timeout: timedelta | float | None, default: float) -> float:
    # c10d's Work.wait treats a zero timedelta as "no timeout given": so do we.
    if isinstance(timeout, timedelta):
        timeout = timeout.total_seconds()
    return default if not timeout else float(timeout)


@dataclass
class _Op:
    kind: str  # "send" or "recv"
    tensor: torch.Tensor
    peer: int  # global rank
    work: EmulatedWork


class _Pair:
    """The ordered queue to one peer and the daemon thread that drains it."""

    def __init__(self, peer: int, execute: Callable[[list[_Op], int], None]) -> None:
        self.peer = peer
        self._execute = execute
        self._entries: queue.SimpleQueue[list[_Op]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self.unfinished = 0  # entries issued and not yet completed (or failed)
        threading.Thread(target=self._run, name=f"nccl-emulation-peer{peer}", daemon=True).start()

    def put(self, entry: list[_Op]) -> None:
        with self._lock:
            self.unfinished += 1
        self._entries.put(entry)

    def _run(self) -> None:
        while True:
            entry = self._entries.get()
            error: BaseException | None = None
            try:
                self._execute(entry, self.peer)
            except BaseException as err:  # handed to whoever waits on the entry's works
                error = err
            with self._lock:
                self.unfinished -= 1
            for op in entry:
                op.work._finish(error)


class _Emulator:
    def __init__(self, originals: dict[str, Callable[..., Any]], timeout_s: float) -> None:
        self.originals = originals
        self.timeout_s = timeout_s
        self._issue_lock = threading.Lock()  # issue order across host threads; pair creation
        self._post_lock = threading.Lock()  # one gloo post at a time: posts never block
        self._pairs: dict[int, _Pair] = {}
        self._counter = itertools.count(1)

    def new_op(self, kind: str, tensor: torch.Tensor, peer: int, tag: int) -> _Op:
        if not isinstance(tensor, torch.Tensor) or not tensor.is_contiguous():
            raise ValueError(f"nccl_emulation: {kind} needs one contiguous tensor")
        me = dist.get_rank()
        if peer == me:
            raise ValueError(f"nccl_emulation: rank {me} cannot {kind} to itself")
        where = f"to rank {peer}" if kind == "send" else f"from rank {peer}"
        label = (f"{'isend' if kind == 'send' else 'irecv'} #{next(self._counter)} of "
                 f"{str(tensor.dtype).removeprefix('torch.')}{list(tensor.shape)} on rank {me} {where} (tag {tag} ignored)")
        return _Op(kind, tensor, peer, EmulatedWork(label, self.timeout_s))

    def issue(self, ops: list[_Op]) -> list[EmulatedWork]:
        by_peer: dict[int, list[_Op]] = {}
        for op in ops:
            by_peer.setdefault(op.peer, []).append(op)
        with self._issue_lock:
            for peer, entry in by_peer.items():
                if peer not in self._pairs:
                    self._pairs[peer] = _Pair(peer, self._execute)
                self._pairs[peer].put(entry)
        return [op.work for op in ops]

    def unfinished(self) -> int:
        with self._issue_lock:
            return sum(pair.unfinished for pair in self._pairs.values())

    def _post(self, name: str, tensor: torch.Tensor, peer: int, tag: int) -> Any:
        with self._post_lock:
            return self.originals[name](tensor, peer, tag=tag)

    def _execute(self, entry: list[_Op], peer: int) -> None:
        """Run one queue entry: its ops start together; it returns when all have completed."""
        pending: list[Any] = []  # gloo works: data receives, tokens sent, data sends
        tokens: list[tuple[_Op, Any]] = []  # each send with its token receive
        for op in entry:  # post everything that does not wait first, in issue order
            if op.kind == "recv":
                pending.append(self._post("irecv", op.tensor, peer, DATA_TAG))
                pending.append(self._post("isend", torch.ones(1, dtype=torch.uint8), peer, TOKEN_TAG))
            else:
                tokens.append((op, self._post("irecv", torch.zeros(1, dtype=torch.uint8), peer, TOKEN_TAG)))
        for op, token in tokens:  # tokens arrive in the peer's receive order: the i-th is for the i-th send
            token.wait()
            pending.append(self._post("isend", op.tensor, peer, DATA_TAG))
        for work in pending:
            work.wait()


_EMULATOR: _Emulator | None = None


def _peer(group: Any, rank: int | None, group_rank: int | None, what: str) -> int:
    if group_rank is not None:
        return dist.get_global_rank(group, group_rank) if group is not None else group_rank
    if rank is None:
        raise ValueError(f"nccl_emulation: {what} needs a peer (NCCL has no receive from any source)")
    return rank


def _issue_one(kind: str, tensor: torch.Tensor, peer: int, tag: int) -> EmulatedWork:
    assert _EMULATOR is not None
    return _EMULATOR.issue([_EMULATOR.new_op(kind, tensor, peer, tag)])[0]


def _emulated_isend(tensor: torch.Tensor, dst: int | None = None, group: Any = None, tag: int = 0,
                    group_dst: int | None = None) -> EmulatedWork:
    return _issue_one("send", tensor, _peer(group, dst, group_dst, "isend"), tag)


def _emulated_irecv(tensor: torch.Tensor, src: int | None = None, group: Any = None, tag: int = 0,
                    group_src: int | None = None) -> EmulatedWork:
    return _issue_one("recv", tensor, _peer(group, src, group_src, "irecv"), tag)


def _emulated_send(tensor: torch.Tensor, dst: int | None = None, group: Any = None, tag: int = 0,
                   group_dst: int | None = None) -> None:
    _emulated_isend(tensor, dst, group, tag, group_dst).wait()


def _emulated_recv(tensor: torch.Tensor, src: int | None = None, group: Any = None, tag: int = 0,
                   group_src: int | None = None) -> int:
    peer = _peer(group, src, group_src, "recv")
    _issue_one("recv", tensor, peer, tag).wait()
    return peer  # like torch: the sender's rank


def _emulated_batch_isend_irecv(p2p_op_list: list[Any]) -> list[EmulatedWork]:
    assert _EMULATOR is not None
    ops = []
    for p2p in p2p_op_list:
        # "irecv" is tested first: "isend" and "_emulated_isend" both contain "send".
        kind = "recv" if "recv" in getattr(p2p.op, "__name__", "") else "send"
        ops.append(_EMULATOR.new_op(kind, p2p.tensor, p2p.peer, p2p.tag))  # P2POp.peer is global
    return _EMULATOR.issue(ops)


_REPLACEMENTS: dict[str, Callable[..., Any]] = {
    "send": _emulated_send, "recv": _emulated_recv, "isend": _emulated_isend, "irecv": _emulated_irecv,
    "batch_isend_irecv": _emulated_batch_isend_irecv,
}


def installed() -> bool:
    return _EMULATOR is not None


def unfinished_ops() -> int:
    """Queue entries (one per peer per issue) not yet completed: > 0 after a timed-out wait.

    A process whose worker threads are parked inside gloo waits aborts in interpreter teardown;
    callers that know they wedged a pair exit with ``os._exit`` instead.
    """
    return _EMULATOR.unfinished() if _EMULATOR is not None else 0


def install(*, timeout_s: float | None = None) -> None:
    """Route all point-to-point traffic through the emulation (idempotent; updates the timeout)."""
    global _EMULATOR
    if timeout_s is None:
        timeout_s = float(os.environ.get(TIMEOUT_ENV, "60"))
    if _EMULATOR is not None:
        _EMULATOR.timeout_s = timeout_s
        return
    _EMULATOR = _Emulator({name: getattr(c10d, name) for name in _PATCHED}, timeout_s)
    for name, fn in _REPLACEMENTS.items():
        setattr(c10d, name, fn)  # P2POp's op check and c10d-internal callers
        setattr(dist, name, fn)


def uninstall() -> None:
    """Restore the original functions (worker threads of wedged pairs stay parked)."""
    global _EMULATOR
    if _EMULATOR is None:
        return
    for name, fn in _EMULATOR.originals.items():
        setattr(c10d, name, fn)
        setattr(dist, name, fn)
    _EMULATOR = None
