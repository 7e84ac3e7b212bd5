"""3D jobs, the pure parts: which copies enter the global norm, data-parallel size, checkpoint layouts."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from deepspeed.runtime.pipe.topology import PipeDataParallelTopology, PipeModelDataParallelTopology
from torch import nn

from ds_vshape.runtime.dropin.checkpoint import CheckpointError, Layout, optim_file, plan_load, stock_layout
from ds_vshape.runtime.step_end.tensor_parallel import counted_in_norm, model_parallel_size


def _param(**attrs: bool) -> nn.Parameter:
    p = nn.Parameter(torch.zeros(2))
    for k, v in attrs.items():
        setattr(p, k, v)
    return p


@pytest.mark.parametrize(("attrs", "on_rank0", "on_rank1"), [
    ({}, True, False),  # a replica (norm, row-parallel bias): once, on tensor-parallel rank 0
    ({"tensor_model_parallel": True}, True, True),  # Megatron's mark: every shard
    ({"model_parallel": True}, True, True),  # DeepSpeed's older mark
    ({"tensor_model_parallel": True, "ds_pipe_replicated": True}, False, False),  # a tied copy off its owner
])
def test_counted_in_norm(attrs: dict[str, bool], on_rank0: bool, on_rank1: bool) -> None:
    p = _param(**attrs)
    assert (counted_in_norm(p, tp_rank=0), counted_in_norm(p, tp_rank=1)) == (on_rank0, on_rank1)


def test_model_parallel_size_reads_the_model_axis() -> None:
    assert model_parallel_size(PipeModelDataParallelTopology(num_pp=2, num_mp=4, num_dp=1)) == 4
    assert model_parallel_size(PipeDataParallelTopology(num_pp=2, num_dp=2)) == 1


def _layout(tp: int) -> Layout:
    return Layout(schedule="v-half", p=2, placement=(0, 1, 1, 0), stage_parts=(0, 1, 2, 3, 4), num_layers=4, zero_stage=0,
                  optimizer="SGD", mapped=True, holders={"0": [0], "1": [1], "2": [1], "3": [0]}, tp=tp)


def test_a_checkpoint_of_another_tensor_parallel_size_is_refused_even_for_weights() -> None:
    with pytest.raises(CheckpointError, match=r"2 tensor-parallel ranks but this run has 4.*num_mp=2"):
        plan_load(_layout(2), _layout(4), load_optimizer=False, where="d", rank=3)
    assert plan_load(_layout(2), replace(_layout(2), schedule="1f1b", placement=(0, 0, 1, 1)), load_optimizer=True,
                     where="d", rank=0) == "mapped"


def test_layout_without_tp_reads_as_one_and_round_trips_with_it() -> None:
    data = json.loads(_layout(1).to_json())
    del data["tp"]  # written before 3D support
    assert Layout.from_json(json.dumps(data), path="x").tp == 1
    assert Layout.from_json(_layout(2).to_json(), path="x") == _layout(2)


def test_optimizer_files_name_the_tensor_parallel_rank_only_in_3d() -> None:
    assert optim_file("d", 1).endswith("vs_optim_pp_rank_01.pt")
    assert optim_file("d", 1, tp_rank=0).endswith("vs_optim_pp_rank_01_tp_rank_00.pt")


def test_stock_3d_checkpoint_counts_pipeline_ranks_without_the_model_axis(tmp_path: Path) -> None:
    for r in range(4):  # p=2 x tp=2: one mp_rank file per pipeline x tensor-parallel rank
        (tmp_path / f"mp_rank_{r:02d}_model_states.pt").touch()
    for layer in range(3):
        for t in range(2):
            (tmp_path / f"layer_{layer:02d}-model_{t:02d}-model_states.pt").touch()
    layout = stock_layout(str(tmp_path))
    assert layout is not None and (layout.p, layout.tp) == (2, 2)
