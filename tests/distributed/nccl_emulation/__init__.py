"""NCCL semantics on gloo, as torch's ProcessGroupNCCL runs them, so CPU tests catch GPU hangs.

Gloo is forgiving where NCCL is not: gloo matches messages by tag, buffers sends eagerly and
runs every operation independently. ``install(mode=...)`` replaces ``torch.distributed``'s p2p
functions (``send``, ``recv``, ``isend``, ``irecv``, ``batch_isend_irecv``) and its tensor
collectives (in ``torch.distributed`` and ``torch.distributed.distributed_c10d``, so ``P2POp``
and ``deepspeed.comm``, which look them up at call time, use them too) with versions that obey
NCCL's rules (torch 2.13's ``ProcessGroupNCCL::pointToPoint`` and ``batch_isend_irecv``):

1. One communicator = one ordered queue per rank, drained by one thread: its entries run
   strictly in issue order, each to completion before the next starts. An entry is one
   unbatched p2p op, one whole ``batch_isend_irecv`` call (its ops, whatever their peers,
   progress together; it completes when all did; it returns ONE Work, as NCCL's coalescing),
   or one collective (the real gloo collective on that group, run from the queue's thread, so
   ranks must reach it at the same position of their queues). So a posted receive holds back
   every later entry on its communicator: sends to other peers and collectives included.
2. Which communicator: "eager" (device bound at ``init_process_group``, what DeepSpeed does on
   GPUs): every op on a process group, batched or not, and its collectives, use the group's
   one communicator; subgroups from ``new_group`` are eager too. "lazy": an unbatched p2p op
   gets a 2-rank communicator of its own per (group, pair of ranks); batches and collectives
   use the group's. A header sent in a batch and received unbatched then never meet.
3. Tags are ignored: per communicator, the i-th send A->B pairs with the i-th receive at B.
4. Rendezvous: a send completes only when the peer's matching receive runs.
5. First contact (its own switch: ``install(first_contact=True)`` or env
   ``DS_VSHAPE_NCCL_FIRST_CONTACT=1``; off by default): a rank's first p2p call with a peer on a
   communicator blocks its host, inside the call, until that peer has made its own first call
   with it on that communicator, as NCCL connects a pair in ``ncclGroupEnd``. A call that waits
   past the timeout raises there ("... first contact ... timed out ...").
6. Synchronize (its own switch: ``install(synchronize=True)`` or env
   ``DS_VSHAPE_NCCL_SYNCHRONIZE=1``): DeepSpeed's ``get_accelerator().synchronize()`` blocks
   the host until every entry the rank issued before it completed, posted receives and
   unmatched sends included, as a device-wide synchronize does on a GPU (``device_sync``);
   past the timeout it raises ("... synchronize ... timed out ...").
7. One queue per rank (its own switch: ``install(one_queue=True)`` or env
   ``DS_VSHAPE_NCCL_ONE_QUEUE=1``): every communicator of the rank feeds one ordered queue,
   drained by one thread, as with ``CUDA_DEVICE_MAX_CONNECTIONS=1`` (one hardware queue) and
   NCCL's caveat that two communicators need not progress concurrently: a posted receive on
   one pair's communicator holds back a send on another's. Data still matches per
   communicator. A stream-ordered wait is a host wait here (the runtime waits on the host
   on gloo), so it holds back everything issued after it, as one hardware queue does.

Data travels over gloo on the default group with global ranks, on three reserved tags per
communicator. The host blocks in ``Work.wait()`` (and in blocking calls, collectives without
``async_op`` included), which raises ``RuntimeError`` ("... timed out ...", naming the op, its
peers, the communicator and the mode) after its timeout: the argument, else ``install``'s,
else env ``DS_VSHAPE_NCCL_TIMEOUT_S``, else 60 s; for a collective, its group's timeout as it
stood at issue where that is shorter (NCCL's watchdog times a collective from its issue, with
the timeout its group had then, however long it queued). An error inside an entry is raised by
``wait()``. After a timeout the communicator is wedged, as under NCCL: later entries never run.
Not emulated: self send/recv, ops inside torch's ``_coalescing_manager`` (left to gloo).
"""

from __future__ import annotations

from .emulator import (first_contact, first_contacts_made, install, installed, mode, one_queue, original, synchronize_rule,
                       synchronizes, synchronizes_waited, unfinished_ops, uninstall)
from .queues import EmulatedWork
from .settings import (FIRST_CONTACT_ENV, MODE_ENV, MODES, ONE_QUEUE_ENV, SYNCHRONIZE_ENV, TIMEOUT_ENV, env_first_contact,
                       env_mode, env_switch)

__all__ = ["FIRST_CONTACT_ENV", "MODES", "MODE_ENV", "ONE_QUEUE_ENV", "SYNCHRONIZE_ENV", "TIMEOUT_ENV", "EmulatedWork",
           "env_first_contact", "env_mode", "env_switch", "first_contact", "first_contacts_made", "install", "installed",
           "mode", "one_queue", "original", "synchronize_rule", "synchronizes", "synchronizes_waited", "unfinished_ops", "uninstall"]
