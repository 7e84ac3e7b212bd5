"""Which accelerator device this rank uses, bound before ``initialize`` touches a tensor.

DeepSpeed binds the device (``args.device_rank``, else ``LOCAL_RANK``) only inside
``DeepSpeedEngine.__init__``. ``ds_vshape.initialize`` moves weights between ranks (carry)
and times layers (profile) before that, so unless the user's script called ``set_device``
itself every rank of a node would work on device 0: NCCL then refuses two ranks on one GPU,
or worse, memory lands on the wrong card. ``bind_local_device`` binds it first, by the same
rule DeepSpeed uses later, and ``comm_device`` is where this rank's transfer buffers live.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from deepspeed.accelerator import get_accelerator

__all__ = ["bind_local_device", "comm_device"]


def bind_local_device(args: Any = None) -> int:
    """Set the current device to DeepSpeed's choice for this rank; returns its index."""
    index = getattr(args, "device_rank", None)
    if index is None:
        index = int(os.environ.get("LOCAL_RANK", "0"))
    if index >= 0:
        get_accelerator().set_device(index)  # a no-op on DeepSpeed's CPU accelerator
    return index


def comm_device() -> torch.device:
    """The device this rank's transfer buffers go on: the accelerator's current device."""
    return torch.device(get_accelerator().current_device_name())
