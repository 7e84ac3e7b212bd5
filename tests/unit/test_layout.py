"""The package layout a newcomer relies on: runtime/ in packages, imports that run one way.

Static reads of the source (no imports run): every runtime module but the engine sits in a
package; module-level imports inside ``ds_vshape`` form no cycle; the schedule layer imports
neither ``torch.distributed`` nor ``deepspeed``.
"""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "ds_vshape"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _top_level_imports(path: Path, modules: set[str]) -> set[str]:
    """ds_vshape modules imported at module level (function-level imports are deliberate late binds)."""
    tree = ast.parse(path.read_text())
    package = _module_name(path) if path.name == "__init__.py" else _module_name(path).rsplit(".", 1)[0]
    out: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            # ``from pkg import mod`` needs mod; ``from mod import name`` needs mod.
            submodules = {f"{target}.{a.name}" for a in node.names} & modules
            out.update(submodules or ({target} if target.startswith("ds_vshape") else set()))
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("ds_vshape"))
    return out


def _graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in PKG.rglob("*.py")}
    names = set(modules)
    return {name: {m for m in _top_level_imports(path, names) if m in modules and m != name} for name, path in modules.items()}


def test_runtime_has_no_module_outside_a_package_but_the_engine() -> None:
    loose = sorted(p.name for p in (PKG / "runtime").glob("*.py"))
    assert loose == ["__init__.py", "engine.py"], loose
    for pkg in (p for p in (PKG / "runtime").iterdir() if p.is_dir() and p.name != "__pycache__"):
        doc = ast.get_docstring(ast.parse((pkg / "__init__.py").read_text()))
        assert doc and "import" in doc, f"runtime/{pkg.name}/__init__.py must say what the package owns and may import"


def test_module_level_imports_have_no_cycle() -> None:
    graph, state, stack = _graph(), {}, []

    def visit(node: str) -> None:
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                cycle = stack[stack.index(nxt):] + [nxt]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name)


def test_the_schedule_layer_imports_neither_torch_distributed_nor_deepspeed() -> None:
    for path in (PKG / "schedules").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            bad = [n for n in names if n.startswith(("torch.distributed", "deepspeed"))]
            assert not bad, f"{path.relative_to(PKG)} imports {bad}"
