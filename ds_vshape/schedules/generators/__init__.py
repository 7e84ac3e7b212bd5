"""Built-in schedule generators; importing this package registers them all."""

from . import basic  # noqa: F401

__all__: list[str] = []
