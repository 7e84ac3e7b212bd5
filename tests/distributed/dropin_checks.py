"""Drop-in cases for worker.py: ``ds_vshape.initialize`` keeps what the job set up.

Each case sets something on the stock PipelineModule or around it (pretrained weights,
parameter groups, an optimizer object, a partition_method), re-cuts it for a schedule on 2
gloo ranks, and compares with a plain model trained from the same start with the same
optimizer setup; or records the refusal. test_dropin.py asserts on what each rank returns.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import copy
from typing import Any

import torch
from deepspeed.accelerator import get_accelerator
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from torch import nn

import ds_vshape

from .worker import DIM, Block, Embed, _ce, _Clone, _config, _data, _head, _mse, _param_diff, _ref_layers, _TiedReference

__all__ = ["run_dropin_case"]

LR = 0.01


class Wide(nn.Module):
    """A residual MLP block with six times a Block's parameters: 'parameters' and 'uniform' cut apart."""

    def __init__(self, dim: int = DIM) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.tanh(self.up(x))) + x


def _model(case: dict[str, Any]) -> tuple[PipelineModule, nn.Module, Any]:
    """Stock module (LayerSpecs, unseeded: a rebuild would draw new weights) and its reference."""
    torch.manual_seed(42)  # the "pretrained" weights, the same on every rank
    if case.get("tied"):
        embed, blocks = Embed(), [Block() for _ in range(4)]
        ref: nn.Module = _TiedReference(embed, blocks)
        specs = [TiedLayerSpec("embed", Embed)] + [LayerSpec(Block) for _ in blocks] + [TiedLayerSpec("embed", Embed, forward_fn=_head)]
        loss_fn = _ce
    else:
        kinds = [Wide] + [Block] * 7 if case.get("wide") else [Block] * 8
        ref = nn.Sequential(*[k() for k in kinds])
        specs = [LayerSpec(k) if case.get("layerspec") else k() for k in kinds]
        loss_fn = _mse
    torch.manual_seed(1000 + torch.distributed.get_rank())  # LayerSpec builds differ per rank and from ref
    module = PipelineModule(specs, num_stages=case["p"], loss_fn=loss_fn, partition_method=case.get("stock_method", "uniform"))
    if case.get("forget_method"):  # as if built before ds_vshape was imported: the cut is inferred
        del module._vs_partition_method
    return module, ref, loss_fn


def _load_pretrained(module: PipelineModule, ref: nn.Module, case: dict[str, Any]) -> None:
    """What a job does before initialize: load its pretrained state into the stock module."""
    layers = _ref_layers(ref, case)
    state = {}
    for name in module.state_dict():
        head, _, rest = name.partition(".")
        src = ref.embed if head == "tied_modules" else layers[int(head)]
        state[name] = src.state_dict()[rest.partition(".")[2] if head == "tied_modules" else rest].clone()
    module.load_state_dict(state)


def _groups(module: nn.Module) -> list[dict[str, Any]]:
    """No weight decay on biases and norms, 0.1 elsewhere (names as the module has them)."""
    decay, plain = [], []
    for name, param in module.named_parameters():
        (plain if name.endswith("bias") or ".norm." in name else decay).append(param)
    return [{"params": decay, "weight_decay": 0.1}, {"params": plain, "weight_decay": 0.0}]


def _optimizer(kind: str, params: Any) -> torch.optim.Optimizer:
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=LR)
    return torch.optim.SGD(params, lr=0.2, momentum=0.9, nesterov=True)


def _reference(ref: nn.Module, loss_fn: Any, data: list, case: dict[str, Any], m: int, steps: int) -> list[float]:
    """Plain training with the case's optimizer over the same groups, clipped like the engine."""
    opt = _optimizer(case["opt"], _groups(ref))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5) if case.get("sched") else None
    losses = []
    for step in range(steps):
        opt.zero_grad()
        total = 0.0
        for x, y in data[step * m : (step + 1) * m]:
            loss = loss_fn(ref(x), y)
            (loss / m).backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        opt.step()
        if sched is not None:
            sched.step()
        losses.append(total / m)
    return losses


def _initialize(module: PipelineModule, case: dict[str, Any], m: int) -> tuple[Any, Any, Any]:
    """(engine, engine's optimizer, the optimizer object given or None), as the case asks."""
    config = _config(case, m)
    how = case.get("how", "config")
    if how == "config":  # DeepSpeed builds torch's AdamW from the config over our groups
        config["optimizer"] = {"type": "AdamW", "params": {"lr": LR, "torch_adam": True}}
        engine, optimizer, _, _ = ds_vshape.initialize(model=module, config=config, model_parameters=_groups(module))
        return engine, optimizer, None
    del config["optimizer"]
    given = _optimizer(case["opt"], _groups(module))
    if how == "stepped":  # as after a step: momentum buffers for every parameter
        for group in given.param_groups:
            for param in group["params"]:
                given.state[param]["momentum_buffer"] = torch.zeros_like(param)
    sched: Any = None
    if how == "sched_object":
        sched = torch.optim.lr_scheduler.StepLR(given, step_size=1, gamma=0.5)
    elif case.get("sched"):
        sched = lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)  # noqa: E731
    engine, optimizer, _, _ = ds_vshape.initialize(model=module, config=config, optimizer=given, lr_scheduler=sched)
    return engine, optimizer, given


def run_dropin_case(case: dict[str, Any]) -> dict[str, Any]:
    m, steps = case["m"], 2
    module, ref, loss_fn = _model(case)
    _load_pretrained(module, ref, case)
    try:
        with _recorded_device_queries() as queries:
            engine, optimizer, given = _initialize(module, case, m)
    except Exception as err:  # the refusals are what those cases check
        return {"refused": f"{type(err).__name__}: {err}"}
    data = _data(case, steps, m)
    it = iter(data)
    losses = [engine.train_batch(it).item() for _ in range(steps)]
    result = {"losses": losses, "ref_losses": _reference(ref, loss_fn, data, case, m, steps),
              "param_diff": _param_diff(engine, ref, case), "local_layers": list(engine.module.local_layer_ids)}
    result.update(_group_report(engine, optimizer, given))
    result["device_queries"] = sorted({str(q) for q in queries})
    return result


@contextmanager
def _recorded_device_queries() -> Iterator[list[Any]]:
    """Which device index was bound each time initialize asked for the current device.

    DeepSpeed's CPU accelerator ignores ``set_device``; here it remembers the index, and each
    ``current_device_name`` call records it, as a GPU rank would see ``cuda:<index>``. A query
    made before anything was bound records None: on a GPU node that rank would use device 0.
    """
    accelerator = get_accelerator()
    bound: list[Any] = [None]
    queries: list[Any] = []
    real = accelerator.set_device, accelerator.current_device_name

    def set_device(index: int) -> None:
        bound[0] = index

    def current_device_name() -> str:
        queries.append(bound[0])
        return real[1]()

    accelerator.set_device, accelerator.current_device_name = set_device, current_device_name
    try:
        yield queries
    finally:
        accelerator.set_device, accelerator.current_device_name = real


def _group_report(engine: Any, optimizer: Any, given: Any) -> dict[str, Any]:
    """Which of this rank's parameters sit in which group, and what the optimizer kept."""
    names = {id(p): n for n, p in engine.module.named_parameters()}
    wanted = {n: (0.0 if n.endswith("bias") or ".norm." in n else 0.1) for n in names.values()}
    grouped = [names.get(id(p), "<not in module>") for g in optimizer.param_groups for p in g["params"]]
    misplaced = [names.get(id(p), "<not in module>") for g in optimizer.param_groups for p in g["params"]
                 if wanted.get(names.get(id(p), "")) != g["weight_decay"]]
    report: dict[str, Any] = {"grouped": sorted(grouped), "params": sorted(names.values()), "misplaced": misplaced,
                              "groups": len(optimizer.param_groups), "lrs": [g["lr"] for g in optimizer.param_groups]}
    if given is not None:
        report["same_class"] = type(optimizer) is type(given)
        report["same_defaults"] = repr(optimizer.defaults) == repr(given.defaults)
        report["rebuilt"] = optimizer is not given
    return report
