"""Host buffers for offloaded storages, reused across units and steps."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["HostPool"]


class HostPool:
    """Host buffers by size, reused across units and steps; pinned when the device is CUDA.

    A buffer given back while a copy from it may still run carries that copy's event and is
    reused only once the event completed.
    """

    def __init__(self, *, pin: bool) -> None:
        self._pin = pin
        self._free: dict[int, list[tuple[torch.Tensor, Any]]] = {}
        self.allocated_bytes = 0

    def take(self, nbytes: int) -> torch.Tensor:
        free = self._free.get(nbytes, [])
        for i, (buf, event) in enumerate(free):
            if event is None or event.query():
                del free[i]
                return buf
        self.allocated_bytes += nbytes
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self._pin)

    def give(self, buf: torch.Tensor, *, event: Any = None) -> None:
        self._free.setdefault(buf.numel(), []).append((buf, event))

    def clear(self) -> None:
        self._free.clear()
        self.allocated_bytes = 0
