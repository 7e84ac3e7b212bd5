"""Point-to-point transfers between pipeline ranks, issued in the order lowering fixed.

NCCL's rules, as torch's ProcessGroupNCCL runs them, are the contract, so the same code is
correct on gloo and on GPUs:

* **One communicator per pair.** Each pair of neighbouring pipeline ranks has a 2-rank
  process group of its own (``p2p_groups``), and every operation goes out through
  ``batch_isend_irecv`` on it, alone or grouped: under eager and lazy NCCL init alike the
  pair then has one communicator and one stream, so a receive posted from one neighbour
  never holds back a send to the other, and header and payload share one order.
* **No tags.** Every message goes with tag 0; between two ranks the i-th send meets the
  i-th receive. Lowering (``schedules.p2p_order``) gives both ranks of a pair one order of
  transfers, so position is meaning.
* **Issue order is completion order per pair.** This class issues exactly what the lowered
  ops say, when they say it: ``post`` (a non-blocking receive), ``send`` (non-blocking),
  ``recv`` (wait for a posted receive, right before the pass that needs it). A post marked
  ``with_next`` goes out in one batch with the send after it.
* **One Work per batch.** A batch is tracked as a whole (``p2p_waits.Batch``): on NCCL it
  returns a single Work for all its tensors.
* **Waits leave the host free on NCCL** (``p2p_waits``): stream-ordered, with hangs still
  named within ``timeout_s``; only shape headers are read on the host.
* **Shapes.** The shapes travel in a small header only with the first transfer of each
  (direction, stage) in a step (lowering marks which), or with every transfer when the
  module has ``dynamic_shape``. A receive that brings a header can post its payload only
  once the header is read, and nothing else may come between them on that pair: before
  the next operation with that peer, the header is read and the payload posted. With one
  hardware queue (``one_queue``, ``CUDA_DEVICE_MAX_CONNECTIONS=1``) every operation of the rank
  shares one queue, so the header is read before the next operation with any peer.

**First contact.** NCCL connects a pair on its first exchange, and that call blocks the host
until the peer makes its own first call with this rank (``schedules.first_contact``).
``warm_up`` makes every first contact at initialize, one peer after another in the one
global order every rank follows, on the pair's group: a step's first transfer then posts
without blocking, and no rank's first receive can wait on a cycle of first receives.

Sends are released as soon as they are known complete, so in-flight buffers do not pile
up over a step; ``inflight`` lists what is still held. Known complete: the backend says so,
or a receive from the same peer completed that was posted after the send was issued (one
stream per pair: the send ran before it). A step that fails leaves posted operations that
neither NCCL nor gloo can cancel: the object then refuses further steps with an error that
says to rebuild the engine.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from .device import one_hardware_queue
from .p2p_waits import Batch, HostWaits, P2PError, P2PTimeoutError, StreamWaits, Waits

__all__ = ["ACT", "GRAD", "P2P", "P2PError", "P2PTimeoutError", "Recv"]

_DTYPES = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.uint8, torch.int8,
    torch.int16, torch.int32, torch.int64, torch.bool,
]
_DTYPE_ID = {d: i for i, d in enumerate(_DTYPES)}
_HEADER = 64  # int64 slots: [count, (dtype, ndim, d0..d5) * count]
_MAX_DIMS = 6
ACT, GRAD = 0, 1
_WHAT = {ACT: "activations", GRAD: "gradients"}

Meta = tuple[tuple[torch.dtype, tuple[int, ...]], ...]
Link = tuple[int, int]  # (direction, consuming stage)


class _Op(NamedTuple):
    """One send or receive to issue: tensor and the peer's pipeline rank."""

    send: bool
    tensor: torch.Tensor
    peer: int


class Recv(NamedTuple):
    """One receive of a step, as the lowered schedule names it."""

    direction: int
    stage: int
    micro_batch: int
    seq_chunk: int
    peer: int
    header: bool

    @property
    def link(self) -> Link:
        return (self.direction, self.stage)

    @property
    def key(self) -> tuple[int, int, int, int]:
        return (self.direction, self.stage, self.micro_batch, self.seq_chunk)

    def label(self) -> str:
        return (f"receive of {_WHAT[self.direction]} for stage {self.stage} micro-batch {self.micro_batch} "
                f"chunk {self.seq_chunk} from pipeline rank {self.peer}")


@dataclass
class _Posted:
    """A receive in flight: its header (until read), then its payload."""

    recv: Recv
    header: tuple[Batch, torch.Tensor] | None = None
    batch: Batch | None = None  # the payload's batch (None while held for the next send)
    buffers: list[torch.Tensor] = field(default_factory=list)
    sends_before: int = 0  # send batches to the same peer issued before this receive was posted


@dataclass
class _Sent:
    """A send batch in flight: its buffers live until it is known complete."""

    batch: Batch
    tensors: list[torch.Tensor]
    peer: int
    number: int  # per peer, over the engine's life


@dataclass
class P2P:
    """Transfers for one pipeline rank.

    ``global_rank_of`` maps a pipeline rank to a process rank; ``groups`` maps each peer
    pipeline rank to the pair's process group (``p2p_groups.pair_groups``);
    ``stream_waits``: wait on the device stream (NCCL) rather than on the host (gloo).
    ``one_queue``: one hardware queue per rank (default: ``CUDA_DEVICE_MAX_CONNECTIONS=1``);
    a header is then read before the next operation with any peer.
    """

    global_rank_of: list[int]
    groups: dict[int, Any]
    device: torch.device
    timeout_s: float
    my_rank: int
    dynamic_shape: bool = False
    stream_waits: bool = False
    one_queue: bool = field(default_factory=one_hardware_queue)
    _waits: Waits = field(init=False)
    _sends: deque[_Sent] = field(default_factory=deque)  # oldest first
    _sent_count: dict[int, int] = field(default_factory=dict)  # send batches per peer, over the engine's life
    _posted: dict[tuple, _Posted] = field(default_factory=dict)
    _unread: dict[int, _Posted] = field(default_factory=dict)  # peer -> posted receive whose header is unread
    _held: list[tuple[_Op, _Posted]] = field(default_factory=list)  # a post waiting for its group's send
    _shapes: dict[Link, Meta] = field(default_factory=dict)  # received this step
    _sent: dict[Link, Meta] = field(default_factory=dict)  # announced this step
    _broken: str | None = None
    peak_inflight_bytes: int = 0

    def __post_init__(self) -> None:
        policy = StreamWaits if self.stream_waits else HostWaits
        self._waits = policy(timeout_s=self.timeout_s, my_rank=self.my_rank)

    # ---- initialize ---------------------------------------------------------------------------
    def warm_up(self, peers: Sequence[int]) -> None:
        """First contact with each of ``peers``, in that order: one exchange of a tiny tensor
        each way, in one batch on the pair's group, waited on the host (``p2p_timeout_s``).

        ``peers``: ``schedules.first_contact.warm_up_peers``, the one global order of pairs.
        Before any step: both ranks of a pair make it as their first transfer with each other.
        """
        self.check_usable()
        for peer in peers:
            label = f"first contact (warm-up exchange at initialize) with pipeline rank {peer}"
            out, into = torch.zeros(1, device=self.device), torch.empty(1, device=self.device)
            batch = self._issue([_Op(True, out, peer), _Op(False, into, peer)], label)
            self._waits.on_host(batch, label)

    # ---- step framing -----------------------------------------------------------------------
    def check_usable(self) -> None:
        """Raise when an earlier step left transfers that cannot be undone."""
        if self._broken is not None:
            raise P2PError(self._broken)

    def start_step(self) -> None:
        """Begin a step (refused after a failed one)."""
        self.check_usable()
        self._shapes.clear()
        self._sent.clear()
        self.peak_inflight_bytes = self.inflight_bytes

    def settle_waits(self, where: str) -> None:
        """Before the host reads a value that depends on received data (``where``: the step's tail,
        whose gradient norm, overflow flags and post-validation read the device with ``.item()``):
        every stream-ordered wait of the step must complete by its deadline, or this raises
        ``P2PTimeoutError`` naming the transfer. Without it, a stuck transfer behind a stream wait
        would hang the host inside ``.item()`` with no name and no timeout."""
        try:
            self._waits.settle([])
        except P2PTimeoutError as err:
            raise P2PTimeoutError(f"{err} (found at {where}, before the host reads the device)") from err

    def drain(self) -> None:
        """Wait for every send of the step (their buffers must live until then)."""
        self._waits.settle([sent.batch for sent in self._sends])
        self._sends.clear()
        if self._posted or self._held:
            pending = [p.recv.label() for p in self._posted.values()][:3]
            raise RuntimeError(f"pipeline rank {self.my_rank}: the step ended with receives posted but never used: {pending}")

    def abandon(self, err: BaseException) -> None:
        """After a failed step: keep what is in flight referenced and refuse later steps if any is."""
        open_ops = len(self._sends) + len(self._posted) + len(self._held)
        if open_ops:
            self._broken = (
                f"pipeline rank {self.my_rank}: an earlier train/eval step failed ({type(err).__name__}: {err}) and left "
                f"{open_ops} transfers posted that cannot be cancelled; later transfers would pair with them. "
                "Rebuild the engine (ds_vshape.initialize) and resume from a checkpoint"
            )

    @property
    def inflight(self) -> list[torch.Tensor]:
        """Buffers still held by transfers: sends not yet complete, receives posted and not used."""
        self._reap()
        out = [t for sent in self._sends for t in sent.tensors]
        for p in self._posted.values():
            out += p.buffers + ([p.header[1]] if p.header else [])
        return out

    @property
    def inflight_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.inflight)

    # ---- the three operations lowering issues --------------------------------------------------
    def post(self, r: Recv, *, with_next: bool = False) -> None:
        """Issue a receive now; ``with_next``: together with the next send, to the same peer."""
        self._waits.check()
        self._flush_held()
        self._read_shapes(r.peer)
        posted = _Posted(r, sends_before=self._sent_count.get(r.peer, 0))
        self._posted[r.key] = posted
        if r.header or self.dynamic_shape:
            buf = torch.empty(_HEADER, dtype=torch.int64, device=self.device)
            posted.header = (self._issue([_Op(False, buf, r.peer)], r.label()), buf)
            self._unread[r.peer] = posted
        else:
            posted.buffers = self._buffers(r)
            ops = [_Op(False, buf, r.peer) for buf in posted.buffers]
            if with_next:
                self._held += [(op, posted) for op in ops]
            else:
                posted.batch = self._issue(ops, r.label())
        self._account()

    def send(self, direction: int, tensors: tuple[torch.Tensor, ...], *, stage: int, micro_batch: int, seq_chunk: int,
             peer: int, header: bool) -> None:
        self._reap()
        self._read_shapes(peer)
        label = f"send of {_WHAT[direction]} for stage {stage} micro-batch {micro_batch} chunk {seq_chunk} to pipeline rank {peer}"
        payload = [t.detach().contiguous() for t in tensors]
        meta = tuple((t.dtype, tuple(t.shape)) for t in payload)
        if header or self.dynamic_shape:
            self._sent[(direction, stage)] = meta
            payload.insert(0, _encode_header(payload, self.device))
        else:
            self._check_static(meta, direction, stage, micro_batch)
        held, self._held = self._held, []
        if held and any(op.peer != peer for op, _ in held):
            raise RuntimeError(f"pipeline rank {self.my_rank}: a receive grouped with the next send is not for rank {peer}")
        batch = self._issue([op for op, _ in held] + [_Op(True, t, peer) for t in payload], label)
        for posted in {id(p): p for _op, p in held}.values():
            posted.batch = batch
        number = self._sent_count.get(peer, 0)
        self._sends.append(_Sent(batch, payload, peer, number))
        self._sent_count[peer] = number + 1
        self._account()

    def recv(self, r: Recv) -> tuple[torch.Tensor, ...]:
        """The tensors of a posted receive; waits only for what has not arrived yet."""
        self._reap()
        posted = self._posted.get(r.key)
        if posted is None:
            raise RuntimeError(f"pipeline rank {self.my_rank}: {r.label()} was never posted (lowering must post every receive)")
        if self._unread.get(r.peer) is posted:
            self._read_shapes(r.peer)
        self._flush_held()  # a grouped receive consumed before its send: lowering never does this
        self._waits.for_data(posted.batch, r.label())
        del self._posted[r.key]
        self._release(r.peer, posted.sends_before)
        return tuple(posted.buffers)

    # ---- receiving --------------------------------------------------------------------------
    def _buffers(self, r: Recv) -> list[torch.Tensor]:
        meta = self._shapes.get(r.link)
        if meta is None:
            raise RuntimeError(f"pipeline rank {self.my_rank}: {r.label()} posted before the shapes of its link arrived")
        return [torch.empty(shape, dtype=dtype, device=self.device) for dtype, shape in meta]

    def _read_shapes(self, peer: int) -> None:
        """Read the header of a receive from ``peer`` and post its payload, before anything else on the
        pair (with one queue: on the rank, whatever the peer)."""
        if self.one_queue:
            for other in [p for p in self._unread if p != peer]:
                self._read_shape(other)
        self._read_shape(peer)

    def _read_shape(self, peer: int) -> None:
        posted = self._unread.pop(peer, None)
        if posted is None:
            return
        batch, buf = posted.header
        self._waits.on_host(batch, posted.recv.label())
        meta = _decode_header(buf)
        posted.header = None
        if not self.dynamic_shape:
            self._shapes[posted.recv.link] = meta
        posted.buffers = [torch.empty(shape, dtype=dtype, device=self.device) for dtype, shape in meta]
        posted.batch = self._issue([_Op(False, b, peer) for b in posted.buffers], posted.recv.label())

    def _flush_held(self) -> None:
        # A grouped post is always followed by its send (lowering guarantees it); anything
        # else first issues the held receive on its own, which keeps the pair order.
        if self._held:
            held, self._held = self._held, []
            batch = self._issue([op for op, _ in held], "grouped receive")
            for _op, posted in held:
                posted.batch = batch

    # ---- issuing ----------------------------------------------------------------------------
    def _issue(self, ops: list[_Op], label: str) -> Batch:
        """One batch on the pair's group (every op here has the same peer)."""
        peer = ops[0].peer
        group, dst = self.groups[peer], self.global_rank_of[peer]
        # Looked up on ``dist`` at call time: a test harness may stand in for the backend.
        p2p_ops = [dist.P2POp(dist.isend if o.send else dist.irecv, o.tensor, dst, group) for o in ops]
        try:
            return Batch(dist.batch_isend_irecv(p2p_ops), label)
        except RuntimeError as err:  # gloo fails a post at once when the peer has gone
            raise P2PError(f"pipeline rank {self.my_rank}: {label} failed: {err}") from err

    def _reap(self) -> None:
        """Release sends the backend reports complete (oldest first)."""
        self._waits.check()
        while self._sends and self._sends[0].batch.is_completed():
            sent = self._sends.popleft()
            self._waits.for_data(sent.batch, sent.batch.label)  # surfaces an error the transfer ended with

    def _release(self, peer: int, before: int) -> None:
        """Release the sends to ``peer`` numbered below ``before``: a later receive from it completed."""
        done = [s for s in self._sends if s.peer == peer and s.number < before]
        for sent in done:
            self._waits.for_data(sent.batch, sent.batch.label)
        if done:
            self._sends = deque(s for s in self._sends if not (s.peer == peer and s.number < before))

    def _account(self) -> None:
        self.peak_inflight_bytes = max(self.peak_inflight_bytes, self.inflight_bytes)

    def _check_static(self, meta: Meta, direction: int, stage: int, mb: int) -> None:
        announced = self._sent.get((direction, stage))
        if announced is None:
            raise RuntimeError(f"pipeline rank {self.my_rank}: {_WHAT[direction]} for stage {stage} sent before their shape header")
        if meta != announced:
            raise ValueError(
                f"pipeline rank {self.my_rank}: {_WHAT[direction]} for stage {stage} changed shape within a step "
                f"(micro-batch {mb}: {_describe(meta)}; earlier in the step: {_describe(announced)}). Give every "
                "micro-batch of a step the same shapes, or build the PipelineModule with dynamic_shape=True"
            )


def _describe(meta: Meta) -> str:
    return ", ".join(f"{str(dtype).removeprefix('torch.')}{list(shape)}" for dtype, shape in meta)


def _encode_header(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    if len(tensors) * (2 + _MAX_DIMS) + 1 > _HEADER:
        raise ValueError(f"a pipeline stage may pass at most {(_HEADER - 1) // (2 + _MAX_DIMS)} tensors, got {len(tensors)}")
    values = [len(tensors)]
    for t in tensors:
        if t.dtype not in _DTYPE_ID or t.dim() > _MAX_DIMS:
            raise TypeError(f"cannot pass a {t.dtype} tensor of {t.dim()} dims between pipeline stages")
        dims = list(t.shape) + [0] * (_MAX_DIMS - t.dim())
        values += [_DTYPE_ID[t.dtype], t.dim(), *dims]
    values += [0] * (_HEADER - len(values))
    return torch.tensor(values, dtype=torch.int64, device=device)


def _decode_header(header: torch.Tensor) -> Meta:
    values = header.tolist()
    out, pos = [], 1
    for _ in range(values[0]):
        dtype, ndim = _DTYPES[values[pos]], values[pos + 1]
        out.append((dtype, tuple(values[pos + 2 : pos + 2 + ndim])))
        pos += 2 + _MAX_DIMS
    return tuple(out)
