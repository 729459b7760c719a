"""Imports run one way (docs/design.md, "Import rules"), read from the AST of ``pmd_jax/``:

* the module import graph has no cycle. Every import of a ``pmd_jax`` module is an edge: at
  module level, under ``if TYPE_CHECKING:`` and inside a function alike; a package's
  ``__init__.py`` is the package (``from pmd_jax.tasks import X`` is an edge to it unless
  ``X`` is a submodule);
* no function imports a ``pmd_jax`` module (they are imported at the top of the module);
* a function-level import of another module (an optional or heavy dependency: matplotlib,
  transformers, scann, ...) says why, in a ``# lazy: <reason>`` comment on its line or on
  the line above it (or above the first of a run of imports it belongs to).

Each rule is also checked on a small package written to ``tmp_path``, so that the checks can
fail."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "pmd_jax"
LAZY = "# lazy:"


def _modules(pkg: Path) -> dict[str, Path]:
    """Dotted module name -> file (``pkg/a/__init__.py`` is ``pkg.a``)."""
    out = {}
    for p in sorted(pkg.rglob("*.py")):
        parts = list(p.relative_to(pkg.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = p
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return ((isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
            or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


def _imports(tree: ast.AST) -> Iterator[tuple[ast.Import | ast.ImportFrom, str]]:
    """Every import statement with where it stands: "top" (module level, class bodies and
    ``try`` blocks included), "type_checking" or "function"."""

    def walk(node: ast.AST, where: str) -> Iterator[tuple[ast.Import | ast.ImportFrom, str]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import | ast.ImportFrom):
                yield child, where
                continue
            inner = where
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
                inner = "function"
            elif (isinstance(child, ast.If) and where == "top"
                  and _is_type_checking(child.test)):
                for stmt in child.body:
                    yield from walk(ast.Module(body=[stmt], type_ignores=[]), "type_checking")
                for stmt in child.orelse:
                    yield from walk(ast.Module(body=[stmt], type_ignores=[]), where)
                continue
            yield from walk(child, inner)

    yield from walk(tree, "top")


def _targets(node: ast.Import | ast.ImportFrom, module: str, modules: dict[str, Path],
             root: str) -> list[str]:
    """The package modules an import statement of ``module`` names."""
    if isinstance(node, ast.Import):
        out = []
        for alias in node.names:
            name = alias.name
            while name not in modules and "." in name:
                name = name.rsplit(".", 1)[0]
            if name in modules:
                out.append(name)
        return out
    base = node.module or ""
    if node.level:  # relative: from the module's package
        pkg = module if modules[module].name == "__init__.py" else module.rpartition(".")[0]
        for _ in range(node.level - 1):
            pkg = pkg.rpartition(".")[0]
        base = f"{pkg}.{base}" if base else pkg
    if base != root and not base.startswith(root + "."):
        return []
    return [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
            for a in node.names if f"{base}.{a.name}" in modules or base in modules]


def import_graph(pkg: Path) -> dict[str, set[str]]:
    """Module -> the package modules it imports (any import of them: top level,
    TYPE_CHECKING or inside a function)."""
    modules = _modules(pkg)
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        for node, _where in _imports(ast.parse(path.read_text(), str(path))):
            graph[module].update(t for t in _targets(node, module, modules, pkg.name)
                                 if t != module)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _describe(graph: dict[str, set[str]], comp: list[str]) -> str:
    members = set(comp)
    return "; ".join(f"{a} -> {b}" for a in comp for b in sorted(graph[a] & members))


def function_level_imports(pkg: Path) -> tuple[list[str], list[str]]:
    """(function-level imports of the package's own modules, function-level imports of
    other modules without a ``# lazy:`` reason), each as ``path:line: module``."""
    modules = _modules(pkg)
    own: list[str] = []
    unexplained: list[str] = []
    import_line = re.compile(r"^\s*(import\s|from\s+\S+\s+import\s)")
    for module, path in modules.items():
        lines = path.read_text().splitlines()
        for node, where in _imports(ast.parse("\n".join(lines), str(path))):
            if where != "function":
                continue
            name = node.names[0].name if isinstance(node, ast.Import) else node.module or ""
            where_at = f"{path.relative_to(pkg.parent)}:{node.lineno}: {name or '.'}"
            if _targets(node, module, modules, pkg.name) or (
                    isinstance(node, ast.ImportFrom) and node.level):
                own.append(where_at)
                continue
            i = node.lineno - 1
            said = LAZY in lines[i]
            while not said and i > 0:  # the line above, over a run of imports
                i -= 1
                if LAZY in lines[i]:
                    said = True
                elif not import_line.match(lines[i]) and not lines[i].strip().startswith(")"):
                    break
            if not said:
                unexplained.append(where_at)
    return own, unexplained


# ------------------------------------------------------------------------- the package
def test_the_package_has_no_import_cycle():
    graph = import_graph(PACKAGE)
    assert len(graph) > 100  # (the walk found the package)
    found = cycles(graph)
    assert not found, "import cycles (every import of a pmd_jax module counts):\n" + "\n".join(
        _describe(graph, c) for c in found)


def test_no_function_imports_a_package_module():
    own, _ = function_level_imports(PACKAGE)
    assert not own, ("pmd_jax modules imported inside functions (import them at the top of "
                     "the module):\n" + "\n".join(own))


def test_every_other_function_level_import_says_why():
    _, unexplained = function_level_imports(PACKAGE)
    assert not unexplained, (f"function-level imports without a '{LAZY} <reason>' comment on "
                             "their line or the line above:\n" + "\n".join(unexplained))


# ------------------------------------------------------------------ the checks can fail
def _write(root: Path, files: dict[str, str]) -> Path:
    pkg = root / "pkg"
    for name, text in files.items():
        path = pkg / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return pkg


def test_a_cycle_is_found_whatever_kind_of_import_closes_it(tmp_path):
    pkg = _write(tmp_path, {
        "__init__.py": "",
        "a.py": "from pkg.b import B\n",
        "b.py": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                 "    from pkg.c import C\nB = 1\n"),
        "c.py": "def f():\n    from pkg import a\n    return a\n",
        "d.py": "from pkg.a import B\n",  # below the cycle, not in it
        "sub/__init__.py": "from pkg.sub.e import E\n",
        "sub/e.py": "from pkg.sub import E2\nE = 1\n",  # the package's __init__ is the package
    })
    graph = import_graph(pkg)
    assert graph["pkg.c"] == {"pkg.a"} and graph["pkg.d"] == {"pkg.a"}
    assert sorted(cycles(graph)) == [["pkg.a", "pkg.b", "pkg.c"], ["pkg.sub", "pkg.sub.e"]]


def test_relative_and_plain_imports_are_edges(tmp_path):
    pkg = _write(tmp_path, {
        "__init__.py": "",
        "x/__init__.py": "",
        "x/one.py": "from . import two\n",
        "x/two.py": "import pkg.x.one\n",
    })
    assert cycles(import_graph(pkg)) == [["pkg.x.one", "pkg.x.two"]]


def test_function_level_imports_are_found(tmp_path):
    pkg = _write(tmp_path, {
        "__init__.py": "",
        "a.py": "X = 1\n",
        "b.py": (
            "import json\n\n"
            "def own():\n    from pkg.a import X\n    return X\n\n"
            "def relative():\n    from .a import X\n    return X\n\n"
            "def heavy():\n    import matplotlib\n    return matplotlib\n\n"
            "def said():\n    # lazy: plots only\n    import matplotlib\n"
            "    import matplotlib.pyplot as plt\n    return plt\n\n"
            "def said_inline():\n    import torch  # lazy: optional\n    return torch\n"
        ),
    })
    own, unexplained = function_level_imports(pkg)
    assert own == ["pkg/b.py:4: pkg.a", "pkg/b.py:8: a"]
    assert unexplained == ["pkg/b.py:12: matplotlib"]
