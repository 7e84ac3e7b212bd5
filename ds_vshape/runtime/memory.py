"""Measured activation memory: bytes that autograd keeps for backward, per rank.

Saved-tensor hooks see every tensor an op keeps for its backward. We count each storage
once (several ops often save the same input), skip parameters (they are not activations),
and take the bytes off again when autograd releases the saved tensor. Weight-gradient work
parked by split backward is added by the engine, since it is activation memory too.
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager
from typing import Iterator

import torch

__all__ = ["ActivationMeter"]


class _Held:
    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


class ActivationMeter:
    """Tracks live saved-activation bytes and their peak over a step."""

    def __init__(self, param_ptrs: set[int]) -> None:
        self._param_ptrs = param_ptrs
        self._refs: dict[int, int] = {}
        self.live_bytes = 0
        self.extra_bytes = 0  # e.g. parked weight-gradient inputs
        self.peak_bytes = 0

    def reset_peak(self) -> None:
        self.peak_bytes = self.live_bytes + self.extra_bytes

    def set_extra(self, nbytes: int) -> None:
        self.extra_bytes = nbytes
        self._update_peak()

    def _update_peak(self) -> None:
        self.peak_bytes = max(self.peak_bytes, self.live_bytes + self.extra_bytes)

    def _pack(self, tensor: torch.Tensor) -> object:
        storage = tensor.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in self._param_ptrs or tensor.device.type == "meta":
            return tensor
        held = _Held(tensor)
        if self._refs.get(ptr, 0) == 0:
            self.live_bytes += storage.nbytes()
            self._update_peak()
        self._refs[ptr] = self._refs.get(ptr, 0) + 1
        weakref.finalize(held, self._release, ptr, storage.nbytes())
        return held

    def _release(self, ptr: int, nbytes: int) -> None:
        self._refs[ptr] -= 1
        if self._refs[ptr] == 0:
            del self._refs[ptr]
            self.live_bytes -= nbytes

    @staticmethod
    def _unpack(packed: object) -> torch.Tensor:
        return packed.tensor if isinstance(packed, _Held) else packed  # type: ignore[return-value]

    @contextmanager
    def recording(self) -> Iterator[None]:
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield
