"""The engine's ZeRO-2/3 side: reducers built at init, the data-parallel ops of the lowered stream.

A mixin of ``VShapeEngine`` (before ``PipelineEngine`` in its bases), kept apart so the engine
module stays about executing a schedule. The work itself is in ``runtime/zero/zero.py``.
"""

from __future__ import annotations

import sys
from typing import Any

import torch.distributed as dist
from deepspeed.runtime.pipe import schedule as ds_schedule
from deepspeed.runtime.pipe.engine import PipelineEngine

from ..program import instructions as ins
from ..dropin.checkpoint import CheckpointError
from .zero import StageGradReducer, Zero3Reducer, whole_parameters

__all__ = ["ZeroPipelineMixin"]


class ZeroPipelineMixin:
    """ZeRO-2/3 inside the pipeline. Expects ``self`` to be a ``PipelineEngine``."""

    _zero_reducer: StageGradReducer | Zero3Reducer | None

    def _stage_grad_reducer(self) -> StageGradReducer | Zero3Reducer | None:
        """Under ZeRO-2/3, what replaces DeepSpeed's per-micro-batch gradient reduce."""
        stage = super().zero_optimization_stage()
        if stage not in (2, 3):
            return None
        stages = {s: [p for m in self.module.stage_modules(s) for p in m.parameters()] for s in self.module.local_stages}
        tied = {id(w) for w, _ in self.module.get_tied_weights_and_groups()}
        if stage == 3:
            return Zero3Reducer(self.optimizer, stages, tensor_parallel_rank=self.grid.get_slice_parallel_rank(),
                                tied=frozenset(tied), rank=dist.get_rank())
        return StageGradReducer(self.optimizer, stages, tied=tied)

    def zero_optimization_stage(self) -> int:
        stage = super().zero_optimization_stage()
        # PipelineEngine.__init__ asserts stage < 2: its schedule would reduce gradients on every
        # micro-batch. Ours reduces them once per step (runtime/zero/zero.py), so that one
        # check is answered as for ZeRO-1; every other caller gets the real stage.
        if stage in (2, 3) and sys._getframe(1).f_code is PipelineEngine.__init__.__code__:
            return 1
        return stage

    def load_module_state_dict(self, *args: Any, **kwargs: Any) -> None:
        # Layer files hold whole tensors; under ZeRO-3 they load into gathered parameters,
        # re-sharded on exit (DeepSpeed's load partitions everything just before this).
        with whole_parameters(self, modify=True):
            super().load_module_state_dict(*args, **kwargs)

    def _exec_reduce_stage_grads(self, stage: int) -> None:
        if self._zero_reducer is not None:
            self._zero_reducer.reduce_stage(stage)

    def _exec_gather_params(self, stage: int) -> None:
        if isinstance(self._zero_reducer, Zero3Reducer):
            self._zero_reducer.gather_stage(stage)

    def _exec_release_params(self, stage: int) -> None:
        if isinstance(self._zero_reducer, Zero3Reducer):
            self._zero_reducer.release_stage(stage)

    def _zero_before_weight_pass(self, stage: int, micro_batch: int) -> None:
        """Under ZeRO-3 a W pass accumulates into full-shaped parameters: its stage must be gathered."""
        if isinstance(self._zero_reducer, Zero3Reducer):
            self._zero_reducer.require_gathered(stage, what=f"the W pass of micro-batch {micro_batch}")

    def _exec_reduce_tied_grads(self) -> None:
        # The step's tail starts here (every rank's first tail op): its host reads (gradient norm,
        # fp16 overflow, post-validation) must not block behind a stuck stream-ordered wait.
        self._p2p.settle_waits("the start of the step's tail (reduce_tied_grads)")
        if self._zero_reducer is None:
            super()._exec_reduce_tied_grads()
            return
        # DeepSpeed's version first runs the ZeRO-2 epilogue meant for its hooks; here tied
        # gradients are still whole, so they are all-reduced across stages before their reduce.
        for weight, group in self.module.get_tied_weights_and_groups():
            if weight.grad is not None:
                dist.all_reduce(weight.grad, group=group)

    def _exec_reduce_grads(self) -> None:
        if self._zero_reducer is None:
            super()._exec_reduce_grads()
            return
        self._force_grad_boundary = True
        self._zero_reducer.finish()
        self._force_grad_boundary = False

    def _refuse_zero3_weights_only(self, *, load_optimizer_states: bool, load_module_only: bool) -> None:
        if self.zero_optimization_stage() == 3 and (load_module_only or not load_optimizer_states):
            raise CheckpointError(
                f"rank {dist.get_rank()}: a weights-only load (load_optimizer_states=False or load_module_only=True) is not "
                "supported under zero_optimization.stage=3 in the pipeline: ZeRO-3's fp32 master shards would not follow the "
                "loaded weights. Load with the optimizer state under the saving schedule, or load weights-only with "
                "zero_optimization.stage=2 (or 0/1) and save again"
            )

    INSTRUCTIONS = {
        ins.ReduceStageGrads: _exec_reduce_stage_grads,
        ins.GatherParams: _exec_gather_params,
        ins.ReleaseParams: _exec_release_params,
        # DeepSpeed's map holds its own functions; these two are overridden for ZeRO-2/3.
        ds_schedule.ReduceTiedGrads: _exec_reduce_tied_grads,
        ds_schedule.ReduceGrads: _exec_reduce_grads,
    }
