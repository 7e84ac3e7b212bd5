"""Which transfer order a rank runs: the per-pair default, or the step's one global order.

The default lowering (``schedules.p2p_order.place_posts``) posts receives early within each
pair's order, which is safe when every pair of ranks has a communicator and a stream of its
own that progress independently (``p2p_check.check_transfers``'s default model). Three
conditions break that model:

* **One hardware queue** (``CUDA_DEVICE_MAX_CONNECTIONS=1``, which Megatron-DeepSpeed's launch
  scripts set for tensor-parallel overlap): every NCCL operation of a rank runs in issue order
  on one queue, and a stream-ordered wait holds back everything issued after it. The looped
  placements (interleaved, breadth-first) then deadlock in their first step.
* **Dynamic shapes** (``dynamic_shape`` modules, unequal sequence chunks): every receive
  brings a header the host must read before its next operation with that peer; interleaved
  at p >= 3 deadlocks on those reads.
* **Device-wide synchronizes inside a step**: ZeRO-3's coalesced all-gather
  (``gather_params``) and ZeRO-2's ``allreduce_and_copy`` (``reduce_stage_grads``) end in
  ``get_accelerator().synchronize()``, which waits for every posted receive of the rank.
  Looped placements at p >= 3 post their first receive (from rank p-1) before the first
  gather: in the default order the synchronize waits for data that needs this rank's forward.

``use_global_order`` checks the default order under the model that applies; where it would
deadlock, every rank lowers with ``one_queue=True`` (``schedules.one_queue``: every rank issues
its transfers in one global order, as torch's looped schedules do with all transfers on one
communicator), checks that order too, and logs a warning naming the reason. The answer depends
only on the schedule and the environment, so every rank makes the same choice.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import lru_cache

from deepspeed.utils import logger

from ...schedules import Schedule
from ...schedules.lowering import programs
from ...schedules.ops import OpKind
from ...schedules.p2p_check import check_transfers
from ...schedules.p2p_order import TransferOrderError
from ..transfers.device import MAX_CONNECTIONS_ENV, one_hardware_queue

__all__ = ["use_global_order"]


def use_global_order(schedule: Schedule, *, train: bool, dynamic_shapes: bool, one_queue: bool | None = None,
                     synchronize_at: Iterable[OpKind] = ()) -> bool:
    """True when ``schedule``'s default transfer order would deadlock here and the global one must run.

    ``one_queue``: None reads ``CUDA_DEVICE_MAX_CONNECTIONS``; ``synchronize_at``: the op kinds
    this engine acts on with a device-wide synchronize (its ZeRO stage's data-parallel points).
    Raises ``TransferOrderError`` when neither order is safe (a lowering bug)."""
    one_queue = one_hardware_queue() if one_queue is None else one_queue
    return _decide(schedule, train, dynamic_shapes, one_queue, frozenset(synchronize_at))


@lru_cache(maxsize=64)
def _decide(schedule: Schedule, train: bool, dynamic_shapes: bool, one_queue: bool, synchronize_at: frozenset[OpKind]) -> bool:
    if not (one_queue or dynamic_shapes or synchronize_at):
        return False  # the default order was checked under the default model at initialize
    model = {"one_queue": one_queue, "dynamic_shapes": dynamic_shapes, "synchronize_at": synchronize_at}
    try:
        check_transfers(programs(schedule, train=train), **model)
        return False
    except TransferOrderError as err:
        default_fails = str(err).splitlines()
    check_transfers(programs(schedule, train=train, one_queue=True), **model)
    logger.warning(
        f"ds_vshape: schedule {schedule.name!r} (p={schedule.stages}, m={schedule.micro_batches}, "
        f"{'training' if train else 'evaluation'}) would deadlock in its default transfer order "
        f"{_reason(one_queue, dynamic_shapes, synchronize_at)}"
        f" ({default_fails[1].strip() if len(default_fails) > 1 else default_fails[0]}); every rank posts its receives in "
        "the step's one global transfer order instead (schedules/one_queue.py), which the checker proves safe here"
    )
    return True


def _reason(one_queue: bool, dynamic_shapes: bool, synchronize_at: frozenset[OpKind]) -> str:
    reasons = []
    if one_queue:
        reasons.append(f"with one hardware queue per GPU ({MAX_CONNECTIONS_ENV}=1: every stream-ordered wait holds back "
                       "all later transfers of the rank)")
    if dynamic_shapes:
        reasons.append("when every receive brings a shape header (dynamic shapes or unequal sequence chunks)")
    if synchronize_at:
        points = ", ".join(sorted(kind.value for kind in synchronize_at))
        reasons.append(f"with ZeRO's device-wide synchronize at {points} (it waits for every posted receive of the rank)")
    return " and ".join(reasons)
