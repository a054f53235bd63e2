"""The dependency rules of docs/architecture.md, checked on the source: module sizes, no
import cycles (imports inside functions count too), `algos/` pure torch, and library modules
never importing the command line."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
MAX_LINES = 500


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted((SRC / "appo").rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _runtime_nodes(tree: ast.AST):
    """Every node except those under `if TYPE_CHECKING:` (annotations only, never executed)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            test = getattr(child, "test", None) if isinstance(child, ast.If) else None
            if test is not None and "TYPE_CHECKING" in ast.unparse(test):
                stack.extend(child.orelse)
                continue
            stack.append(child)


def _imports(name: str, path: Path) -> set[str]:
    """appo modules `name` imports anywhere in its body, at run time (a package for
    `from pkg import x` unless `x` is itself a module)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found: set[str] = set()
    for node in _runtime_nodes(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1]
                                + ([node.module] if node.module else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in MODULES else base)
    return {m for m in found if m in MODULES and m != name}


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _is_package_init(child: str, parent: str) -> bool:
    # A package's __init__ re-exporting its submodules, and those submodules importing
    # siblings through the package, is how Python packages work, not a layering cycle.
    return child.startswith(parent + ".")


def test_no_module_over_the_line_limit():
    sizes = {n: len(p.read_text().splitlines()) for n, p in MODULES.items()}
    assert {n: s for n, s in sizes.items() if s > MAX_LINES} == {}


def test_no_import_cycles():
    edges = {n: {m for m in deps if not _is_package_init(m, n) and not _is_package_init(n, m)}
             for n, deps in GRAPH.items()}
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(n: str) -> None:
        state[n] = 1
        stack.append(n)
        for m in sorted(edges[n]):
            if state.get(m) == 1:
                cycles.append(stack[stack.index(m):] + [m])
            elif m not in state:
                visit(m)
        stack.pop()
        state[n] = 2

    for n in sorted(edges):
        if n not in state:
            visit(n)
    assert cycles == []


def test_the_cycle_check_finds_a_cycle(monkeypatch):
    # The checker itself: a planted a -> b -> a must be reported.
    monkeypatch.setitem(GRAPH, "appo.errors", GRAPH["appo.errors"] | {"appo.config"})
    with pytest.raises(AssertionError):
        test_no_import_cycles()


def test_algos_import_only_torch_and_the_error_type():
    for name, path in MODULES.items():
        if not name.startswith("appo.algos"):
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            mods = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                    [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level
                    else [])
            for mod in mods:
                top = mod.split(".")[0]
                ok = (top in {"torch", "__future__", "dataclasses", "typing", "collections",
                              "math", "functools"} or mod == "appo.errors"
                      or mod.startswith("appo.algos"))
                assert ok, f"{name} imports {mod}"


def test_library_modules_never_import_the_cli():
    cli = {n for n in MODULES if n == "appo.cli" or n.endswith(".commands")}
    for name, deps in GRAPH.items():
        if name in cli:
            continue
        assert not deps & cli, f"{name} imports {sorted(deps & cli)}"


def test_test_files_have_unique_basenames():
    """pytest imports test modules by basename (rootdir-relative, no packages): two files of
    one name in different folders stop the whole collection ("import file mismatch")."""
    import collections

    tests = Path(__file__).resolve().parent
    names = collections.Counter(p.name for p in tests.rglob("test_*.py"))
    assert [n for n, c in names.items() if c > 1] == []
