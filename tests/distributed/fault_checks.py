"""One rank of a fault case: train, and on the chosen rank die by SIGKILL at the chosen point of a step.

Run by fault_driver.py in a process of its own (forked, one per rank, none the parent of
another), so no launcher stops the survivors: each must fail by itself, with the runtime's
error, within ``p2p_timeout_s``. The dying rank is made silent as under NCCL: just before its
SIGKILL it forks a holder that keeps its sockets open (a TCP close would tell gloo's survivors
at once, which NCCL's never learn), and the driver ends the holder once the survivors exited.

Kill points (``POINTS``), in step ``kill_step`` of the case, on pipeline rank ``kill_rank``:
``F`` / ``B`` / ``W``: as the rank starts the forward, backward (B, or the fused backward of
1f1b) or weight pass of micro-batch ``kill_mb``; ``send``: right after it posts the send of
that micro-batch's activations or gradients (whichever comes first), before the peer's receive
completes; ``step``: as it enters the optimizer step; ``choose``: as it starts auto's choice after
the step (``schedule: "auto"`` or ``pass_costs: "measure"``, with ``kill_step`` its warm-up steps).
"""

from __future__ import annotations

import json
import os
import signal
import time
from typing import Any, Callable

from deepspeed.runtime.pipe import schedule as ds_schedule

import ds_vshape
from ds_vshape.runtime.program import instructions as ins

from .worker import _build, _config, _data

__all__ = ["POINTS", "run_fault_rank"]

# Which instructions a kill point hooks, and whether the rank dies before (True) or after the handler.
POINTS: dict[str, tuple[tuple[type, ...], bool]] = {
    "F": ((ins.ForwardPass,), True),
    "B": ((ins.BackwardInput, ins.FusedBackward), True),
    "W": ((ins.BackwardWeight,), True),
    "send": ((ins.SendActivation, ins.SendGrad), False),
    "step": ((ds_schedule.OptimizerStep,), True),
    "choose": ((), True),  # no instruction: as auto (or pass_costs "measure") starts its choice after step kill_step
}


HOLDER_LIMIT_S = 180  # a holder outlives no case: the driver ends it, or this does (hung survivors end 30 s after the kill)


def _die_silently(out_dir: str, rank: int) -> None:
    """Fork a holder of this process's sockets, record the time, SIGKILL this process."""
    holder = os.fork()
    if holder == 0:  # the holder: keeps every inherited descriptor open, runs nothing
        signal.alarm(HOLDER_LIMIT_S)  # ends it should the driver never get to (SIGALRM's default action)
        while True:
            signal.pause()
    with open(os.path.join(out_dir, f"killed{rank}.json"), "w") as fh:
        json.dump({"at": time.time(), "holder": holder, "pid": os.getpid()}, fh)
    os.kill(os.getpid(), signal.SIGKILL)


def _arm(engine: Any, case: dict[str, Any], out_dir: str, rank: int) -> None:
    """Replace this engine's handlers of the case's kill point with ones that die at the chosen pass."""
    kinds, before = POINTS[case["point"]]
    table = dict(engine._INSTRUCTION_MAP)

    def wrap(handler: Callable[..., None]) -> Callable[..., None]:
        def run(self: Any, **kwargs: Any) -> None:
            due = self.global_steps + 1 == case["kill_step"] and kwargs.get("micro_batch", case["kill_mb"]) == case["kill_mb"]
            if due and before:
                _die_silently(out_dir, rank)
            handler(self, **kwargs)
            if due:
                _die_silently(out_dir, rank)
        return run

    for kind in kinds:
        if kind in table:
            table[kind] = wrap(table[kind])
    engine._INSTRUCTION_MAP = table  # this engine only
    if case["point"] == "choose":
        choose = engine._choose

        def die_first() -> None:
            if engine.global_steps == case["kill_step"]:
                _die_silently(out_dir, rank)
            choose()
        engine._choose = die_first


def run_fault_rank(case: dict[str, Any], out_dir: str) -> None:
    """Build the case's engine and train ``steps`` steps; the kill rank dies on the way, the others must fail."""
    p, m = case["p"], case["m"]
    model, _, _ = _build(case, p)
    engine, *_ = ds_vshape.initialize(model=model, config=_config(case, m))
    rank = int(os.environ["RANK"])
    if rank == case["kill_rank"]:
        _arm(engine, case, out_dir, rank)
    it = iter(_data(case, case["steps"], m))
    for step in range(case["steps"]):
        engine.train_batch(it)
        with open(os.path.join(out_dir, f"progress{rank}.json"), "w") as fh:
            json.dump({"steps": step + 1, "at": time.time()}, fh)
