"""ZeRO stages 2 and 3 inside the pipeline: reducing a stage's gradients after its last
backward and gathering its weights around its passes (``zero``), and the engine mixin that
drives them from the lowered stream (``zero_engine``). May import the schedule layer's op
kinds, ``program`` and ``dropin.checkpoint``.
"""
