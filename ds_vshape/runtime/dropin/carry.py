"""Carry the weights a stock PipelineModule holds into the module re-cut for a schedule.

A *unit* is what one name prefix of ``named_parameters`` covers in both modules: layer ``i``
(``"i.fc.weight"``) or a tied module counted once (``"tied_modules.<key>.weight"``). Both
modules number layers globally, so a unit means the same thing before and after the re-cut.

DeepSpeed's stock module builds only the units of its own stage, so after the re-cut a rank
may own a unit whose values only another rank holds (a V placement moves the last stage
back to rank 0). The value of each unit comes from its *source*: the lowest pipeline rank
(same data/model coordinates) whose stock stage holds it, the rank DeepSpeed itself
broadcasts tied weights from. Every other rank that now owns the unit receives its tensors
(parameters and persistent buffers) by point-to-point, in one order all ranks agree on.
Shapes are compared on every rank first, so a mismatch is the same error everywhere, not a hang.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from deepspeed.runtime.pipe.module import PipelineModule as DSPipelineModule
from deepspeed.runtime.pipe.module import TiedLayerSpec
from torch import nn

from ...config import ConfigError
from ..transfers.device import comm_device

__all__ = ["unit_of", "unit_holders", "global_rank_of", "gather_checked", "carry_weights"]

Signature = list[tuple[str, tuple[int, ...], str]]


def unit_of(name: str) -> str:
    """The unit of a parameter name: ``"3.fc.weight"`` -> ``"3"``, ``"tied_modules.e.weight"`` -> ``"tied_modules.e"``."""
    head, _, rest = name.partition(".")
    return f"{head}.{rest.partition('.')[0]}" if head == "tied_modules" else head


def unit_holders(module: DSPipelineModule) -> dict[str, list[int]]:
    """Unit name -> the pipeline ranks whose stage holds it, ascending (layer order)."""
    holders: dict[str, list[int]] = {}
    for idx, spec in enumerate(module._layer_specs):
        unit = f"tied_modules.{spec.key}" if isinstance(spec, TiedLayerSpec) else str(idx)
        ranks = holders.setdefault(unit, [])
        owner = module.stage_owner(idx)
        if owner not in ranks:
            ranks.append(owner)
    return {unit: sorted(ranks) for unit, ranks in holders.items()}


def global_rank_of(module: DSPipelineModule, pipe: int) -> int:
    """The global rank at pipeline rank ``pipe`` with this rank's other coordinates."""
    coord = module._topo.get_coord(dist.get_rank())._asdict()
    coord["pipe"] = pipe
    return module._topo.get_rank(**coord)


def gather_checked(payload: Any, error: str | None) -> list[Any]:
    """All-gather ``payload`` from every rank; if any rank had an error, raise all of them on every rank."""
    items: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(items, (payload, error))
    errors = [f"rank {r}: {err}" for r, (_, err) in enumerate(items) if err]
    if errors:
        raise ConfigError("; ".join(errors))
    return [p for p, _ in items]


def carry_weights(stock: DSPipelineModule, new: DSPipelineModule) -> None:
    """Copy into ``new`` every unit value it must take from another rank's stock stage (collective)."""
    plan = _plan(unit_holders(stock), unit_holders(new))
    me = dist.get_rank()
    sends: dict[str, Signature] = {}
    recvs: dict[str, tuple[int, Signature]] = {}
    for unit, src, dst in plan:
        src_rank, dst_rank = global_rank_of(stock, src), global_rank_of(stock, dst)
        if me == src_rank:
            sends[unit] = _signature(_unit_module(stock, unit))
        if me == dst_rank:
            recvs[unit] = (src_rank, _signature(_unit_module(new, unit)))
    gathered = gather_checked((sends, recvs), None)
    _check_signatures(gathered)
    device = comm_device()
    for unit, src, dst in plan:  # the same order on every rank: no pair can wait on the other
        src_rank, dst_rank = global_rank_of(stock, src), global_rank_of(stock, dst)
        if me == src_rank and sends[unit]:
            for tensor in _unit_module(stock, unit).state_dict().values():  # type: ignore[union-attr]
                dist.send(tensor.detach().to(device).contiguous(), dst_rank)
        elif me == dst_rank and recvs[unit][1]:
            _receive_into(_unit_module(new, unit), src_rank, device)  # type: ignore[arg-type]


def _plan(old: dict[str, list[int]], fresh: dict[str, list[int]]) -> list[tuple[str, int, int]]:
    """(unit, source pipe rank, destination pipe rank) for every copy needed, in layer order.

    A non-tied unit staying on its rank is the same module object (taken over): no copy. A
    tied unit is copied to every new holder but the source, as DeepSpeed's own broadcast of
    tied weights would overwrite those copies with the source's anyway.
    """
    plan = []
    for unit, holders in old.items():
        src = holders[0]
        plan.extend((unit, src, dst) for dst in fresh.get(unit, []) if dst != src)
    return plan


def _unit_module(module: DSPipelineModule, unit: str) -> nn.Module | None:
    if unit.startswith("tied_modules."):
        return module.tied_modules[unit.partition(".")[2]]
    return module._modules.get(unit)  # None: the layer is a plain function


def _signature(module: nn.Module | None) -> Signature:
    if module is None:
        return []  # a plain function: nothing to carry
    return [(k, tuple(t.shape), str(t.dtype)) for k, t in module.state_dict().items()]


def _check_signatures(gathered: list[tuple[dict[str, Signature], dict[str, tuple[int, Signature]]]]) -> None:
    """Every receiver's unit must have exactly the sender's tensors; same verdict on every rank."""
    for dst_rank, (_, recvs) in enumerate(gathered):
        for unit, (src_rank, mine) in recvs.items():
            theirs = gathered[src_rank][0].get(unit, [])
            if theirs != mine:
                raise ConfigError(
                    f"cannot carry unit {unit!r} from rank {src_rank} (its stock stage holds it) to rank {dst_rank} "
                    f"(the schedule's placement gives it there): the state differs, {theirs} there vs {mine} here; "
                    "build each layer with the same shapes and dtypes on every rank (same LayerSpec arguments)"
                )


@torch.no_grad()
def _receive_into(module: nn.Module, src_rank: int, device: torch.device) -> None:
    for tensor in module.state_dict().values():  # shares storage with the module's tensors
        buf = torch.empty(tensor.shape, dtype=tensor.dtype, device=device)
        dist.recv(buf, src_rank)
        tensor.copy_(buf.to(tensor.device))
