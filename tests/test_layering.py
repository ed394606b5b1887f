"""Imports point one way: the package table in ``docs/structure.md`` is the rule, this test the check.

Every import in ``kvtier/``, ``worker/`` and ``controller/`` is read from the ``ast`` (function-level
and ``TYPE_CHECKING`` imports included: a circle through a lazy import is still a circle). The test
fails on an import the table does not allow, on a package the table does not list (or lists but the
tree lacks), on a core package importing a library kept out of it, on an import circle between
modules, and on a hand-written module over 600 lines that the table of large modules does not name.
The last test runs the check on a copy of the tree with one upward import injected, so the check is
shown to fail.
"""

from __future__ import annotations

import ast
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# Installed package name -> folder in the repository (pyproject's package-dir).
ROOTS = {"kvtier": "kvtier", "kvtier.worker": "worker", "kvtier.controller": "controller"}
GENERATED = "kvtier/rpc/_gen"
MAX_LINES = 600


@dataclass(frozen=True, slots=True)
class Rules:
    may_import: dict[str, frozenset[str]]  # short package name -> short names it may import
    kept_out: dict[str, frozenset[str]]  # third-party top-level module -> packages that may not import it
    large_modules: frozenset[str]  # repository paths allowed over MAX_LINES


def _table_rows(text: str, heading: str) -> list[list[str]]:
    section = text.split(f"## {heading}", 1)[1].split("\n## ", 1)[0]
    rows = [line.strip().strip("|").split("|") for line in section.splitlines() if line.startswith("|")]
    return [[cell.strip() for cell in row] for row in rows[2:]]  # past the header and its rule


def _names(cell: str) -> frozenset[str]:
    return frozenset(n.strip() for n in cell.replace("`", "").split(",") if n.strip() not in ("", "—"))


def load_rules(structure_md: Path) -> Rules:
    text = structure_md.read_text()
    may_import = {}
    for package, _owns, allowed in _table_rows(text, "Packages"):
        may_import[package.strip("`").removeprefix("kvtier.")] = _names(allowed)
    kept_out = {}
    for libraries, packages in _table_rows(text, "Libraries kept out of the core"):
        for library in _names(libraries):
            kept_out[library] = _names(packages)
    large = frozenset(row[0].strip("`") for row in _table_rows(text, "Large modules"))
    return Rules(may_import, kept_out, large)


@dataclass(frozen=True, slots=True)
class Module:
    name: str  # dotted, as installed: kvtier.cache.radix, kvtier.worker.actor
    path: Path

    @property
    def package(self) -> str:
        """Short name of the top-level package: ``cache``, ``worker``; ``client`` for kvtier/client/."""
        parts = self.name.split(".")
        return parts[1] if len(parts) > 1 else ""


def modules(repo: Path) -> dict[str, Module]:
    found = {}
    for base, folder in ROOTS.items():
        for path in sorted((repo / folder).rglob("*.py")):
            if path.is_relative_to(repo / GENERATED):
                continue
            parts = list(path.relative_to(repo / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            name = ".".join([base, *parts])
            found[name] = Module(name, path)
    return found


def imports_of(module: Module, known: dict[str, Module]) -> list[tuple[str, int]]:
    """(imported kvtier module or third-party top-level name, line) for every import in ``module``."""
    out = []
    for node in ast.walk(ast.parse(module.path.read_text(), str(module.path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from kvtier.cli import flags` imports the module kvtier.cli.flags.
            targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known else node.module
                       for a in node.names]
        else:
            continue
        out.extend((target, node.lineno) for target in targets)
    return out


def _owner(name: str, known: dict[str, Module]) -> Module | None:
    while name:
        if name in known:
            return known[name]
        name = name.rpartition(".")[0]
    return None


def violations(repo: Path) -> list[str]:
    rules = load_rules(repo / "docs" / "structure.md")
    known = modules(repo)
    problems = []
    packages = {m.package for m in known.values() if m.package}
    for missing in sorted(packages - rules.may_import.keys()):
        problems.append(f"package kvtier.{missing} is not in docs/structure.md's table")
    for stale in sorted(rules.may_import.keys() - packages):
        problems.append(f"docs/structure.md lists kvtier.{stale}, which the tree does not have")
    graph: dict[str, set[str]] = {name: set() for name in known}
    for module in known.values():
        where = module.path.relative_to(repo)
        allowed = rules.may_import.get(module.package, frozenset())
        for target, line in imports_of(module, known):
            if target == "kvtier" or target.startswith("kvtier."):
                dep = _owner(target, known)
                if dep is None or dep.name == module.name:
                    continue
                graph[module.name].add(dep.name)
                if dep.package and dep.package != module.package and dep.package not in allowed:
                    problems.append(f"{where}:{line}: kvtier.{module.package} may not import {dep.name}")
            else:
                library = target.split(".")[0]
                if module.package in rules.kept_out.get(library, ()):
                    problems.append(f"{where}:{line}: kvtier.{module.package} may not import {library}")
        num_lines = len(module.path.read_text().splitlines())
        if num_lines > MAX_LINES and str(where) not in rules.large_modules:
            problems.append(f"{where} has {num_lines} lines and is not named in docs/structure.md's large modules")
    problems.extend(f"import circle: {' -> '.join(cycle)}" for cycle in _cycles(graph))
    return problems


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
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
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_imports_follow_the_structure_table():
    assert violations(REPO) == []


def test_large_modules_named_in_the_table_exist():
    rules = load_rules(REPO / "docs" / "structure.md")
    for path in rules.large_modules:
        assert (REPO / path).is_file(), f"docs/structure.md names {path}, which does not exist"


def _copy_tree(tmp_path: Path) -> Path:
    copy = tmp_path / "repo"
    for folder in [*ROOTS.values(), "docs"]:
        shutil.copytree(REPO / folder, copy / folder, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    return copy


def test_an_upward_import_fails_the_check(tmp_path):
    copy = _copy_tree(tmp_path)
    errors_py = copy / "kvtier" / "domain" / "errors.py"
    errors_py.write_text(errors_py.read_text() + "\nfrom kvtier.tiers.manager import TierManager  # noqa\n")
    assert any(re.search(r"kvtier/domain/errors.py:\d+: kvtier.domain may not import kvtier.tiers.manager", p)
               for p in violations(copy))


def test_a_circle_and_a_kept_out_library_fail_the_check(tmp_path):
    copy = _copy_tree(tmp_path)
    pool = copy / "kvtier" / "cache" / "page_pool.py"
    pool.write_text(pool.read_text() + "\nimport grpc  # noqa\nfrom kvtier.cache import radix  # noqa\n")
    problems = violations(copy)
    assert any("kvtier.cache may not import grpc" in p for p in problems)
    assert any(p.startswith("import circle:") and "kvtier.cache.page_pool" in p for p in problems)


def test_an_unlisted_package_fails_the_check(tmp_path):
    copy = _copy_tree(tmp_path)
    (copy / "kvtier" / "misc").mkdir()
    (copy / "kvtier" / "misc" / "__init__.py").write_text("")
    assert "package kvtier.misc is not in docs/structure.md's table" in violations(copy)
