"""Worker side of tests/distributed/test_zero.py: ZeRO-2/3 on PPxDP against a non-pipelined reference.

Each data-parallel replica trains on its own micro-batches, so a reduce that is skipped, done
twice, or summed instead of averaged changes the parameters. The reference trains one model on
all replicas' micro-batches of a step (loss averaged over them), clips, and steps.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

import ds_vshape
from ds_vshape.schedules.ops import DATA_PARALLEL, OpKind
from tests.distributed.checkpoint_checks import _refusal
from tests.distributed.worker import _build, _config, _data, _device, _param_diff

__all__ = ["run_zero_case"]


def _replica_data(case: dict[str, Any], steps: int, m: int, dp: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Per replica, its ``steps * m`` micro-batches: step s of replica d is slice (s, d) of the whole."""
    whole = _data(case, steps * dp, m)
    return [[mb for s in range(steps) for mb in whole[(s * dp + d) * m:(s * dp + d + 1) * m]] for d in range(dp)]


def _reference(ref: torch.nn.Module, loss_fn: Any, per_replica: list[list[Any]], m: int, steps: int, clip: float) -> list[float]:
    opt = torch.optim.SGD(ref.parameters(), lr=0.2)
    losses = []
    n = m * len(per_replica)
    for step in range(steps):
        opt.zero_grad()
        total = 0.0
        for data in per_replica:
            for x, y in data[step * m:(step + 1) * m]:
                loss = loss_fn(ref(x), y)
                (loss / n).backward()
                total += loss.item()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
        opt.step()
        losses.append(total / n)
    return losses


def _engine(case: dict[str, Any], **over: Any) -> Any:
    model, _, _ = _build(dict(case, **over), case["p"])
    engine, *_ = ds_vshape.initialize(model=model, config=_config(dict(case, **over), case["m"]))
    return engine


def _checkpoint_case(case: dict[str, Any]) -> dict[str, Any]:
    """Save after 2 steps, load into a fresh engine, run step 3 on both: the same losses and
    parameters. Loading the optimizer under another schedule is refused; weights-only works."""
    m, root = case["m"], case["dir"]
    saver = _engine(case)
    dp_rank = saver.grid.get_data_parallel_rank()
    data = _replica_data(case, 3, m, saver.grid.get_data_parallel_world_size())[dp_rank]
    it = iter(data)
    for _ in range(2):
        saver.train_batch(it)
    saver.save_checkpoint(root, tag="z2")
    loader = _engine(case)
    loader.load_checkpoint(root, tag="z2")
    losses = [e.train_batch(iter(data[2 * m:])).item() for e in (saver, loader)]
    param_diff = max(_gathered(loader).get(n, torch.zeros(())).sub(t).abs().max().item() for n, t in _gathered(saver).items())
    other = _engine(case, schedule=case["load_as"])
    refused = _refusal(lambda: other.load_checkpoint(root, tag="z2"))
    weights = _refusal(lambda: other.load_checkpoint(root, tag="z2", load_optimizer_states=False))
    files = sorted(f for f in os.listdir(os.path.join(root, "z2")) if f.startswith("layer_"))
    saved = torch.load(os.path.join(root, "z2", files[0]), weights_only=True)  # whole tensors, also under ZeRO-3
    return {"losses": losses, "param_diff": param_diff, "global_steps": loader.global_steps, "refused": refused,
            "weights_only_error": weights, "layer_file_numel": sum(t.numel() for t in saved.values())}


def run_zero_case(case: dict[str, Any]) -> dict[str, Any]:
    if case.get("dir"):
        return _checkpoint_case(case)
    p, m, steps = case["p"], case["m"], case.get("steps", 3)
    model, ref, loss_fn = _build(case, p)
    ref.to(_device())
    engine, *_ = ds_vshape.initialize(model=model, config=_config(case, m))
    dp = engine.grid.get_data_parallel_world_size()
    per_replica = [[(x.to(_device()), y.to(_device())) for x, y in d] for d in _replica_data(case, steps, m, dp)]
    mine_data = per_replica[engine.grid.get_data_parallel_rank()]
    if case.get("bf16") and not case.get("tied"):  # float inputs meet a bf16 model as bf16; the reference stays fp32
        mine_data = [(x.bfloat16(), y.bfloat16()) for x, y in mine_data]
    mine = iter(mine_data)
    calls = []
    losses = []
    for _ in range(steps):
        losses.append(engine.train_batch(mine).item())
        reducer = engine._zero_reducer
        calls.append(None if reducer is None else [reducer.calls, getattr(reducer, "gathers", 0)])
    losses = _global_mean(losses, engine)
    out = {}
    ref_losses = _reference(ref, loss_fn, per_replica, m, steps, case.get("clip", 0.05))
    if case.get("eval"):  # evaluation after training: the forward-only stream gathers too
        out["eval_loss"] = engine.eval_batch(iter(per_replica[engine.grid.get_data_parallel_rank()][:m])).item()
        with torch.no_grad():  # eval_batch averages over the data-parallel replicas too
            out["ref_eval_loss"] = sum(loss_fn(ref(x), y).item() for d in per_replica for x, y in d[:m]) / (m * dp)
    return {**out,
        "losses": losses,
        "ref_losses": ref_losses,
        "param_diff": _gathered_param_diff(engine, ref, case),
        "reduce_calls": calls,
        "local_stages": len(engine.module.local_stages),
        "dp_ops": sorted({op.kind.value for op in engine._train_ir.ops if op.kind in DATA_PARALLEL}),
        "gather_ops": sum(op.kind is OpKind.GATHER_PARAMS for op in engine._train_ir.ops),
        "optimizer": type(engine.optimizer).__name__,
        "offloaded_units": engine._offload.offloaded_units,
    }


def _gathered_param_diff(engine: Any, ref: torch.nn.Module, case: dict[str, Any]) -> float:
    """Under ZeRO-3 each rank holds a shard of every parameter: gather them to compare."""
    import deepspeed

    if engine.zero_optimization_stage() != 3:
        return _param_diff(engine, ref, case)
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        return _param_diff(engine, ref, case)


def _gathered(engine: Any) -> dict[str, torch.Tensor]:
    """This rank's parameters, whole (gathered from their shards under ZeRO-3)."""
    import deepspeed

    params = dict(engine.module.named_parameters())
    if engine.zero_optimization_stage() != 3:
        return {n: p.detach().clone() for n, p in params.items()}
    with deepspeed.zero.GatheredParameters(list(params.values())):
        return {n: p.detach().clone() for n, p in params.items()}


def _global_mean(losses: list[float], engine: Any) -> list[float]:
    """train_batch returns this replica's loss; the reference's is the mean over replicas."""
    t = torch.tensor(losses, dtype=torch.float64)
    dist.all_reduce(t, group=engine.grid.get_data_parallel_group())
    return (t / engine.grid.get_data_parallel_world_size()).tolist()
