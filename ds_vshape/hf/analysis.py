"""Anatomy of a traced causal LM, and the structural checks that refuse unsupported models.

``analyse`` finds, from a ``Trace`` and without lists of class names, the
``ModuleList`` of decoder blocks, the base model whose forward calls them, the
input embedding, the final norm and the LM head, and turns the recorded calls
of the base model and of every block into ``Recipe`` objects that a later
pipeline stage can replay from the sequence alone.  An argument that *is*
the cache the trace handed the model becomes ``Kind.CACHE`` whatever its
name, and each block is noted as storing keys/values through that cache or
not (what sequence chunks need).  Anything it cannot
rebuild (weighted modules between blocks, block arguments computed from
values, bidirectional masks, ...) raises ``ValueError`` with the reason.
Everything here is internal to ``ds_vshape.hf``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.cache_utils import Cache

from .direct_embedding import runs_embedding_alone
from .tracing import Arg, Call, Kind, MaskRecipe, Recipe, RopeRef, Runtime, Trace

__all__ = [
    "Anatomy",
    "analyse",
    "hidden_of",
    "is_ancestor",
]

# ---------------------------------------------------------------------- analysis


@dataclass(frozen=True)
class Anatomy:
    base: str  # path of the base model (whose forward calls the blocks)
    layers: str  # path of the ModuleList of decoder blocks
    num_layers: int
    norm: str | None  # final norm, None if the model has none
    head: str  # linear LM head
    embedding: str  # token embedding, relative to the base model
    tied: bool
    base_recipe: Recipe
    block_recipes: tuple[Recipe, ...]
    stores_kv: tuple[bool, ...]  # per block: stored keys/values through the model's cache in the trace
    embedding_alone: bool = False  # the first block receives the token embedding's output as it is


@dataclass
class _Known:
    """Recorded objects that block arguments may be traced back to."""

    lm: nn.Module
    trace: Trace
    masks: dict[int, MaskRecipe] = field(default_factory=dict)
    producers: dict[int, str] = field(default_factory=dict)
    ropes: dict[str, RopeRef] = field(default_factory=dict)


def analyse(lm: PreTrainedModel, trace: Trace) -> Anatomy:
    head, embedding = _head_path(lm), _path_of(lm, lm.get_input_embeddings())
    layers, count = _layer_list(lm, trace)
    known = _Known(lm, trace)
    _collect_masks(lm, known)
    _collect_producers(lm, known, layers)
    blocks = tuple(_block_recipe(known, layers, index) for index in range(count))
    base = _base_path(trace, layers)
    _require_inside(base, embedding, "the input embedding")
    if is_ancestor(base, head):
        raise ValueError(f"the LM head {head!r} lives inside the base model {base!r}; cannot split it off")
    norm = _final_norm(lm, trace, layers, count, head)
    _check_between_blocks(lm, trace, layers, count)
    _check_prologue(lm, trace, layers, base)
    head_module = lm.get_submodule(head)
    tied = head_module.weight is lm.get_input_embeddings().weight
    if tied and head_module.bias is not None:
        raise ValueError("a tied LM head with its own bias is not supported")
    base_call = _single_call(trace, base, "the base model")
    base_recipe = _recipe(
        lm.get_submodule(base).forward, base_call, known, first_is_hidden=False, where="base", by_name=True
    )
    relative_embedding = embedding[len(base) + 1 :] if base else embedding
    stores = tuple(_stores_kv(trace, f"{layers}.{index}") for index in range(count))
    alone = runs_embedding_alone(lm, trace, base=base, layers=layers, embedding=embedding, ropes=known.ropes)
    return Anatomy(base, layers, count, norm, head, relative_embedding, tied, base_recipe, blocks, stores, alone)


def _stores_kv(trace: Trace, path: str) -> bool:
    begin, end = trace.index("start", path), trace.index("end", path)
    return any(begin < update <= end for update in trace.cache_updates)


def _base_path(trace: Trace, layers: str) -> str:
    """The innermost module around the block list that ran once: its forward calls the blocks."""
    path = layers
    while "." in path:
        path = path.rpartition(".")[0]
        if len(trace.calls.get(path, [])) == 1:
            return path
    raise ValueError(f"no module inside the LM calls the decoder blocks {layers!r}; cannot separate the head")


def _head_path(lm: PreTrainedModel) -> str:
    head = lm.get_output_embeddings()
    if not isinstance(head, nn.Linear):
        raise ValueError(f"{type(lm).__name__} has no linear LM head (get_output_embeddings() is {head!r})")
    return _path_of(lm, head)


def _path_of(root: nn.Module, target: nn.Module | None) -> str:
    for path, module in root.named_modules():
        if module is target:
            return path
    raise ValueError(f"module {type(target).__name__} is not part of {type(root).__name__}")


def _layer_list(lm: PreTrainedModel, trace: Trace) -> tuple[str, int]:
    """The ModuleList whose every element ran exactly once, in order: the decoder blocks."""
    wanted = getattr(lm.config.get_text_config(), "num_hidden_layers", None)
    found = []
    for path, module in lm.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) == 0:
            continue
        if wanted is not None and len(module) != wanted:
            continue
        starts = [_first_start(trace, f"{path}.{i}") for i in range(len(module))]
        if all(s is not None for s in starts) and starts == sorted(starts):  # type: ignore[type-var]
            found.append((path, len(module)))
    if len(found) != 1:
        names = [path for path, _ in found] or "none"
        raise ValueError(f"cannot identify the decoder block list (candidates: {names})")
    return found[0]


def _first_start(trace: Trace, path: str) -> int | None:
    try:
        return trace.index("start", path)
    except ValueError:
        return None


def _collect_masks(lm: nn.Module, known: _Known) -> None:
    if getattr(lm.config, "is_causal", True) is False:
        raise ValueError("config.is_causal is False: bidirectional attention cannot be trained as a causal LM")
    for record in known.trace.masks:
        name = record.builder.__name__
        if "bidirectional" in name:
            raise ValueError(
                f"the model builds a bidirectional attention mask ({name}); only causal decoder-only "
                "models can be split (encoder-only models are not causal LMs)"
            )
        call = Call((), record.arguments, record.marker)
        where = f"mask builder {name}"
        recipe = _recipe(record.builder, call, known, first_is_hidden=False, where=where, by_name=True)
        known.masks[id(record.marker)] = MaskRecipe(record.builder, recipe)


def _collect_producers(lm: nn.Module, known: _Known, layers: str) -> None:
    # Outputs of weight-free modules (rotary embeddings) can be recomputed on
    # any stage; outputs of modules with weights cannot.
    for path, calls in known.trace.calls.items():
        if is_ancestor(path, layers) or is_ancestor(layers, path):
            continue
        if len(calls) == 1 and not _has_params(lm.get_submodule(path)):
            known.producers[id(calls[0].output)] = path


def _block_recipe(known: _Known, layers: str, index: int) -> Recipe:
    path = f"{layers}.{index}"
    call = _single_call(known.trace, path, f"decoder block {index}")
    block = known.lm.get_submodule(path)
    recipe = _recipe(block.forward, call, known, first_is_hidden=True, where=f"decoder block {index}")
    if index > 0:
        previous = hidden_of(_single_call(known.trace, f"{layers}.{index - 1}", "").output)
        first = next(iter(inspect.signature(block.forward).bind(*call.args, **call.kwargs).arguments.values()))
        if first is not previous:
            raise ValueError(f"the model changes the hidden state between decoder blocks {index - 1} and {index}")
    if not any(arg.kind is Kind.HIDDEN for arg in recipe.positional):
        raise ValueError(f"decoder block {index} does not take the hidden state as its first argument")
    return recipe


def _single_call(trace: Trace, path: str, what: str) -> Call:
    calls = trace.calls.get(path, [])
    if len(calls) != 1:
        raise ValueError(f"{what} ({path!r}) ran {len(calls)} times in one forward pass; expected once")
    return calls[0]


def hidden_of(output: Any) -> Any:
    # Older transformers blocks return (hidden, ...) tuples; newer a tensor.
    return output[0] if isinstance(output, tuple) else output


def _recipe(
    fn: Callable[..., Any], call: Call, known: _Known, *, first_is_hidden: bool, where: str, by_name: bool = False
) -> Recipe:
    bound = inspect.signature(fn).bind(*call.args, **call.kwargs)
    items = _flatten_arguments(fn, bound, where)
    positional: list[Arg] = []
    keyword: list[Arg] = []
    for index, (name, value) in enumerate(items):
        first = index == 0 and first_is_hidden
        arg = _classify(name, value, known, first=first, where=where, by_name=by_name)
        (positional if first else keyword).append(arg)
    return Recipe(tuple(positional), tuple(keyword))


def _flatten_arguments(fn: Callable[..., Any], bound: inspect.BoundArguments, where: str) -> list[tuple[str, Any]]:
    items: list[tuple[str, Any]] = []
    for name, value in bound.arguments.items():
        kind = bound.signature.parameters[name].kind
        if kind is inspect.Parameter.VAR_KEYWORD:
            items.extend(value.items())
        elif kind is inspect.Parameter.VAR_POSITIONAL:
            if value:
                raise ValueError(f"{where}: extra positional arguments are not supported")
        else:
            items.append((name, value))
    return items


_NAMED_TENSORS = {
    "input_ids": Kind.INPUT_IDS,
    "inputs_embeds": Kind.HIDDEN,
    "input_embeds": Kind.HIDDEN,  # masking_utils spelling before transformers 5
    "attention_mask": Kind.KEY_MASK,
    "position_ids": Kind.POSITIONS,
    "cache_position": Kind.CACHE_POSITIONS,
}


def _classify(name: str, value: Any, known: _Known, *, first: bool, where: str, by_name: bool) -> Arg:
    if value is not None and value is known.trace.cache:  # the model's cache, under whatever name it is passed
        return Arg(name, Kind.CACHE)
    if id(value) in known.masks:
        return Arg(name, Kind.MASK, known.masks[id(value)])
    if not _holds_tensor(value):
        return Arg(name, Kind.CONST, value)
    if first:
        return Arg(name, Kind.HIDDEN)
    if id(value) in known.producers:
        return Arg(name, Kind.ROPE, _rope_ref(known, known.producers[id(value)]))
    kind = _NAMED_TENSORS.get(name) if isinstance(value, torch.Tensor) else None
    # A tensor named attention_mask given to a block must be the 2-D padding
    # mask itself; a mask the model built some other way (e.g. transformers
    # < 4.53 without masking_utils) would silently lose causality otherwise.
    if kind is Kind.KEY_MASK and not by_name and value is not known.trace.input_mask:
        kind = None
    if kind is not None:
        return Arg(name, kind)
    raise ValueError(
        f"{where}: argument {name!r} carries tensors the model computes in a way this adapter "
        "cannot rebuild on a later pipeline stage"
    )


def _rope_ref(known: _Known, path: str) -> RopeRef:
    if path not in known.ropes:
        module = known.lm.get_submodule(path)
        call = _single_call(known.trace, path, f"position-embedding module {path!r}")
        recipe = _recipe(module.forward, call, known, first_is_hidden=True, where=f"module {path!r}")
        _check_position_only(module, recipe, path, example=_first_argument(module, call))
        known.ropes[path] = RopeRef(path, recipe)
    return known.ropes[path]


def _first_argument(module: nn.Module, call: Call) -> Any:
    bound = inspect.signature(module.forward).bind(*call.args, **call.kwargs)
    return next(iter(bound.arguments.values()))


def _check_position_only(module: nn.Module, recipe: Recipe, path: str, *, example: torch.Tensor) -> None:
    """A module re-run on every stage may use the hidden state's shape, dtype and device, not its values.

    True for rotary embeddings; a weight-free transform of the *embedding
    output* handed to every block would otherwise be silently recomputed
    from the wrong hidden state.
    """
    device = next((buffer.device for buffer in module.buffers()), torch.device("cpu"))
    if device.type == "meta":
        raise ValueError(f"module {path!r} has buffers on the meta device; load the model's weights first")
    outputs = []
    with torch.no_grad():
        for fill in (0.0, 1.0):
            hidden = torch.full(example.shape, fill, dtype=example.dtype, device=device)
            outputs.append(_tensors(Runtime(hidden=hidden).call(module, recipe)))
    if len(outputs[0]) != len(outputs[1]) or not all(map(torch.equal, *outputs)):
        raise ValueError(f"blocks receive an output of {path!r} that depends on hidden-state values; cannot rebuild")


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [tensor for item in value for tensor in _tensors(item)]
    if isinstance(value, dict):
        return [tensor for item in value.values() for tensor in _tensors(item)]
    return []


def _holds_tensor(value: Any) -> bool:
    if isinstance(value, (torch.Tensor, Cache)):
        return True
    if isinstance(value, (tuple, list)):
        return any(_holds_tensor(item) for item in value)
    if isinstance(value, dict):
        return any(_holds_tensor(item) for item in value.values())
    return False


def _has_params(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def is_ancestor(ancestor: str, path: str) -> bool:
    return ancestor == "" or path == ancestor or path.startswith(ancestor + ".")


def _require_inside(base: str, path: str, what: str) -> None:
    if not is_ancestor(base, path):
        raise ValueError(f"{what} ({path!r}) is not inside the base model {base!r} that runs the blocks")


def _weighted_starts(lm: nn.Module, trace: Trace, begin: int, end: int, layers: str) -> list[str]:
    """Outermost modules with weights that started in events[begin:end], containers of the blocks excluded."""
    found: list[str] = []
    for kind, path in trace.events[begin:end]:
        if kind != "start" or is_ancestor(path, layers) or any(is_ancestor(f, path) for f in found):
            continue
        if _has_params(lm.get_submodule(path)):
            found.append(path)
    return found


def _final_norm(lm: nn.Module, trace: Trace, layers: str, count: int, head: str) -> str | None:
    last = _single_call(trace, f"{layers}.{count - 1}", "the last decoder block")
    after = _weighted_starts(lm, trace, trace.index("end", f"{layers}.{count - 1}") + 1, len(trace.events), layers)
    if after[-1:] != [head] or len(after) > 2:
        raise ValueError(
            f"after the last decoder block the model runs {after}; only one final norm followed by the "
            f"LM head {head!r} is supported"
        )
    if len(after) == 1:
        return None
    norm = after[0]
    call = _single_call(trace, norm, f"final norm {norm!r}")
    if len(call.args) != 1 or call.kwargs or call.args[0] is not hidden_of(last.output):
        raise ValueError(f"the final norm {norm!r} is not applied to the last block's output alone")
    return norm


def _check_between_blocks(lm: nn.Module, trace: Trace, layers: str, count: int) -> None:
    for index in range(1, count):
        begin = trace.index("end", f"{layers}.{index - 1}")
        between = _weighted_starts(lm, trace, begin, trace.index("start", f"{layers}.{index}"), layers)
        if between:
            raise ValueError(f"modules with weights run between decoder blocks {index - 1} and {index}: {between}")


def _check_prologue(lm: nn.Module, trace: Trace, layers: str, base: str) -> None:
    before = _weighted_starts(lm, trace, 0, trace.index("start", f"{layers}.0"), layers)
    outside = [path for path in before if not is_ancestor(base, path)]
    if outside:
        raise ValueError(f"modules with weights run outside the base model before the blocks: {outside}")
