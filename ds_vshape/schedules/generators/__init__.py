"""Built-in schedule generators.

Each generator module marks its generators with ``@builtin`` (``generators/builtin.py``);
importing this package imports them all, in the order ``ds-vshape list`` shows them, and the
registry registers what ``builtin_generators()`` returns. A new built-in generator module must
be imported here: the registry knows nothing else of this package.
"""

from . import basic  # noqa: F401
from . import looped, seq1f1b, zero_bubble  # noqa: F401
from . import vshape  # noqa: F401
from .builtin import Builtin, builtin_generators

__all__ = ["Builtin", "builtin_generators"]
