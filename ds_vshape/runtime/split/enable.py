"""Split backward enabled on a stage's modules: which parameters W takes, how each module's forward splits.

Every trainable parameter inside the modules is adopted by the store (``WeightGradStore.adopt``):
deferred to W, or computed in B where cheap or named by ``in_b``. A plain ``nn.Linear`` is taken
over by class (``graph_linear``), a module owning deferred parameters gets the routing's hooks
(``module_hooks.route_forward``), a stage's own module owning none routes by its class
(``route_stage``), and DeepSpeed's checkpoint function re-runs what it checkpoints routed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from torch import nn

from .graph_linear import take_over
from .in_b import matching, module_paths
from .module_hooks import route_forward, route_stage, routed_checkpoint

if TYPE_CHECKING:
    from .split_backward import WeightGradStore

__all__ = ["enable_split_backward"]


def enable_split_backward(modules: list[nn.Module], store: WeightGradStore, *, root: nn.Module | None = None,
                          in_b: Sequence[str] = ()) -> int:
    """Defer to W the gradient of every trainable parameter inside ``modules``; returns how many
    modules own such parameters. ``root`` (the whole model) names modules by their path in it.

    ``in_b``: ``fnmatch`` patterns (``split.in_b``); a parameter whose module path matches one gets
    its gradient in B, like a cheap one. A parameter frozen now (``requires_grad=False``) parks
    nothing as long as it stays frozen.
    """
    count = 0
    for top, mod, path in module_paths(modules, root=root):
        own = list(mod.parameters(recurse=False))
        named = bool(matching(path, in_b))
        for param in own:  # a parameter shared by two modules keeps its first adoption
            store.adopt(param, f"{path or '<root>'} ({type(mod).__module__}.{type(mod).__qualname__})", in_b=named)
        # A module whose trainable parameters are all computed in B (a norm) owns nothing W waits for:
        # it needs no hooks of its own (a whole forward is routed from outside, a checkpoint re-run enters
        # through the stage's own modules), and a plain nn.Linear splits on autograd's graph (graph_linear).
        owner = any(p.requires_grad and not store.grad_in_b(p) for p in own)
        # A stage's own module owning none routes by its class (route_stage), by hooks where that cannot be.
        if not take_over(mod, store) and (owner or (mod is top and not route_stage(mod, store))):
            route_forward(mod, store, owner=owner)
        count += bool(own)
    if root is not None and callable(getattr(root, "activation_checkpoint_func", None)):
        root.activation_checkpoint_func = routed_checkpoint(root.activation_checkpoint_func, store)
    return count
