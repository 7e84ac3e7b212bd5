"""The NCCL emulation's synchronize rule leaves a synchronize from a finalizer alone.

DeepSpeed's engine finalizer destroys its ZeRO optimizer, which synchronizes the device. A test
launch builds many engines in one process, and the collector finalizes an old one on whatever
thread allocates: a communicator's thread as it starts, while the host holds the emulation's
issue lock waiting for that start. Waiting there for the rank's entries deadlocked a launch
(its rank 0 never finished). One process, a gloo world of one: no launch.
"""

from __future__ import annotations

import threading

from deepspeed.accelerator import get_accelerator

from tests.distributed import nccl_emulation
from tests.distributed.nccl_emulation import emulator


class _Owner:
    """Stands for an engine whose finalizer synchronizes (DeepSpeed's optimizer ``destroy``)."""

    def __init__(self, done: threading.Event) -> None:
        self.done = done

    def __del__(self) -> None:
        get_accelerator().synchronize()
        self.done.set()


def test_a_synchronize_from_a_finalizer_returns_while_another_thread_holds_the_issue_lock(gloo_world_of_one: None) -> None:
    nccl_emulation.install(mode="eager", synchronize=True, timeout_s=5.0)
    try:
        assert emulator._EMU is not None
        held, release, done = threading.Event(), threading.Event(), threading.Event()

        def hold() -> None:  # the host inside _enqueue, starting a communicator's thread
            with emulator._EMU._issue_lock:
                held.set()
                release.wait(10.0)

        holder = threading.Thread(target=hold, daemon=True)
        holder.start()
        assert held.wait(10.0)
        finalizing = threading.Thread(target=lambda: _Owner(done), daemon=True)  # finalized at once, on that thread
        finalizing.start()
        finalizing.join(3.0)
        finalized = done.is_set()
        release.set()
        holder.join(10.0)
        assert finalized, "a synchronize from a finalizer waited on the emulation's issue lock"
        assert nccl_emulation.synchronizes() == 0  # not counted as a step's synchronize
    finally:
        nccl_emulation.uninstall()
