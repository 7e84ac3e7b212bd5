"""Routing of torch.distributed calls onto emulated communicators, and install/uninstall."""

from __future__ import annotations

import functools
import inspect
import itertools
import os
import threading
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from . import device_sync
from .queues import CommKey, Communicator, EmulatedWork, Lane, P2P, Transport, in_worker
from .settings import FIRST_CONTACT_ENV, MODES, ONE_QUEUE_ENV, SYNCHRONIZE_ENV, TIMEOUT_ENV, env_first_contact, env_switch

__all__ = ["first_contact", "first_contacts_made", "install", "installed", "mode", "one_queue", "original", "synchronize_rule",
           "synchronizes", "synchronizes_waited", "unfinished_ops", "uninstall"]

_P2P = ("send", "recv", "isend", "irecv", "batch_isend_irecv")
# Every tensor collective DeepSpeed reaches (deepspeed/comm/torch.py looks them up at call time,
# except all_gather_into_tensor / reduce_scatter_tensor, cached at its init: install before it).
# Object collectives are left alone: they call these. Calls made while an entry runs (torch's
# deprecated names delegate to the new ones) run inline.
_COLLECTIVES = ("all_reduce", "all_reduce_coalesced", "broadcast", "reduce", "all_gather", "all_gather_single",
                "all_gather_into_tensor", "_all_gather_base", "reduce_scatter", "reduce_scatter_single",
                "reduce_scatter_tensor", "_reduce_scatter_base", "gather", "scatter", "all_to_all", "all_to_all_single",
                "barrier")


class _Emulator:
    """This rank's communicators (kept across uninstall: a wedged one stays wedged) and settings."""

    def __init__(self, originals: dict[str, Callable[..., Any]]) -> None:
        self.originals = originals
        self.in_dist = {name for name in originals if hasattr(dist, name)}  # the rest live in c10d only
        self.transport = Transport(originals["isend"], originals["irecv"])
        self.mode = "eager"
        self.timeout_s = 60.0
        self.first_contact = False
        self.one_queue = False  # every communicator's entries go on the rank's one lane
        self.synchronize = False  # the accelerator's synchronize() waits for every entry issued before it
        self._rank_lane: Lane | None = None  # the one lane, made at the first entry under the rule
        self._issued: list[EmulatedWork] = []  # entries not yet seen complete, in issue order (for synchronize)
        self.active = False
        self._contacted: set[tuple[CommKey, int]] = set()  # (communicator, peer) this rank has called with
        self._greetings: list[Any] = []  # gloo works of greetings still open (their buffers must live)
        self.greeted = 0  # first contacts made under the rule
        # Issue order across host threads; communicator creation. Reentrant: a finalizer the collector
        # runs inside it (on this thread) may issue or ask for outstanding entries.
        self._issue_lock = threading.RLock()
        self._comms: dict[CommKey, Communicator] = {}
        self._tags: dict[int, CommKey] = {}
        self._count = itertools.count(1)

    def _communicator(self, key: CommKey) -> Communicator:
        comm = self._comms.get(key)
        if comm is None:
            data_tag = key.tags()[0]
            if self._tags.setdefault(data_tag, key) != key:
                raise RuntimeError(f"nccl_emulation: communicators {self._tags[data_tag]} and {key} hash to one gloo "
                                   "tag; change CommKey.tags")
            comm = self._comms[key] = Communicator(key)
        return comm

    def _enqueue(self, key: CommKey, label: str, run: Callable[[Communicator], Any], *,
                 timeout_s: float | None = None) -> EmulatedWork:
        with self._issue_lock:
            comm = self._communicator(key)
            where = f"{key}, on rank {dist.get_rank()}'s one queue" if self.one_queue else str(key)
            default = (lambda: self.timeout_s) if timeout_s is None else (lambda: timeout_s)
            work = EmulatedWork(f"{label} #{next(self._count)}", where, default, self.mode)
            self._lane(comm).put(functools.partial(run, comm), work)
            self._issued = [w for w in self._issued if not w.is_completed()] + [work]
        return work

    def _lane(self, comm: Communicator) -> Lane:
        """The communicator's own stream, or under the one-queue rule the rank's one queue."""
        if not self.one_queue:
            return comm.lane
        if self._rank_lane is None:
            self._rank_lane = Lane(f"rank {dist.get_rank()} one queue")
        return self._rank_lane

    def outstanding(self) -> list[EmulatedWork]:
        """Entries issued so far and not complete (what a device-wide synchronize waits for)."""
        with self._issue_lock:
            self._issued = [w for w in self._issued if not w.is_completed()]
            return list(self._issued)

    def p2p(self, ops: list[P2P], group: Any, *, batched: bool, label: str) -> EmulatedWork:
        """Eager: the group's communicator. Lazy: a batch on the group's, an unbatched op on the
        pair's own (so the two never meet)."""
        pair = None
        if not batched and self.mode == "lazy":
            a, b = sorted((dist.get_rank(), ops[0].peer))
            pair = (a, b)
        key = CommKey(group.group_name, pair)
        self._contact(key, [op.peer for op in ops], label)
        return self._enqueue(key, label, functools.partial(self.transport.exchange, ops))

    def _contact(self, key: CommKey, peers: list[int], label: str) -> None:
        """NCCL's first contact: this rank's first call with a peer on a communicator returns only
        once the peer made its own first call with this rank there (recorded even when the rule
        is off, so that turning it on never greets a pair already connected)."""
        with self._issue_lock:
            new = [peer for peer in dict.fromkeys(peers) if (key, peer) not in self._contacted]
            self._contacted.update((key, peer) for peer in new)
        if not new or not self.first_contact:
            return
        self.greeted += len(new)
        missing, still_open = self.transport.greet(new, self._communicator(key).greeting_tag, self.timeout_s)
        self._greetings += still_open
        if missing:
            raise RuntimeError(
                f"nccl_emulation ({self.mode} init, first contact): {label} on communicator {key} timed out after "
                f"{self.timeout_s:g} s waiting for the first call of rank(s) {missing} with rank {dist.get_rank()} "
                "there; under NCCL this call would hang on the host in ncclGroupEnd (a cycle of first calls: make "
                "every pair's first contact in one global order first)"
            )

    def collective(self, name: str, group: Any, call: Callable[[], Any]) -> EmulatedWork:
        """One entry on the group's communicator: the real gloo collective, run from its thread.

        Its wait times out after the group's timeout as it stands at issue (at most the
        emulation's): NCCL's watchdog times a collective from its issue with the timeout its
        group had then, however long it queued behind others. The gloo call itself runs later,
        with whatever the group's timeout is by then."""
        timeout_s = min(self.timeout_s, _group_timeout_s(group) or self.timeout_s)
        return self._enqueue(CommKey(group.group_name), f"{name} on rank {dist.get_rank()}", lambda comm: call(),
                             timeout_s=timeout_s)

    def unfinished(self) -> int:
        with self._issue_lock:
            lanes = [comm.lane for comm in self._comms.values()] + ([self._rank_lane] if self._rank_lane else [])
            return sum(lane.unfinished for lane in lanes) + len(self._greetings)


_EMU: _Emulator | None = None


def _group_timeout_s(group: Any) -> float | None:
    """The timeout the group's gloo backend has now (None where it cannot be read)."""
    try:
        timeout = group._get_backend(torch.device("cpu")).options._timeout
    except (AttributeError, RuntimeError):
        return None
    return timeout.total_seconds() if isinstance(timeout, timedelta) else None


def _passthrough(group: Any) -> bool:
    """Calls the emulation leaves to torch: when off, inside an entry, or on a non-member rank."""
    return _EMU is None or not _EMU.active or in_worker() or c10d._rank_not_in_group(group)


def _group(group: Any) -> Any:
    return group if group is not None else c10d._get_default_group()


def _peer(group: Any, rank: int | None, group_rank: int | None, what: str) -> int:
    if group_rank is not None:
        return dist.get_global_rank(group, group_rank)
    if rank is None:
        raise ValueError(f"nccl_emulation: {what} needs a peer (NCCL has no receive from any source)")
    dist.get_group_rank(group, rank)  # raises when the peer is not in the group
    return rank


def _op(kind: str, tensor: torch.Tensor, peer: int, what: str) -> P2P:
    if not isinstance(tensor, torch.Tensor) or not tensor.is_contiguous():
        raise ValueError(f"nccl_emulation: {what} needs one contiguous tensor")
    if peer == dist.get_rank():
        raise ValueError(f"nccl_emulation: rank {peer} cannot {what} to itself (not emulated)")
    return P2P(kind, tensor, peer)


def _describe(op: P2P) -> str:
    where = f"to rank {op.peer}" if op.kind == "send" else f"from rank {op.peer}"
    shape = f"{str(op.tensor.dtype).removeprefix('torch.')}{list(op.tensor.shape)}"
    return f"{'isend' if op.kind == 'send' else 'irecv'} of {shape} {where}"


def _unbatched(kind: str, tensor: torch.Tensor, peer: int | None, group: Any, tag: int, group_peer: int | None) -> EmulatedWork:
    assert _EMU is not None
    what = "isend" if kind == "send" else "irecv"
    op = _op(kind, tensor, _peer(group, peer, group_peer, what), what)
    label = f"{_describe(op)} on rank {dist.get_rank()} (tag {tag} ignored)"
    return _EMU.p2p([op], group, batched=False, label=label)


def _emulated_isend(tensor: torch.Tensor, dst: int | None = None, group: Any = None, tag: int = 0,
                    group_dst: int | None = None) -> Any:
    if _passthrough(group):
        return _EMU.originals["isend"](tensor, dst, group, tag, group_dst)
    return _unbatched("send", tensor, dst, _group(group), tag, group_dst)


def _emulated_irecv(tensor: torch.Tensor, src: int | None = None, group: Any = None, tag: int = 0,
                    group_src: int | None = None) -> Any:
    if _passthrough(group):
        return _EMU.originals["irecv"](tensor, src, group, tag, group_src)
    return _unbatched("recv", tensor, src, _group(group), tag, group_src)


def _emulated_send(tensor: torch.Tensor, dst: int | None = None, group: Any = None, tag: int = 0,
                   group_dst: int | None = None) -> None:
    if _passthrough(group):
        return _EMU.originals["send"](tensor, dst, group, tag, group_dst)
    _unbatched("send", tensor, dst, _group(group), tag, group_dst).wait()
    return None


def _emulated_recv(tensor: torch.Tensor, src: int | None = None, group: Any = None, tag: int = 0,
                   group_src: int | None = None) -> int:
    if _passthrough(group):
        return _EMU.originals["recv"](tensor, src, group, tag, group_src)
    group = _group(group)
    peer = _peer(group, src, group_src, "recv")
    _unbatched("recv", tensor, peer, group, tag, None).wait()
    return peer  # like torch: the sender's global rank


def _emulated_batch_isend_irecv(p2p_op_list: list[Any]) -> list[Any]:
    """All ops of the call are one entry on their group's communicator: ONE Work for all."""
    assert _EMU is not None
    if not p2p_op_list or any(not isinstance(p, dist.P2POp) for p in p2p_op_list):
        raise ValueError("nccl_emulation: batch_isend_irecv needs a non-empty list of P2POp")
    group = p2p_op_list[0].group  # P2POp resolved None to the default group, and peer to a global rank
    if any(p.group != group for p in p2p_op_list):
        raise ValueError("nccl_emulation: all ops of one batch_isend_irecv must use the same group")
    if _passthrough(group):
        return _EMU.originals["batch_isend_irecv"](p2p_op_list)
    receives = (_emulated_irecv, _EMU.originals["irecv"])
    ops = [_op("recv" if p.op in receives else "send", p.tensor, p.peer, "batch_isend_irecv") for p in p2p_op_list]
    label = f"batch_isend_irecv [{', '.join(map(_describe, ops))}] on rank {dist.get_rank()}"
    return [_EMU.p2p(ops, group, batched=True, label=label)]


def _emulated_collective(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def collective(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        group = bound.arguments.get("group")
        # Inside torch's _coalescing_manager the ops are recorded, not run: left to torch (not emulated).
        if _passthrough(group) or _group(group) in c10d._world.pg_coalesce_state:
            return original(*args, **kwargs)
        async_op = bool(bound.arguments.get("async_op", False))
        if "async_op" in bound.arguments:
            bound.arguments["async_op"] = False  # run to completion on the communicator's thread
        work = _EMU.collective(name, _group(group), functools.partial(original, *bound.args, **bound.kwargs))
        if async_op:
            return work
        work.wait()
        return None

    return collective


_P2P_REPLACEMENTS: dict[str, Callable[..., Any]] = {
    "send": _emulated_send, "recv": _emulated_recv, "isend": _emulated_isend, "irecv": _emulated_irecv,
    "batch_isend_irecv": _emulated_batch_isend_irecv,
}


def install(*, mode: str = "eager", timeout_s: float | None = None, first_contact: bool | None = None,
            synchronize: bool | None = None, one_queue: bool | None = None) -> None:
    """Route p2p ops and collectives through the emulation, in ``mode`` ("eager": device bound at
    init, as DeepSpeed does on GPUs; "lazy": none bound). ``first_contact`` (default: env
    ``FIRST_CONTACT_ENV``): a rank's first p2p call with a peer on a communicator blocks its host
    until that peer's first call with it there. ``synchronize`` (default: env ``SYNCHRONIZE_ENV``):
    DeepSpeed's ``get_accelerator().synchronize()`` blocks the host until every entry the rank
    issued before it completed (posted receives and unmatched sends included), as a device-wide
    synchronize does on a GPU. ``one_queue`` (default: env ``ONE_QUEUE_ENV``): every
    communicator of the rank feeds one ordered queue (``CUDA_DEVICE_MAX_CONNECTIONS=1``).
    Installing again sets the mode, the timeout and the rules for ops issued from then on
    (every rank must switch at the same point, with nothing in flight when ``one_queue`` changes)."""
    global _EMU
    if mode not in MODES:
        raise ValueError(f"nccl_emulation: mode must be one of {MODES}, got {mode!r}")
    if timeout_s is None:
        timeout_s = float(os.environ.get(TIMEOUT_ENV, "60"))
    if first_contact is None:
        first_contact = env_first_contact(os.environ.get(FIRST_CONTACT_ENV))
    if synchronize is None:
        synchronize = env_switch(SYNCHRONIZE_ENV, os.environ.get(SYNCHRONIZE_ENV))
    if one_queue is None:
        one_queue = env_switch(ONE_QUEUE_ENV, os.environ.get(ONE_QUEUE_ENV))
    names = _P2P + tuple(n for n in _COLLECTIVES if hasattr(c10d, n))
    if _EMU is None:
        _EMU = _Emulator({name: getattr(c10d, name) for name in names})
    _EMU.mode, _EMU.timeout_s, _EMU.first_contact = mode, timeout_s, first_contact
    _EMU.one_queue, _EMU.synchronize = one_queue, synchronize
    if synchronize:
        device_sync.patch(_EMU.outstanding, lambda: _EMU.timeout_s, lambda: _EMU.mode)
    else:
        device_sync.restore()
    if _EMU.active:
        return
    for name in names:
        fn = _P2P_REPLACEMENTS.get(name) or _emulated_collective(name, _EMU.originals[name])
        setattr(c10d, name, fn)  # P2POp's op check and c10d-internal callers
        if name in _EMU.in_dist:
            setattr(dist, name, fn)
    _EMU.active = True


def uninstall() -> None:
    """Restore torch's functions (communicators and their threads stay, wedged ones parked)."""
    if _EMU is None or not _EMU.active:
        return
    device_sync.restore()
    for name, fn in _EMU.originals.items():
        setattr(c10d, name, fn)
        if name in _EMU.in_dist:
            setattr(dist, name, fn)
    _EMU.active = False


def installed() -> bool:
    return _EMU is not None and _EMU.active


def mode() -> str | None:
    """The installed mode, None when not installed."""
    return _EMU.mode if installed() else None


def first_contact() -> bool:
    """Whether the first-contact rule is on (False when not installed)."""
    return installed() and _EMU.first_contact


def original(name: str) -> Callable[..., Any]:
    """torch's own function behind an emulated one (for harness calls that must bypass the rules)."""
    if _EMU is None:
        return getattr(c10d, name)
    return _EMU.originals[name]


def one_queue() -> bool:
    """Whether the one-queue rule is on (False when not installed)."""
    return installed() and _EMU.one_queue


def synchronize_rule() -> bool:
    """Whether the synchronize rule is on (False when not installed)."""
    return installed() and _EMU.synchronize


def synchronizes_waited() -> int:
    """How many emulated synchronize() calls found entries still outstanding and waited for them."""
    return device_sync.waited()


def synchronizes() -> int:
    """How many synchronize() calls the rule saw from the host (DeepSpeed's ZeRO sites included)."""
    return device_sync.calls()


def first_contacts_made() -> int:
    """How many first contacts (communicator, peer) this rank made under the rule so far."""
    return _EMU.greeted if _EMU is not None else 0


def unfinished_ops() -> int:
    """Queue entries not yet completed and greetings never answered, installed or not: > 0 after
    a timed-out wait.

    A process whose worker threads are parked inside gloo waits aborts in interpreter teardown;
    callers that know they wedged a communicator exit with ``os._exit`` instead.
    """
    return _EMU.unfinished() if _EMU is not None else 0
