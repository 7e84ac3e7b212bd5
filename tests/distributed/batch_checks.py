"""Batch keys, batch ramp-up and evaluation, as a DeepSpeed job uses them (run from worker.py).

Each check trains the worker's small model through ``ds_vshape.initialize`` and compares it
with the plain reference; the pytest side (test_batch.py) asserts on what is returned.
"""

from __future__ import annotations

from typing import Any

import deepspeed
import torch

import ds_vshape
from tests.distributed import worker as w


def _config(case: dict[str, Any]) -> dict[str, Any]:
    config = w._config(case, case["m"])
    if "batch" in case:  # exactly the batch keys the case gives, DeepSpeed resolves the rest
        for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
            config.pop(key, None)
        config.update(case["batch"])
    return config


def batch_keys(case: dict[str, Any]) -> dict[str, Any]:
    """Train two steps with only some batch keys set; ``m`` is what DeepSpeed should resolve."""
    m, steps, clip = case["m"], 2, case.get("clip", 0.05)
    model, ref, loss_fn = w._build(case, case["p"])
    engine, *_ = ds_vshape.initialize(model=model, config=_config(case))
    data = w._data(case, steps, m)
    it = iter(data)
    losses = [engine.train_batch(it).item() for _ in range(steps)]
    ref_losses = w._reference(ref, lambda mod, x, y: loss_fn(mod(x), y), data, m, steps, clip)
    return {"losses": losses, "ref_losses": ref_losses, "param_diff": w._param_diff(engine, ref, case),
            "micro_batches": engine.micro_batches, "schedule_m": engine.schedule.micro_batches}


def ramp(case: dict[str, Any]) -> dict[str, Any]:
    """One step at m, then set_train_batch_size to m2 micro-batches, one more step; and a
    size the schedule cannot take, which must be refused and leave m2 in place."""
    m, m2, clip = case["m"], case["m2"], case.get("clip", 0.05)
    model, ref, loss_fn = w._build(case, case["p"])
    engine, *_ = ds_vshape.initialize(model=model, config=_config(case))
    data = w._data(case, 1, m) + w._data(dict(case, data_seed=1), 1, m2)
    it = iter(data)
    losses = [engine.train_batch(it).item()]
    engine.set_train_batch_size(w.ROWS * m2)
    losses.append(engine.train_batch(it).item())
    loss_of = lambda mod, x, y: loss_fn(mod(x), y)  # noqa: E731
    ref_losses = w._reference(ref, loss_of, data[:m], m, 1, clip) + w._reference(ref, loss_of, data[m:], m2, 1, clip)
    refused = None
    try:
        engine.set_train_batch_size(w.ROWS * case["too_few"])
    except ValueError as err:
        refused = str(err)
    return {"losses": losses, "ref_losses": ref_losses, "param_diff": w._param_diff(engine, ref, case), "refused": refused,
            "schedule_m": engine.schedule.micro_batches, "micro_batches": engine.micro_batches}


def eval_any_m(case: dict[str, Any]) -> dict[str, Any]:
    """eval_batch with several numbers of micro-batches, optionally with DeepSpeed's activation
    checkpointing configured with partitioned activations; equals the reference's mean loss."""
    if case.get("partition_activations"):
        deepspeed.checkpointing.configure(None, partition_activations=True)
    model, ref, loss_fn = w._build(case, case["p"])
    engine, *_ = ds_vshape.initialize(model=model, config=_config(case))
    out: dict[str, Any] = {"eval": [], "ref_eval": []}
    data = w._data(case, 1, max(case["eval_m"]))
    ref.eval()
    for n in case["eval_m"]:
        out["eval"].append(engine.eval_batch(iter(data[:n]), num_micro_batches=n).item())
        with torch.no_grad():
            out["ref_eval"].append(sum(loss_fn(ref(x), y).item() for x, y in data[:n]) / n)
    return out


def _groups() -> int:
    return len(torch.distributed.distributed_c10d._world.pg_map)


def process_groups(case: dict[str, Any]) -> dict[str, Any]:
    """Process groups made by building a stock module and initialising it, through DeepSpeed
    and through ds_vshape (which re-cuts it for the schedule); and the stock layers left."""
    counts = {}
    for system in ("deepspeed", "ds_vshape"):  # the same stock module, then initialize
        before_module = _groups()
        model, _ref, _loss = w._build(case, case["p"])
        counts["stock_module"] = _groups() - before_module  # a grid's worth of groups
        config = _config(dict(case, schedule=case["schedule"] if system == "ds_vshape" else None))
        before = _groups()
        engine, *_ = ds_vshape.initialize(model=model, config=config)
        counts[system] = _groups() - before
    owned = {id(m) for m in engine.module.modules()}
    left = [n for n, m in model._modules.items() if n.isdigit() and id(m) not in owned]
    return {"groups": counts, "stock_layers_left": left, "same_grid": engine.grid is model._grid}


CHECKS = {"batch_keys": batch_keys, "ramp": ramp, "eval_any_m": eval_any_m, "groups": process_groups}


def run_batch_case(case: dict[str, Any]) -> dict[str, Any]:
    return CHECKS[case["batch_check"]](case)
