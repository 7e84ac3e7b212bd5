"""Which accelerator device this rank uses, bound before ``initialize`` touches a tensor.

DeepSpeed binds the device (``args.device_rank``, else ``LOCAL_RANK``) only inside
``DeepSpeedEngine.__init__``. ``ds_vshape.initialize`` moves weights between ranks (carry)
and times layers (profile) before that, so unless the user's script called ``set_device``
itself every rank of a node would work on device 0: NCCL then refuses two ranks on one GPU,
or worse, memory lands on the wrong card. ``bind_local_device`` binds it first, by the same
rule DeepSpeed uses later, and ``comm_device`` is where this rank's transfer buffers live.

DeepSpeed's ``init_distributed`` binds the default process group to device ``LOCAL_RANK``
(eager NCCL init), and every group made later inherits that device. An ``args.device_rank``
naming another device would put the transfers' tensors on a device their communicators are
not bound to, so ``bind_local_device`` refuses it before any transfer is issued.

``waits_on_stream`` says how a rank waits for its transfers: stream-ordered where the
backend that moves tensors of this device is NCCL, on the host otherwise. It reads the
backend per device type, so a mixed default backend (``"cpu:gloo,cuda:nccl"``) gives CUDA
tensors NCCL's waits.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator

__all__ = ["MAX_CONNECTIONS_ENV", "bind_local_device", "check_device_rank", "comm_device", "one_hardware_queue",
           "waits_on_stream"]

MAX_CONNECTIONS_ENV = "CUDA_DEVICE_MAX_CONNECTIONS"


def one_hardware_queue() -> bool:
    """Whether this process runs with one hardware queue per GPU (``CUDA_DEVICE_MAX_CONNECTIONS=1``,
    as Megatron-DeepSpeed's launch scripts set): every NCCL operation of the rank then runs in
    issue order on one queue, whatever its communicator."""
    return os.environ.get(MAX_CONNECTIONS_ENV, "").strip() == "1"


def check_device_rank(args: Any = None) -> int:
    """This rank's device index: ``LOCAL_RANK`` (0 without it); refuses an ``args.device_rank`` that differs."""
    local = int(os.environ.get("LOCAL_RANK", "0"))
    asked = getattr(args, "device_rank", None)
    if asked is not None and int(asked) != local:
        rank = os.environ.get("RANK", "?")
        raise ValueError(
            f"rank {rank}: args.device_rank={asked} but LOCAL_RANK={local}. DeepSpeed binds the process groups to "
            f"device LOCAL_RANK, so pipeline transfers on device {asked} would go through communicators bound to "
            f"another device and hang. Drop args.device_rank (or set it to LOCAL_RANK) and choose the GPU with "
            "CUDA_VISIBLE_DEVICES or the launcher's --include/--num_gpus instead"
        )
    return local


def bind_local_device(args: Any = None) -> int:
    """Set the current device to DeepSpeed's choice for this rank; returns its index."""
    index = check_device_rank(args)
    get_accelerator().set_device(index)  # a no-op on DeepSpeed's CPU accelerator
    return index


def comm_device() -> torch.device:
    """The device this rank's transfer buffers go on: the accelerator's current device."""
    return torch.device(get_accelerator().current_device_name())


def waits_on_stream(device: torch.device, group: Any = None) -> bool:
    """Whether transfers of tensors on ``device`` over ``group`` (default: the world) run on NCCL."""
    config = dist.get_backend_config(group)  # "cpu:gloo,cuda:nccl"; a single backend reads "cuda:nccl"
    backends = dict(item.split(":", 1) for item in config.split(",") if ":" in item)
    if not backends:  # an older torch's single name
        return config == "nccl"
    return backends.get(device.type) == "nccl"
