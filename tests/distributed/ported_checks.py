"""DeepSpeed's own pipeline unit tests, re-expressed for ds_vshape schedules (run from worker.py).

What DeepSpeed checks for its 1F1B engine, checked here for each schedule a case names:
gradient accumulation scales the loss once; a PipelineModule gives the sequential model's
output (with and without DeepSpeed's activation checkpointing, partitioned activations
included) and holds all its parameters; micro-batches of changing shapes train with
``dynamic_shape=True``. Written from what those tests assert, not from their code.
"""

from __future__ import annotations

import copy
from typing import Any

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.pipe import PipelineModule
from torch import nn

import ds_vshape

HIDDEN = 16


def _config(schedule: str, m: int, **extra: Any) -> dict[str, Any]:
    return {"train_batch_size": m, "train_micro_batch_size_per_gpu": 1, "gradient_clipping": 0.0,
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "zero_allow_untested_optimizer": True,
            "steps_per_print": 10**9, "pipeline": {"schedule": schedule, "p2p_timeout_s": 60, **extra}}


def gas_scaling(case: dict[str, Any]) -> dict[str, Any]:
    """Four bias-free 1x1 linears at weight 1, x = 1, y = 0, MSE: every weight's gradient is 2
    per micro-batch, so one SGD step over m micro-batches must leave 1 - 0.1 * 2 = 0.8."""
    layers = [nn.Linear(1, 1, bias=False) for _ in range(4)]
    for layer in layers:
        layer.weight.data.fill_(1.0)
    model = PipelineModule(layers=layers, num_stages=2, loss_fn=nn.MSELoss(), partition_method="uniform")
    m = case["m"]
    engine, *_ = ds_vshape.initialize(config=_config(case["schedule"], m), model=model, model_parameters=model.parameters())
    engine.train_batch(iter([(torch.ones(1, 1), torch.zeros(1, 1))] * m))
    return {"weights": [p.item() for p in engine.module.parameters()]}


def sequential_eval(case: dict[str, Any]) -> dict[str, Any]:
    """eval_batch output and parameter count of the pipeline equal the sequential model's."""
    torch.manual_seed(0)
    base = nn.Sequential(*[nn.Linear(HIDDEN, HIDDEN) for _ in range(8)], nn.Linear(HIDDEN, 1))
    x = torch.randn(1, HIDDEN)
    want = base(x).detach()
    model = PipelineModule(layers=copy.deepcopy(base), num_stages=2, partition_method="uniform",
                           activation_checkpoint_interval=1 if case.get("ckpt") else 0)
    engine, *_ = ds_vshape.initialize(config=_config(case["schedule"], case.get("m", 2)), model=model,
                                      model_parameters=list(model.parameters()))
    if case.get("ckpt"):
        deepspeed.checkpointing.configure(None, deepspeed_config=engine.config, partition_activations=True,
                                          contiguous_checkpointing=True, num_checkpoints=9)
    count = torch.tensor([sum(p.numel() for p in engine.module.parameters())])
    dist.all_reduce(count, group=engine.grid.get_pipe_parallel_group())
    # No loss_fn: eval_batch averages the model's output over the micro-batches and every rank
    # gets it, as DeepSpeed's own test relies on.
    got = engine.eval_batch(iter([(x, torch.zeros(1))] * case.get("m", 2)))
    return {"max_diff": float((got.detach().cpu() - want).abs().max()), "params": int(count.item()),
            "base_params": sum(p.numel() for p in base.parameters())}


class _ShapeLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(HIDDEN, HIDDEN)
        self.shapes: set[tuple[int, ...]] = set()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.shapes.add(tuple(x.shape))
        return self.fc(x)


def dynamic_shapes(case: dict[str, Any]) -> dict[str, Any]:
    """Every micro-batch has its own row count; every layer must have seen several shapes."""
    torch.manual_seed(0)
    layers = [_ShapeLayer() for _ in range(4)]
    model = PipelineModule(layers=layers, num_stages=2, loss_fn=nn.MSELoss(), dynamic_shape=True, partition_method="uniform")
    m = case["m"]
    engine, *_ = ds_vshape.initialize(config=_config(case["schedule"], m), model=model, model_parameters=model.parameters())
    rows = [8, 16, 32, 64]
    data = [(torch.randn(rows[i % 4], HIDDEN), torch.randn(rows[i % 4], HIDDEN)) for i in range(3 * m)]
    it = iter(data)
    losses = [engine.train_batch(it).item() for _ in range(3)]
    seen = [len(layer.shapes) for layer in engine.module.modules() if isinstance(layer, _ShapeLayer)]
    return {"losses": losses, "shapes_seen": seen}


CHECKS = {"gas_scaling": gas_scaling, "sequential_eval": sequential_eval, "dynamic_shapes": dynamic_shapes}


def run_ported_case(case: dict[str, Any]) -> dict[str, Any]:
    return CHECKS[case["ported"]](case)
