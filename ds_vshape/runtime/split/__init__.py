"""Split backward: B computes input gradients, W the weight gradients later.

``split_backward`` owns the store of parked weight-gradient work and the entry points the
engine calls; ``split_mode`` routes parameter-consuming torch calls during a forward;
``split_ops`` holds the autograd functions behind them (the GEMM fast path and the generic
re-run); ``split_graph`` takes over custom ``autograd.Function`` nodes. The store is passed to
the others as a parameter, so imports run one way: backward -> enable -> graph_linear, module_hooks -> mode -> graph -> ops.
``fit`` holds what W keeps to the schedule's ``w_memory``; ``in_b`` matches
``pipeline.weight_grads_in_b``'s patterns to module paths; ``enable`` adopts a stage's
parameters and sets up its modules' forwards (``graph_linear``, ``module_hooks``); ``setup`` enables
split backward on a rank's stages and checks the patterns across ranks. May import torch
only (``setup`` also torch.distributed).
"""
