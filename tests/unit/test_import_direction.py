"""Imports point one way (README, "Layout"): ``gpu_runtime`` imports none of
``workflows``, ``activities`` and ``workers``; ``workflows`` imports nothing from
``gpu_runtime`` (workflow code stays torch-free); ``activities`` imports no ``workers``.
Every import is checked, also the ones inside functions."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FORBIDDEN = {
    "gpu_runtime": ("workflows", "activities", "workers"),
    "workflows": ("gpu_runtime", "activities", "workers"),
    "activities": ("workers",),
}


def imported_packages(path: Path) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name.split(".")[0]) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module.split(".")[0]))
    return out


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_imports_point_one_way(package: str) -> None:
    files = sorted((ROOT / package).rglob("*.py"))
    assert files, f"no Python files under {package}/"
    bad = [f"{f.relative_to(ROOT)}:{line} imports {mod}" for f in files for line, mod in imported_packages(f)
           if mod in FORBIDDEN[package]]
    assert not bad, "\n".join(bad)


def test_the_check_sees_a_wrong_import(tmp_path: Path) -> None:
    f = tmp_path / "m.py"
    f.write_text("def f():\n    from workflows.config import RunConfig\n    return RunConfig\n")
    assert imported_packages(f) == [(2, "workflows")]
