"""An exact copy of what one optimizer step changes on this rank, to undo the step.

Post-validation steps before it knows whether the step should have been clipped or skipped;
when it should have, the step is undone with ``StepSnapshot.restore`` and redone. What a
DeepSpeed step changes, and so what is kept:

* the module's parameters (values and gradients); for fp16/bf16 these are the low-precision
  copies, which the wrappers overwrite from their fp32 masters;
* the fp32 masters and gradient accumulators of DeepSpeed's fp16/bf16 wrappers;
* the torch optimizer's per-parameter state (created on a parameter's first step: undoing
  that step removes it) and its parameter groups' options (the lr scheduler writes ``lr``);
* the scalars of the wrapper (loss scale, overflow, norm) and of the engine (step counters),
  and the lr scheduler's state;
* under ZeRO-1/2, the shards instead of whole weights (``zero_shards.ZeroShards``): the fp32
  master partition and its optimizer state as above, the owned low-precision partition and
  reduced gradient partition, and the loss scaler; restoring all-gathers the weights again.

Tensors are restored in place (``copy_``), so anything holding a reference (fused optimizers,
the wrappers' flat buffers and their views) sees the old values again.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch

from .zero_shards import ZeroShards, is_zero_optimizer

__all__ = ["StepSnapshot"]

# Engine counters a step advances.
_ENGINE_FIELDS = ("global_steps", "global_samples", "skipped_steps", "_step_applied", "_global_grad_norm", "losses",
                  "_unmanaged_backward_count")
# fp16/bf16 wrappers' flat fp32 tensors (masters, gradient accumulators), by attribute name.
_WRAPPER_FLATS = ("fp32_groups_flat", "fp32_groups_gradients_flat")
_WRAPPER_LISTS = ("fp32_groups_has_gradients", "flatten_grad_norm_mask_list")


def _clone(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach().clone()


def _put(target: torch.Tensor, saved: torch.Tensor) -> None:
    with torch.no_grad():
        target.copy_(saved)


def _inner(opt: Any) -> torch.optim.Optimizer:
    """The torch optimizer doing the update (DeepSpeed's wrappers hold it as ``.optimizer``)."""
    inner = getattr(opt, "optimizer", None)
    return inner if isinstance(inner, torch.optim.Optimizer) else opt


def _is_scalar(value: Any) -> bool:
    return value is None or isinstance(value, (bool, int, float, str))


@dataclass
class StepSnapshot:
    params: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]  # (parameter, value, gradient)
    state: dict[torch.Tensor, dict[str, Any]]  # torch optimizer state, for every parameter it holds
    groups: list[dict[str, Any]]  # parameter groups' options, without their parameters
    flats: list[tuple[torch.Tensor, torch.Tensor]]  # (wrapper tensor, its value)
    wrapper: dict[str, Any]  # the wrapper's scalars, lists and loss-scale config
    engine: dict[str, Any]
    scheduler: dict[str, Any] | None
    zero: ZeroShards | None = None  # ZeRO-1/2: the owned shards (module parameters are not copied whole)

    @classmethod
    def take(cls, engine: Any) -> StepSnapshot:
        opt = engine.optimizer
        inner = _inner(opt)
        masters = [p for g in inner.param_groups for p in g["params"]]
        zero = ZeroShards.take(opt) if is_zero_optimizer(opt) else None
        # Under ZeRO the module's weights are all-gathered from the shards on restore.
        module_params = [] if zero is not None else list(engine.module.parameters())
        params = {id(p): p for p in [*module_params, *masters]}.values()
        state = {p: {k: (_clone(v) if torch.is_tensor(v) else copy.deepcopy(v)) for k, v in inner.state[p].items()}
                 for p in masters if p in inner.state}
        flats = [(t, _clone(t)) for name in _WRAPPER_FLATS for t in (getattr(opt, name, None) or []) if torch.is_tensor(t)]
        wrapper: dict[str, Any] = {}
        if opt is not inner:
            wrapper = {k: v for k, v in vars(opt).items() if _is_scalar(v)}
            wrapper.update({k: copy.deepcopy(getattr(opt, k)) for k in (*_WRAPPER_LISTS, "loss_scale_config") if hasattr(opt, k)})
        scheduler = engine.lr_scheduler
        return cls(
            params=[(p, _clone(p.data), _clone(p.grad)) for p in params],
            state=state,
            groups=[{k: copy.deepcopy(v) for k, v in g.items() if k != "params"} for g in inner.param_groups],
            flats=flats,
            wrapper=wrapper,
            engine={k: copy.deepcopy(getattr(engine, k)) for k in _ENGINE_FIELDS if hasattr(engine, k)},
            scheduler=copy.deepcopy(scheduler.state_dict()) if scheduler is not None else None,
            zero=zero,
        )

    def restore(self, engine: Any) -> None:
        opt = engine.optimizer
        inner = _inner(opt)
        for p, value, grad in self.params:
            _put(p.data, value)
            if grad is None:
                p.grad = None
            elif p.grad is None:
                p.grad = grad.clone()
            else:
                _put(p.grad, grad)
        for t, value in self.flats:
            _put(t, value)
        self._restore_state(inner)
        for group, saved in zip(inner.param_groups, self.groups):
            group.update(copy.deepcopy(saved))
        for k, v in self.wrapper.items():
            setattr(opt, k, copy.deepcopy(v))
        for k, v in self.engine.items():
            setattr(engine, k, copy.deepcopy(v))
        if self.scheduler is not None:
            engine.lr_scheduler.load_state_dict(copy.deepcopy(self.scheduler))
        if self.zero is not None:
            self.zero.restore(opt)

    def _restore_state(self, inner: torch.optim.Optimizer) -> None:
        for p in [p for g in inner.param_groups for p in g["params"]]:
            saved = self.state.get(p)
            if saved is None:
                inner.state.pop(p, None)  # the undone step was this parameter's first
                continue
            current = inner.state[p]
            for k, v in saved.items():
                if torch.is_tensor(v) and torch.is_tensor(current.get(k)) and current[k].shape == v.shape:
                    _put(current[k], v)
                else:
                    current[k] = _clone(v) if torch.is_tensor(v) else copy.deepcopy(v)
            for k in [k for k in current if k not in saved]:
                del current[k]
