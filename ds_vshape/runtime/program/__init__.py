"""What one rank executes: the lowered stream as DeepSpeed instructions (``instructions``) and
the per-rank state of sequence chunks (``seq_chunks``). May import the schedule layer and
``ds_vshape.hf``.
"""
