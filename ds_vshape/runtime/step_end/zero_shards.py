"""Post-validation under ZeRO-1/2: what a rank owns of the step, and the figures it checks.

DeepSpeed's ZeRO-1/2 optimizer (``DeepSpeedZeroOptimizer``) keeps, per parameter group, one
flat partition per data-parallel rank. After the step's reduce-scatter each rank holds the
reduced gradient of its own partition only (``averaged_gradients``); its step unscales and
clips that partition by a norm all-reduced over data parallel and the model-parallel group
(the whole pipeline here), updates the fp32 master partition and its optimizer state, copies
the result into the rank's low-precision partition and all-gathers the low-precision
partitions across data parallel. So:

* the global figures are sums over the shards: each rank's owned gradient partition, summed
  over data parallel here (``shard_norm_sq``) and over the pipeline by post-validation's own
  asynchronous all-reduce;
* the undo copy holds the shards (``ZeroShards``): the low-precision partition and the reduced
  gradient partition (a redo steps on it again); the fp32 master partition, its optimizer
  state and the scalars are kept by ``StepSnapshot`` as for any optimizer. Restoring ends
  with the all-gather the step itself ends with, so every replica's whole low-precision
  weights are the pre-step ones again (every replica restores: they all see the same sums).

May import torch, ``torch.distributed`` and DeepSpeed; nothing else of ds_vshape but
``tensor_parallel``.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from deepspeed.runtime.utils import all_gather_dp_groups
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

from .tensor_parallel import counted_in_norm

__all__ = ["ZeroShards", "counted_shard_grads", "is_zero_optimizer", "shard_norm_sq", "zero_skips_nonfinite"]


def is_zero_optimizer(opt: Any) -> bool:
    """Whether ``opt`` is DeepSpeed's ZeRO-1/2 optimizer (the sharded path applies)."""
    return isinstance(opt, DeepSpeedZeroOptimizer)


def counted_shard_grads(grads: Iterable[torch.Tensor], params: Iterable[torch.nn.Parameter], *,
                        tp_rank: int) -> list[torch.Tensor]:
    """The owned-partition gradients that enter the global norm, as ZeRO's own norm takes them.

    ``grads``: one group's reduced partition (alignment padding marked ``_zero_padding``,
    possibly between tensors); ``params``: the group's parameters in the partition, in order.
    Padding is dropped before pairing, and a parameter counts as ``counted_in_norm`` says (a
    pipe-replicated tied copy never, a tensor-parallel replica on tensor-parallel rank 0 only).
    """
    real = [g for g in grads if not getattr(g, "_zero_padding", False)]
    return [g for g, p in zip(real, params) if counted_in_norm(p, tp_rank=tp_rank)]


def shard_norm_sq(engine: Any) -> torch.Tensor:
    """This pipeline rank's squared gradient norm under ZeRO-1/2 (float64, 1 element): its owned
    partitions' squares, summed over data parallel (a short wait among replicas, which reach
    this point together after their reduce-scatter). Not finite when some gradient is not."""
    opt = engine.optimizer
    tp_rank = engine.grid.get_slice_parallel_rank()
    total = torch.zeros(1, dtype=torch.float64, device=engine.device)
    for i, params in enumerate(opt.params_in_partition):
        for g in counted_shard_grads(opt.averaged_gradients.get(i) or [], params, tp_rank=tp_rank):
            total += g.detach().double().pow(2).sum()
    if dist.get_world_size(group=opt.dp_process_group) > 1:
        dist.all_reduce(total, group=opt.dp_process_group)
    return total


def zero_skips_nonfinite(opt: Any) -> bool:
    """Whether ZeRO's step skips on an inf/nan gradient: with its overflow check (fp16, or bf16
    with ``check_grad_overflow``), and, outside bf16, whenever it computes the norm (an invalid
    norm counts as overflow there, fp32 included)."""
    return bool(opt.check_grad_overflow or (opt.compute_grad_norm and opt.dtype != torch.bfloat16))


def _own(opt: Any, i: int) -> torch.Tensor:
    """Group ``i``'s low-precision partition owned by this rank (a view into the flat weights)."""
    return opt.parallel_partitioned_bit16_groups[i][dist.get_rank(group=opt.real_dp_process_group[i])]


@dataclass
class ZeroShards:
    """The ZeRO-specific part of an undo copy (see the module docstring)."""

    bit16: list[torch.Tensor]  # per group: the owned low-precision partition
    grads: dict[int, Any]  # ``averaged_gradients``: per group, the reduced partition (views kept)
    loss_scaler: dict[str, Any]  # the dynamic loss scaler's counters (fp16)

    @classmethod
    def take(cls, opt: Any) -> ZeroShards:
        if opt.cpu_offload:  # check_post_validation_config refuses it; the step's buffers differ there
            raise RuntimeError("post-validation cannot copy ZeRO's offloaded optimizer state (offload_optimizer)")
        return cls(
            bit16=[_own(opt, i).detach().clone() for i in range(len(opt.bit16_groups))],
            # One deepcopy keeps views of one flat buffer views of one new buffer, and the
            # padding marks; the step may scale a single-tensor group in place, so no references.
            grads=copy.deepcopy(dict(opt.averaged_gradients)),
            loss_scaler=copy.deepcopy(vars(opt.loss_scaler)),
        )

    def restore(self, opt: Any) -> None:
        """Put the shards back, then all-gather the low-precision partitions across data
        parallel (every replica restores at the same point, so the collective matches)."""
        with torch.no_grad():
            for i, saved in enumerate(self.bit16):
                _own(opt, i).copy_(saved)
        opt.averaged_gradients.clear()
        opt.averaged_gradients.update(copy.deepcopy(self.grads))
        vars(opt.loss_scaler).update(copy.deepcopy(self.loss_scaler))
        all_gather_dp_groups(groups_flat=opt.bit16_groups_flat, partitioned_param_groups=opt.parallel_partitioned_bit16_groups,
                             dp_process_group=opt.real_dp_process_group, start_alignment_factor=opt.nccl_start_alignment_factor,
                             allgather_bucket_size=opt.allgather_bucket_size)
