"""The mark a built-in generator carries: ``@builtin("gpipe", summary=...)``.

It only notes the generator and its registry fields here; ``schedules/registry.py`` imports
this package and registers every noted generator, in the order the generator modules are
imported in ``generators/__init__.py``. So imports run one way, registry -> generators, and
no generator module imports the registry (before, each did, and the registry imported the
generators back inside a function to hide the circle).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from ..ir import Schedule

__all__ = ["Builtin", "builtin", "builtin_generators"]

Generator = Callable[..., Schedule]


class Builtin(NamedTuple):
    """One built-in generator: its name, function and ``GeneratorInfo`` fields (``summary``, ...)."""

    name: str
    fn: Generator
    info: dict[str, Any]


_NOTED: list[Builtin] = []


def builtin(name: str, **info: Any) -> Callable[[Generator], Generator]:
    """Decorator: note ``fn`` as the built-in schedule ``name``; same fields as ``register``."""

    def wrap(fn: Generator) -> Generator:
        _NOTED.append(Builtin(name, fn, info))
        return fn

    return wrap


def builtin_generators() -> tuple[Builtin, ...]:
    """Every generator noted so far, in the order its module was imported."""
    return tuple(_NOTED)
