"""Checkpoint cases for worker.py: optimizer state crosses schedules and pipeline sizes, or is refused.

``chain`` cases are one link each of a resume chain over separate launches (different world
sizes) sharing one directory: phase k loads phase k-1's checkpoint (optimizer, scheduler, step
included), trains 3 steps, saves; each compares with a plain model trained 3(k+1) steps with
torch's AdamW and the same WarmupLR. The other cases save and load within one launch and
record what the load did or the refusal it gave. test_checkpoints.py asserts on the results.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from deepspeed.pipe import PipelineModule
from deepspeed.runtime.lr_schedules import WarmupLR
from torch import nn

import ds_vshape

from .worker import _config, _data, _layers, _mse

__all__ = ["run_checkpoint_case"]

LR, WD, CLIP, STEPS = 0.01, 0.1, 1.0, 3
WARMUP = {"warmup_min_lr": 0.001, "warmup_max_lr": LR, "warmup_num_steps": 6, "warmup_type": "linear"}


def _engine(case: dict[str, Any], *, layers: int = 8) -> tuple[Any, nn.Sequential]:
    """A PipelineModule of Blocks (same weights on every rank) under the case's schedule, and its reference."""
    blocks = _layers(layers, seed=5)
    ref = nn.Sequential(*[copy.deepcopy(b) for b in blocks])
    module = PipelineModule(blocks, num_stages=case["p"], loss_fn=_mse, partition_method="uniform")
    config = _config(case, case["m"])
    config.update(gradient_clipping=case.get("clip", CLIP), zero_allow_untested_optimizer=True,
                  optimizer={"type": "AdamW", "params": {"lr": LR, "weight_decay": WD, "torch_adam": True}},
                  scheduler={"type": "WarmupLR", "params": dict(WARMUP)})
    engine, *_ = ds_vshape.initialize(model=module, config=config)
    return engine, ref


def _train_reference(ref: nn.Module, data: list, m: int, steps: int) -> tuple[list[float], torch.optim.Optimizer]:
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD)
    sched = WarmupLR(opt, **WARMUP)
    losses = []
    for step in range(steps):
        opt.zero_grad()
        total = 0.0
        for x, y in data[step * m : (step + 1) * m]:
            loss = _mse(ref(x), y)
            (loss / m).backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP)
        opt.step()
        sched.step()
        losses.append(total / m)
    return losses, opt


def _ref_param(ref: nn.Sequential, name: str) -> torch.Tensor:
    head, _, rest = name.partition(".")
    return dict(ref[int(head)].named_parameters())[rest]


def _diffs(engine: Any, ref: nn.Sequential, ref_opt: torch.optim.Optimizer) -> dict[str, Any]:
    """Largest |pipeline - reference| over this rank's parameters and their Adam state, by name."""
    worst_param = worst_state = 0.0
    steps = set()
    for name, param in engine.module.named_parameters():
        other = _ref_param(ref, name)
        worst_param = max(worst_param, (param.detach() - other.detach()).abs().max().item())
        mine, theirs = engine.optimizer.state[param], ref_opt.state[other]
        for key in ("exp_avg", "exp_avg_sq"):
            worst_state = max(worst_state, (mine[key] - theirs[key]).abs().max().item())
        steps.add((float(mine["step"]), float(theirs["step"])))
    return {"param_diff": worst_param, "state_diff": worst_state, "adam_steps": sorted(steps)}


def _run_chain(case: dict[str, Any]) -> dict[str, Any]:
    phase, m = case["phase"], case["m"]
    engine, ref = _engine(case)
    result: dict[str, Any] = {"optimizer": type(engine.optimizer).__name__, "local_layers": list(engine.module.local_layer_ids)}
    if phase > 0:
        engine.load_checkpoint(case["dir"], tag=f"phase{phase - 1}")
    result["loaded_global_steps"] = engine.global_steps
    data = _data(case, STEPS * (phase + 1), m)
    it = iter(data[STEPS * phase * m :])
    result["losses"] = [engine.train_batch(it).item() for _ in range(STEPS)]
    engine.save_checkpoint(case["dir"], tag=f"phase{phase}")
    ref_losses, ref_opt = _train_reference(ref, data, m, STEPS * (phase + 1))
    result["ref_losses"] = ref_losses[STEPS * phase :]
    result.update(_diffs(engine, ref, ref_opt))
    return result


def _refusal(fn: Any) -> str | None:
    try:
        fn()
    except Exception as err:  # the refusal is what the case records
        return f"{type(err).__name__}: {err}"
    return None


def _run_stock(case: dict[str, Any]) -> dict[str, Any]:
    """Stock DeepSpeed saves; ours loads it at the same placement (optimizer too) and at another (refused)."""
    m, root = case["m"], case["dir"]
    case = dict(case, clip=0.0)  # stock DeepSpeed clips by a per-stage norm, ds_vshape by the global one
    stock, _ = _engine(dict(case, schedule=None))
    data = _data(case, 3, m)
    it = iter(data)
    for _ in range(2):
        stock.train_batch(it)
    stock.save_checkpoint(root, tag="stock")
    ours, _ = _engine(dict(case, schedule="1f1b"))
    ours.load_checkpoint(root, tag="stock")
    theirs = dict(stock.module.named_parameters())
    state_diff = max((ours.optimizer.state[p][k] - stock.optimizer.state[theirs[n]][k]).abs().max().item()
                     for n, p in ours.module.named_parameters() for k in ("exp_avg", "exp_avg_sq"))
    losses = [e.train_batch(iter(data[2 * m :])).item() for e in (stock, ours)]
    param_diff = max((p - theirs[n]).abs().max().item() for n, p in ours.module.named_parameters())
    v_half, _ = _engine(dict(case, schedule="v-half"))
    refused = _refusal(lambda: v_half.load_checkpoint(root, tag="stock"))
    weights = _refusal(lambda: v_half.load_checkpoint(root, tag="stock", load_optimizer_states=False))
    return {"state_diff": state_diff, "losses": losses, "param_diff": param_diff, "global_steps": ours.global_steps - 1,
            "refused": refused, "weights_only_error": weights}


def _run_zero1(case: dict[str, Any]) -> dict[str, Any]:
    """ZeRO-1 keeps flat partitions: a load under another placement is refused; weights only works."""
    m, root = case["m"], case["dir"]
    saver, _ = _engine(dict(case, schedule="1f1b", zero=1))
    saver.train_batch(iter(_data(case, 1, m)))
    saver.save_checkpoint(root, tag="z1")
    saved = {n: p.detach().clone() for n, p in saver.module.named_parameters()}
    loader, _ = _engine(dict(case, schedule="v-half", zero=1))
    refused = _refusal(lambda: loader.load_checkpoint(root, tag="z1"))
    weights = _refusal(lambda: loader.load_checkpoint(root, tag="z1", load_optimizer_states=False))
    weight_diff = max((p.detach() - saved[n]).abs().max().item() for n, p in loader.module.named_parameters() if n in saved)
    longer, _ = _engine(dict(case, schedule="v-half"), layers=10)
    layers = _refusal(lambda: longer.load_checkpoint(root, tag="z1", load_optimizer_states=False))
    return {"refused": refused, "weights_only_error": weights, "weight_diff": weight_diff, "layers_refused": layers,
            "loaded_global_steps": loader.global_steps}


def run_checkpoint_case(case: dict[str, Any]) -> dict[str, Any]:
    kind = case["ckpt_case"]
    return {"chain": _run_chain, "stock": _run_stock, "zero1": _run_zero1}[kind](case)
