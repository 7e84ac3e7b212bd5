"""Carry the caller's optimizer setup from the stock PipelineModule to the re-cut one.

``model_parameters`` (a flat list or parameter groups) and an optimizer object name the stock
module's parameter objects; after the re-cut a rank owns other layers, built as other
objects. Each parameter is matched by its name in both modules (global layer index and
parameter name, tied modules once), and its group is the one the *source* rank put it in
(the rank whose stock stage held it, see ``carry``): a layer this rank gains joins the group
its old owner chose, a layer it loses leaves its groups. Groups keep their options and their
order on every rank, even when empty (torch accepts empty groups), so group-wise settings and
schedulers line up across ranks. A parameter the source rank left out stays out.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from typing import Any

import torch
from deepspeed.runtime.pipe.module import PipelineModule as DSPipelineModule
from torch import nn

from ...config import ConfigError
from .carry import gather_checked, global_rank_of, unit_holders, unit_of

__all__ = ["as_groups", "carry_param_groups", "carry_model_parameters", "rebuild_optimizer", "check_lr_scheduler"]

Group = dict[str, Any]


def as_groups(params: Iterable[Any], *, what: str) -> tuple[list[Group], bool]:
    """``params`` as a list of groups with list ``params``; True when it was given flat."""
    items = list(params)
    if items and all(isinstance(g, dict) for g in items):
        for i, group in enumerate(items):
            if "params" not in group:
                raise ConfigError(f"{what} group {i} has no 'params' key; every group needs one")
        return [dict(g, params=_param_list(g["params"], what=what)) for g in items], False
    return [{"params": _param_list(items, what=what)}], True


def _param_list(params: Any, *, what: str) -> list[torch.Tensor]:
    items = [params] if isinstance(params, torch.Tensor) else list(params)
    for item in items:
        if not isinstance(item, torch.Tensor):
            raise ConfigError(f"{what} holds a {type(item).__name__}, not a parameter; pass parameters or groups "
                              "({'params': [...], ...}); (name, parameter) pairs are not mapped to the re-cut module")
    return items


def carry_model_parameters(stock: DSPipelineModule, new: nn.Module, params: Any) -> Any:
    """``model_parameters`` for the re-cut module, in the caller's form (flat list or groups)."""
    groups, flat = as_groups(params, what="model_parameters")
    carried = carry_param_groups(stock, new, groups, what="model_parameters")
    return carried[0]["params"] if flat else carried


def carry_param_groups(stock: DSPipelineModule, new: nn.Module, groups: list[Group], *, what: str,
                       error: str | None = None) -> list[Group]:
    """The same groups (options, order) over ``new``'s parameters (collective on all ranks)."""
    names = _names_by_id(stock)
    member: dict[str, int] = {}
    for g, group in enumerate(groups):
        for param in group["params"]:
            name = names.get(id(param))
            if name is None and error is None:
                error = (f"{what} group {g} holds a parameter of shape {tuple(param.shape)} that is not in the "
                         "PipelineModule; ds_vshape rebuilds the module for the schedule and can map only the module's "
                         "own parameters: keep other tensors out, or optimize them separately")
            member.setdefault(name or "", g)
    options = [_options(g) for g in groups]
    gathered = gather_checked((member, [repr(o) for o in options]), error)
    _check_same_options(gathered, what=what)
    holders = unit_holders(stock)
    out = [dict(o, params=[]) for o in options]
    for name, param in new.named_parameters():
        unit = unit_of(name)
        source = global_rank_of(stock, holders[unit][0]) if unit in holders else torch.distributed.get_rank()
        g = gathered[source][0].get(name)
        if g is not None:  # absent: the source rank left it out on purpose
            out[g]["params"].append(param)
    return out


def _names_by_id(stock: DSPipelineModule) -> dict[int, str]:
    names = {id(p): n for n, p in stock.named_parameters()}
    # Built modules passed as layers exist on every rank, also where the stock stage did not
    # register them; their names are known, their group is taken from the source rank.
    for idx, spec in enumerate(stock._layer_specs):
        if isinstance(spec, nn.Module):
            for n, p in spec.named_parameters():
                names.setdefault(id(p), f"{idx}.{n}")
    return names


def _options(group: Group) -> Group:
    return {k: v for k, v in group.items() if k != "params"}


def _check_same_options(gathered: list[Any], *, what: str) -> None:
    first = gathered[0][1]
    for rank, (_, options) in enumerate(gathered):
        if options != first:
            raise ConfigError(
                f"{what}: rank {rank} has groups {options} but rank 0 has {first}; a layer moving to another rank "
                "joins the group of the same index there, so pass the same groups (count, order, options) on every rank"
            )


def rebuild_optimizer(optimizer: torch.optim.Optimizer, stock: DSPipelineModule, new: nn.Module) -> torch.optim.Optimizer:
    """The same optimizer class, defaults and group options over the re-cut module (collective)."""
    cls = type(optimizer)
    stepped = sum(1 for v in optimizer.state.values() if v)
    error = None
    if stepped:
        error = (f"the optimizer object ({cls.__name__}) already has state for {stepped} parameters, which cannot move "
                 "to the re-cut module's parameters; pass the optimizer class instead (optimizer=lambda params: "
                 f"{cls.__name__}(params, ...)) or an \"optimizer\" block in the config, and restore its state with "
                 "engine.load_checkpoint")
    groups = [dict(g) for g in optimizer.param_groups]
    carried = carry_param_groups(stock, new, groups, what="optimizer.param_groups", error=error)
    accepted = inspect.signature(cls.__init__).parameters
    defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}
    try:
        rebuilt = cls(carried, **defaults)
    except Exception as err:  # any constructor failure means the class cannot be rebuilt this way
        raise ConfigError(f"cannot rebuild the optimizer object ({cls.__name__}) on the re-cut module: {err}; "
                          "pass the optimizer class or a callable (optimizer=lambda params: ...) instead") from None
    if repr(rebuilt.defaults) != repr(optimizer.defaults) or [repr(_options(g)) for g in rebuilt.param_groups] != [
            repr(_options(g)) for g in groups]:
        raise ConfigError(f"rebuilding the optimizer object ({cls.__name__}) on the re-cut module did not keep its "
                          "defaults and group options; pass the optimizer class or a callable "
                          "(optimizer=lambda params: ...) instead")
    return rebuilt


def check_lr_scheduler(lr_scheduler: Any) -> None:
    """Refuse a scheduler object bound to an optimizer of the stock module's parameters."""
    bound = getattr(lr_scheduler, "optimizer", None)
    if lr_scheduler is None or callable(lr_scheduler) or bound is None:
        return  # DeepSpeed calls a callable with the optimizer it builds
    name = type(lr_scheduler).__name__
    raise ConfigError(
        f"lr_scheduler is a {name} object bound to an optimizer over the stock module's parameters, which ds_vshape "
        f"replaces when it re-cuts the module; pass a callable instead (lr_scheduler=lambda opt: {name}(opt, ...)) "
        "or a \"scheduler\" block in the config"
    )
