"""Measured activation memory: bytes that autograd keeps for backward, per rank.

Saved-tensor hooks see every tensor an op keeps for its backward. We count each storage
once (several ops often save the same input), skip parameters (they are not activations),
and take the bytes off again when autograd releases the saved tensor. Weight-gradient work
parked by split backward, and the keys/values a stage keeps for a micro-batch's later
sequence chunks where autograd does not hold them, are added by the engine (``set_extra``),
since they are activation memory too. Transfer buffers still in flight (``source="p2p"``) are counted beside it:
``peak_bytes`` is the activations the schedule plans for, ``peak_total_bytes`` adds the
transfer buffers held at the same moment.
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
        self._extra: dict[str, int] = {}  # "parked" weight-gradient inputs, "kv" chunk K/V, "p2p" transfer buffers
        self.peak_bytes = 0
        self.peak_total_bytes = 0

    @property
    def extra_bytes(self) -> int:
        """Activation bytes held outside autograd's saved tensors (parked for W, K/V kept for later chunks)."""
        return self._extra.get("parked", 0) + self._extra.get("kv", 0)

    def reset_peak(self) -> None:
        self.peak_bytes = self.live_bytes + self.extra_bytes
        self.peak_total_bytes = self.live_bytes + sum(self._extra.values())

    def set_extra(self, nbytes: int, *, source: str = "parked") -> None:
        """Bytes held outside autograd's saved tensors, per ``source`` (each call replaces its figure)."""
        self._extra[source] = nbytes
        self._update_peak()

    def untracked_bytes(self, tensors: list[torch.Tensor]) -> int:
        """Bytes of the storages among ``tensors`` not already counted as saved (nor parameters)."""
        seen: set[int] = set()
        total = 0
        for t in tensors:
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr not in seen and ptr not in self._refs and ptr not in self._param_ptrs:
                seen.add(ptr)
                total += storage.nbytes()
        return total

    def _update_peak(self) -> None:
        self.peak_bytes = max(self.peak_bytes, self.live_bytes + self.extra_bytes)
        self.peak_total_bytes = max(self.peak_total_bytes, self.live_bytes + sum(self._extra.values()))

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
