"""What one rank executes: the lowered stream as DeepSpeed instructions (``instructions``) and
the per-rank state of sequence chunks (``seq_chunks``), and which transfer order a rank runs
(``transfer_order``: the one global order where the per-pair default would deadlock). May import
the schedule layer, ``ds_vshape.hf`` and ``transfers`` (the device's hardware queues).
"""
