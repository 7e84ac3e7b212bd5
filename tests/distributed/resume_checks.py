"""Exact resume (issue 30, point 3): a job restarted from its last checkpoint equals the uninterrupted one.

One case, run from checkpoint_checks.py in test_checkpoints.py's 2-rank launch: ``schedule:
"auto"`` (V placement, one measuring step), post-validation speculating after one step, the
``w_memory`` fit (0.5), fp16 with dynamic loss scaling (an overflow forced in step 1, so the scale
moves; step 2 then stands, so the speculation streak is under way at the save), clipping at a
norm the steps stay under, AdamW with WarmupLR, and each step draws from torch's and Python's
RNGs as dropout or augmentation would. The uninterrupted job trains 4 steps and saves after
steps 2 and 4. The restarted job (a new engine, its RNG reseeded as a new process's would be)
loads the step-2 tag, trains steps 3 and 4 on the micro-batches that follow, and saves. The
case records the losses of both, every tensor of the two step-4 tags that differs (fp32 master
weights, optimizer and scheduler state, loss scaler, bit for bit), and the runtime state each
engine holds after its load and at the end: auto's choice, the speculation streak, the fit,
the loss scale, the RNG.
"""

from __future__ import annotations

import hashlib
import os
import random
from typing import Any

import torch
from deepspeed.pipe import PipelineModule

import ds_vshape

from .worker import _config, _data, _layers, _mse

__all__ = ["run_resume_case"]

STEPS, SAVED_AT = 4, 2
POISON = (0, 1)  # (step index, micro-batch): an fp16 overflow, so the loss scale moves before the save


def _engine(case: dict[str, Any]) -> Any:
    module = PipelineModule(_layers(8, seed=5), num_stages=case["p"], loss_fn=_mse, partition_method="uniform")
    config = _config(dict(case, schedule="auto"), case["m"])
    config["pipeline"].update(auto_warmup_steps=1, post_validation=True, speculate_after=1, w_memory=0.5)
    warmup = {"warmup_min_lr": 0.001, "warmup_max_lr": 0.01, "warmup_num_steps": 6}
    config.update(gradient_clipping=100.0,
                  fp16={"enabled": True, "initial_scale_power": 12, "loss_scale_window": 2, "hysteresis": 1},
                  optimizer={"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.1, "torch_adam": True}},
                  scheduler={"type": "WarmupLR", "params": warmup})
    engine, *_ = ds_vshape.initialize(model=module, config=config, model_parameters=list(module.parameters()))
    return engine


def _batches(case: dict[str, Any], m: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    data = [(x.half(), y.half()) for x, y in _data(case, STEPS, m)]
    step, mb = POISON
    x = data[step * m + mb][0].clone()
    x[0, 0] = 60000.0  # finite in fp16, its square is not
    data[step * m + mb] = (x, data[step * m + mb][1])
    return data


def _consume_rng() -> None:
    """What dropout or data augmentation would draw each step: the RNG state moves on."""
    torch.rand(5)
    random.random()


def _runtime(engine: Any) -> dict[str, Any]:
    choice = getattr(engine, "auto_choice", None)
    validator = getattr(engine, "_validator", None)
    return {"auto": None if choice is None else choice.name, "schedule": engine.schedule.name,
            "streak": None if validator is None else validator._streak, "fit": sorted(engine._fit.fitted),
            # the schedule whose limit on the work moved into B the last fit used: the one running, in both jobs
            "fit_on_schedule": getattr(engine, "_fit_limit_of", (None,))[0] == engine.schedule,
            "scale": float(engine._get_optimizer_loss_scale()),
            "rng": hashlib.sha1(torch.get_rng_state().numpy().tobytes()).hexdigest(), "python_rng": hash(random.getstate())}


def _tensors(obj: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    if torch.is_tensor(obj):
        return {prefix: obj}
    if isinstance(obj, dict):
        return {k: v for key, value in obj.items() for k, v in _tensors(value, f"{prefix}/{key}").items()}
    if isinstance(obj, (list, tuple)):
        return {k: v for i, value in enumerate(obj) for k, v in _tensors(value, f"{prefix}/{i}").items()}
    return {}


def _scalars(obj: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(obj, dict):
        return {k: v for key, value in obj.items() for k, v in _scalars(value, f"{prefix}/{key}").items()}
    if isinstance(obj, (int, float, bool)) and not isinstance(obj, type):
        return {prefix: obj}
    return {}


def _differ(a_dir: str, b_dir: str) -> tuple[list[str], int]:
    """Every tensor and number of the .pt files of two tags that is not identical (bit for bit); how many compared."""
    differ, compared = [], 0
    for name in sorted(f for f in os.listdir(a_dir) if f.endswith(".pt")):
        a = torch.load(os.path.join(a_dir, name), map_location="cpu", weights_only=False)
        path_b = os.path.join(b_dir, name)
        if not os.path.exists(path_b):
            differ.append(f"{name} (missing)")
            continue
        b = torch.load(path_b, map_location="cpu", weights_only=False)
        ta, tb = _tensors(a), _tensors(b)
        for key in sorted(set(ta) | set(tb)):
            compared += 1
            if key not in ta or key not in tb or ta[key].dtype != tb[key].dtype or not torch.equal(ta[key], tb[key]):
                differ.append(f"{name}:{key}")
        sa, sb = _scalars(a), _scalars(b)
        for key in sorted(set(sa) | set(sb)):
            compared += 1
            if sa.get(key) != sb.get(key):
                differ.append(f"{name}:{key}={sa.get(key)!r} vs {sb.get(key)!r}")
    return differ, compared


def run_resume_case(case: dict[str, Any]) -> dict[str, Any]:
    m, root = case["m"], case["dir"]
    data = _batches(case, m)
    torch.manual_seed(1)
    random.seed(1)
    first = _engine(case)
    it = iter(data)
    losses_a = []
    for step in range(1, STEPS + 1):
        losses_a.append(first.train_batch(it).item())
        _consume_rng()
        if step == SAVED_AT:
            first.save_checkpoint(root, tag=f"a{step}")
            at_save = _runtime(first)
    first.save_checkpoint(root, tag=f"a{STEPS}")
    end_a = _runtime(first)
    torch.manual_seed(2)  # a new process: another RNG state until the checkpoint restores it
    random.seed(2)
    second = _engine(case)
    second.load_checkpoint(root, tag=f"a{SAVED_AT}")
    after_load = _runtime(second)
    it = iter(data[SAVED_AT * m :])
    losses_b = []
    for _ in range(SAVED_AT, STEPS):
        losses_b.append(second.train_batch(it).item())
        _consume_rng()
    second.save_checkpoint(root, tag=f"b{STEPS}")
    differ, compared = _differ(os.path.join(root, f"a{STEPS}"), os.path.join(root, f"b{STEPS}"))
    return {"losses": [losses_a[SAVED_AT:], losses_b], "at_save": at_save, "after_load": after_load,
            "end": [end_a, _runtime(second)], "differ": differ, "compared": compared,
            "skipped": [first.skipped_steps, second.skipped_steps], "global_steps": [first.global_steps, second.global_steps]}
