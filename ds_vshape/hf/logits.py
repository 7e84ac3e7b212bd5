"""The LM's own logit post-processing (scaling, soft-capping), recorded once and replayed on the last stage.

Some causal LMs change what their LM head computes before returning it: Granite
divides by ``config.logits_scaling``, Gemma2 soft-caps with
``final_logit_softcapping``, Cohere multiplies by ``logit_scale``.  Rather than
knowing those attributes, ``LogitRecorder`` watches the LM's own forward run
around a stub head (``semantics`` builds that probe) under a
``TorchFunctionMode``: every torch call that takes the head's output, or a value
computed from it, is recorded with its other arguments.  ``LogitOps`` replays
the calls that lead to the returned logits, the same functions with the same
constants, so the pipeline's logits are the model's own to the last bit.  A call
that combines the logits with another tensor is not replayable from the logits
alone; logits returned through one are refused.  Everything here is internal to
``ds_vshape.hf``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = [
    "LogitOps",
    "LogitRecorder",
]


@dataclass(frozen=True)
class _Ref:
    """A value of the chain: 0 is the head's output, ``i`` the result of the ``i``-th kept call."""

    index: int


@dataclass(frozen=True, eq=False)
class _Op:
    func: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: tuple[tuple[str, Any], ...]


class LogitOps:
    """The recorded chain from the LM head's output to the logits the LM returns; call it on logits."""

    def __init__(self, ops: tuple[_Op, ...]) -> None:
        self._ops = ops

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        values = [logits]
        for op in self._ops:
            kwargs = {key: _resolve(value, values) for key, value in op.kwargs}
            values.append(op.func(*_resolve(op.args, values), **kwargs))
        return values[-1]

    def __repr__(self) -> str:
        return f"LogitOps({', '.join(_name(op.func) for op in self._ops)})"


class LogitRecorder(TorchFunctionMode):
    """Records, while active, every torch call on ``logits`` or on values computed from it."""

    def __init__(self, logits: torch.Tensor) -> None:
        super().__init__()
        self._values: list[torch.Tensor] = [logits]  # kept alive, so that no id() is reused
        self._index = {id(logits): 0}
        self._ops: list[tuple[_Op, int]] = []  # each call with the index of the value it made
        self._mixed: list[str] = []  # calls that combined tracked values with other tensors

    def __torch_function__(
        self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        found = [self._index.get(id(tensor)) for tensor in _tensors((args, kwargs))]
        if all(index is None for index in found):
            return out
        if any(index is None for index in found):
            self._mixed.append(_name(func))  # its result is not tracked: logits returned through it are refused
        elif isinstance(out, torch.Tensor):
            op = _Op(func, self._template(args), tuple((key, self._template(value)) for key, value in kwargs.items()))
            self._values.append(out)
            self._index[id(out)] = len(self._values) - 1  # an in-place call re-points its tensor here
            self._ops.append((op, len(self._values) - 1))
        return out

    def chain(self, returned: torch.Tensor, *, what: str) -> LogitOps | None:
        """The calls that made ``returned`` from the head's output; None when it *is* the head's output."""
        index = self._index.get(id(returned))
        if index is None:
            mixed = f" (combined with other tensors in {', '.join(self._mixed)})" if self._mixed else ""
            raise ValueError(f"{what} returns logits that cannot be recomputed from the LM head's output{mixed}")
        if index == 0:
            return None
        made = {made: op for op, made in self._ops}
        needed = sorted(_ancestors(index, made))
        renumber = {old: new for new, old in enumerate([0, *needed])}
        ops = tuple(_renumbered(made[old], renumber) for old in needed)
        return LogitOps(ops)

    def _template(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return _Ref(self._index[id(value)])
        if isinstance(value, (tuple, list)):
            return type(value)(self._template(item) for item in value)
        if isinstance(value, dict):
            return {key: self._template(item) for key, item in value.items()}
        return value


def _ancestors(index: int, made: dict[int, _Op]) -> set[int]:
    found: set[int] = set()
    pending = [index]
    while pending:
        current = pending.pop()
        if current == 0 or current in found:
            continue
        found.add(current)
        op = made[current]
        pending += [ref.index for ref in _refs((op.args, op.kwargs))]
    return found


def _renumbered(op: _Op, renumber: dict[int, int]) -> _Op:
    def swap(value: Any) -> Any:
        if isinstance(value, _Ref):
            return _Ref(renumber[value.index])
        if isinstance(value, (tuple, list)):
            return type(value)(swap(item) for item in value)
        if isinstance(value, dict):
            return {key: swap(item) for key, item in value.items()}
        return value

    return _Op(op.func, swap(op.args), tuple((key, swap(value)) for key, value in op.kwargs))


def _resolve(value: Any, values: list[torch.Tensor]) -> Any:
    if isinstance(value, _Ref):
        return values[value.index]
    if isinstance(value, (tuple, list)):
        return type(value)(_resolve(item, values) for item in value)
    if isinstance(value, dict):
        return {key: _resolve(item, values) for key, item in value.items()}
    return value


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)


def _refs(value: Any) -> Iterator[_Ref]:
    if isinstance(value, _Ref):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _refs(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _refs(item)


def _name(func: Callable[..., Any]) -> str:
    return getattr(func, "__name__", None) or repr(func)
