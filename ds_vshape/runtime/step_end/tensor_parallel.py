"""Tensor parallelism (DeepSpeed's ``model`` topology axis) as the engine's reductions see it.

A 3D job (``PipeModelDataParallelTopology``) runs each pipeline stage on several
tensor-parallel ranks. Sharded parameters (Megatron's column/row-parallel weights, marked
``model_parallel`` or ``tensor_model_parallel`` as DeepSpeed expects) hold a different slice
on each of them; every other parameter (norms, a row-parallel layer's bias) is a replica. A
global gradient norm sums each sharded slice once per tensor-parallel rank and each replica
once in all, so replicas are counted on tensor-parallel rank 0 only.
"""

from __future__ import annotations

from typing import Any

import torch
from deepspeed.runtime.utils import is_model_parallel_parameter

__all__ = ["model_parallel_size", "counted_in_norm", "norm_group"]


def model_parallel_size(topology: Any) -> int:
    """Ranks along the topology's ``model`` (tensor-parallel) axis; 1 when it has none."""
    return topology.get_dim("model") if "model" in topology.get_axis_names() else 1


def counted_in_norm(param: torch.nn.Parameter, *, tp_rank: int) -> bool:
    """Whether this rank's copy of ``param`` enters the global gradient norm.

    A tied layer's copy on a rank other than its owner (``ds_pipe_replicated``) never does;
    a tensor-parallel replica does on tensor-parallel rank 0 only; a shard always does.
    """
    if getattr(param, "ds_pipe_replicated", False):
        return False
    return tp_rank == 0 or is_model_parallel_parameter(param)


def norm_group(grid: Any) -> Any:
    """The group a global norm is summed over: the pipeline, and its tensor-parallel ranks if any.

    Without a model axis it is the pipeline group itself (its communicator, as before); with
    one, DeepSpeed's model-parallel group, which spans pipe x model of one data-parallel replica.
    """
    if grid.get_slice_parallel_world_size() > 1:
        return grid.get_model_parallel_group()
    return grid.get_pipe_parallel_group()
