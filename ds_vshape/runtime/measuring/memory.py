"""Measured activation memory: bytes that autograd keeps for backward, per rank.

Saved-tensor hooks see every tensor an op keeps for its backward. We count each storage
once (several ops often save the same input), skip parameters (they are not activations),
and take the bytes off again when autograd releases the saved tensor. Weight-gradient work
parked by split backward, and the keys/values a stage keeps for a micro-batch's later
sequence chunks where autograd does not hold them, are added by the engine (``set_extra``),
since they are activation memory too. Transfer buffers still in flight (``source="p2p"``) are counted beside it:
``peak_bytes`` is the activations the schedule plans for, ``peak_total_bytes`` adds the
transfer buffers held at the same moment.

With activation offload (``runtime/offload``) the offloaded units' storages are counted by
the offloader: those on the device as ``source="offload"`` (part of ``peak_bytes``), those in
host memory through ``set_host`` (``host_bytes``, ``peak_host_bytes``), never in both.
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
        # "parked" weight-gradient inputs, "kv" chunk K/V, "offload" offloaded units' storages on the
        # device, "p2p" transfer buffers
        self._extra: dict[str, int] = {}
        self.peak_bytes = 0
        self.peak_breakdown: dict[str, int] = {}  # what made up peak_bytes when it was reached
        self.peak_total_bytes = 0
        self.host_bytes = 0
        self.peak_host_bytes = 0

    @property
    def param_ptrs(self) -> set[int]:
        """Storages of the parameters: never activations."""
        return self._param_ptrs

    @property
    def extra_bytes(self) -> int:
        """Device activation bytes held outside the meter's own count (parked for W, K/V kept for
        later chunks, offloaded units' storages while on the device)."""
        return self._extra.get("parked", 0) + self._extra.get("kv", 0) + self._extra.get("offload", 0)

    @property
    def saved_bytes(self) -> int:
        """Every saved activation byte, wherever it lives now: autograd's on the device, offloaded ones on either side."""
        return self.live_bytes + self._extra.get("offload", 0) + self.host_bytes

    def _breakdown(self) -> dict[str, int]:
        """The device activation bytes by holder: autograd's saved tensors ("saved") and each extra source."""
        return {"saved": self.live_bytes, **{k: self._extra.get(k, 0) for k in ("parked", "kv", "offload")}}

    def reset_peak(self) -> None:
        self.peak_bytes = self.live_bytes + self.extra_bytes
        self.peak_breakdown = self._breakdown()
        self.peak_total_bytes = self.live_bytes + sum(self._extra.values())
        self.peak_host_bytes = self.host_bytes

    def set_host(self, nbytes: int) -> None:
        """Activation bytes now in host memory (offloaded); their peak is ``peak_host_bytes``."""
        self.host_bytes = nbytes
        self.peak_host_bytes = max(self.peak_host_bytes, nbytes)

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
        level = self.live_bytes + self.extra_bytes
        if level > self.peak_bytes:
            self.peak_breakdown = self._breakdown()
        self.peak_bytes = max(self.peak_bytes, level)
        self.peak_total_bytes = max(self.peak_total_bytes, self.live_bytes + sum(self._extra.values()))

    def hold(self, tensor: torch.Tensor) -> object:
        """Count ``tensor``'s storage (once however many hold it) until the returned token is dropped."""
        return self._pack(tensor)

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
    def unpack(packed: object) -> torch.Tensor:
        """The tensor behind what ``hold`` (or the recording hooks) returned."""
        return packed.tensor if isinstance(packed, _Held) else packed  # type: ignore[return-value]

    @contextmanager
    def recording(self) -> Iterator[None]:
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self.unpack):
            yield
