"""A tensor whose value is still travelling: any use of it first waits for the transfer.

``train_batch`` returns the step's loss on every pipeline rank. With post-validation the loss
reaches ranks other than the last with an all-reduce that is still in flight when
``train_batch`` returns, so that the ranks need not wait for each other there. Returning a
plain tensor would hand out a value that is not there yet (a silent wrong loss); a
``PendingValue`` instead waits for the all-reduce the first time anything reads it
(``.item()``, printing, arithmetic, ``.cpu()``), and is an ordinary tensor from then on.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

__all__ = ["PendingValue"]


class PendingValue(torch.Tensor):
    """A 0-d float32 tensor filled from ``source`` after ``wait()``, on first use."""

    _vs_source: torch.Tensor | None
    _vs_wait: Callable[[], None]

    @staticmethod
    def __new__(cls, source: torch.Tensor, wait: Callable[[], None]) -> PendingValue:
        out = torch.zeros((), dtype=torch.float32, device=source.device).as_subclass(cls)
        out._vs_source = source
        out._vs_wait = wait
        return out

    @property
    def arrived(self) -> bool:
        """Whether the value is already here (reading it would not wait)."""
        return self._vs_source is None

    def _vs_resolve(self) -> None:
        source = self._vs_source
        if source is None:
            return
        self._vs_wait()
        self._vs_source = None
        with torch._C.DisableTorchFunctionSubclass():
            self.copy_(source)

    def __format__(self, spec: str) -> str:
        # Tensor.__format__ formats 0-d values as numbers only for the exact Tensor type.
        return self.item().__format__(spec)

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        for leaf in tree_flatten((args, kwargs))[0]:
            if isinstance(leaf, PendingValue):
                leaf._vs_resolve()
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)
