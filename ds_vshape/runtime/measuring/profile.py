"""``partition_method: "profile"``: measure every layer once, then cut by the measured costs.

At ``initialize`` the stock module holds its own layers on its own device, and a sample
micro-batch goes down the pipeline through them: each rank times F and F+B of each of its
layers on the activation the previous rank handed over, counts the bytes autograd saves, and
weighs the parameters. The last layer's figures include the loss (logits included). Every
rank then holds all layers' costs (an all-gather); global rank 0 cuts (the pure
``ds_vshape.schedules.partition``) and broadcasts the cut, so every rank builds the same one.

The sample comes from ``training_data`` when it is passed to ``initialize`` (its first
micro-batch, as DeepSpeed's loader would batch it), else from ``pipeline.profile_sample``.
Weights, gradients, buffers and random state are left as they were.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.pipe.module import PipelineModule as DSPipelineModule
from deepspeed.utils import logger as log
from torch import nn

from ...config import ConfigError, PipelineConfig
from ...schedules import Schedule
from ...schedules.cut_refine import profile_cut
from ...schedules.partition import Cut, LayerCost, pool_alike, stage_inflight
from ...tuning import INTEGER_DTYPES, SampleTensor
from ..dropin.carry import gather_checked, global_rank_of
from .memory import ActivationMeter
from ..transfers.device import comm_device

__all__ = ["Profile", "profiled_cut", "measure_layers", "sample_micro_batch"]

_REPEATS = 3  # timed runs per layer after one warm-up run; the median is kept


@dataclass(frozen=True)
class Profile:
    """What the cut was made from (kept as ``module.vs_profile``): every layer's measured cost,
    the micro-batches each stage holds at its rank's peak under the schedule, and the cut."""

    costs: tuple[LayerCost, ...]
    inflight: tuple[float, ...]
    cut: Cut


def profiled_cut(model: DSPipelineModule, schedule: Schedule, vs: PipelineConfig, *, micro_batch_size: int,
                 training_data: Any = None, collate_fn: Callable[..., Any] | None = None) -> Profile:
    """Measure the stock module's layers on a sample micro-batch and cut them for ``schedule``'s placement.

    ``micro_batch_size``: the rows DeepSpeed's loader batches ``training_data`` into (``initialize``
    resolves the batch keys once)."""
    rows = micro_batch_size if training_data is not None else 0
    sample = sample_micro_batch(vs, micro_batch_size=rows, training_data=training_data, collate_fn=collate_fn)
    costs = tuple(measure_layers(model, sample))
    inflight = stage_inflight(schedule, kept_until_w=vs.w_memory)
    box: list[Any] = [None]
    if dist.get_rank() == 0:  # one rank decides: the cut must be identical everywhere, to the bit
        box[0] = profile_cut(costs, schedule, inflight=inflight, time_slack=vs.profile_time_slack)
        _log_cut(costs, box[0], schedule)
    dist.broadcast_object_list(box, src=0, device=comm_device())
    return Profile(costs, inflight, box[0])


def sample_micro_batch(vs: PipelineConfig, *, micro_batch_size: int, training_data: Any = None,
                       collate_fn: Callable[..., Any] | None = None) -> tuple[Any, Any]:
    """(inputs, labels) of one micro-batch: the first of ``training_data``, else made from ``pipeline.profile_sample``."""
    if training_data is not None:
        loader = torch.utils.data.DataLoader(training_data, batch_size=micro_batch_size, shuffle=False, collate_fn=collate_fn)
        batch = next(iter(loader))
        if not isinstance(batch, (tuple, list)) or len(batch) != 2:
            raise ConfigError("partition_method 'profile' reads the first micro-batch of training_data, which must be "
                              f"(inputs, labels) as DeepSpeed's pipeline expects; got a {type(batch).__name__}")
        return batch[0], batch[1]
    spec = vs.profile_sample
    if spec is None:
        raise ConfigError("pipeline.partition_method 'profile' needs a sample micro-batch to measure the layers on: pass "
                          "training_data to ds_vshape.initialize, or set pipeline.profile_sample, e.g. "
                          '{"inputs": {"shape": [4, 512], "dtype": "int64", "high": 50257}}')
    g = torch.Generator().manual_seed(0)  # the same sample on every rank
    inputs = _make(spec.inputs, g)
    return inputs, _make(spec.labels, g) if spec.labels is not None else _make(spec.inputs, g)


def _make(spec: SampleTensor | tuple[SampleTensor, ...], g: torch.Generator) -> Any:
    if isinstance(spec, tuple):
        return tuple(_make(s, g) for s in spec)
    dtype = getattr(torch, spec.dtype)
    if spec.dtype in INTEGER_DTYPES:
        return torch.randint(0, spec.high or 1, spec.shape, generator=g, dtype=dtype)
    return torch.randn(spec.shape, generator=g).to(dtype)


def measure_layers(model: DSPipelineModule, sample: tuple[Any, Any]) -> list[LayerCost]:
    """Every layer's cost, the same list on every rank (collective over the world); alike
    layers (same class, parameter shapes and saved bytes) share their median time (``pool_alike``).

    The sample goes down this rank's pipeline, stage after stage: the owner of a stage
    measures its layers and sends the last activation to the next stage's owner. A rank that
    fails passes its error on instead, so every rank raises it and none waits for data.
    """
    ranges = _stage_ranges(model)
    funcs = _local_funcs(model)
    me = model._grid.get_stage_id()
    x, error, local = _to_device(sample[0]), None, {}
    n = len(model._layer_specs)
    with _untouched(model):
        for s, (owner, lo, hi) in enumerate(ranges):
            if owner == me and error is None:
                try:
                    for i in range(lo, hi):
                        last = i == n - 1
                        cost, x = _measure(funcs[i], x, model.loss_fn if last else None,
                                           _to_device(sample[1]) if last else None)
                        local[i] = (cost, None if last else _kind(funcs[i], cost))
                except Exception as err:  # handed on and raised on every rank below
                    error = f"measuring layer {i} for partition_method 'profile' failed: {type(err).__name__}: {err}"
            if s + 1 < len(ranges) and ranges[s + 1][0] != owner:
                x, error = _hand_over(model, (x, error), owner, ranges[s + 1][0], me)
    gathered = gather_checked(local, error)
    costs = _merge([{i: c for i, (c, _) in g.items()} for g in gathered], n)
    kinds = [next(g[i][1] for g in gathered if i in g) for i in range(n)]
    return list(pool_alike(costs, kinds))


def _kind(func: Any, cost: LayerCost) -> str | None:
    """What makes two layers alike: class, parameter shapes and dtypes, and bytes saved for backward
    (None for a plain function: alike to nothing)."""
    module = func.args[0] if isinstance(func, partial) else func
    if not isinstance(module, nn.Module):
        return None
    shapes = tuple((name, tuple(p.shape), str(p.dtype)) for name, p in module.named_parameters())
    return f"{type(module).__module__}.{type(module).__qualname__}|{shapes}|{cost.activation_bytes:.0f}"


def _stage_ranges(model: DSPipelineModule) -> list[tuple[int, int, int]]:
    """(owning pipeline rank, first layer, end) of each stage in forward order."""
    placement = getattr(model, "placement", None)
    parts = list(getattr(model, "stage_parts", None) or model.parts)
    owners = list(placement) if placement is not None else list(range(model.num_stages))
    return [(owners[s], parts[s], parts[s + 1]) for s in range(len(owners))]


def _local_funcs(model: DSPipelineModule) -> dict[int, Any]:
    if hasattr(model, "stage_funcs"):  # ds_vshape's module: several stages per rank
        return {i: f for s in model.local_stages for i, f in zip(range(model.stage_parts[s], model.stage_parts[s + 1]),
                                                                  model.stage_funcs[s])}
    return {model._local_start + k: f for k, f in enumerate(model.forward_funcs)}


def _measure(func: Any, x: Any, loss_fn: Any, labels: Any) -> tuple[LayerCost, Any]:
    """Median F and F+B time of one layer (with the loss on the last), its saved bytes and weights."""
    module = func.args[0] if isinstance(func, partial) else func
    params = list(module.parameters()) if isinstance(module, nn.Module) else []
    meter = ActivationMeter({p.untyped_storage().data_ptr() for p in params})
    forward, backward, saved, out = [], [], 0, None
    for run in range(_REPEATS + 1):
        inputs = _leaves(x)
        start = _now()
        with meter.recording() if run == 0 else _nothing():  # the hooks cost time: only in the warm-up run
            out = func(inputs)
            result = loss_fn(out, labels) if loss_fn is not None else out
        mid = _now()
        saved = saved or meter.live_bytes
        roots = [t for t in _tensors(result) if t.is_floating_point() and t.requires_grad]
        if roots:
            torch.autograd.backward(roots, [torch.ones_like(t) for t in roots])
        end = _now()
        if run:
            forward.append(mid - start)
            backward.append(end - mid)
    cost = LayerCost(statistics.median(forward) + statistics.median(backward), float(saved),
                     float(sum(p.numel() * p.element_size() for p in params)))
    return cost, _detached(out)


def _hand_over(model: DSPipelineModule, payload: tuple[Any, str | None], src: int, dst: int, me: int) -> tuple[Any, str | None]:
    """Send (activation, error) from pipeline rank ``src`` to ``dst``; other ranks keep theirs."""
    box = [None]
    if me == src:
        x, error = payload
        box[0] = (_to_cpu(x) if error is None else None, error)
        dist.send_object_list(box, dst=global_rank_of(model, dst), device=comm_device())
        return payload
    if me == dst:
        dist.recv_object_list(box, src=global_rank_of(model, src), device=comm_device())
        x, error = box[0]  # type: ignore[misc]
        return _to_device(x), error
    return payload


def _merge(gathered: list[dict[int, LayerCost]], n: int) -> list[LayerCost]:
    """Per layer, the mean over the data-parallel ranks that measured it, in rank order."""
    costs = []
    for i in range(n):
        seen = [g[i] for g in gathered if i in g]
        if not seen:
            raise ConfigError(f"partition_method 'profile': no rank measured layer {i}; this is a bug, please report it")
        costs.append(LayerCost(*(sum(getattr(c, f) for c in seen) / len(seen) for f in ("time", "activation_bytes", "param_bytes"))))
    return costs


@contextmanager
def _untouched(model: nn.Module) -> Iterator[None]:
    """Leave gradients, buffers (batch-norm statistics) and random state as they were."""
    grads = {p: p.grad for p in model.parameters()}
    buffers = {b: b.detach().clone() for b in model.buffers()}
    accel = get_accelerator()
    device_rng = accel.get_rng_state() if accel.device_name() != "cpu" else None
    with torch.random.fork_rng(devices=[]):
        try:
            yield
        finally:
            for p, g in grads.items():
                p.grad = g
            with torch.no_grad():
                for b, value in buffers.items():
                    b.copy_(value)
            if device_rng is not None:
                accel.set_rng_state(device_rng)


def _log_cut(costs: list[LayerCost], cut: Cut, schedule: Schedule) -> None:
    ms = ", ".join(f"{c.time * 1e3:.2f}" for c in costs)
    log.info("ds_vshape: partition_method=profile measured per-layer F+B ms [%s]; cut %s for %s placement %s: "
             "per rank time ms %s, memory MiB %s", ms, list(cut.parts), schedule.name, list(schedule.stage_to_rank),
             [round(t * 1e3, 2) for t in cut.rank_time], [round(m / 2**20, 2) for m in cut.rank_memory])


def _now() -> float:
    get_accelerator().synchronize()  # device work is asynchronous: wait before reading the clock
    return time.perf_counter()


@contextmanager
def _nothing() -> Iterator[None]:
    yield


def _device() -> torch.device:
    return torch.device(get_accelerator().current_device_name())


def _tensors(x: Any) -> list[torch.Tensor]:
    if isinstance(x, (tuple, list)):
        return [t for t in x if torch.is_tensor(t)]
    return [x] if torch.is_tensor(x) else []


def _leaves(x: Any) -> Any:
    def leaf(t: Any) -> Any:
        if not torch.is_tensor(t):
            return t
        out = t.detach()
        return out.requires_grad_(True) if out.is_floating_point() else out

    return tuple(leaf(t) for t in x) if isinstance(x, (tuple, list)) else leaf(x)


def _detached(x: Any) -> Any:
    return tuple(t.detach() if torch.is_tensor(t) else t for t in x) if isinstance(x, (tuple, list)) else \
        (x.detach() if torch.is_tensor(x) else x)


def _to_cpu(x: Any) -> Any:
    return tuple(_to_cpu(t) for t in x) if isinstance(x, (tuple, list)) else (x.cpu() if torch.is_tensor(x) else x)


def _to_device(x: Any) -> Any:
    device = _device()
    return tuple(_to_device(t) for t in x) if isinstance(x, (tuple, list)) else (x.to(device) if torch.is_tensor(x) else x)
