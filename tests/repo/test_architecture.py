"""The dependency rules of docs/architecture.md, checked on the imports the code really makes.

Every .py file under the library packages is parsed (ast, so imports inside functions count, and so do
``importlib.import_module("...")`` calls with a literal name); each rule lists its offenders by file and line.
"""
import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
THREE = ("picasso_ops", "moe_proto", "gba_engine")
CORE = "sparse_core"
LIBRARY = (*THREE, "sparse_scale", CORE)
SCRIPT_DIRS = ("launch", "benchmarks")


@dataclass(frozen=True)
class Import:
    """One imported name, absolute (``from .x import y`` in a.b resolves to ``a.x.y``), where it is written."""

    name: str
    file: str
    line: int

    def under(self, package: str) -> bool:
        """True when the import is ``package`` or something inside it."""
        return self.name == package or self.name.startswith(package + ".")

    def __str__(self) -> str:
        return f"{self.file}:{self.line} imports {self.name}"


def imports_of(path: Path) -> list[Import]:
    """Every import in one file, at any depth, with relative imports made absolute."""
    return imports_in_source(path.read_text(), str(path.relative_to(ROOT)))


def imports_in_source(text: str, rel: str) -> list[Import]:
    """The imports of source ``text`` as if it lived at ``rel`` (a path relative to the repository)."""
    tree = ast.parse(text, filename=rel)
    path = Path(rel)
    module = ".".join(path.with_suffix("").parts[:-1] if path.stem == "__init__" else path.with_suffix("").parts)
    package = module if path.stem == "__init__" else module.rpartition(".")[0]
    found: list[Import] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [Import(alias.name, rel, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            found += [Import(f"{base}.{alias.name}" if alias.name != "*" else base, rel, node.lineno)
                      for alias in node.names]
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name in ("import_module", "__import__"):
                found.append(Import(node.args[0].value, rel, node.lineno))
    return sorted(found, key=lambda imp: imp.line)


def _files(*folders: str) -> list[Path]:
    return sorted(p for folder in folders for p in (ROOT / folder).rglob("*.py") if ".venv" not in p.parts)


def _offenders(folders, forbidden, allowed=()):
    return [str(imp) for path in _files(*folders) for imp in imports_of(path)
            if any(imp.under(f) for f in forbidden) and not any(imp.under(a) for a in allowed)]


def test_imports_are_resolved_at_any_depth():
    text = ("import os\nfrom . import jagged\n\n\ndef f():\n    from ..cache import policy\n"
            "    import importlib\n    importlib.import_module('moe_proto.layer')\n")
    found = [(imp.name, imp.line) for imp in imports_in_source(text, "picasso_ops/interleave/x.py")]
    assert found == [("os", 1), ("picasso_ops.interleave.jagged", 2), ("picasso_ops.cache.policy", 6),
                     ("importlib", 7), ("moe_proto.layer", 8)]
    init = imports_in_source("from .x import y\n", "gba_engine/ps/__init__.py")
    assert [imp.name for imp in init] == ["gba_engine.ps.x.y"]


@pytest.mark.parametrize("package, forbidden", [
    ("picasso_ops", ("moe_proto", "gba_engine")),
    ("moe_proto", ("picasso_ops", "gba_engine")),
    ("gba_engine", ("moe_proto",)),
])
def test_package_dependencies_point_one_way(package, forbidden):
    bad = _offenders([package], forbidden)
    assert not bad, f"{package} must not import {forbidden}:\n" + "\n".join(bad)


@pytest.mark.parametrize("package", THREE)
def test_the_three_packages_never_import_the_job_layer(package):
    bad = _offenders([package], ["sparse_scale"])
    assert not bad, f"{package} must not import sparse_scale (the job layer); the floor is sparse_core:\n" + "\n".join(bad)


def test_the_foundation_imports_no_package_of_the_project():
    bad = _offenders([CORE], [*THREE, "sparse_scale"])
    assert not bad, f"{CORE} must import none of the packages nor the job layer:\n" + "\n".join(bad)


def test_what_only_the_jobs_use_lives_with_the_jobs():
    """A module of the foundation that none of the three packages imports belongs to the job layer."""
    used = {imp.name.split(".")[1] for path in _files(*THREE) for imp in imports_of(path)
            if imp.under(CORE) and imp.name != CORE}
    modules = {p.stem for p in (ROOT / CORE).glob("*.py") if p.stem != "__init__"}
    assert modules - used == set(), f"used by the jobs only, move to sparse_scale: {sorted(modules - used)}"


def test_the_old_foundation_path_still_imports_with_a_warning():
    import importlib
    import sys
    import warnings

    for name in [n for n in sys.modules if n == "sparse_scale.base" or n.startswith("sparse_scale.base.")]:
        del sys.modules[name]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        old = importlib.import_module("sparse_scale.base.blocks")
    assert old is importlib.import_module("sparse_core.blocks")
    assert any(issubclass(w.category, DeprecationWarning) and "sparse_core" in str(w.message) for w in caught)


def test_library_code_never_imports_launch_or_benchmarks():
    bad = _offenders(LIBRARY, SCRIPT_DIRS)
    assert not bad, "library code must not import launch/ or benchmarks/:\n" + "\n".join(bad)


def sys_path_edits(text: str, rel: str) -> list[str]:
    """Lines of source ``text`` (file ``rel``) that change the import path: ``sys.path`` calls and
    assignments, ``site.addsitedir``."""
    tree = ast.parse(text, filename=rel)

    def is_sys_path(node):
        return isinstance(node, ast.Attribute) and node.attr == "path" and isinstance(node.value, ast.Name) \
            and node.value.id == "sys"

    edits = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if is_sys_path(node.func.value) or node.func.attr == "addsitedir":
                edits.append((node.lineno, f"{rel}:{node.lineno} {ast.unparse(node)[:80]}"))
        elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                inner = target.value if isinstance(target, ast.Subscript) else target
                if is_sys_path(inner):
                    edits.append((node.lineno, f"{rel}:{node.lineno} {ast.unparse(node)[:80]}"))
    return [text for _, text in sorted(edits)]


def test_sys_path_edit_detector():
    text = ("import sys, site\nsys.path.insert(0, 'x')\nsys.path += ['y']\nsys.path[:0] = ['z']\n"
            "site.addsitedir('w')\nprint(sys.path)\n")
    assert [e.split()[0] for e in sys_path_edits(text, "p.py")] == [f"p.py:{n}" for n in (2, 3, 4, 5)]


def test_scripts_do_not_edit_sys_path():
    bad = [edit for path in _files(*SCRIPT_DIRS)
           for edit in sys_path_edits(path.read_text(), str(path.relative_to(ROOT)))]
    assert not bad, "launch/ and benchmarks/ must run as installed modules, not edit sys.path:\n" + "\n".join(bad)
