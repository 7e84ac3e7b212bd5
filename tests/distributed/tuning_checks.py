"""``partition_method: "profile"`` and ``"schedule": "auto"`` on real ranks (run from worker.py).

Each check trains through ``ds_vshape.initialize`` next to the plain reference and returns
what the pytest side (test_tuning.py) asserts on: losses, parameter differences, the cut or
the schedule every rank ended up with.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch
from deepspeed.pipe import PipelineModule
from torch import nn

import ds_vshape
from tests.distributed import worker as w

HEAVY_AT = 5  # the layer that costs many times the others


class HeavyBlock(w.Block):
    """A block whose forward repeats its linear many times: same kind of math, far more time."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x
        for _ in range(150):
            h = torch.tanh(self.fc(h))
        return self.norm(h) + x


def _heavy_model(case: dict[str, Any]) -> tuple[PipelineModule, nn.Module]:
    blocks = w._layers(case.get("layers", 8), seed=5)
    torch.manual_seed(9)
    blocks[HEAVY_AT] = HeavyBlock()
    ref = nn.Sequential(*[copy.deepcopy(b) for b in blocks])
    return PipelineModule(blocks, num_stages=case["p"], loss_fn=w._mse, partition_method="uniform"), ref


def _config(case: dict[str, Any]) -> dict[str, Any]:
    config = w._config(case, case["m"])
    config["pipeline"].update(case.get("tuning", {}))
    return config


def profile(case: dict[str, Any]) -> dict[str, Any]:
    """Cut by measured costs, then two steps against the reference. ``training_data``: take the
    sample from a dataset passed to initialize instead of pipeline.profile_sample."""
    m, steps, clip = case["m"], 2, case.get("clip", 0.05)
    if case.get("heavy"):
        model, ref = _heavy_model(case)
        loss_fn = w._mse
    else:
        model, ref, loss_fn = w._build(case, case["p"])
    data = w._data(case, steps, m)
    dataset = None
    if case.get("training_data"):
        xs, ys = torch.cat([x for x, _ in data]), torch.cat([y for _, y in data])
        dataset = torch.utils.data.TensorDataset(xs, ys)
    engine, *_ = ds_vshape.initialize(model=model, config=_config(case), training_data=dataset)
    it = iter(data)
    losses = [engine.train_batch(it).item() for _ in range(steps)]
    ref_losses = w._reference(ref, lambda mod, x, y: loss_fn(mod(x), y), data, m, steps, clip)
    profile = engine.module.vs_profile
    return {"losses": losses, "ref_losses": ref_losses, "param_diff": w._param_diff(engine, ref, case),
            "parts": [int(b) for b in engine.module.stage_parts], "method": engine.module._vs_partition_method,
            "placement": list(engine.module.placement), "inflight": list(profile.inflight),
            "schedule": engine.schedule.to_json(),
            "costs": [[c.time, c.activation_bytes, c.param_bytes] for c in profile.costs]}


def refused(case: dict[str, Any]) -> dict[str, Any]:
    """initialize must fail with an error on every rank (no rank left waiting); returns it."""
    model, _ref, _loss = w._build(case, case["p"])
    try:
        ds_vshape.initialize(model=model, config=_config(case))
    except Exception as err:  # the test reads the message
        return {"refused": f"{type(err).__name__}: {err}"}
    return {"refused": None}


def auto(case: dict[str, Any]) -> dict[str, Any]:
    """Warm-up steps under the safe schedule, then the chosen one; every step against the reference."""
    m, steps, clip = case["m"], case.get("steps", 4), case.get("clip", 0.05)
    model, ref, loss_fn = w._build(case, case["p"])
    engine, *_ = ds_vshape.initialize(model=model, config=_config(case))
    data = w._data(case, steps, m)
    it = iter(data)
    losses, names, picked = [], [], []
    for _ in range(steps):
        names.append(engine.schedule.name)  # the schedule this step runs
        picked.append(engine.schedule.params.get("picked"))  # a V schedule's order for given costs, if not its block
        losses.append(engine.train_batch(it).item())
    ref_losses = w._reference(ref, lambda mod, x, y: loss_fn(mod(x), y), data, m, steps, clip)
    if case.get("tuning", {}).get("post_validation"):
        engine.settle()  # the last step's check, before the weights are read
    choice = engine.auto_choice
    return {"losses": losses, "ref_losses": ref_losses, "param_diff": w._param_diff(engine, ref, case), "names": names,
            "choice": choice.name, "predicted_s": choice.predicted_s, "step_s": engine.auto_step_s,
            "table": [[c.name, c.makespan, c.peak_bytes, c.fits] for c in choice.table], "picked": picked,
            "costs": dataclasses.asdict(choice.costs), "ran": engine.schedule.to_json(),
            "parts": [int(b) for b in engine.module.stage_parts], "method": engine.module._vs_partition_method}


CHECKS = {"profile": profile, "refused": refused, "auto": auto}


def run_tuning_case(case: dict[str, Any]) -> dict[str, Any]:
    return CHECKS[case["tuning_check"]](case)
