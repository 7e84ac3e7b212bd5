"""fp16 cases for worker.py: dynamic loss scaling, forced overflows, one run per system.

Every system (stock DeepSpeed when ``schedule`` is None, ours otherwise) trains the same
model on the same fp16 data, in which chosen micro-batches are poisoned: a large finite
value overflows the scaled gradients only while the loss scale is high, ``inf`` always
overflows. Each rank records per step the loss, DeepSpeed's overflow flag, skipped steps
and the loss scale, and finally its fp16 parameters by global layer name; test_fp16.py
compares the systems.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

import ds_vshape
from ds_vshape.runtime.step_end import precision

from .worker import _build, _config, _data

__all__ = ["run_fp16_case"]


def _fp16_config(case: dict[str, Any], m: int) -> dict[str, Any]:
    config = _config(case, m)
    # Off: stock clips inside the optimizer, ours would too; the comparison is about scaling.
    config["gradient_clipping"] = case.get("clip", 0.0)
    config["fp16"] = {"enabled": True, **case["fp16"]}
    if "torch_autocast" in case:
        config["torch_autocast"] = case["torch_autocast"]
    return config


def _poisoned(case: dict[str, Any], steps: int, m: int, dp_rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The worker's data in fp16, with ``case["poison"]`` = [[step, micro_batch, value], ...] applied."""
    data = [(x.half(), y.half()) for x, y in _data(case, steps, m)]
    for step, micro_batch, value in case.get("poison", []):
        if case.get("poison_dp_rank") not in (None, dp_rank):
            continue  # only one data-parallel replica sees the bad micro-batch
        x = data[step * m + micro_batch][0].clone()
        x[0, 0] = float(value)
        data[step * m + micro_batch] = (x, data[step * m + micro_batch][1])
    return data


def _step_record(engine: Any, loss: float) -> dict[str, Any]:
    store = getattr(engine, "_store", None)
    return {
        "loss": loss,
        "overflow": bool(getattr(engine.optimizer, "overflow", False)),
        "skipped": int(engine.skipped_steps),
        "scale": float(engine._get_optimizer_loss_scale()),
        "parked": len(store.pending()) if store is not None else 0,
    }


def _agreement_checks(engine: Any) -> dict[str, str]:
    """Provoke both refusals: ranks that disagree on overflow, an overflow group without the pipeline."""
    out: dict[str, str] = {}
    engine.optimizer.overflow = dist.get_rank() == 0  # as if only rank 0 had found an inf
    try:
        precision.agree_on_overflow(engine)
        out["disagree"] = "accepted"
    except precision.OverflowDisagreement as err:
        out["disagree"] = str(err)
    engine.optimizer.overflow = False
    group, engine.optimizer.model_parallel_group = engine.optimizer.model_parallel_group, None
    try:
        precision.check_overflow_group(engine)  # ZeRO would now reduce over data parallel only
        out["group"] = "accepted"
    except precision.OverflowDisagreement as err:
        out["group"] = str(err)
    finally:
        engine.optimizer.model_parallel_group = group
    return out


def run_fp16_case(case: dict[str, Any]) -> dict[str, Any]:
    p, m, steps = case["p"], case["m"], case.get("steps", 8)
    model, _, _ = _build(case, p)
    engine, *_ = ds_vshape.initialize(model=model, config=_fp16_config(case, m),
                                      model_parameters=[q for q in model.parameters()])
    if case.get("agreement"):
        return _agreement_checks(engine)
    data = _poisoned(case, steps, m, engine.grid.get_data_parallel_rank())
    it = iter(data)
    records = []
    for _ in range(steps):
        loss = engine.train_batch(it)
        if hasattr(engine, "settle") and not case.get("late_records"):
            engine.settle()  # post-validation: the step's flags and scale are final only once checked
        records.append(_step_record(engine, loss.item()))
    if hasattr(engine, "settle"):
        engine.settle()
    params = {name: q.detach().float().flatten().tolist() for name, q in engine.module.named_parameters()}
    return {
        "steps": records,
        "params": params,
        "param_dtype": str(next(engine.module.parameters()).dtype),
        "optimizer": type(engine.optimizer).__name__,
        "dp_rank": engine.grid.get_data_parallel_rank(),
        "redone": getattr(engine, "redone_steps", 0),
        "rerun": getattr(engine, "rerun_steps", 0),
        "final": _step_record(engine, float("nan")),
    }
