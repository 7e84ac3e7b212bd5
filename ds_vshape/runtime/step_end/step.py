"""The end of a step: the optimizer step, clipping by the global norm, fp16 agreement, and
optional post-validation (``post_validation.py``), as an engine mixin."""

from __future__ import annotations

import math
from collections import deque
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from .post_validation import PostValidator, Verdict
from .precision import agree_on_overflow, check_overflow_group

__all__ = ["OptimizerStepMixin"]


class OptimizerStepMixin:
    """Mixed into ``VShapeEngine`` before DeepSpeed's ``PipelineEngine``."""

    _validator: PostValidator | None = None
    _vs_optimistic = False  # inside a post-validated step taken on local information
    _vs_known_norm: float | None = None  # fp32 redo: the global norm the check found

    _vs_loaded: list[Any] | None = None  # micro-batches a speculated step read, for its rerun
    _vs_replay: deque[Any] | None = None

    def _init_step(self, *, post_validation: bool, speculate_after: int | None = None) -> None:
        self._validator = PostValidator(self, speculate_after=speculate_after) if post_validation else None

    # ---- speculated steps ------------------------------------------------------------------
    def train_batch(self, *args: Any, **kwargs: Any) -> Any:
        validator = self._validator
        if validator is None or not validator.speculating:
            return super().train_batch(*args, **kwargs)  # type: ignore[misc]
        self._vs_loaded = []
        try:
            loss = super().train_batch(*args, **kwargs)  # type: ignore[misc]
            if validator.rerun_needed:
                # The previous step should have been clipped or skipped, and this one ran on its
                # weights: redo that one, then run this one again on the micro-batches it read.
                validator.redo_previous(self)
                self._vs_replay, self._vs_loaded = deque(self._vs_loaded), None
                loss = super().train_batch()  # type: ignore[misc]
        finally:
            self._vs_loaded = self._vs_replay = None
        return loss

    def _load_batch(self) -> Any:
        """The next micro-batch: the data iterator's, or a speculated step's again on its rerun."""
        if self._vs_replay is not None:
            return self._vs_replay.popleft()
        batch = self._next_batch()  # type: ignore[attr-defined]
        if self._vs_loaded is not None:
            self._vs_loaded.append(batch)
        return batch

    def _settle_before_passes(self) -> None:
        """The previous step's check, before this step's first pass; a speculated train step
        reads it at its own optimizer step instead."""
        if not (self._validator is not None and self._validator.speculating and self.module.training):  # type: ignore[attr-defined]
            self.settle()

    # ---- post-validation --------------------------------------------------------------------
    def settle(self) -> Verdict | None:
        """Finish the previous step's post-validation: wait for the global gradient norm and
        inf/nan check and, if the step should have been clipped or skipped, undo it and redo
        it. ``train_batch``, ``eval_batch`` and checkpoint save/load call this themselves;
        call it before reading the weights in other ways after the last ``train_batch``.
        Returns the check's outcome, or None when nothing was pending (or post-validation is off)."""
        return self._validator.settle(self) if self._validator is not None else None

    @property
    def redone_steps(self) -> int:
        """Post-validated steps that had to be undone and redone (clipped or skipped)."""
        return self._validator.redone_steps if self._validator is not None else 0

    @property
    def rerun_steps(self) -> int:
        """Speculated steps that ran a second time (their predecessor was redone)."""
        return self._validator.rerun_steps if self._validator is not None else 0

    def get_global_grad_norm(self) -> float | None:
        self.settle()
        return super().get_global_grad_norm()  # type: ignore[misc]

    def _aggregate_total_loss(self) -> Any:
        if self._validator is None:
            return super()._aggregate_total_loss()  # type: ignore[misc]
        return self.agg_train_loss  # set at the step: no broadcast that would hold every rank here

    # ---- the step ---------------------------------------------------------------------------
    def _take_model_step(self, lr_kwargs: Any = None) -> None:
        step = partial(self._ordinary_step, lr_kwargs)
        if self._validator is None:
            step()
        else:
            self._validator.step(self, step)

    def _ordinary_step(self, lr_kwargs: Any) -> None:
        """DeepSpeed's step (unscale, inf/nan check, skip, scale update); fp16 adds agreement checks."""
        self._force_grad_boundary = True  # as PipelineEngine's optimizer-step handler sets it (a redo runs outside it)
        try:
            self._step_with_checks(lr_kwargs)
        finally:
            self._force_grad_boundary = False

    def _step_with_checks(self, lr_kwargs: Any) -> None:
        if not self.fp16_enabled() or self._vs_optimistic:
            super()._take_model_step(lr_kwargs)  # type: ignore[misc]
            return
        if not getattr(self, "_vs_overflow_group_checked", False):
            check_overflow_group(self)  # before the first step, while no rank has stepped alone
            self._vs_overflow_group_checked = True
        super()._take_model_step(lr_kwargs)  # type: ignore[misc]
        if agree_on_overflow(self):
            # All W ran before the step; drop anything parked anyway so the next step starts clean.
            self._store.clear()
            self._meter.set_extra(self._store.parked_bytes)

    def clip_fp32_gradients(self) -> None:
        """Clip by the global norm over all stages (DeepSpeed's own takes a per-stage norm)."""
        if self._vs_optimistic:
            return  # post-validation clips, if at all, when it redoes the step
        max_norm = self.gradient_clipping()
        grads = [(p.grad, getattr(p, "ds_pipe_replicated", False)) for p in self.module.parameters() if p.grad is not None]
        if self._vs_known_norm is not None:
            total = self._vs_known_norm  # a post-validation redo: the check already summed the same figures
        else:
            local = torch.zeros(1, dtype=torch.float64, device=self.device)
            for g, replicated in grads:
                if not replicated:  # a tied copy on a second rank counts once, on its owner
                    local += g.detach().double().pow(2).sum()
            dist.all_reduce(local, group=self.grid.get_pipe_parallel_group())
            total = math.sqrt(local.item())
        self._global_grad_norm = total
        coef = max_norm / (total + 1e-6)
        if coef < 1.0:
            for g, _ in grads:
                g.detach().mul_(coef)
