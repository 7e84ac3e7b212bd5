"""Transfers between pipeline ranks: what goes on the wire, on which communicator, and how a
rank waits for it.

Owns the point-to-point class the engine drives (``comm``), the 2-rank process group per
neighbour pair (``p2p_groups``), the wait policies for NCCL and gloo (``p2p_waits``) and the
device this rank's buffers live on (``device``), and the engine's transfer instructions
(``handlers``, a mixin). May import torch, ``torch.distributed`` and
DeepSpeed's accelerator; nothing else of ds_vshape.
"""
