"""What split backward keeps from B to W, offloaded: to host after B, back ahead of W.

For the units the plan names (``OffloadPlan.w_reload_at``: with any offload share, every unit
whose W runs at least two passes after its B), the storages of the tensors the weight-gradient store keeps
for W (``WeightGradStore.held``: the weight GEMMs' inputs, the output gradients, re-run graphs'
saved tensors) are copied to a host buffer after B and the device memory is let go by resizing
the storage to zero bytes. The storage object itself stays, so every tensor and autograd node
W reads keeps pointing at it; the reload resizes it back and copies the bytes in: the values
come back bit for bit, so the weight gradients are exact.

A storage that anything besides W may still read must stay: resizing it would pull the bytes
out from under that reader. Left on the device are the storages the caller names ``live`` (the
unit's stage inputs and outputs, the input gradients B sends on, the K/V later chunks read),
parameters, tensors under ``min_bytes``, tensor subclasses, other devices, and storages that
cannot be resized (memory torch does not own, such as numpy's).
"""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ...schedules.ir import Unit

__all__ = ["KeptForW", "storage_key"]


def storage_key(t: torch.Tensor) -> int:
    """The identity of ``t``'s storage, stable while it moves (its address changes on reload)."""
    return t.untyped_storage()._cdata


@dataclass(eq=False)
class _Kept:
    """One storage W keeps: resized to nothing while its bytes are on the host."""

    storage: torch.UntypedStorage
    nbytes: int
    host: torch.Tensor | None = None
    d2h: Any = None  # CUDA events; None on the CPU
    h2d: Any = None


class KeptForW:
    """The W-kept storages of one rank's units while they are on the host (or coming back).

    ``pool`` hands out and takes back host buffers (``take(nbytes)``, ``give(buf, event=)``);
    ``host_bytes`` is what is on the host now.
    """

    def __init__(self, pool: Any, *, device: torch.device, min_bytes: int, param_ptrs: set[int]) -> None:
        self._pool, self._device, self._min_bytes, self._param_ptrs = pool, device, min_bytes, param_ptrs
        self._units: dict[Unit, list[_Kept]] = {}
        self.host_bytes = 0

    def pending(self) -> list[Unit]:
        return list(self._units)

    def clear(self) -> None:
        """After a failed step: the store drops the work, and with it these storages."""
        for kept in (k for ks in self._units.values() for k in ks):
            if kept.host is not None:
                self._pool.give(kept.host, event=kept.d2h)
        self._units.clear()
        self.host_bytes = 0

    def choose(self, held: Iterable[torch.Tensor], live: set[int]) -> list[torch.UntypedStorage]:
        """The storages among ``held`` to offload: each once, none that lives on elsewhere (module doc)."""
        seen = set(live)
        out = []
        for t in held:
            if type(t) is not torch.Tensor or isinstance(t, nn.Parameter) or hasattr(t, "ds_id"):
                continue
            if t.device != self._device or t.layout is not torch.strided or t.is_quantized:
                continue
            storage = t.untyped_storage()
            key = storage._cdata
            if key in seen or storage.data_ptr() in self._param_ptrs:
                continue
            seen.add(key)
            if storage.nbytes() >= self._min_bytes and storage.resizable():
                out.append(storage)
        return out

    def offload(self, unit: Unit, storages: list[torch.UntypedStorage], *, stream: Any, compute: Any) -> int:
        """Copy ``storages`` to host buffers and free their device bytes; returns the bytes moved."""
        if not storages:
            return 0
        if stream is not None:
            stream.wait_stream(compute)  # B's results, before they are copied
        moved = []
        with torch.cuda.stream(stream) if stream is not None else nullcontext():
            for storage in storages:
                kept = _Kept(storage, storage.nbytes(), self._pool.take(storage.nbytes()))
                source = _bytes(storage, self._device)
                kept.host.copy_(source, non_blocking=stream is not None)
                if stream is not None:
                    source.record_stream(stream)  # the freed block is reused only after the copy
                    kept.d2h = torch.cuda.Event()
                    kept.d2h.record(stream)
                del source
                storage.resize_(0)
                moved.append(kept)
        self._units[unit] = moved
        nbytes = sum(k.nbytes for k in moved)
        self.host_bytes += nbytes
        return nbytes

    def reload(self, unit: Unit, *, stream: Any, compute: Any) -> int:
        """Start bringing ``unit``'s storages back (nothing when none is on the host); returns the bytes."""
        nbytes = 0
        # Allocated on the copy stream, so that the reload waits for no compute work.
        with torch.cuda.stream(stream) if stream is not None else nullcontext():
            for kept in self._units.get(unit, ()):
                if kept.host is None:
                    continue
                kept.storage.resize_(kept.nbytes)
                if kept.d2h is not None:
                    stream.wait_event(kept.d2h)
                target = _bytes(kept.storage, self._device)
                target.copy_(kept.host, non_blocking=stream is not None)
                if stream is not None:
                    kept.h2d = torch.cuda.Event()
                    kept.h2d.record(stream)
                    target.record_stream(compute)  # freed after W: not reused before W ran
                self._pool.give(kept.host, event=kept.h2d)
                kept.host = None
                nbytes += kept.nbytes
        self.host_bytes -= nbytes
        return nbytes

    def ready(self, unit: Unit, *, compute: Any, rank: int) -> None:
        """W of ``unit`` runs next: its storages are back (the compute stream waits for their copies)."""
        for kept in self._units.pop(unit, ()):
            if kept.host is not None or kept.storage.nbytes() != kept.nbytes:
                raise RuntimeError(f"pipeline rank {rank}: the W of unit {unit} would run with a tensor it keeps still in "
                                   "host memory (offload did not bring it back); set pipeline.offload to 0 and report this")
            if kept.h2d is not None:
                compute.wait_event(kept.h2d)


def _bytes(storage: torch.UntypedStorage, device: torch.device) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage)
