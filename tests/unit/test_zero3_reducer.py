"""Zero3Reducer's bookkeeping (pure): which gradients each reduce round takes, once per step;
refusals of a W outside its stage's gathered run and of a gradient arriving after its stage's
reduce; releases that DeepSpeed's stale per-layer marks cannot block.

The optimizer and the parameters' ZeRO-3 methods are stand-ins recording what the reducer asks
of them; that DeepSpeed's real ZeRO-3 then gives the reference's parameters is checked on real
gloo ranks in tests/distributed/test_zero.py.
"""
from __future__ import annotations

from typing import Any

import pytest
import torch
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

from ds_vshape.runtime.zero.zero import Zero3Reducer


class _Opt:
    """The attributes and calls of DeepSpeed's ZeRO-3 optimizer the reducer uses, recorded."""

    def __init__(self, groups: list[list[torch.nn.Parameter]]) -> None:
        self.fp16_groups = groups
        self._coalesce_grad_reduction = False
        self.model_parallel_rank = 0
        self.rounds: list[list[str]] = [[]]

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        assert is_boundary

    def reduce_independent_p_g_buckets_and_remove_grads(self, p: torch.nn.Parameter) -> None:
        self.rounds[-1].append(p.label)
        p.grad = None  # as DeepSpeed's partition_grads leaves it

    def independent_gradient_partition_epilogue(self) -> None:
        self.rounds.append([])


def _param(name: str, *, persist: bool = False) -> Any:
    p = torch.nn.Parameter(torch.zeros(2))
    p.label, p.ds_status, p.ds_persist, p.is_external_param, p.ds_id = name, ZeroParamStatus.NOT_AVAILABLE, persist, False, 0
    p.ds_active_sub_modules = set()
    log: list[str] = []
    p.log = log

    def all_gather(param_list: list[Any]) -> None:
        for q in param_list:
            q.ds_status = ZeroParamStatus.AVAILABLE
            q.log.append("gather")

    def partition(param_list: list[Any]) -> None:
        for q in param_list:
            q.ds_status = ZeroParamStatus.NOT_AVAILABLE
            q.log.append("partition")

    p.all_gather, p.partition = all_gather, partition
    return p


def _reducer() -> tuple[Zero3Reducer, _Opt, dict[str, Any]]:
    ps = {n: _param(n, persist=n == "small") for n in ("a0", "b0", "a3", "tied", "small")}
    opt = _Opt([list(ps.values())])
    stages = {0: [ps["a0"], ps["b0"], ps["tied"]], 3: [ps["a3"], ps["small"]]}
    return Zero3Reducer(opt, stages, tensor_parallel_rank=0, tied=frozenset({id(ps["tied"])}), rank=5), opt, ps


def _grads(ps: dict[str, Any]) -> None:
    for p in ps.values():
        p.grad = torch.ones(2)


def test_each_gradient_is_reduced_once_per_step_by_its_stage_and_tied_ones_at_the_tail() -> None:
    reducer, opt, ps = _reducer()
    assert opt._coalesce_grad_reduction  # DeepSpeed's hooks reduce nothing themselves
    for _ in range(2):
        opt.rounds = [[]]
        reducer.start_step()
        _grads(ps)
        reducer.reduce_stage(3)
        reducer.reduce_stage(3)  # a repeated point takes nothing twice
        reducer.reduce_stage(0)
        reducer.finish()
        assert opt.rounds == [["a3", "small"], [], ["a0", "b0"], ["tied"], []]
        assert reducer.calls == 4


def test_a_gradient_after_its_stage_reduce_is_refused_not_lost() -> None:
    reducer, _, ps = _reducer()
    reducer.start_step()
    _grads(ps)
    reducer.reduce_stage(0)
    ps["b0"].grad = torch.ones(2)  # a W of stage 0 after the reduce
    with pytest.raises(RuntimeError) as err:
        reducer.finish()
    for needle in ("rank 5", "step 1", "stage 0", "reduce_stage_grads", "add_stage_reduces"):
        assert needle in str(err.value)


def test_w_outside_its_stage_gathered_run_is_refused() -> None:
    reducer, _, _ = _reducer()
    reducer.start_step()
    with pytest.raises(RuntimeError, match=r"rank 5, step 1: the W pass of micro-batch 2 of stage 3 .* released"):
        reducer.require_gathered(3, what="the W pass of micro-batch 2")
    reducer.gather_stage(3)
    reducer.require_gathered(3, what="W")
    reducer.release_stage(3)
    with pytest.raises(RuntimeError, match="gather_params and release_params"):
        reducer.require_gathered(3, what="W")
    reducer.require_gathered(7, what="W")  # not this rank's stage: nothing to check


def test_release_is_not_blocked_by_stale_layer_marks_and_restores_flags() -> None:
    reducer, _, ps = _reducer()
    reducer.gather_stage(0)
    assert all(ps[n].ds_persist and ps[n].ds_status == ZeroParamStatus.AVAILABLE for n in ("a0", "b0"))
    ps["a0"].ds_active_sub_modules.add(9)  # a post-backward hook that miscounted micro-batches in flight
    reducer.release_stage(0)
    assert [ps[n].log for n in ("a0", "b0")] == [["gather", "partition"]] * 2
    assert not ps["a0"].ds_persist and not ps["a0"].is_external_param and not ps["a0"].ds_active_sub_modules
    reducer.gather_stage(3)
    reducer.release_stage(3)
    assert ps["small"].ds_persist and ps["small"].ds_status == ZeroParamStatus.AVAILABLE  # DeepSpeed keeps it whole
    assert reducer.gathers == 2
