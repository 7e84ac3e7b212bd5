"""What the ranks execute: the plan made once at the front door (``plan``: the schedule, the
engine's settings, every rank's checked program), one rank's lowered stream as DeepSpeed
instructions (``instructions``), the per-rank state of sequence chunks (``seq_chunks``), and
which transfer order a rank runs (``transfer_order``: the one global order where the per-pair
default would deadlock). May import the schedule layer, ``ds_vshape.hf`` and ``transfers`` (the
device's hardware queues).
"""
