"""One attention layer's keys (or values) of a micro-batch's sequence chunks, in one buffer per stage.

Chunk ``j`` attends to the keys of positions ``[0, e_j)``.  Concatenating the earlier chunks'
keys in front of its own would give every chunk its own copy of the prefix, and attention
saves that copy for backward: with ``k`` equal chunks about ``(k + 1) / 2`` times the keys and
values of the whole sequence, on top of the chunks' own.  Here each chunk writes its keys
into one buffer per layer and attends to a view of it, so what backward keeps is that one
buffer, as in the unchunked model, and the chunk's own keys are not kept apart from it.

The buffer takes part in no autograd graph itself: ``_Attend`` maps the gradient of the view a
chunk attended to back onto the chunk's own keys and the earlier chunks' leaves (detached views
of the buffer, whose ``.grad`` the earlier chunks' backward then delivers).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["KVBuffer"]


class KVBuffer:
    """Positions ``[0, end)`` of one layer's keys or values, written chunk by chunk."""

    def __init__(self) -> None:
        self._data: torch.Tensor | None = None

    @property
    def data(self) -> torch.Tensor | None:
        """The buffer (``[..., capacity, head_dim]``), or None before the first chunk."""
        return self._data

    def append(
        self, new: torch.Tensor, start: int, end: int, capacity: int, earlier: list[torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``new`` (positions ``[start, end)``); returns ``(view of [0, end), the chunk's leaf)``.

        ``earlier`` are the earlier chunks' leaves, covering ``[0, start)``; the view's gradient
        flows into their ``.grad`` and into ``new``.  ``capacity`` is the length to allocate when
        the buffer is first made (the whole sequence when known); a chunk beyond it moves the
        buffer to a larger one, which costs one copy of the prefix.
        """
        data = self._grow(new, start, end, capacity)
        # Through ``.data``: earlier chunks saved views of this buffer for backward, and a write
        # through the buffer itself would bump the version those views are checked against,
        # although the positions written here are ones no earlier chunk read.
        data.data[..., start:end, :].copy_(new.detach())
        leaf = data[..., start:end, :].detach().requires_grad_(new.requires_grad)
        if not new.requires_grad:
            return data[..., :end, :], leaf
        sizes = [t.shape[-2] for t in earlier] + [end - start]
        return _Attend.apply((data, end, sizes), new, *earlier), leaf

    def _grow(self, new: torch.Tensor, start: int, end: int, capacity: int) -> torch.Tensor:
        data = self._data
        if data is not None and start and (data.shape[:-2] != new.shape[:-2] or data.shape[-1] != new.shape[-1]
                                           or data.dtype != new.dtype):
            raise RuntimeError(f"keys/values {tuple(new.shape)} ({new.dtype}) of positions [{start}, {end}) do not "
                               f"continue the earlier chunks' buffer {tuple(data.shape)} ({data.dtype})")
        if data is None or start == 0 or end > data.shape[-2]:
            grown = new.new_empty((*new.shape[:-2], max(capacity, end), new.shape[-1]))
            if data is not None and start:
                grown[..., :start, :].copy_(data[..., :start, :])
            self._data = data = grown
        return data


class _Attend(torch.autograd.Function):
    """The view ``buffer[..., :end, :]``, differentiable with respect to the pieces written into it."""

    @staticmethod
    def forward(ctx: Any, where: tuple[torch.Tensor, int, list[int]], new: torch.Tensor, *earlier: torch.Tensor) -> torch.Tensor:
        # The buffer travels inside a tuple so that autograd does not see it as an input: the
        # output is then a plain output of this node, not a view autograd would track.
        data, end, sizes = where
        ctx.sizes = sizes
        return data[..., :end, :]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        pieces = grad.split(ctx.sizes, dim=-2)
        return (None, pieces[-1], *pieces[:-1])
