"""The end of a step: the optimizer step, clipping by the global norm, fp16/bf16 agreement on
overflow, and optimizer post-validation.

``step`` is the engine mixin; ``precision`` scales losses and agrees on overflow;
``post_validation`` steps on local figures and checks the global ones later, with
``snapshot`` (exact undo), ``zero_shards`` (the same under ZeRO-1/2, from each rank's shards)
and ``pending`` (a loss that arrives later); ``tensor_parallel``
says which parameters count in the global norm and over which group (tensor-parallel jobs);
``failures`` bounds a step's collectives by the transfer timeout and names what a survivor of a
dead rank waited for. May import torch, ``torch.distributed``, DeepSpeed and ``transfers`` (its
errors); nothing else of ds_vshape.
"""
