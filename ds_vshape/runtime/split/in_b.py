"""``pipeline.weight_grads_in_b``: which parameters' weight gradients B computes, by module path.

A pattern is an ``fnmatch`` pattern (case-sensitive) matched against the path of the module
that holds a parameter, as the whole model's ``named_modules()`` names it: in a pipeline model
the layer's index comes first, then the path inside the layer (``"3.block.self_attn.q_proj"``
for an HF decoder block built by ``ds_vshape.hf.pipeline_layers``; ``"tied_modules.<key>..."``
for a tied layer). Without a root, ``"<i>.<path>"`` with ``i`` the module's place in the list.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from fnmatch import fnmatchcase

from torch import nn

__all__ = ["FIELD", "matching", "module_paths", "trainable_paths", "unmatched", "unmatched_error"]

FIELD = "pipeline.weight_grads_in_b"
_EXAMPLES = 4  # module paths quoted in an error, so that the user sees what a pattern is matched against


def module_paths(modules: Sequence[nn.Module], *, root: nn.Module | None) -> Iterator[tuple[nn.Module, nn.Module, str]]:
    """(top module, module, path) for every module inside ``modules``, each once, named as ``root`` names it."""
    paths = {id(m): name for name, m in root.named_modules()} if root is not None else {}
    seen: set[int] = set()
    for index, top in enumerate(modules):
        for name, mod in top.named_modules():
            if id(mod) not in seen:
                seen.add(id(mod))
                yield top, mod, paths.get(id(mod)) or (f"{index}.{name}" if name else str(index))


def trainable_paths(modules: Sequence[nn.Module], *, root: nn.Module | None) -> list[str]:
    """The paths of the modules inside ``modules`` that hold a trainable parameter themselves."""
    return [path for _, mod, path in module_paths(modules, root=root)
            if any(p.requires_grad for p in mod.parameters(recurse=False))]


def matching(path: str, patterns: Sequence[str]) -> list[str]:
    """The patterns that match a module's ``path``."""
    return [p for p in patterns if fnmatchcase(path, p)]


def unmatched(paths: Sequence[str], patterns: Sequence[str]) -> list[str]:
    """The patterns that match none of ``paths``, in the order given."""
    hit = {p for path in paths for p in matching(path, patterns)}
    return [p for p in patterns if p not in hit]


def unmatched_error(pattern: str, paths: Sequence[str], *, where: str = "the model") -> ValueError:
    """The error for a pattern that matches no module holding a trainable parameter in ``where``."""
    shown = ", ".join(repr(p) for p in list(dict.fromkeys(paths))[:_EXAMPLES]) or "none"
    return ValueError(f"{FIELD}: pattern {pattern!r} matches no module holding a trainable parameter in {where} "
                      f"(module paths look like {shown}); fix the pattern (e.g. '*self_attn*') or remove it")
