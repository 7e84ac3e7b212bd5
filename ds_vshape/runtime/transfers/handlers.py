"""The engine's transfer instructions: post, send and receive of activations and gradients.

A mixin of the engine, which owns the state these handlers read and write: ``_p2p`` (the
point-to-point object of ``comm``), ``_act_in`` (a stage's input activations by unit) and
``_grad_in`` (the gradient of a stage's output by unit), and, while measuring, ``_meter``,
which counts the transfer buffers in flight beside the activations.
"""

from __future__ import annotations

from typing import Any

import torch

from .comm import ACT, GRAD, Recv

__all__ = ["TransferHandlersMixin", "stage_tensors"]


class TransferHandlersMixin:
    """``_exec_*`` handlers of the transfer instructions (the engine's instruction table names them)."""

    _p2p: Any
    _act_in: dict[Any, Any]
    _grad_in: dict[Any, Any]
    _meter: Any
    _measuring: bool

    def _exec_post(self, direction: int, stage: int, micro_batch: int, seq_chunk: int, peer: int, header: bool,
                   with_next: bool) -> None:
        self._p2p.post(Recv(direction, stage, micro_batch, seq_chunk, peer, header), with_next=with_next)
        self._count_inflight()

    def _exec_post_act(self, stage: int, micro_batch: int, seq_chunk: int, peer: int, buffer_id: Any, header: bool,
                       with_next: bool) -> None:
        self._exec_post(ACT, stage, micro_batch, seq_chunk, peer, header, with_next)

    def _exec_post_grad(self, stage: int, micro_batch: int, seq_chunk: int, peer: int, buffer_id: Any, header: bool,
                        with_next: bool) -> None:
        self._exec_post(GRAD, stage, micro_batch, seq_chunk, peer, header, with_next)

    def _exec_send_act(self, stage: int, micro_batch: int, seq_chunk: int, peer: int, buffer_id: Any, header: bool) -> None:
        tensors = stage_tensors(self._act_in.pop((stage, micro_batch, seq_chunk)))
        self._p2p.send(ACT, tensors, stage=stage, micro_batch=micro_batch, seq_chunk=seq_chunk, peer=peer, header=header)
        self._count_inflight()

    def _exec_recv_act(self, stage: int, micro_batch: int, seq_chunk: int, peer: int, buffer_id: Any, header: bool) -> None:
        got = self._p2p.recv(Recv(ACT, stage, micro_batch, seq_chunk, peer, header))
        self._act_in[(stage, micro_batch, seq_chunk)] = got[0] if len(got) == 1 else got
        self._count_inflight()

    def _exec_send_grad(self, stage: int, micro_batch: int, seq_chunk: int, peer: int, buffer_id: Any, header: bool) -> None:
        grads = self._grad_in.pop((stage, micro_batch, seq_chunk))
        self._p2p.send(GRAD, grads, stage=stage, micro_batch=micro_batch, seq_chunk=seq_chunk, peer=peer, header=header)
        self._count_inflight()

    def _exec_recv_grad(self, stage: int, micro_batch: int, seq_chunk: int, peer: int, buffer_id: Any, header: bool) -> None:
        self._grad_in[(stage, micro_batch, seq_chunk)] = self._p2p.recv(Recv(GRAD, stage, micro_batch, seq_chunk, peer, header))
        self._count_inflight()

    def _count_inflight(self) -> None:
        # Transfer buffers are counted beside the activations (peak_memory_bytes); only while
        # measuring, since it walks every buffer in flight.
        if self._measuring:
            self._meter.set_extra(self._meter.untracked_bytes(self._p2p.inflight), source="p2p")



def stage_tensors(x: Any) -> tuple[torch.Tensor, ...]:
    """A stage's activations as a tuple: one tensor, or the tuple or list of several."""
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)
