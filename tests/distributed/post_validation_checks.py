"""Post-validation cases for worker.py.

``run_post_validation_case`` (fp32, bf16): a schedule with ``pipeline.post_validation`` trains
10 steps with a clipping threshold between the steps' gradient norms, so some steps are taken
as they are and others are undone and redone clipped; bf16 runs also carry an ``inf`` in one
micro-batch, so one step is skipped. Recorded: the losses (as ``train_batch`` returned them,
read only after the next step started), the verdict of every step, and the parameters after
``engine.settle()``; fp32 also runs the non-pipelined reference, bf16 the same schedule
without post-validation.

``run_overlap_case``: the last pipeline rank holds its optimizer step of step k until rank 0
has started a forward pass of step k+1 (a key in the default TCPStore, with a timeout). That
can only happen when ``train_batch`` waits for no other rank at its end. With ``hold_at:
stats`` it holds before it even sends its figures for the global check: then rank 0 gets there
only by speculating.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

import ds_vshape
from ds_vshape.runtime.step_end import post_validation as pv

from .worker import _build, _config, _data, _device, _param_diff, _reference

__all__ = ["run_post_validation_case", "run_overlap_case"]


def _pv_config(case: dict[str, Any], m: int, *, post_validation: bool) -> dict[str, Any]:
    config = _config(case, m)
    config["pipeline"]["post_validation"] = post_validation
    return config


def _train(case: dict[str, Any], *, post_validation: bool) -> dict[str, Any]:
    p, m, steps = case["p"], case["m"], case.get("steps", 10)
    model, ref, loss_fn = _build(case, p)
    engine, *_ = ds_vshape.initialize(model=model, config=_pv_config(case, m, post_validation=post_validation))
    ref.to(_device())
    data = [(x.to(_device()), y.to(_device())) for x, y in _data(case, steps, m)]  # cuda:r under the GPU tier
    if case.get("bf16"):
        data = [(x.bfloat16(), y.bfloat16()) for x, y in data]
    for step, micro_batch in case.get("poison", []):
        x = data[step * m + micro_batch][0].clone()
        x[0, 0] = float("inf")
        data[step * m + micro_batch] = (x, data[step * m + micro_batch][1])
    it = iter(data)
    returned, verdicts, arrived_early = [], [], []
    for _ in range(steps):
        returned.append(engine.train_batch(it))
        if len(returned) > 1:
            verdicts.append(_verdict(engine))
    engine.settle()
    verdicts.append(_verdict(engine))
    for loss in returned:
        arrived_early.append(bool(getattr(loss, "arrived", True)))
    out = {"losses": [float(x) for x in returned], "verdicts": verdicts, "redone": engine.redone_steps,
           "rerun": engine.rerun_steps,
           "skipped": int(engine.skipped_steps), "arrived_before_read": arrived_early,
           "params": {n: q.detach().float().flatten().tolist() for n, q in engine.module.named_parameters()},
           "optimizer": type(engine.optimizer).__name__}
    if not case.get("bf16"):
        out["ref_losses"] = _reference(ref, lambda mod, x, y: loss_fn(mod(x), y), data, m, steps, case["clip"],
                                       momentum=case.get("momentum", 0.0))
        out["param_diff"] = _param_diff(engine, ref, case)
    return out


def _verdict(engine: Any) -> dict[str, Any] | None:
    v = engine._validator.last_verdict if engine._validator is not None else None
    return None if v is None else {"norm": v.norm, "nonfinite": v.nonfinite, "redo": v.redo}


def run_post_validation_case(case: dict[str, Any]) -> dict[str, Any]:
    result = _train(case, post_validation=True)
    if case.get("compare_plain"):
        result["plain"] = _train(case, post_validation=False)
    return result


def run_overlap_case(case: dict[str, Any]) -> dict[str, Any]:
    """Does rank 0 start step k+1 while the last rank has not stepped its optimizer in step k?"""
    p, m, steps = case["p"], case["m"], 3
    model, _, _ = _build(case, p)
    engine, *_ = ds_vshape.initialize(model=model, config=_pv_config(case, m, post_validation=case["post_validation"]))
    store = dist.distributed_c10d._get_default_store()
    unpatched = pv.reduce_stats
    tag = case["name"]
    stage = engine.stage_id
    waits: list[str] = []
    state = {"step": 0}
    if stage == 0:  # a forward of model stage 0 marks that rank 0 runs step state["step"]
        def mark(*_: Any) -> None:
            store.set(f"{tag}/fwd{state['step']}", b"1")

        engine.module.stage_modules(0)[0].register_forward_pre_hook(mark)
    if stage == p - 1:
        def hold(*_: Any) -> None:
            nxt = engine.global_steps + 1  # the step rank 0 would start next
            key = f"{tag}/fwd{nxt}"
            if nxt >= steps or len(waits) >= nxt:  # no next step, or a redo of a step already held
                return
            try:
                store.wait([key], timedelta(seconds=case.get("timeout_s", 20)))
                waits.append("released")
            except Exception:  # the store raises on timeout (its type differs across torch versions)
                waits.append("timed out")

        if case.get("hold_at") == "stats":  # before the rank even starts the global check
            def held(stats: torch.Tensor, group: Any) -> Any:
                hold()
                return unpatched(stats, group)

            pv.reduce_stats = held
        else:
            engine.optimizer.register_step_pre_hook(hold)
    it = iter([(x.to(_device()), y.to(_device())) for x, y in _data(case, steps, m)])
    try:
        for k in range(steps):
            state["step"] = k
            engine.train_batch(it)
        engine.settle()
    finally:
        pv.reduce_stats = unpatched
    return {"waits": waits}
