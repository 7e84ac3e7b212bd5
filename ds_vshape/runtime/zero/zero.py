"""ZeRO-2 and ZeRO-3 in the pipeline: gradients reduced once per step, never per micro-batch.

DeepSpeed's ZeRO-2 optimizer reduces a parameter's gradient from a hook each time autograd
accumulates into it, that is once per micro-batch; DeepSpeed's pipeline engine refuses ZeRO-2
for that reason. Here those hooks are removed: gradients accumulate locally over the step, as
under ZeRO-1, and each stage's gradients go into the optimizer's reduce-scatter buckets when the
lowered stream reaches ``reduce_stage_grads`` for that stage (right after the stage's last
backward pass, W included under split backward). What the optimizer then does with them (keep
the owned partition, drop the rest, clip on the global norm, step) is DeepSpeed's own code,
unchanged.

ZeRO-3 gathers a stage's weight shards once per run of its passes in one direction
(``gather_params`` / ``release_params``); DeepSpeed's per-layer hooks find them whole and leave
them so. Under split backward the W passes belong to the backward runs, so a W always finds its
stage gathered: it needs no weight values (it multiplies kept activations by kept output
gradients), but it accumulates into the full-shaped parameter, whose gradient hook DeepSpeed
owns. Those hooks are told to hold their reduce (``_coalesce_grad_reduction``); the stage's
gradients go into ZeRO-3's reduce-scatter buckets at its ``reduce_stage_grads``, once per step.

Tied parameters (``PipelineModule``'s tied weights) are all-reduced across the pipeline at the
step tail first, so they are reduced over data parallel only then, with whatever a stage's
reduce skipped.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

from ...schedules.ops import OpKind

__all__ = ["StageGradReducer", "Zero3Reducer", "ZeroLayoutError", "check_zero_config", "whole_parameters"]


class ZeroLayoutError(RuntimeError):
    """The ZeRO optimizer is not the one this module knows how to drive."""


def check_zero_config(config: dict[str, Any], *, schedule: str, allowed: tuple[int, ...], tied: bool, seq_chunks: int) -> None:
    """Refuse a ZeRO setting the pipeline would not honour, naming the field and what to change.

    ``allowed``: the schedule's ZeRO stages (the registry's rule); ``tied``: the module has
    tied layers; ``seq_chunks``: sequence chunks per micro-batch.
    """
    zero = int((config.get("zero_optimization") or {}).get("stage", 0))
    if zero not in allowed:
        stages = ", ".join(str(z) for z in allowed)
        raise ValueError(f"zero_optimization.stage={zero} is not supported with schedule {schedule!r}: it runs with ZeRO "
                         f"stages {stages}; set zero_optimization.stage to one of them, or pick a schedule that lists {zero} "
                         "in `ds-vshape list`")
    if zero == 3 and tied:
        raise ValueError("zero_optimization.stage=3 with tied layers (TiedLayerSpec) is not supported in the pipeline: the "
                         "tied weight's gradient is all-reduced across stages while ZeRO-3 holds it in shards; use "
                         "zero_optimization.stage=2")
    if zero == 3 and seq_chunks > 1:
        raise ValueError(f"zero_optimization.stage=3 with pipeline.seq_chunks={seq_chunks} is not supported: the chunks' "
                         "attention keys and values outlive ZeRO-3's per-layer parameter gathering; use "
                         "zero_optimization.stage=2 or seq_chunks=1")
    if zero == 2:
        _check_accumulation(config)


_SAME = {"bf16": ("bf16", "bfloat16"), "fp16": ("fp16", "float16", "half")}


def _check_accumulation(config: dict[str, Any]) -> None:
    """DeepSpeed's own ZeRO-2 folds each micro-batch's reduced gradient into a ``grad_accum_dtype``
    accumulator; here micro-batches accumulate locally in the model's dtype before the one
    reduce per step, so a wider accumulator than the model dtype cannot be honoured."""
    accum = (config.get("data_types") or {}).get("grad_accum_dtype")
    model = next((k for k in ("bf16", "fp16") if (config.get(k) or {}).get("enabled")), "fp32")
    if accum is None or model == "fp32" or str(accum).lower() in _SAME[model]:
        return
    raise ValueError(
        f"data_types.grad_accum_dtype={accum!r} with {model} and zero_optimization.stage=2 is not supported in the pipeline: "
        f"micro-batch gradients accumulate in {model} before the once-per-step reduce, so the wider accumulator would be "
        "silently ignored. Remove data_types.grad_accum_dtype, or use zero_optimization.stage=1 (bf16 then accumulates in fp32)"
    )


_NEEDED = ("_grad_acc_hooks", "bit16_groups", "setup_buckets", "reduce_ready_partitions_and_remove_grads",
           "reduce_ipg_grads", "overlapping_partition_gradients_reduce_epilogue", "set_gradient_accumulation_boundary")


def _require(optimizer: Any, names: tuple[str, ...], *, stage: int, wants: str) -> None:
    """The optimizer DeepSpeed built has what this module drives, or a clear refusal."""
    missing = [name for name in names if not hasattr(optimizer, name)]
    if missing:
        raise ZeroLayoutError(
            f"zero_optimization.stage={stage} in the pipeline needs {wants}; {type(optimizer).__name__} lacks "
            f"{', '.join(missing)}. Use the DeepSpeed version this plugin pins, or zero_optimization.stage={stage - 1}"
        )


class StageGradReducer:
    """Drives a DeepSpeed ZeRO-2 optimizer's reduction per pipeline stage instead of per micro-batch.

    ``stage_params``: this rank's model stages and the parameters each owns; ``tied``: ids of
    parameters that are all-reduced across stages at the step tail (reduced in ``finish``).
    """

    OPS = frozenset({OpKind.REDUCE_STAGE_GRADS})  # the lowered ops it acts on

    def __init__(self, optimizer: Any, stage_params: dict[int, list[torch.nn.Parameter]], *, tied: set[int]) -> None:
        _require(optimizer, _NEEDED, stage=2, wants="DeepSpeed's ZeRO-1/2 optimizer (DeepSpeedZeroOptimizer)")
        self._opt = optimizer
        # Autograd would call DeepSpeed's reduce on every micro-batch's accumulation: off.
        for hook in optimizer._grad_acc_hooks:
            hook.remove()
        optimizer._grad_acc_hooks = []
        group_of = {id(p): i for i, group in enumerate(optimizer.bit16_groups) for p in group}
        self._stages = {
            stage: [(p, group_of[id(p)]) for p in params if p.requires_grad and id(p) not in tied and id(p) in group_of]
            for stage, params in stage_params.items()
        }
        self._all = [(p, i) for i, group in enumerate(optimizer.bit16_groups) for p in group if p.requires_grad]
        self._done: set[int] = set()
        self.calls = 0  # reduce rounds started this step (a stage's, or the tail's)

    def start_step(self) -> None:
        self._done.clear()
        self.calls = 0

    def reduce_stage(self, stage: int) -> None:
        """Hand every gradient of ``stage`` to the optimizer's reduce-scatter and flush it now."""
        todo = [(p, i) for p, i in self._stages.get(stage, []) if id(p) not in self._done]
        if todo:
            self._reduce(todo)

    def finish(self) -> None:
        """The step tail: reduce what no stage did (tied weights), then DeepSpeed's epilogue
        turns the reduced gradients into the owned flat partitions the optimizer steps on."""
        rest = [(p, i) for p, i in self._all if id(p) not in self._done]
        self._reduce(rest)
        self._opt.overlapping_partition_gradients_reduce_epilogue()

    def _reduce(self, params: list[tuple[torch.nn.Parameter, int]]) -> None:
        opt = self._opt
        # Every call is at the step's accumulation boundary: the gradient is the step's total.
        opt.set_gradient_accumulation_boundary(True)
        opt.setup_buckets()
        for p, i in params:
            self._done.add(id(p))
            if opt.get_gradient_for_reduction(p) is not None:
                opt.reduce_ready_partitions_and_remove_grads(p, i)
        opt.reduce_ipg_grads()  # start this stage's reduce now, not when a later stage fills the bucket
        self.calls += 1


_NEEDED_3 = ("_coalesce_grad_reduction", "fp16_groups", "reduce_independent_p_g_buckets_and_remove_grads",
             "independent_gradient_partition_epilogue", "model_parallel_rank", "set_gradient_accumulation_boundary")


class Zero3Reducer:
    """Drives DeepSpeed's ZeRO-3 by stage: weights gathered once per run of a stage's passes in
    one direction (``gather_params`` / ``release_params`` in the lowered stream), each stage's
    gradients reduce-scattered once per step at its ``reduce_stage_grads`` (after its last
    backward pass, W included), the rest (tied weights) at the step tail.

    ``tensor_parallel_rank``: this rank's tensor-slicing rank. DeepSpeed's ZeRO-3 counts a
    parameter in the gradient norm only on model-parallel rank 0, and the pipeline grid's
    model-parallel group spans the pipeline stages, so every stage but the first would drop
    out of the clipping norm; the tensor-slicing rank is what that rule means. ``tied``: ids
    of parameters all-reduced across stages at the step tail (reduced in ``finish``); ``rank``:
    this process's global rank, for errors.
    """

    OPS = frozenset({OpKind.GATHER_PARAMS, OpKind.RELEASE_PARAMS, OpKind.REDUCE_STAGE_GRADS})  # the lowered ops it acts on

    def __init__(self, optimizer: Any, stage_params: dict[int, list[torch.nn.Parameter]], *, tensor_parallel_rank: int,
                 tied: frozenset[int] = frozenset(), rank: int = 0) -> None:
        _require(optimizer, _NEEDED_3, stage=3, wants="DeepSpeed's DeepSpeedZeroOptimizer_Stage3")
        self._opt = optimizer
        optimizer._coalesce_grad_reduction = True  # the gradient hooks keep accumulating, reduce nothing
        optimizer.model_parallel_rank = tensor_parallel_rank
        self._stages = {stage: [p for p in params if hasattr(p, "ds_status")] for stage, params in stage_params.items()}
        self._reduced = {stage: [p for p in params if p.requires_grad and id(p) not in tied]
                         for stage, params in self._stages.items()}
        self._persist: dict[int, tuple[bool, bool]] = {}  # DeepSpeed's own flags of each gathered parameter
        self._gathered: set[int] = set()  # stages whose weights are whole now
        self._done: dict[int, int] = {}  # parameter id -> the stage whose reduce took it this step
        self.calls = 0  # reduce rounds this step (a stage's, or the tail's)
        self.gathers = 0  # stage gathers this step
        self.step = 0  # steps started, for errors
        self._rank = rank

    def gather_stage(self, stage: int) -> None:
        """The stage's weights whole until ``release_stage``: one all-gather for all its layers.

        While gathered they are flagged so that DeepSpeed's per-layer hooks find them available
        and leave them alone instead of fetching and releasing them around every pass.
        """
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

        params = self._stages.get(stage, [])
        for p in params:
            self._persist.setdefault(id(p), (p.ds_persist, p.is_external_param))
            # DeepSpeed's release after a layer's pass skips either flag, depending on whether
            # its module trace is complete (a pipeline's rarely is): set both while gathered.
            p.ds_persist = p.is_external_param = True
        self._gathered.add(stage)
        missing = [p for p in params if p.ds_status == ZeroParamStatus.NOT_AVAILABLE]
        if missing:
            missing[0].all_gather(param_list=missing)
            self.gathers += 1

    def release_stage(self, stage: int) -> None:
        """Back to shards, except what DeepSpeed itself keeps whole (small persistent weights)."""
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

        params = self._stages.get(stage, [])
        self._gathered.discard(stage)
        for p in params:
            p.ds_persist, p.is_external_param = self._persist.pop(id(p), (p.ds_persist, p.is_external_param))
            # DeepSpeed marks a layer active from its forward or pre-backward hook until its
            # post-backward hook; that hook counts one forward in flight per layer, so with several
            # micro-batches in flight (and a first stage's input, which takes no gradient) a mark
            # outlives every pass and would keep the stage whole. No pass of the stage runs between
            # its runs: a mark left now is stale.
            p.ds_active_sub_modules.clear()
        whole = [p for p in params if not p.ds_persist and p.ds_status == ZeroParamStatus.AVAILABLE]
        if whole:
            whole[0].partition(param_list=whole)

    def require_gathered(self, stage: int, *, what: str) -> None:
        """A W pass accumulates into its stage's full-shaped parameters: refuse one outside a gathered run."""
        if self._stages.get(stage) and stage not in self._gathered:
            raise RuntimeError(f"rank {self._rank}, step {self.step}: {what} of stage {stage} runs while the stage's ZeRO-3 "
                               "weights are released; the lowered stream must place every pass of a stage between its "
                               "gather_params and release_params (schedules/lowering.py add_param_gathers)")

    def start_step(self) -> None:
        self.calls = self.gathers = 0
        self._done.clear()
        self.step += 1

    def reduce_stage(self, stage: int) -> None:
        """The stage's last backward pass ran: its gradients are the step's totals, reduce-scatter them now."""
        self._reduce(stage, [p for p in self._reduced.get(stage, []) if id(p) not in self._done])

    def finish(self) -> None:
        """The step tail: reduce what no stage did (tied weights, after their cross-stage
        all-reduce), then DeepSpeed's epilogue hands the owned partitions to the optimizer."""
        rest = [p for group in self._opt.fp16_groups for p in group if p.requires_grad and id(p) not in self._done]
        late = [(self._done[id(p)], p) for group in self._opt.fp16_groups for p in group
                if id(p) in self._done and p.grad is not None]
        if late:
            stage, p = late[0]
            raise RuntimeError(f"rank {self._rank}, step {self.step}: {len(late)} gradient(s) of stage {stage} (first: ds_id {p.ds_id}) "
                               "arrived after the stage's reduce_stage_grads and would be lost; the lowered stream must "
                               "place it after the stage's last backward pass, W included (schedules/lowering.py "
                               "add_stage_reduces)")
        self._reduce(-1, rest)

    def _reduce(self, stage: int, params: list[torch.nn.Parameter]) -> None:
        opt = self._opt
        opt.set_gradient_accumulation_boundary(True)  # every gradient reduced here is the step's total
        for p in params:
            self._done[id(p)] = stage
            if p.grad is not None:
                opt.reduce_independent_p_g_buckets_and_remove_grads(p)
        # Flushes the buckets now (this stage's reduce-scatter starts here, not when a later stage
        # fills them) and points the optimizer at the owned partitions.
        opt.independent_gradient_partition_epilogue()
        self.calls += 1


def whole_parameters(engine: Any, *, modify: bool) -> AbstractContextManager[Any]:
    """Under ZeRO-3, this rank's parameters gathered whole for the block (else nothing).

    ``modify``: what the block writes into them is kept: data-parallel rank 0's copy is
    broadcast and re-sharded on exit (a checkpoint load, where every replica reads the same
    files).
    """
    if engine.zero_optimization_stage() != 3:
        return nullcontext()
    import deepspeed  # only here: the rest of this module drives an optimizer it is handed

    return deepspeed.zero.GatheredParameters(list(engine.module.parameters()), modifier_rank=0 if modify else None)
