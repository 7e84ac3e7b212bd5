"""Whether the embedding layer may run the token embedding alone instead of the hollowed base model.

``HFEmbedding`` runs the base model's own forward with no blocks: whatever the model does before its
first block (scaling, position embeddings, a norm, dropout) happens as the model does it. That forward
also builds the attention masks and rotary outputs the blocks would receive, which on the embedding
layer nobody receives: host time on every forward of the first stage. Where the trace shows that the
first block receives the token embedding's own output, unchanged, the layer runs that module alone.
"""

from __future__ import annotations

import inspect
from collections.abc import Collection

from torch import nn

from .tracing import Trace

__all__ = ["runs_embedding_alone"]


def runs_embedding_alone(lm: nn.Module, trace: Trace, *, base: str, layers: str, embedding: str,
                         ropes: Collection[str]) -> bool:
    """True where the first decoder block's hidden state is the output of ``embedding`` (full path) called
    on the input ids alone, not changed in place before the block starts, and nothing ran in the base
    model before the blocks but that module and the weight-free ``ropes`` whose outputs blocks receive.

    Only from a trace in training mode: a dropout module or function in eval mode hands its input on as
    it is, so the check would not see the dropout the layer must run in training.
    """
    calls = trace.calls.get(embedding, [])
    if not trace.training or trace.input_ids is None or len(calls) != 1:
        return False
    call = calls[0]
    if call.kwargs or len(call.args) != 1 or call.args[0] is not trace.input_ids:
        return False
    block = f"{layers}.0"
    block_call = trace.calls[block][0]
    bound = inspect.signature(lm.get_submodule(block).forward).bind(*block_call.args, **block_call.kwargs)
    hidden = next(iter(bound.arguments.values()))
    if hidden is not call.output or trace.start_versions.get(block, {}).get(id(hidden)) != call.output_version:
        return False
    allowed = (embedding, *ropes)
    begin, end = trace.index("start", base), trace.index("start", block)
    return all(any(path == a or path.startswith(a + ".") for a in allowed)
               for kind, path in trace.events[begin + 1:end] if kind == "start")
