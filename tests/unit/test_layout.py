"""The package layout a newcomer relies on: runtime/ in packages, imports that run one way.

Static reads of the source (no imports run): every runtime module but the engines sits in a
package; every import of a ``ds_vshape`` module, function-level (lazy) ones included, is one
its package may make (``MAY_IMPORT``, the README's "How it works" table as data); module-level
imports inside ``ds_vshape``, and every import inside the schedule layer, form no cycle; the
schedule layer imports neither ``torch.distributed`` nor ``deepspeed``.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "ds_vshape"

# What each package may import of ds_vshape, as paths under ds_vshape/: a key or value ending
# in "/" is a package (everything under it), any other a single module. A module is governed
# by the longest key that covers it; imports within that key's package are always allowed.
# Third-party imports (torch, DeepSpeed, transformers) are not checked here but for the
# schedule layer (last test). Keep README.md's "How it works" table in step with this dict.
MAY_IMPORT: dict[str, frozenset[str]] = {
    # Pure schedules: nothing else of ds_vshape, so it runs on a laptop.
    "schedules/": frozenset(),
    # Hugging Face layers: built on transformers and torch only.
    "hf/": frozenset(),
    # Config types for what is measured (profile's sample batch): pydantic only.
    "tuning.py": frozenset(),
    "config.py": frozenset({"schedules/", "tuning.py"}),
    "cli.py": frozenset({"schedules/"}),
    "__main__.py": frozenset({"cli.py"}),
    # The front door: initialize builds everything, once.
    "api.py": frozenset({"config.py", "schedules/", "runtime/"}),
    # Lazy on purpose: ``import ds_vshape`` stays light (no torch, no DeepSpeed) until
    # ``initialize`` or ``PipelineModule`` is asked for.
    "__init__.py": frozenset({"api.py", "runtime/dropin/module.py"}),
    # The runtime package's re-exports.
    "runtime/__init__.py": frozenset({"runtime/engine.py", "runtime/dropin/"}),
    "runtime/engine.py": frozenset({
        "schedules/", "runtime/program/", "runtime/transfers/", "runtime/split/", "runtime/step_end/",
        "runtime/zero/", "runtime/dropin/", "runtime/offload/", "runtime/measuring/",
    }),
    # transfers: the engine's transfer order (transfer_order.py) reads the rank's device to
    # decide whether a one-queue order applies.
    "runtime/program/": frozenset({"schedules/", "hf/", "runtime/transfers/"}),
    "runtime/transfers/": frozenset(),
    "runtime/split/": frozenset(),
    # transfers: a failed step names the transfer error it wraps (failures.py, P2PError).
    "runtime/step_end/": frozenset({"runtime/transfers/"}),
    # Only the schedule layer's op kinds; DeepSpeed's checkpoint layout from dropin.
    "runtime/zero/": frozenset({"schedules/ops.py", "runtime/program/", "runtime/dropin/"}),
    # config.py: carry and optim_carry raise the config's ConfigError.
    "runtime/dropin/": frozenset({"config.py", "runtime/transfers/"}),
    "runtime/offload/": frozenset({"schedules/", "runtime/measuring/"}),
    "runtime/measuring/": frozenset({"schedules/", "config.py", "tuning.py", "runtime/dropin/", "runtime/transfers/"}),
    # ``schedule: "auto"``: the engine measuring, then choosing (beside the engine, never below it).
    "runtime/auto_engine.py": frozenset({"schedules/", "runtime/engine.py", "runtime/program/", "runtime/step_end/failures.py"}),
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in PKG.rglob("*.py")}


def _imports(path: Path, modules: set[str], *, lazy: bool) -> Iterator[tuple[str, int]]:
    """(ds_vshape module, line) for each import in ``path``; module level only unless ``lazy``."""
    name = _module_name(path)
    yield from _imports_in(path.read_text(), name if path.name == "__init__.py" else name.rsplit(".", 1)[0], modules, lazy=lazy)


def _imports_in(source: str, package: str, modules: set[str], *, lazy: bool) -> Iterator[tuple[str, int]]:
    """Imports of ``source``, a module of ``package`` (relative imports resolve against it)."""
    tree = ast.parse(source)
    for node in ast.walk(tree) if lazy else tree.body:
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            # ``from pkg import mod`` needs mod; ``from mod import name`` needs mod.
            submodules = {f"{target}.{a.name}" for a in node.names} & modules
            for name in submodules or ({target} if target.startswith("ds_vshape") else set()):
                yield name, node.lineno
        elif isinstance(node, ast.Import):
            yield from ((a.name, node.lineno) for a in node.names if a.name.startswith("ds_vshape"))


def _graph(*, lazy_under: str | None = None) -> dict[str, set[str]]:
    """Module -> the modules it imports at module level (and anywhere, for those under ``lazy_under``)."""
    modules = _modules()
    names = set(modules)

    def edges(name: str, path: Path) -> set[str]:
        lazy = lazy_under is not None and (name == lazy_under or name.startswith(lazy_under + "."))
        return {m for m, _ in _imports(path, names, lazy=lazy) if m in modules and m != name}

    return {name: edges(name, path) for name, path in modules.items()}


def _rel(path: Path) -> str:
    return path.relative_to(PKG).as_posix()


def _covers(rule: str, rel: str) -> bool:
    return rel.startswith(rule) if rule.endswith("/") else rel == rule


def _package_of(rel: str) -> str | None:
    """The longest ``MAY_IMPORT`` key that covers the module at ``rel`` (a path under ds_vshape/)."""
    keys = [k for k in MAY_IMPORT if _covers(k, rel)]
    return max(keys, key=len) if keys else None


def _forbidden(rel: str, targets: Iterable[tuple[str, int]]) -> list[str]:
    """The imports (path under ds_vshape/, line) that the module at ``rel`` may not make."""
    package = _package_of(rel)
    allowed = MAY_IMPORT[package] | {package} if package else frozenset()
    return [f"{rel}:{line} imports {target}, which {package} may not (tests/unit/test_layout.py MAY_IMPORT)"
            for target, line in targets if not any(_covers(rule, target) for rule in allowed)]


def _forbidden_imports() -> list[str]:
    modules = _modules()
    bad = []
    for path in modules.values():
        targets = ((_rel(modules[name]), line) for name, line in _imports(path, set(modules), lazy=True) if name in modules)
        bad += _forbidden(_rel(path), targets)
    return bad


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, str] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = "done"
        return None

    for name in sorted(graph):
        if name not in state and (found := visit(name)):
            return found
    return None


def test_runtime_has_no_module_outside_a_package_but_the_engines() -> None:
    loose = sorted(p.name for p in (PKG / "runtime").glob("*.py"))
    assert loose == ["__init__.py", "auto_engine.py", "engine.py"], loose
    for pkg in (p for p in (PKG / "runtime").iterdir() if p.is_dir() and p.name != "__pycache__"):
        doc = ast.get_docstring(ast.parse((pkg / "__init__.py").read_text()))
        assert doc and "import" in doc, f"runtime/{pkg.name}/__init__.py must say what the package owns and may import"


def test_every_module_has_a_may_import_rule() -> None:
    # A new package or top-level module needs its row: here and in the README's table.
    loose = sorted(_rel(p) for p in PKG.rglob("*.py") if _package_of(_rel(p)) is None)
    assert not loose, f"no MAY_IMPORT rule covers {loose}; add one (and a row to README.md's package table)"
    for package, allowed in MAY_IMPORT.items():
        for rule in allowed | {package}:
            assert (PKG / rule).exists(), f"MAY_IMPORT names {rule}, which does not exist under ds_vshape/"


def test_every_import_is_one_its_package_may_make() -> None:
    bad = _forbidden_imports()
    assert not bad, "\n".join(bad)


def test_module_level_imports_have_no_cycle() -> None:
    cycle = _find_cycle(_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_schedule_layer_has_no_cycle_even_through_lazy_imports() -> None:
    # The registry once imported its generators inside a function, which imported the registry:
    # a circle the module-level check could not see. The schedule layer has no reason for a
    # late import, so every import there counts.
    cycle = _find_cycle(_graph(lazy_under="ds_vshape.schedules"))
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_a_function_level_import_is_read_and_judged_like_any_other() -> None:
    # A package may not hide an upward arrow in a function.
    source = "import torch\n\ndef f():\n    from ..api import initialize\n"
    names = {"ds_vshape.api"}
    assert list(_imports_in(source, "ds_vshape.schedules", names, lazy=False)) == []
    assert list(_imports_in(source, "ds_vshape.schedules", names, lazy=True)) == [("ds_vshape.api", 4)]
    assert _forbidden("schedules/registry.py", [("api.py", 4)]) == [
        "schedules/registry.py:4 imports api.py, which schedules/ may not (tests/unit/test_layout.py MAY_IMPORT)"]
    assert _forbidden("api.py", [("schedules/registry.py", 1), ("runtime/engine.py", 2)]) == []


def test_the_schedule_layer_imports_neither_torch_distributed_nor_deepspeed() -> None:
    for path in (PKG / "schedules").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            bad = [n for n in names if n.startswith(("torch.distributed", "deepspeed"))]
            assert not bad, f"{path.relative_to(PKG)} imports {bad}"
