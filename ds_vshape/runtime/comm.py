"""Point-to-point transfers between pipeline ranks: non-blocking sends, receives that wait.

Sends never block the sender (isend, reaped at the end of the step), and a receive waits
only right before the pass that needs the data. With that, any schedule the validator
accepts runs to completion: the wait graph is the schedule's own dependency graph.

Every message carries a small header (count, dtype, shape of each tensor) so stages may
pass tuples of tensors of any shape; each message has its own tag, so receives match by
meaning (direction, stage, micro-batch, chunk) rather than by arrival order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

__all__ = ["P2P", "P2PTimeoutError"]

_DTYPES = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.uint8, torch.int8,
    torch.int16, torch.int32, torch.int64, torch.bool,
]
_DTYPE_ID = {d: i for i, d in enumerate(_DTYPES)}
_HEADER = 64  # int64 slots: [count, (dtype, ndim, d0..d5) * count]
_MAX_DIMS = 6
_ACT, _GRAD = 0, 1


class P2PTimeoutError(RuntimeError):
    """A transfer did not complete in time; the message names who waited for what."""


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
    _pending: list = field(default_factory=list)

    def _tag(self, direction: int, stage: int, micro_batch: int, seq_chunk: int, part: int) -> int:
        unit = (stage * self.micro_batches + micro_batch) * self.seq_chunks + seq_chunk
        return ((unit * 2 + direction) * 16) + part

    # ---- public ---------------------------------------------------------------------------
    def send_activations(self, tensors: tuple[torch.Tensor, ...], *, stage: int, micro_batch: int, seq_chunk: int, peer: int) -> None:
        self._send(_ACT, tensors, stage, micro_batch, seq_chunk, peer)

    def send_grads(self, tensors: tuple[torch.Tensor, ...], *, stage: int, micro_batch: int, seq_chunk: int, peer: int) -> None:
        self._send(_GRAD, tensors, stage, micro_batch, seq_chunk, peer)

    def recv_activations(self, *, stage: int, micro_batch: int, seq_chunk: int, peer: int) -> tuple[torch.Tensor, ...]:
        return self._recv(_ACT, stage, micro_batch, seq_chunk, peer, what="activations")

    def recv_grads(self, *, stage: int, micro_batch: int, seq_chunk: int, peer: int) -> tuple[torch.Tensor, ...]:
        return self._recv(_GRAD, stage, micro_batch, seq_chunk, peer, what="gradients")

    def drain(self) -> None:
        """Wait for every send of the step (the buffers must live until then)."""
        for work, _keep, label in self._pending:
            self._wait(work, label)
        self._pending.clear()

    # ---- internals ------------------------------------------------------------------------
    def _send(self, direction: int, tensors: tuple[torch.Tensor, ...], stage: int, mb: int, chunk: int, peer: int) -> None:
        dst = self.global_rank_of[peer]
        header = _encode_header(tensors, self.device)
        payload = [header] + [t.detach().contiguous() for t in tensors]
        kind = "activations" if direction == _ACT else "gradients"
        label = f"send of {kind} for stage {stage} micro-batch {mb} chunk {chunk} to pipeline rank {peer}"
        for part, tensor in enumerate(payload):
            work = dist.isend(tensor, dst, tag=self._tag(direction, stage, mb, chunk, part))
            self._pending.append((work, tensor, label))

    def _recv(self, direction: int, stage: int, mb: int, chunk: int, peer: int, *, what: str) -> tuple[torch.Tensor, ...]:
        src = self.global_rank_of[peer]
        label = f"receive of {what} for stage {stage} micro-batch {mb} chunk {chunk} from pipeline rank {peer}"
        header = torch.empty(_HEADER, dtype=torch.int64, device=self.device)
        self._wait(dist.irecv(header, src, tag=self._tag(direction, stage, mb, chunk, 0)), label)
        out = []
        for part, (dtype, shape) in enumerate(_decode_header(header), start=1):
            buf = torch.empty(shape, dtype=dtype, device=self.device)
            self._wait(dist.irecv(buf, src, tag=self._tag(direction, stage, mb, chunk, part)), label)
            out.append(buf)
        return tuple(out)

    def _wait(self, work: dist.Work, label: str) -> None:
        try:
            ok = work.wait(timeout=timedelta(seconds=self.timeout_s))
        except RuntimeError as err:
            raise P2PTimeoutError(self._timeout_message(label, err)) from err
        if ok is False:
            raise P2PTimeoutError(self._timeout_message(label, None))

    def _timeout_message(self, label: str, err: Exception | None) -> str:
        why = f" ({err})" if err else ""
        return (
            f"pipeline rank {self.my_rank}: {label} did not complete within {self.timeout_s:g} s{why}. "
            "A peer probably failed or runs a different schedule; raise pipeline.p2p_timeout_s if passes are just slow."
        )


def _encode_header(tensors: tuple[torch.Tensor, ...], device: torch.device) -> torch.Tensor:
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


def _decode_header(header: torch.Tensor) -> list[tuple[torch.dtype, tuple[int, ...]]]:
    values = header.tolist()
    out, pos = [], 1
    for _ in range(values[0]):
        dtype, ndim = _DTYPES[values[pos]], values[pos + 1]
        out.append((dtype, tuple(values[pos + 2 : pos + 2 + ndim])))
        pos += 2 + _MAX_DIMS
    return out
