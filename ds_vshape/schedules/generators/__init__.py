"""Built-in schedule generators; importing this package registers them all."""

from . import basic  # noqa: F401
from . import looped, seq1f1b, zero_bubble  # noqa: F401
from . import vshape  # noqa: F401

__all__: list[str] = []
