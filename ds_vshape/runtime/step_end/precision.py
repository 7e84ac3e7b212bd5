"""fp16 loss scaling when backward is split into B (input grads) and W (weight grads).

DeepSpeed applies the loss scale inside ``DeepSpeedEngine.backward``, which our engine never
calls: B differentiates the last stage's loss itself. So B scales the loss here, with the
same operation DeepSpeed's optimizer would use; every other stage then receives scaled
output gradients, and the weight GEMMs W runs later see scaled gradients too. Unscaling, the
inf/nan check, skipping the step and updating the scale all stay in DeepSpeed's optimizer
step, which runs after the step's last W, so the scale sequence is exactly DeepSpeed's.

A skipped step must be skipped on every rank: a pipeline rank that steps while another
skips leaves the model half updated. DeepSpeed reduces the overflow flag over the
optimizer's model-parallel group (for a pipeline grid: every stage of one pipeline) and the
data-parallel group; ``check_overflow_group`` makes sure that group spans the pipeline before
the first step, and ``agree_on_overflow`` confirms after each step that all ranks decided alike.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from deepspeed.runtime.base_optimizer import ZeROOptimizer
from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

__all__ = ["OverflowDisagreement", "agree_on_overflow", "check_overflow_group", "scale_loss"]


class OverflowDisagreement(RuntimeError):
    """Ranks disagreed on whether an fp16 step overflowed (some stepped, some skipped)."""


def _who(engine: Any) -> str:
    return f"pipeline rank {engine.stage_id} (global rank {engine.global_rank})"


def scale_loss(engine: Any, loss: torch.Tensor) -> torch.Tensor:
    """The last stage's loss (already divided by the micro-batch count) times the loss scale."""
    if not engine.fp16_enabled():
        return loss
    opt = engine.optimizer
    if isinstance(opt, ZeROOptimizer):
        return opt.scale_if_loss(loss)  # the call DeepSpeedEngine.backward makes (ZeRO-1)
    if isinstance(opt, (FP16_Optimizer, FP16_UnfusedOptimizer)):
        # What these optimizers' own backward() does; in fp32 so the product cannot overflow.
        if opt.custom_loss_scaler:
            return opt.external_loss_scale * loss
        return loss.float() * opt.loss_scale_config.cur_scale
    raise TypeError(
        f"{_who(engine)}: fp16 is enabled but the optimizer is a {type(opt).__name__}, whose loss scale ds_vshape "
        "does not know how to apply; let DeepSpeed wrap a torch optimizer (the config's \"optimizer\" block) "
        "and use zero_optimization.stage 0 or 1"
    )


def _overflow_groups(opt: Any) -> list[Any] | None:
    """The groups ``opt`` reduces its overflow flag over; None when we cannot tell."""
    if isinstance(opt, ZeROOptimizer) and hasattr(opt, "model_parallel_group"):
        # DeepSpeedZeroOptimizer.has_overflow: data-parallel, then model-parallel if any.
        return [g for g in (getattr(opt, "dp_process_group", None), opt.model_parallel_group) if g is not None]
    checker = getattr(opt, "overflow_checker", None)
    if checker is not None and checker.mpu is not None:
        return [checker.mpu.get_model_parallel_group()]  # CheckOverflow.has_overflow
    return None


def check_overflow_group(engine: Any) -> None:
    """Refuse an optimizer whose overflow reduction would leave out some pipeline rank."""
    groups = _overflow_groups(engine.optimizer)
    if groups is None:
        return  # agree_on_overflow still catches a disagreement after the step
    covered = {dist.get_rank()}.union(*(dist.get_process_group_ranks(g) for g in groups))
    missing = sorted(set(dist.get_process_group_ranks(engine.grid.get_pipe_parallel_group())) - covered)
    if missing:
        raise OverflowDisagreement(
            f"{_who(engine)}: the fp16 optimizer {type(engine.optimizer).__name__} reduces its overflow flag over "
            f"global ranks {sorted(covered)}, which leaves out global ranks {missing} of this pipeline, so its stages "
            "would skip different steps; pass the pipeline grid as mpu (ds_vshape.initialize does) so that its "
            "model-parallel group spans the whole pipeline"
        )


def agree_on_overflow(engine: Any) -> bool:
    """Whether this step overflowed; raises unless every rank of the job says the same."""
    overflow = bool(getattr(engine.optimizer, "overflow", False))
    # One MAX reduction yields both "someone overflowed" (max f) and "everyone did" (-max -f).
    flags = torch.tensor([float(overflow), -float(overflow)], dtype=torch.float64, device=engine.device)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    anyone, everyone = flags[0].item() > 0, -flags[1].item() > 0
    if anyone != everyone:
        raise OverflowDisagreement(
            f"{_who(engine)}: after optimizer step {engine.global_steps} this rank has overflow={overflow} but other "
            "ranks decided otherwise, so some ranks skipped the step and others took it; the optimizer's overflow "
            "reduction does not span every pipeline and data-parallel rank (check the mpu passed to initialize)"
        )
    return overflow
