"""The import graph of the two packages, read from their source (every ``import``, also those
inside functions): generic code asks the model-family protocol (``modelzoo.family``) and never
imports a family, ``modelzoo`` has no import circle, and ``trainers`` imports nothing of
``modelzoo`` but the protocol and two shared utilities."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: What trainers may import from modelzoo: the protocol, atomic writes, the C-kernel loader,
#: the Triton kernels' switch and tables.
TRAINERS_MAY_IMPORT = {
    "modelzoo",
    "modelzoo.family",
    "modelzoo.fileio",
    "modelzoo._native",
    "modelzoo._triton",
}
#: The family packages: generic code never imports them.
FAMILY_PACKAGES = ("modelzoo.vision", "modelzoo.nlp", "modelzoo.graph", "modelzoo.linear")
#: Generic modelzoo modules that must not name a family.
GENERIC = ("modelzoo.family", "modelzoo.registry", "modelzoo.weights", "modelzoo.artifact",
           "modelzoo.export", "modelzoo.features", "modelzoo.store", "modelzoo.fileio")  # fmt: skip


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules(package: str) -> dict[str, Path]:
    return {_module_name(p): p for p in sorted((ROOT / package).rglob("*.py"))}


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The modules of ``known`` that ``path`` (module ``name``) imports."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
        for target in targets:
            while target and target not in known:  # `import a.b.c` of a.b.c's function
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def _graph(*packages: str) -> dict[str, set[str]]:
    modules: dict[str, Path] = {}
    for package in packages:
        modules.update(_modules(package))
    known = set(modules)
    return {name: _imports(name, path, known) for name, path in modules.items()}


def _is_within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_the_parser_sees_relative_and_function_level_imports():
    graph = _graph("modelzoo")
    assert "modelzoo.family" in graph["modelzoo.export"]  # `from .family import ...`
    assert "modelzoo.store" in graph["modelzoo.registry"]  # inside fetch_weights
    assert "modelzoo.vision.family" in graph["modelzoo.vision.resnest"]


def test_trainers_import_no_model_family():
    graph = _graph("trainers", "modelzoo")
    arrows = sorted(
        f"{source} -> {target}"
        for source, targets in graph.items()
        if _is_within(source, "trainers")
        for target in targets
        if _is_within(target, "modelzoo") and target not in TRAINERS_MAY_IMPORT
    )
    assert arrows == [], "trainers reach into modelzoo beyond its protocol: " + ", ".join(arrows)


@pytest.mark.parametrize("module", GENERIC)
def test_generic_modelzoo_modules_import_no_family(module):
    graph = _graph("modelzoo")
    family = sorted(t for t in graph[module] if any(_is_within(t, p) for p in FAMILY_PACKAGES))
    assert family == [], f"{module} imports model families: {family}"


def test_modelzoo_has_no_import_circle():
    """A circle among modules (a package's ``__init__`` importing its own submodules, and a
    submodule importing its package's ``__init__`` implicitly, are not arrows here)."""
    graph = _graph("modelzoo")
    packages = {n for n, p in _modules("modelzoo").items() if p.name == "__init__.py"}
    edges = {
        source: {t for t in targets if not (t in packages and _is_within(source, t))}
        for source, targets in graph.items()
        if source not in packages
    }
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    circles: list[list[str]] = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                circles.append([*path[path.index(nxt) :], nxt])
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node, [node])
    assert circles == [], "import circles: " + "; ".join(" -> ".join(c) for c in circles)
