"""The model's KV cache, recognised by its role: an empty cache handed to the traced forward.

Decoder blocks take the cache under many names (``past_key_values``,
``past_key_value``, ``cache``, ``layer_past``, ...), and the names change
between transformers releases.  Instead of a list of names, the trace hands a
``TraceCache`` to the first forward that has a parameter typed as a
``Cache`` (the LM's own, or its base model's where the LM's parameter is not
typed so); every argument of a block or mask builder that then *is* that
object is the model's cache, and each ``update`` through it shows which
blocks store keys/values there.  Everything here is internal to ``ds_vshape.hf``.
"""

from __future__ import annotations

import inspect
import re
import typing
from collections.abc import Callable
from typing import Any

import torch
from transformers.cache_utils import Cache

__all__ = [
    "TraceCache",
    "query_length",
    "call_with_cache",
]


def query_length(query: int | torch.Tensor) -> int:
    # Cache.get_mask_sizes gets the query length (transformers 5) or the
    # cache positions of the queries (4.5x).
    return int(query.shape[0]) if isinstance(query, torch.Tensor) else int(query)


class TraceCache(Cache):
    """An empty KV cache that keeps nothing; calls ``on_update`` at every K/V update made through it."""

    def __init__(self, *, on_update: Callable[[], None]) -> None:
        super().__init__(layers=[])
        self._on_update = on_update

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self._on_update()
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return 0

    def get_mask_sizes(self, query: int | torch.Tensor, layer_idx: int = 0) -> tuple[int, int]:
        return query_length(query), 0


def call_with_cache(
    forward: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], cache: Cache
) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """``(args, kwargs)`` of a call of ``forward`` with ``cache`` in its one ``Cache``-typed parameter.

    None when ``forward`` has no such parameter (or several), or the caller passes a cache already.
    """
    name = _cache_parameter(forward)
    if name is None:
        return None
    try:
        bound = inspect.signature(forward).bind_partial(*args, **kwargs)
    except TypeError:
        return None
    if bound.arguments.get(name) is not None:
        return None
    bound.arguments[name] = cache
    return bound.args, bound.kwargs


def _cache_parameter(fn: Callable[..., Any]) -> str | None:
    try:
        parameters = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return None
    typed = [name for name, parameter in parameters.items() if _is_cache_type(parameter.annotation)]
    return typed[0] if len(typed) == 1 else None


def _is_cache_type(annotation: Any) -> bool:
    """Whether an annotation admits a ``transformers`` ``Cache`` (``Cache | None``, ``Optional[Union[..., Cache]]``)."""
    if isinstance(annotation, str):  # postponed evaluation: the name as written
        return re.search(r"\bCache\b", annotation) is not None
    arguments = typing.get_args(annotation)
    if arguments:  # a union or a generic: any member will do
        return any(_is_cache_type(argument) for argument in arguments)
    return isinstance(annotation, type) and issubclass(annotation, Cache)
