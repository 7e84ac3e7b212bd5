"""3D cases (pipeline x tensor x data parallel): Megatron-style layers against a non-sharded model.

Each layer is a transformer-MLP-shaped block: a replicated LayerNorm, a column-parallel linear
(its weight and bias split by output rows), tanh, a row-parallel linear (its weight split by
input columns, its bias replicated), and the residual. The parallel linears are custom
autograd Functions as Megatron writes them: the column linear all-reduces its input gradient
over the tensor-parallel group in backward, the row linear's output is all-reduced in forward.
Every shard is cut from the same full block the reference holds, so after training each
shard must equal its slice of the reference (fp32, 1e-5).

Launched by worker.py's ``run_case`` for a case with ``"tp": <size>``.
"""

from __future__ import annotations

import copy
import os
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from deepspeed.pipe import PipelineModule
from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology
from torch import nn

import ds_vshape
from ds_vshape.config import parse_pipeline_config
from tests.distributed.worker import _config, _mse
from tests.distributed.zero_checks import _global_mean, _replica_data

__all__ = ["run_tp_case", "TPBlock", "FullBlock"]

DIM, HID = 8, 16


class _ReduceFromTP(torch.autograd.Function):
    """All-reduce forward, identity backward: a row-parallel linear's partial outputs."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:  # type: ignore[override]
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        return grad, None


class _ParallelLinear(torch.autograd.Function):
    """``x W^T + b`` computing only the gradients asked for; with a group, the input gradient
    is all-reduced over it (a column-parallel linear: each rank saw the whole input)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None,  # type: ignore[override]
                group: Any) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        ctx.group, ctx.has_bias = group, b is not None
        return F.linear(x, w, b)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        x, w = ctx.saved_tensors
        need = ctx.needs_input_grad
        g2, x2 = grad.reshape(-1, grad.shape[-1]), x.reshape(-1, x.shape[-1])
        gx = grad @ w if need[0] else None
        if gx is not None and ctx.group is not None:
            dist.all_reduce(gx, group=ctx.group)
        gw = g2.t() @ x2 if need[1] else None
        gb = g2.sum(0) if need[2] and ctx.has_bias else None
        return gx, gw, gb, None


class _EagerParallelLinear(_ParallelLinear):
    """The same, computing every gradient whatever it is asked (as Megatron's linear does):
    split backward keeps it whole in B, with a warning."""

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        x, w = ctx.saved_tensors
        g2, x2 = grad.reshape(-1, grad.shape[-1]), x.reshape(-1, x.shape[-1])
        gx = grad @ w
        if ctx.group is not None:
            dist.all_reduce(gx, group=ctx.group)
        return gx, g2.t() @ x2, g2.sum(0) if ctx.has_bias else None, None


class FullBlock(nn.Module):
    """The non-sharded block: norm, fc1 (DIM -> HID), tanh, fc2 (HID -> DIM), residual."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.norm = nn.LayerNorm(DIM)
        self.fc1, self.fc2 = nn.Linear(DIM, HID), nn.Linear(HID, DIM)
        with torch.no_grad():  # LayerNorm starts at ones/zeros: make its gradient matter to the check
            self.norm.weight.add_(0.1 * torch.randn(DIM))
            self.norm.bias.add_(0.1 * torch.randn(DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(self.norm(x)))) + x


# TPBlock parameter -> (FullBlock parameter, dimension it is split along; None: replicated)
SLICES: dict[str, tuple[str, int | None]] = {
    "norm.weight": ("norm.weight", None), "norm.bias": ("norm.bias", None),
    "w1": ("fc1.weight", 0), "b1": ("fc1.bias", 0), "w2": ("fc2.weight", 1), "b2": ("fc2.bias", None),
}


def shard_of(full: torch.Tensor, dim: int | None, tp_rank: int, tp: int) -> torch.Tensor:
    """This tensor-parallel rank's slice of ``full`` (all of it for a replicated parameter)."""
    return full if dim is None else full.chunk(tp, dim=dim)[tp_rank]


class TPBlock(nn.Module):
    """FullBlock(seed) split over ``tp`` ranks, Megatron-style; shards marked ``tensor_model_parallel``."""

    def __init__(self, seed: int, group: Any, tp_rank: int, tp: int, *, eager: bool = False) -> None:
        super().__init__()
        full = FullBlock(seed)
        self.group = group
        self.linear = _EagerParallelLinear if eager else _ParallelLinear
        self.norm = copy.deepcopy(full.norm)
        source = dict(full.named_parameters())
        for name, (src, dim) in SLICES.items():
            if "." in name:
                continue
            param = nn.Parameter(shard_of(source[src].detach(), dim, tp_rank, tp).clone())
            if dim is not None:
                param.tensor_model_parallel = True  # what DeepSpeed's is_model_parallel_parameter reads
            setattr(self, name, param)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.linear.apply(self.norm(x), self.w1, self.b1, self.group))  # column-parallel
        out = _ReduceFromTP.apply(self.linear.apply(h, self.w2, None, None), self.group)  # row-parallel
        return out + self.b2 + x


def _tp_groups(topo: PipeModelDataParallelTopology) -> Any:
    """The tensor-parallel group of this rank (every rank creates every group, in one order)."""
    mine = None
    for ranks in topo.get_axis_comm_lists("model"):
        group = dist.new_group(ranks=ranks)
        if dist.get_rank() in ranks:
            mine = group
    return mine


def _layer_counts(case: dict[str, Any]) -> tuple[int, int]:
    """(replicated input layers, tensor-parallel blocks): two layers per model stage, the first
    stage holding one input layer and a tensor-parallel block, as Megatron's stage 0 does
    (split backward on such a stage: tests/unit/test_split_first_stage.py)."""
    name = case.get("layers_of", case["schedule"])  # a checkpoint case keeps the saving schedule's layer list
    schedule = parse_pipeline_config({"pipeline": {"schedule": name}}).make_schedule(case["p"], case["m"])
    total = 2 * schedule.num_model_stages
    plain = 1
    return plain, total - plain


def _build(case: dict[str, Any]) -> tuple[PipelineModule, nn.Sequential, int]:
    tp, p = case["tp"], case["p"]
    dp = dist.get_world_size() // (p * tp)
    topo = PipeModelDataParallelTopology(num_pp=p, num_mp=tp, num_dp=dp)
    group = _tp_groups(topo)
    tp_rank = topo.get_coord(dist.get_rank()).model
    plain, tp_blocks = _layer_counts(case)
    seeds = [50 + i for i in range(tp_blocks)]
    torch.manual_seed(49)
    inputs = [nn.Linear(DIM, DIM) for _ in range(plain)]  # replicated, as a real model's embedding
    blocks = [copy.deepcopy(x) for x in inputs] + [TPBlock(s, group, tp_rank, tp, eager=case.get("eager", False)) for s in seeds]
    ref = nn.Sequential(*inputs, *[FullBlock(s) for s in seeds])
    module = PipelineModule(blocks, topology=topo, loss_fn=_mse, partition_method="uniform")
    return module, ref, tp_rank


def _shard_diff(engine: Any, ref: nn.Sequential, tp_rank: int, tp: int) -> float:
    """Largest |shard - its slice of the reference| over this rank's parameters."""
    worst = 0.0
    for name, param in engine.module.named_parameters():
        layer, _, rest = name.partition(".")
        block = ref[int(layer)]
        src, dim = SLICES[rest] if isinstance(block, FullBlock) else (rest, None)  # an input layer: replicated
        want = shard_of(dict(ref[int(layer)].named_parameters())[src].detach(), dim, tp_rank, tp)
        worst = max(worst, (param.detach() - want).abs().max().item())
    return worst


def run_tp_case(case: dict[str, Any]) -> dict[str, Any]:
    """Train ``steps`` steps on the 3D pipeline and on the reference; report losses and shard differences.

    With ``"ckpt": {"dir", "load_as"}`` the trained engine saves, an engine under schedule
    ``load_as`` loads weights and optimizer state, and trains one step more (the reference too)."""
    m, steps, tp = case["m"], case.get("steps", 2), case["tp"]
    more = 1 if case.get("ckpt") else 0
    module, ref, tp_rank = _build(case)
    engine, *_ = ds_vshape.initialize(model=module, config=_config(case, m))
    grid = engine.grid
    dp = grid.get_data_parallel_world_size()
    per_replica = _replica_data(case, steps + more, m, dp)
    it = iter(per_replica[grid.get_data_parallel_rank()])
    losses = [engine.train_batch(it).item() for _ in range(steps)]
    result: dict[str, Any] = {"global_norm": float(engine.get_global_grad_norm() or 0.0), "p2p_peers": _p2p_peers(engine)}
    if more:
        engine, extra = _resume(engine, case)
        # A fresh iterator at the next step: a rank that held neither the first nor the last
        # stage under the saving placement read no micro-batches from the old one.
        losses += [engine.train_batch(iter(per_replica[grid.get_data_parallel_rank()][steps * m:])).item()]
        result.update(extra)
    ref_losses = _train_reference(ref, per_replica, m, steps + more, clip=case.get("clip", 0.05), momentum=case.get("momentum", 0.0))
    return {**result, "losses": _global_mean(losses, engine), "ref_losses": ref_losses,
            "param_diff": _shard_diff(engine, ref, tp_rank, tp), "dp": dp, "tp": grid.get_slice_parallel_world_size(),
            "tp_rank": tp_rank, "stage": engine.stage_id, "last": engine.is_last_stage(), "rank": int(os.environ.get("RANK", "0"))}


def _p2p_peers(engine: Any) -> list[list[int]]:
    """(data, model) coordinates of every process this rank's transfers reach: its own, or it pairs wrong ranks."""
    topo, p2p = engine.module.topology(), engine._p2p
    ranks = set(p2p.global_rank_of) | {r for g in p2p.groups.values() for r in dist.get_process_group_ranks(g)}
    return sorted({(topo.get_coord(r).data, topo.get_coord(r).model) for r in ranks})  # type: ignore[misc]


def _resume(engine: Any, case: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """Save, then load into a new engine under ``case["ckpt"]["load_as"]`` (weights and optimizer state)."""
    root, other = case["ckpt"]["dir"], dict(case, schedule=case["ckpt"]["load_as"], layers_of=case["schedule"])
    engine.save_checkpoint(root, tag="t")
    module, _, _ = _build(other)
    loaded, *_ = ds_vshape.initialize(model=module, config=_config(other, other["m"]))
    loaded.load_checkpoint(root, tag="t")
    files = sorted(f for f in os.listdir(os.path.join(root, "t")) if f.startswith(("vs_optim", "layer_")))
    saved, got = _all_params(engine), _all_params(loaded)
    shared = sorted(set(saved) & set(got))  # every layer of this tensor-parallel rank, wherever it lives
    diff = max(((saved[n] - got[n]).abs().max().item() for n in shared), default=0.0)
    return loaded, {"ckpt_files": files, "loaded_schedule": loaded.schedule.name, "load_diff": diff,
                    "load_compared": len(shared), "load_bad": [n for n in shared if not torch.equal(saved[n], got[n])][:6]}


def _all_params(engine: Any) -> dict[str, torch.Tensor]:
    """Every parameter of this rank's tensor-parallel slice of the model, gathered from all pipeline ranks."""
    mine = {n: p.detach().cpu().clone() for n, p in engine.module.named_parameters()}
    items: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(items, (engine.grid.get_slice_parallel_rank(), mine))
    tp_rank = engine.grid.get_slice_parallel_rank()
    return {n: t for r, params in items if r == tp_rank for n, t in params.items()}


def _train_reference(ref: nn.Module, per_replica: list[list[Any]], m: int, steps: int, *, clip: float,
                     momentum: float) -> list[float]:
    """The non-sharded model: every replica's micro-batches averaged, clipped, torch SGD."""
    opt = torch.optim.SGD(ref.parameters(), lr=0.2, momentum=momentum)
    n, losses = m * len(per_replica), []
    for step in range(steps):
        opt.zero_grad()
        total = 0.0
        for data in per_replica:
            for x, y in data[step * m:(step + 1) * m]:
                loss = _mse(ref(x), y)
                (loss / n).backward()
                total += loss.item()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
        opt.step()
        losses.append(total / n)
    return losses
