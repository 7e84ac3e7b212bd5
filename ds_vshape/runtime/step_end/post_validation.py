"""Optimizer post-validation: step on local information, check globally later, redo if wrong.

Without it every rank ends a step in two pipeline-wide synchronisations: the global gradient
norm (clipping, and for fp16/bf16 the inf/nan check) before the optimizer step, and the loss
broadcast after it. Both make the first rank wait for the last one, so consecutive steps
cannot overlap.

With it (``pipeline.post_validation``), at the end of a step each rank:

1. sums its own gradients' squares (not finite: some inf or nan), adds the loss if it holds the last
   stage, and starts one asynchronous all-reduce of that over the pipeline group;
2. keeps an exact copy of everything the optimizer step changes (``StepSnapshot``), when a
   redo is possible at all;
3. runs the optimizer step as if nothing were clipped or skipped, with the optimizer's own
   pipeline-spanning reductions answered locally (``answered_locally``), and returns.

Before anything uses the new weights (the next ``train_batch``/``eval_batch``, a checkpoint,
``engine.settle()``), ``PostValidator.settle`` waits for the all-reduce. When the global
figures say the step should have been clipped or skipped, every rank of the pipeline (they
all see the same sums) restores its snapshot and redoes the step the ordinary way, with the
optimizer's own reductions: the result is exactly that of an engine without
post-validation. A plain fp32 step without clipping cannot be wrong, so nothing waits at all
then. The check is conservative: a norm within ``MARGIN`` of the clipping
threshold also redoes, so float rounding cannot flip a decision.

Speculation (``speculate_after``): after a run of steps that stood, the next train step does not
wait for the check before its first pass; the check is read at that step's own optimizer step,
by when it has long arrived. A redo then also makes the engine run the speculated step again
on the same micro-batches (``OptimizerStepMixin.train_batch``), since its passes used weights
that changed.

ZeRO-1/2 (``zero_shards``): the figures come from each rank's owned gradient partition, summed
over data parallel before the pipeline's all-reduce; the optimistic step keeps DeepSpeed's
data-parallel reductions (the replicas of a stage step together anyway) and drops only the
pipeline-spanning one and the clipping; the snapshot holds the shards.

Limits: not with ZeRO-3 or ZeRO's optimizer offload (``check_post_validation_config``), and the
snapshot costs one copy of the weights, gradients and optimizer state per rank (under ZeRO-1/2,
of this rank's shards).
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from .pending import PendingValue
from .snapshot import StepSnapshot
from .tensor_parallel import counted_in_norm, norm_group
from .zero_shards import is_zero_optimizer, shard_norm_sq, zero_skips_nonfinite

__all__ = ["MARGIN", "ClippingDefaultWarning", "PostValidator", "Verdict", "check_post_validation_config", "decide", "reduce_stats"]

# A step whose clip coefficient is below 1 + MARGIN is redone: the optimizer computes its
# own norm in another precision and order, so a decision this close to the threshold could
# differ from ours.
MARGIN = 1e-4

# The figures one all-reduce carries. No separate inf/nan count: a gradient holds an inf or
# nan exactly when its float64 sum of squares is not finite (fp32 squares cannot overflow it).
_NORM_SQ, _DP_LOSS, _AGG_LOSS = range(3)


class ClippingDefaultWarning(UserWarning):
    """post_validation with gradient_clipping left out: DeepSpeed clips at 1.0 then."""


def check_post_validation_config(config: dict[str, Any], *, enabled: bool) -> None:
    """The front-door rules: post-validation runs with ZeRO stages 0, 1 and 2, without ZeRO's
    optimizer offload; an absent ``gradient_clipping`` is DeepSpeed's default of 1.0, which the
    user is told (every step then awaits or may redo)."""
    if enabled and "gradient_clipping" not in config:
        warnings.warn(
            "pipeline.post_validation=true with gradient_clipping not set: DeepSpeed then clips at 1.0, so every step's "
            "global-norm check is awaited before the next step (or, once speculating, a step above the threshold is "
            "redone). Set gradient_clipping to 0 for no clipping (plain fp32 steps then never wait, except under ZeRO-1/2), "
            "or to the value you mean to silence this", ClippingDefaultWarning, stacklevel=3)
    zero = config.get("zero_optimization") or {}
    stage = int(zero.get("stage", 0))
    if enabled and stage == 3:
        raise ValueError(
            "pipeline.post_validation=true is not supported with zero_optimization.stage 3: ZeRO-3 partitions the weights "
            "themselves and its step is not undone from the shards post-validation copies; set zero_optimization.stage to "
            "0, 1 or 2, or pipeline.post_validation to false"
        )
    device = str((zero.get("offload_optimizer") or {}).get("device", "none")).lower()
    if enabled and stage in (1, 2) and device != "none":
        raise ValueError(
            f"pipeline.post_validation=true is not supported with zero_optimization.offload_optimizer.device={device!r}: the "
            "offloaded step keeps its gradients and overflow flag in host buffers that post-validation does not copy; set "
            "offload_optimizer.device to \"none\" (or remove offload_optimizer), or pipeline.post_validation to false"
        )


@dataclass(frozen=True)
class Verdict:
    """What the global figures say about a step taken on local information."""

    norm: float  # the global gradient norm, unscaled (fp16: divided by the loss scale)
    nonfinite: bool  # some rank had an inf or nan gradient
    redo: bool  # the optimistic step was not the right one


def decide(*, norm_sq: float, nonfinite: bool, clip: float, loss_scale: float, skips_nonfinite: bool) -> Verdict:
    """Whether a step taken without clipping and without the inf/nan check must be redone.

    ``skips_nonfinite``: the optimizer skips a step with inf/nan gradients (fp16 and bf16
    wrappers); plain fp32 steps never check. ``clip`` 0 means no clipping. Clipping scales
    by ``clip / (norm + 1e-6)`` when that is below 1, as DeepSpeed's optimizers do.
    """
    norm = math.sqrt(norm_sq) / loss_scale if norm_sq >= 0 else float("nan")
    if nonfinite and skips_nonfinite:
        return Verdict(norm, True, True)
    redo = False
    if clip > 0:
        coef = clip / (norm + 1e-6)
        redo = coef < 1 + MARGIN  # nan compares false, as in the optimizers (no clip)
    return Verdict(norm, nonfinite, redo)


def reduce_stats(stats: torch.Tensor, group: Any) -> Any:
    """Start the sum of every rank's figures over the pipeline group (benchmarks wrap this)."""
    return dist.all_reduce(stats, group=group, async_op=True)


@contextmanager
def answered_locally(engine: Any) -> Iterator[None]:
    """The optimizer step without clipping and without pipeline-spanning reductions.

    DeepSpeed's fp16/bf16 wrappers reduce their norm and overflow flag over the model-
    parallel group (the whole pipeline) inside ``step``; with ``mpu`` and the overflow
    checker's links cleared they use this rank's gradients only, and ``clip_grad`` 0 keeps
    them from clipping. ``engine._vs_optimistic`` tells the engine's own clip to hold off.
    """
    opt = engine.optimizer
    checker = getattr(opt, "overflow_checker", None)
    # ZeRO-1/2 (``model_parallel_group``): its norm and overflow flag then cover this stage's
    # data-parallel replicas only, which step together anyway.
    saved = [(obj, name, getattr(obj, name)) for obj, name in (
        (opt, "mpu"), (opt, "clip_grad"), (opt, "model_parallel_group"), (checker, "mpu"), (checker, "deepspeed"),
    ) if obj is not None and hasattr(obj, name)]
    for obj, name, _ in saved:
        setattr(obj, name, 0.0 if name == "clip_grad" else None)
    engine._vs_optimistic = True
    try:
        yield
    finally:
        engine._vs_optimistic = False
        for obj, name, value in saved:
            setattr(obj, name, value)


def _grads_for_norm(engine: Any) -> list[torch.Tensor]:
    """The gradients the optimizer takes its norm over (a tied copy counts once, on its owner)."""
    opt = engine.optimizer
    if engine.bfloat16_enabled() and hasattr(opt, "get_grads_for_norm"):
        non_expert, _ = opt.get_grads_for_norm()  # its fp32 accumulators, the tied copy already left out
        return list(non_expert)
    tp_rank = engine.grid.get_slice_parallel_rank()
    return [p.grad for p in engine.module.parameters() if p.grad is not None and counted_in_norm(p, tp_rank=tp_rank)]


def _local_stats(engine: Any) -> torch.Tensor:
    """This rank's figures for the pipeline's all-reduce (under ZeRO-1/2 its data-parallel
    replicas' shards already summed in)."""
    stats = torch.zeros(3, dtype=torch.float64, device=engine.device)
    if is_zero_optimizer(engine.optimizer):
        stats[_NORM_SQ] = shard_norm_sq(engine)[0]
        return stats
    for g in _grads_for_norm(engine):
        stats[_NORM_SQ] += g.detach().double().pow(2).sum()
    return stats


class PostValidator:
    """One pipeline rank's optimistic steps and their later checks.

    ``speculate_after``: once this many steps in a row needed no redo, the next step's
    passes no longer wait for the check: they run on the optimistic weights and the check is
    read at that step's optimizer step, when it has long arrived. If it then says redo, the
    engine undoes and redoes the previous step and runs this one again on the same
    micro-batches (``rerun_needed``), and waits for the checks again until the next run of
    steps that stand. None: always wait before the next step's first pass.
    """

    def __init__(self, engine: Any, *, speculate_after: int | None = None) -> None:
        self._group = norm_group(engine.grid)  # the pipeline, and its tensor-parallel ranks if any
        self._pending: _Pending | None = None
        self._in_flight: list[Any] = []  # unawaited all-reduces of steps that could not be wrong
        self.speculate_after = speculate_after
        self._streak = 0  # steps in a row that stood
        self.redone_steps = 0  # steps whose optimistic update was replaced (clipped or skipped)
        self.rerun_steps = 0  # speculated steps that had to run again
        self.rerun_needed = False
        self.last_verdict: Verdict | None = None

    @property
    def speculating(self) -> bool:
        """Whether the next train step may start before the pending check arrives."""
        return (self._pending is not None and self._pending.may_redo and self.speculate_after is not None
                and self._streak >= self.speculate_after)

    def step(self, engine: Any, run_step: Callable[[], None]) -> None:
        """Start the global check, then step on local information (``run_step`` is the
        engine's ordinary step; it runs again, whole, if the check fails)."""
        if self._pending is not None:  # this step was speculated: the previous step's check is due
            verdict = self._check(self._pending, engine)
            if verdict.redo:
                self.rerun_needed = True  # no update from passes that ran on weights about to change
                return
            self._accept(verdict, engine)
        stats = _local_stats(engine)
        losses = _last_stage_losses(engine, stats)
        scale = _loss_scale(engine)
        work = reduce_stats(stats, self._group)
        snapshot = StepSnapshot.take(engine) if _may_redo(engine) else None
        with answered_locally(engine):
            run_step()
        self._pending = _Pending(work, stats, snapshot, run_step, scale)
        # train_batch returns agg_train_loss. On the last stage it is known now; elsewhere it
        # arrives with the all-reduce, and the first use of the returned tensor waits for it.
        if losses is None:
            wait = functools.partial(_wait, work, timeout_s=float(engine._p2p.timeout_s))
            losses = PendingValue(stats[_DP_LOSS], wait), PendingValue(stats[_AGG_LOSS], wait)
        engine.dp_group_loss, engine.agg_train_loss = losses

    def settle(self, engine: Any) -> Verdict | None:
        """Wait for the global figures; restore and redo the step when they say so.

        A plain fp32 step without clipping cannot be wrong (DeepSpeed neither clips nor checks
        for inf/nan there): nothing is awaited, and the all-reduce, which still carries the
        loss, completes in the background (kept referenced until it has).
        """
        pending = self._pending
        if pending is None:
            return None
        self._in_flight = [w for w in self._in_flight if not w.is_completed()]
        if not pending.may_redo:
            self._pending = None
            self._in_flight.append(pending.work)
            return None
        verdict = self._check(pending, engine)
        if verdict.redo:
            self._pending = None
            self._redo(pending, verdict, engine)
        else:
            self._accept(verdict, engine)
        return verdict

    def redo_previous(self, engine: Any) -> None:
        """After a speculated step found its predecessor wrong: undo and redo that one (the
        speculated step's gradients go with the undo); the engine then runs the step again."""
        pending, self._pending = self._pending, None
        if pending is None or not self.rerun_needed or self.last_verdict is None:
            raise RuntimeError(f"pipeline rank {engine.stage_id}: no speculated step to run again")
        self.rerun_needed = False
        self._redo(pending, self.last_verdict, engine)
        self.rerun_steps += 1

    def _check(self, pending: _Pending, engine: Any) -> Verdict:
        _wait(pending.work, timeout_s=float(engine._p2p.timeout_s))
        norm_sq = float(pending.stats[_NORM_SQ])
        verdict = decide(norm_sq=norm_sq, nonfinite=not math.isfinite(norm_sq),
                         clip=float(engine.gradient_clipping() or 0.0), loss_scale=pending.loss_scale,
                         skips_nonfinite=_skips_nonfinite(engine))
        self.last_verdict = verdict
        return verdict

    def _accept(self, verdict: Verdict, engine: Any) -> None:
        self._pending = None
        self._streak += 1
        engine._global_grad_norm = verdict.norm  # the optimistic step could only see this rank's

    def _redo(self, pending: _Pending, verdict: Verdict, engine: Any) -> None:
        assert pending.snapshot is not None  # taken whenever a redo was possible
        pending.snapshot.restore(engine)
        # Every rank of the pipeline redoes: they all saw the same sums. A plain fp32 step
        # clips with the norm found here (no second reduction, so no wait for the others);
        # the fp16/bf16 wrappers run their own step, reductions included.
        engine._vs_known_norm = verdict.norm
        try:
            pending.run_step()
        finally:
            engine._vs_known_norm = None
        self.redone_steps += 1
        self._streak = 0


@dataclass
class _Pending:
    work: Any
    stats: torch.Tensor
    snapshot: StepSnapshot | None  # None when no redo is possible (plain fp32 without clipping)
    run_step: Callable[[], None]
    loss_scale: float

    @property
    def may_redo(self) -> bool:
        return self.snapshot is not None


def _wait(work: Any, *, timeout_s: float) -> None:
    """Wait for the check's all-reduce, bounded by the step's transfer timeout.

    It is issued in one step and often waited for in the next, outside the window in which
    ``bounded_step`` shortens the groups' timeouts; a wait without a timeout would then hang
    on a dead peer for the process group's (30 minutes, or forever on NCCL)."""
    if work.wait(timeout=timedelta(seconds=timeout_s)) is False:
        raise RuntimeError(f"post-validation's all-reduce timed out after {timeout_s:g} s")


def _skips_nonfinite(engine: Any) -> bool:
    """DeepSpeed's fp16 and bf16 wrappers skip a step with inf/nan gradients; plain fp32 never
    checks, except under ZeRO-1/2, whose step has its own rule (``zero_skips_nonfinite``)."""
    if is_zero_optimizer(engine.optimizer):
        return zero_skips_nonfinite(engine.optimizer)
    return bool(engine.fp16_enabled() or engine.bfloat16_enabled())


def _may_redo(engine: Any) -> bool:
    """Whether the global check can overturn a step taken on local figures."""
    return _skips_nonfinite(engine) or (engine.gradient_clipping() or 0.0) > 0


def _loss_scale(engine: Any) -> float:
    """The scale the gradients carry (fp16), taken before the step may raise it."""
    if not engine.fp16_enabled():
        return 1.0
    opt = engine.optimizer
    config = getattr(opt, "loss_scale_config", None)
    return float(config.cur_scale if config is not None else opt.loss_scale)


def _last_stage_losses(engine: Any, stats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """DeepSpeed's step loss on the last stage (averaged over data-parallel replicas), put
    into ``stats`` so the pipeline's all-reduce carries it to every rank: (this replica's,
    the average); None elsewhere."""
    if not engine.is_last_stage():
        return None
    loss = engine._scale_loss_by_gas(engine.total_loss).clone().detach()
    agg = loss.clone()
    if engine.is_data_parallel:  # the replicas' last stages end together: a short wait among them
        dist.all_reduce(agg, group=engine.mpu.get_data_parallel_group())
        agg /= engine.dp_world_size
    stats[_DP_LOSS], stats[_AGG_LOSS] = loss.double(), agg.double()
    engine.agg_additional_losses = None
    return loss, agg
