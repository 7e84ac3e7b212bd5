"""Point-to-point transfers between pipeline ranks: non-blocking sends, receives posted early.

Sends never block the sender (isend, reaped at the end of the step), and a receive waits
only right before the pass that needs the data. With that, any schedule the validator
accepts runs to completion: the wait graph is the schedule's own dependency graph.

One message per tensor. The shapes travel in a small header only with the first transfer
of each (direction, stage) in a step (lowering marks which one, ``Op.header``), or with
every transfer when the module has ``dynamic_shape``. Knowing the shapes, the receiver
posts its next receives ahead of time (``lookahead``), so the data lands while the rank
computes instead of costing a round trip when the pass needs it. Each message has its own
tag, so receives match by meaning (direction, stage, micro-batch, chunk), not by order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import NamedTuple

import torch
import torch.distributed as dist

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


class P2PError(RuntimeError):
    """A transfer failed (the peer closed its connection, say); the message names which one."""


class P2PTimeoutError(P2PError):
    """A transfer did not complete in time; the message names who waited for what."""


class Recv(NamedTuple):
    """One receive of a step, as the lowered schedule lists it."""

    direction: int
    stage: int
    micro_batch: int
    seq_chunk: int
    peer: int
    header: bool

    @property
    def link(self) -> Link:
        return (self.direction, self.stage)

    def label(self) -> str:
        return (f"receive of {_WHAT[self.direction]} for stage {self.stage} micro-batch {self.micro_batch} "
                f"chunk {self.seq_chunk} from pipeline rank {self.peer}")


@dataclass
class _Posted:
    """A receive in flight: its header (if it brings one) and its payload (once shapes are known)."""

    header: tuple[dist.Work, torch.Tensor] | None = None
    payload: list[tuple[dist.Work, torch.Tensor]] | None = None


@dataclass
class P2P:
    """Transfers for one pipeline. ``global_rank_of`` maps a pipeline rank to a process rank."""

    global_rank_of: list[int]
    num_stages: int
    micro_batches: int
    seq_chunks: int
    device: torch.device
    timeout_s: float
    my_rank: int
    dynamic_shape: bool = False
    lookahead: int = 2
    _pending: list = field(default_factory=list)
    _plan: tuple[Recv, ...] = ()
    _next: int = 0
    _posted: dict[Recv, _Posted] = field(default_factory=dict)
    _shapes: dict[Link, Meta] = field(default_factory=dict)  # received this step
    _sent: dict[Link, Meta] = field(default_factory=dict)  # announced this step
    _header_of: dict[Link, Recv] = field(default_factory=dict)

    def _tag(self, direction: int, stage: int, micro_batch: int, seq_chunk: int, part: int) -> int:
        unit = (stage * self.micro_batches + micro_batch) * self.seq_chunks + seq_chunk
        return ((unit * 2 + direction) * 16) + part

    # ---- step framing -----------------------------------------------------------------------
    def start_step(self, plan: tuple[Recv, ...] = ()) -> None:
        """Begin a step whose receives come in ``plan`` order; posts the first few at once."""
        if self._posted:
            raise RuntimeError(f"pipeline rank {self.my_rank}: receives of the last step were never consumed: {list(self._posted)[:4]}")
        self._plan, self._next = plan, 0
        self._shapes.clear()
        self._sent.clear()
        self._header_of = {r.link: r for r in plan if r.header}
        self._refill()

    def drain(self) -> None:
        """Wait for every send of the step (the buffers must live until then)."""
        for work, _keep, label in self._pending:
            self._wait(work, label)
        self._pending.clear()

    # ---- public ---------------------------------------------------------------------------
    def send_activations(self, tensors: tuple[torch.Tensor, ...], *, stage: int, micro_batch: int, seq_chunk: int,
                         peer: int, header: bool = True) -> None:
        self._send(ACT, tensors, stage, micro_batch, seq_chunk, peer, header)

    def send_grads(self, tensors: tuple[torch.Tensor, ...], *, stage: int, micro_batch: int, seq_chunk: int,
                   peer: int, header: bool = True) -> None:
        self._send(GRAD, tensors, stage, micro_batch, seq_chunk, peer, header)

    def recv_activations(self, *, stage: int, micro_batch: int, seq_chunk: int, peer: int, header: bool = True) -> tuple[torch.Tensor, ...]:
        return self.recv(Recv(ACT, stage, micro_batch, seq_chunk, peer, header))

    def recv_grads(self, *, stage: int, micro_batch: int, seq_chunk: int, peer: int, header: bool = True) -> tuple[torch.Tensor, ...]:
        return self.recv(Recv(GRAD, stage, micro_batch, seq_chunk, peer, header))

    def recv(self, r: Recv) -> tuple[torch.Tensor, ...]:
        """The tensors of one receive; waits only for what has not arrived yet."""
        posted = self._posted.get(r) or self._post(r)
        meta = self._shapes_for(r, posted)
        if posted.payload is None:
            posted.payload = self._post_payload(r, meta)
        out = tuple(self._waited(work, buf, r) for work, buf in posted.payload)
        del self._posted[r]
        self._refill()
        return out

    # ---- receiving --------------------------------------------------------------------------
    def _carries_header(self, r: Recv) -> bool:
        return r.header or self.dynamic_shape

    def _post(self, r: Recv) -> _Posted:
        posted = _Posted()
        if self._carries_header(r):
            buf = torch.empty(_HEADER, dtype=torch.int64, device=self.device)
            posted.header = (self._irecv(buf, r, 0), buf)
        elif r.link in self._shapes:
            posted.payload = self._post_payload(r, self._shapes[r.link])
        self._posted[r] = posted
        return posted

    def _post_payload(self, r: Recv, meta: Meta) -> list[tuple[dist.Work, torch.Tensor]]:
        out = []
        for part, (dtype, shape) in enumerate(meta, start=1):
            buf = torch.empty(shape, dtype=dtype, device=self.device)
            out.append((self._irecv(buf, r, part), buf))
        return out

    def _irecv(self, buf: torch.Tensor, r: Recv, part: int) -> dist.Work:
        try:
            return dist.irecv(buf, self.global_rank_of[r.peer], tag=self._tag(*r[:4], part))
        except RuntimeError as err:  # gloo fails a post at once when the peer has gone
            raise P2PError(f"pipeline rank {self.my_rank}: {r.label()} failed: {err}") from err

    def _shapes_for(self, r: Recv, posted: _Posted) -> Meta:
        if posted.header is not None:
            meta = _decode_header(self._waited(*posted.header, r))
            posted.header = None
            if self.dynamic_shape:
                return meta
            self._learn(r.link, meta)
        if r.link not in self._shapes:
            # This link's header rides on a unit the sender sent earlier: wait for it there.
            first = self._header_of.get(r.link)
            if first is None:
                raise RuntimeError(f"pipeline rank {self.my_rank}: {r.label()} has no shape header in this step's plan")
            self._shapes_for(first, self._posted.get(first) or self._post(first))
        return self._shapes[r.link]

    def _learn(self, link: Link, meta: Meta) -> None:
        self._shapes[link] = meta
        for r, posted in self._posted.items():  # pre-posted receives that were waiting for shapes
            if r.link == link and posted.header is None and posted.payload is None:
                posted.payload = self._post_payload(r, meta)

    def _refill(self) -> None:
        while self._next < len(self._plan) and len(self._posted) < self.lookahead:
            r = self._plan[self._next]
            self._next += 1
            if r not in self._posted:
                self._post(r)

    def _waited(self, work: dist.Work, buf: torch.Tensor, r: Recv) -> torch.Tensor:
        self._wait(work, r.label())
        return buf

    # ---- sending ----------------------------------------------------------------------------
    def _send(self, direction: int, tensors: tuple[torch.Tensor, ...], stage: int, mb: int, chunk: int, peer: int,
              header: bool) -> None:
        dst = self.global_rank_of[peer]
        label = f"send of {_WHAT[direction]} for stage {stage} micro-batch {mb} chunk {chunk} to pipeline rank {peer}"
        payload = [t.detach().contiguous() for t in tensors]
        meta = tuple((t.dtype, tuple(t.shape)) for t in payload)
        if header or self.dynamic_shape:
            self._sent[(direction, stage)] = meta
            payload.insert(0, _encode_header(payload, self.device))
        else:
            self._check_static(meta, direction, stage, mb)
        for part, tensor in enumerate(payload, start=0 if header or self.dynamic_shape else 1):
            try:
                work = dist.isend(tensor, dst, tag=self._tag(direction, stage, mb, chunk, part))
            except RuntimeError as err:
                raise P2PError(f"pipeline rank {self.my_rank}: {label} failed: {err}") from err
            self._pending.append((work, tensor, label))

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

    def _wait(self, work: dist.Work, label: str) -> None:
        try:
            ok = work.wait(timeout=timedelta(seconds=self.timeout_s))
        except RuntimeError as err:
            if "closed" in str(err).lower():
                raise P2PError(f"pipeline rank {self.my_rank}: {label} failed, the peer closed its connection ({err})") from err
            raise P2PTimeoutError(self._timeout_message(label, err)) from err
        if ok is False:
            raise P2PTimeoutError(self._timeout_message(label, None))

    def _timeout_message(self, label: str, err: Exception | None) -> str:
        why = f" ({err})" if err else ""
        return (
            f"pipeline rank {self.my_rank}: {label} did not complete within {self.timeout_s:g} s{why}. "
            "A peer probably failed or runs a different schedule; raise pipeline.p2p_timeout_s if passes are just slow."
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
