"""``python -m ds_vshape``: the same commands as the ``ds-vshape`` console script."""

from __future__ import annotations

from .cli import main

__all__: list[str] = []

if __name__ == "__main__":
    raise SystemExit(main(prog="python -m ds_vshape"))
