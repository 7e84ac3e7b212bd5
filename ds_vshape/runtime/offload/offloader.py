"""Activation offload in the engine (PipeOffload): saved tensors to host after F, back before B.

For the units ``schedules.offload`` picks, a saved-tensor hook copies each storage autograd
saves during the unit's forward (``forward``) to a host buffer from a reused pool as it is
saved, on a copy stream on CUDA, and holds only the copy: the device memory goes as soon as
the forward itself lets go of the tensor, so a unit's activations never pile up on the device,
not even while its own forward runs. With sequence chunks, whose K/V buffers are written in
place across the chunks' forwards, the copies wait for the forward's end (``after_forward``).
Storages that live on anyway stay on the device, since copying them would free nothing: the
stage's inputs and outputs (the engine holds them; one copied when saved gets its copy
dropped when the forward ends), the keys/values a micro-batch's later sequence chunks read,
parameters, tensors under ``min_bytes``. The reload
of a unit starts as the pass before its backward starts (``before_pass``), on a second copy
stream, so it overlaps that pass; its backward waits for it (a reload the plan did not start
in time is started there). The values come back bit for bit, so gradients are exact.

Split backward: what B keeps for W (the weight GEMMs' inputs and output gradients) goes to
host after B too (``after_backward_input``, ``w_kept``) where the plan says so (every unit
whose W runs at least two passes after its B), and comes back as the pass before that W
starts; W waits for it. Elsewhere it stays on the device until W.

On the CPU the copies are real copies into the separate host pool, done at once, so the
device figures fall as they would on a GPU. Accounting: ``device_bytes`` are offloaded units'
storages resident on the device (forward not finished, or reloaded), ``host_bytes`` those in
the host pool, W-kept storages included; the engine's ``ActivationMeter`` gets both
(``set_extra(..., "offload")``, ``set_host``) and the parked figure less what of it is on the
host (``set_extra(..., "parked")``, from the ``parked`` callable: the store's parked bytes),
and reports device and host peaks apart.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ...schedules import Action, Kind, Schedule
from ...schedules.lowering import OpKind
from ...schedules.ir import Unit
from ...schedules.offload import check_share, offload_plan
from ..measuring.memory import ActivationMeter
from .host_pool import HostPool
from .w_kept import KeptForW, storage_key

__all__ = ["HostPool", "Offloader", "MIN_BYTES"]

MIN_BYTES = 4096  # smaller saved tensors are not worth a copy (about 1k fp32 elements, as the reference does)
_KIND = {OpKind.FORWARD: Kind.F, OpKind.BACKWARD_INPUT: Kind.B, OpKind.BACKWARD_WEIGHT: Kind.W, OpKind.BACKWARD: Kind.BW}


@dataclass(eq=False)
class _Slot:
    """One storage of one offloaded unit: on the device, on the host, or back on the device."""

    nbytes: int
    device: torch.UntypedStorage | None
    host: torch.Tensor | None = None
    d2h: Any = None  # CUDA events; None on the CPU
    h2d: Any = None
    handles: int = 0
    kept: bool = False  # lives on anyway: stays on the device, not the offloader's to count
    token: Any = None  # the meter's hold on a kept storage
    # (saved tensor, its version) until after_forward; weak, so that a copy made at save time frees the device memory
    pending: list[tuple[weakref.ref[torch.Tensor], int]] = field(default_factory=list)
    # The storage itself, weakly: once copied, its address may pass to another storage (torch keeps one
    # Python object per live storage, so ``alive() is storage`` tells the two apart).
    alive: weakref.ref[torch.UntypedStorage] | None = None


class _Packed:
    """What autograd holds for an offloaded saved tensor: its slot and how to view it."""

    __slots__ = ("slot", "dtype", "size", "stride", "offset", "__weakref__")

    def __init__(self, slot: _Slot, t: torch.Tensor) -> None:
        self.slot, self.dtype, self.size, self.stride, self.offset = slot, t.dtype, t.size(), t.stride(), t.storage_offset()


class Offloader:
    """One rank's offload: the plan for the current schedule, the copies, the accounting."""

    def __init__(self, meter: ActivationMeter, *, share: float, device: torch.device, rank: int,
                 min_bytes: int = MIN_BYTES, parked: Callable[[], int] = lambda: 0, offload_w: bool = True) -> None:
        self.share = check_share(share)
        self._meter, self._device, self._rank, self._min_bytes = meter, device, rank, min_bytes
        self._cuda = device.type == "cuda"
        self._pool = HostPool(pin=self._cuda)
        self._parked = parked  # the weight-gradient store's parked bytes, wherever they are
        self.offload_w = offload_w  # off: what B keeps for W stays on the device (comparisons)
        self._w = KeptForW(self._pool, device=device, min_bytes=min_bytes, param_ptrs=meter.param_ptrs)
        self._w_reload_at: dict[int, tuple[Unit, ...]] = {}
        self._w_units: frozenset[Unit] = frozenset()
        # A W-offloaded unit's stage inputs and outputs, from its forward to its B's end: the storages
        # themselves, so that their identity cannot pass to a new storage meanwhile.
        self._live_of: dict[Unit, list[torch.UntypedStorage]] = {}
        self._streams: tuple[Any, Any] | None = None  # device-to-host, host-to-device (CUDA, made on first use)
        self._plan_of: tuple[int, Any] | None = None  # (id of the schedule, its plan and pass order)
        self._units: frozenset[Unit] = frozenset()
        self._reload_at: dict[int, tuple[Unit, ...]] = {}
        self._passes: list[tuple[Kind, Unit]] = []
        self._next = 0
        self._open: dict[Unit, dict[Any, _Slot]] = {}  # by storage address; forward running or done, not yet after_forward
        self._slots: dict[Unit, list[_Slot]] = {}  # offloaded, until their backward began
        self._measure = False
        self._at_save = False  # copy each saved storage when saved, not when the forward ends
        self.device_bytes = 0
        self.host_bytes = 0
        self.offloaded_units = 0  # units that went to host, over the engine's life (tests read it)
        self.w_offloaded_units = 0  # units whose W-kept storages went to host, likewise

    @property
    def units(self) -> frozenset[Unit]:
        return self._units

    def set_share(self, share: float) -> None:
        """Offload another share from the next step on (``schedule: auto``'s choice)."""
        self.share = check_share(share)
        self._plan_of = None

    # ---- step framing -----------------------------------------------------------------------------
    def start_step(self, schedule: Schedule, ops: Sequence[Any], *, train: bool) -> None:
        """The plan for this step's schedule (made once per schedule) and its pass order."""
        self._next = 0
        self._live_of.clear()
        if not train or self.share <= 0:
            self._units, self._reload_at, self._passes = frozenset(), {}, []
            self._w_units, self._w_reload_at = frozenset(), {}
            return
        if self._cuda and self._streams is None:
            self._streams = (torch.cuda.Stream(self._device), torch.cuda.Stream(self._device))
        if self._plan_of is None or self._plan_of[0] != id(schedule):
            passes = [(_KIND[op.kind], (op.stage, op.micro_batch, op.seq_chunk)) for op in ops if op.kind in _KIND]
            actions = [Action(kind, *unit) for kind, unit in passes]
            plan = offload_plan(schedule, self._rank, self.share, passes=actions)
            self._plan_of = (id(schedule), (plan, passes, schedule))  # the schedule kept: its id stays unique
        plan, self._passes, _ = self._plan_of[1]
        # Sequence chunks write K/V buffers in place across the chunks' forwards: those copy at the end.
        self._at_save = schedule.seq_chunks == 1
        self._units, self._reload_at = plan.units, plan.reload_at
        self._w_units, self._w_reload_at = plan.w_units, plan.w_reload_at

    def pending(self) -> list[Unit]:
        """Units whose offload or reload the step left unfinished."""
        return list(self._open) + list(self._slots) + self._w.pending()

    def clear(self) -> None:
        """After a failed step: forget every unit (their tensors go with autograd's graph and the store)."""
        self._open.clear()
        self._slots.clear()
        self._w.clear()
        self._live_of.clear()
        self.count_parked()

    # ---- forward ----------------------------------------------------------------------------------
    def forward(self, unit: Unit, keep: Iterable[torch.Tensor], *, measure: bool) -> Any:
        """The context of ``unit``'s forward: offloading hooks for a planned unit, else the meter's (or none)."""
        self._measure = measure
        if unit not in self._units or not torch.is_grad_enabled():
            return self._meter.recording() if measure else nullcontext()
        return self._hooks(unit, {_ptr(t) for t in keep if torch.is_tensor(t)})

    @contextmanager
    def _hooks(self, unit: Unit, keep: set[int]) -> Iterator[None]:
        slots = self._open.setdefault(unit, {})

        def pack(t: torch.Tensor) -> Any:
            if not self._offloadable(t) or _ptr(t) in keep:
                return self._meter.hold(t) if self._measure else t
            storage = t.untyped_storage()
            slot = slots.get(storage.data_ptr())
            if slot is not None and (slot.alive() is not storage or slot.handles == 0):
                # Another storage at a freed one's address, or a slot autograd already let go of (its copy
                # and device reference are gone): a fresh slot. The old one stays the unit's, under a key
                # no storage has.
                slots[(storage.data_ptr(), id(slot))] = slot
                slot = None
            if slot is None:
                slot = slots[storage.data_ptr()] = _Slot(storage.nbytes(), storage, alive=weakref.ref(storage))
                self._count(device=slot.nbytes)
            slot.pending.append((weakref.ref(t), t._version))
            slot.handles += 1
            if self._at_save and slot.host is None:
                self._to_host([slot])  # the device memory goes as soon as the forward lets go of the tensor
            packed = _Packed(slot, t)
            weakref.finalize(packed, self._drop, slot)
            return packed

        with torch.autograd.graph.saved_tensors_hooks(pack, self._unpack):
            yield

    def _offloadable(self, t: torch.Tensor) -> bool:
        if isinstance(t, nn.Parameter) or type(t) is not torch.Tensor or t.layout is not torch.strided:
            return False
        if t.device != self._device or t.is_quantized or hasattr(t, "ds_id"):
            return False
        storage = t.untyped_storage()
        return storage.nbytes() >= self._min_bytes and storage.data_ptr() not in self._meter.param_ptrs

    def after_forward(self, unit: Unit, keep: Iterable[torch.Tensor]) -> None:
        """``unit``'s forward ended: copy its saved storages to host, except those in ``keep``."""
        keep = [t for t in keep if torch.is_tensor(t)]
        if unit in self._w_units:  # also a unit whose activations stay: its W-kept tensors may go
            self._live_of[unit] = [t.untyped_storage() for t in keep]
        slots = self._open.pop(unit, None)
        if slots is None:
            return
        kept = {_ptr(t): t for t in keep}
        for ptr, slot in slots.items():
            _check_unchanged(slot, unit, self._rank)
            # A slot autograd let go of holds nothing to keep (its bytes are counted off already).
            if slot.handles > 0 and ptr in kept and slot.alive() is kept[ptr].untyped_storage():
                self._keep(slot, kept[ptr])
        self._to_host([slot for slot in slots.values() if not slot.kept and slot.handles > 0 and slot.host is None])
        away = [slot for slot in slots.values() if not slot.kept and slot.host is not None]
        for slot in away:
            slot.pending.clear()
        if away:
            self._slots[unit] = away
            self.offloaded_units += 1

    def _keep(self, slot: _Slot, tensor: torch.Tensor) -> None:
        """``slot``'s storage lives on anyway (a stage input or output, K/V): it stays on the device."""
        slot.kept = True
        if slot.host is not None:  # copied when saved: the copy goes, the live storage serves the backward
            self._pool.give(slot.host, event=slot.d2h)
            slot.host, slot.device = None, tensor.untyped_storage()
            self._count(device=slot.nbytes, host=-slot.nbytes)
        if self._measure:
            slot.token = self._meter.hold(tensor)  # counted once with the other holders of it
        slot.pending.clear()
        self._count(device=-slot.nbytes)

    def _to_host(self, slots: list[_Slot]) -> None:
        if not slots:
            return
        stream = self._streams[0] if self._streams else None
        if stream is not None:
            stream.wait_stream(self._current())  # the forward's results, before they are copied
        with torch.cuda.stream(stream) if stream is not None else nullcontext():
            for slot in slots:
                slot.host = self._pool.take(slot.nbytes)
                source = _bytes(slot.device, self._device)
                slot.host.copy_(source, non_blocking=stream is not None)
                if stream is not None:
                    source.record_stream(stream)  # the allocator reuses the block only after the copy
                    slot.d2h = torch.cuda.Event()
                    slot.d2h.record(stream)
                slot.device = None
                self._count(device=-slot.nbytes, host=slot.nbytes)

    # ---- backward ---------------------------------------------------------------------------------
    def before_pass(self, kind: Kind, unit: Unit) -> None:
        """A compute pass starts: start the reloads planned here; a backward's own unit comes back first."""
        if not self._passes:
            return
        if self._next >= len(self._passes) or self._passes[self._next] != (kind, unit):
            expected = self._passes[self._next] if self._next < len(self._passes) else "none"
            raise RuntimeError(f"pipeline rank {self._rank}: offload expected pass {expected}, the engine ran {kind}{unit}; "
                               "the offload plan was made for another schedule")
        for planned in self._reload_at.get(self._next, ()):
            self._reload(planned)
        for planned in self._w_reload_at.get(self._next, ()):
            self._w.reload(planned, **self._copy_streams(1))
        self._next += 1
        if kind is Kind.W:
            self._w.reload(unit, **self._copy_streams(1))  # late: outside the plan
            self._w.ready(unit, compute=self._current() if self._cuda else None, rank=self._rank)
        elif kind.is_backward:
            self._reload(unit)
            self._slots.pop(unit, None)  # its tensors now live and die with autograd's graph
        if self._w_units:
            self.count_parked()

    def after_backward_input(self, unit: Unit, held: Iterable[torch.Tensor], *, live: Iterable[torch.Tensor]) -> None:
        """``unit``'s B ended: what it keeps for W (``held``) goes to host when the plan says so.

        ``live``: tensors that something besides W may still read (the input gradients B sends
        on, K/V of pending chunks); with the unit's stage inputs and outputs they stay.
        """
        self.count_parked()  # B's end, everything W keeps still on the device
        forward = self._live_of.pop(unit, None)
        if unit not in self._w_units or forward is None or not self.offload_w:
            return
        keep = {s._cdata for s in forward} | {storage_key(t) for t in live if torch.is_tensor(t)}
        if self._w.offload(unit, self._w.choose(held, keep), **self._copy_streams(0)):
            self.w_offloaded_units += 1
            self.count_parked()

    def _copy_streams(self, which: int) -> dict[str, Any]:
        """The copy stream ``which`` (0: to host, 1: to the device) and the compute stream; None on the CPU."""
        if self._streams is None:
            return {"stream": None, "compute": None}
        return {"stream": self._streams[which], "compute": self._current()}

    def _reload(self, unit: Unit) -> None:
        for slot in self._slots.get(unit, ()):
            self._reload_slot(slot)

    def _reload_slot(self, slot: _Slot) -> None:
        if slot.host is None or slot.device is not None:
            return
        stream = self._streams[1] if self._streams else None
        compute = self._current() if stream is not None else None
        # Allocated on the copy stream, so that it waits for no compute work: a block the compute
        # stream freed is not handed to another stream before that stream's work on it is done.
        with torch.cuda.stream(stream) if stream is not None else nullcontext():
            target = torch.empty(slot.nbytes, dtype=torch.uint8, device=self._device)
            if slot.d2h is not None:
                stream.wait_event(slot.d2h)
            target.copy_(slot.host, non_blocking=stream is not None)
            if stream is not None:
                slot.h2d = torch.cuda.Event()
                slot.h2d.record(stream)
                target.record_stream(compute)  # freed after backward: not reused before the backward ran
        slot.device = target.untyped_storage()
        self._pool.give(slot.host, event=slot.h2d)
        slot.host = None
        self._count(device=slot.nbytes, host=-slot.nbytes)

    def _unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, _Packed):
            return self._meter.unpack(packed)
        slot = packed.slot
        self._reload_slot(slot)  # planned reloads started earlier; this one is late (outside the plan)
        if slot.h2d is not None:
            self._current().wait_event(slot.h2d)
        out = torch.empty(0, dtype=packed.dtype, device=self._device)
        return out.set_(slot.device, packed.offset, packed.size, packed.stride)

    def _drop(self, slot: _Slot) -> None:
        slot.handles -= 1
        if slot.handles > 0:
            return
        slot.pending.clear()
        if slot.kept:
            slot.token = None
        elif slot.host is not None:
            self._pool.give(slot.host, event=slot.d2h)
            slot.host = None
            self._count(host=-slot.nbytes)
        elif slot.device is not None:
            slot.device = None
            self._count(device=-slot.nbytes)

    def _current(self) -> Any:
        """The stream the passes run on (CUDA only)."""
        return torch.cuda.current_stream(self._device)

    def _count(self, *, device: int = 0, host: int = 0) -> None:
        self.device_bytes += device
        self.host_bytes += host
        self._meter.set_extra(self.device_bytes, source="offload")
        self._meter.set_host(self.host_bytes + self._w.host_bytes)

    def count_parked(self) -> None:
        """The meter's parked figure: the store's parked bytes less those on the host (after B, around W)."""
        self._meter.set_extra(self._parked() - self._w.host_bytes)
        self._meter.set_host(self.host_bytes + self._w.host_bytes)


def _ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _bytes(storage: torch.UntypedStorage, device: torch.device) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage)


def _check_unchanged(slot: _Slot, unit: Unit, rank: int) -> None:
    """A saved tensor written in place after it was saved: autograd would refuse it in backward, and the
    host copy (made when saved, or when the forward ended) would not hold what autograd saved."""
    for ref, version in slot.pending:
        t = ref()
        if t is not None and t._version != version:  # one freed since cannot have been written
            raise RuntimeError(
                f"pipeline rank {rank}: unit {unit} wrote a tensor in place after autograd saved it for backward "
                f"(shape {tuple(t.shape)}); its offloaded copy would not hold the values autograd saved. "
                "Make the operation out of place, or set pipeline.offload to 0")
