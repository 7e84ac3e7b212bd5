"""The synchronize rule: DeepSpeed's ``get_accelerator().synchronize()`` as a GPU runs it.

On a GPU a device-wide synchronize (``torch.cuda.synchronize``, which DeepSpeed's CUDA
accelerator calls) returns only once every stream of the device is idle: every NCCL kernel
the rank launched, posted receives waiting for their sender and sends waiting for their
receiver included (``REFERENCE.md`` section 7). The CPU accelerator's ``synchronize`` does
nothing, so on gloo such a call can never hang. ``patch`` makes it wait, on the host, for every
emulated entry the rank issued before the call (``outstanding``), and raise ``RuntimeError``
("... synchronize ... timed out ...", naming the first entry still open) after the
emulation's timeout, where a GPU would hang. ``restore`` puts the accelerator's own back.
Calls made on a communicator's thread (inside an entry) or from a finalizer (``__del__``) are
left alone.

DeepSpeed skips its synchronizes where the accelerator ``resolves_data_dependency()`` (the CPU
one does; CUDA does not). Under the rule, that answer is False where DeepSpeed's next statement
is ``get_accelerator().synchronize()`` (ZeRO-3's all-gathers, ZeRO-2's reduction epilogue with
``overlap_comm``), as on CUDA, and the accelerator's own answer everywhere else (where False
would reach for CUDA streams the CPU accelerator does not have).
"""

from __future__ import annotations

import linecache
import sys
import time
from typing import Any, Callable

import torch.distributed as dist

from .queues import EmulatedWork, in_worker

__all__ = ["calls", "patch", "restore", "synchronizes_next", "waited"]

_SYNCHRONIZE = "get_accelerator().synchronize()"


def synchronizes_next(filename: str, lineno: int) -> bool:
    """Whether the statement after ``filename:lineno`` is a device-wide synchronize."""
    return linecache.getline(filename, lineno + 1).strip() == _SYNCHRONIZE

_ORIGINAL: dict[str, Any] = {}  # "accelerator", "synchronize": what patch replaced
_WAITED = [0]  # synchronize calls that found entries outstanding (and waited for them)
_CALLS = [0]  # synchronize calls under the rule (from the host)


def _accelerator() -> Any:
    from deepspeed.accelerator import get_accelerator

    return get_accelerator()


def patch(outstanding: Callable[[], list[EmulatedWork]], timeout_s: Callable[[], float], mode: Callable[[], str]) -> None:
    """Replace the accelerator's ``synchronize`` (once; later calls only rebind the sources)."""
    acc = _accelerator()
    if "synchronize" not in _ORIGINAL:
        _ORIGINAL.update(accelerator=acc, synchronize=acc.synchronize, resolves=acc.resolves_data_dependency)
    original, resolves = _ORIGINAL["synchronize"], _ORIGINAL["resolves"]

    def synchronize(device_index: Any = None) -> Any:
        if not in_worker() and not _in_finalizer():
            _CALLS[0] += 1
            _wait_all(outstanding(), timeout_s(), mode())
        return original(device_index)

    def resolves_data_dependency() -> bool:
        caller = sys._getframe(1)
        return False if synchronizes_next(caller.f_code.co_filename, caller.f_lineno) else resolves()

    acc.synchronize = synchronize
    acc.resolves_data_dependency = resolves_data_dependency


def _in_finalizer() -> bool:
    """Whether the call comes from a ``__del__`` (DeepSpeed's engine finalizer destroys its ZeRO
    optimizer, which synchronizes). The collector runs finalizers on whatever thread allocates,
    a communicator's thread starting or the host inside the emulation's own locks, where a wait
    for the rank's entries would deadlock the emulation itself; a job has one engine and never
    finalizes it mid-step, so such a call is left to the accelerator's own synchronize."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_name == "__del__":
            return True
        frame = frame.f_back
    return False


def restore() -> None:
    if "synchronize" in _ORIGINAL:
        acc = _ORIGINAL.pop("accelerator")
        acc.synchronize = _ORIGINAL.pop("synchronize")
        acc.resolves_data_dependency = _ORIGINAL.pop("resolves")


def waited() -> int:
    return _WAITED[0]


def calls() -> int:
    return _CALLS[0]


def _wait_all(works: list[EmulatedWork], seconds: float, mode: str) -> None:
    if not works:
        return
    _WAITED[0] += 1
    deadline = time.monotonic() + seconds
    for work in works:
        if not work._done.wait(max(deadline - time.monotonic(), 0.0)):
            open_ = [w for w in works if not w.is_completed()]
            raise RuntimeError(
                f"nccl_emulation ({mode} init, synchronize): get_accelerator().synchronize() on rank {dist.get_rank()} "
                f"timed out after {seconds:g} s with {len(open_)} transfer(s) or collective(s) of this rank still open, "
                f"first: {open_[0].label} on communicator {open_[0].communicator}; on a GPU a device-wide synchronize "
                "waits for every posted receive and unmatched send of the rank, and would hang here"
            )
