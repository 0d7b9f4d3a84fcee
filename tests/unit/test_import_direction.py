"""Imports point one way (README, "Layout"): ``gpu_runtime`` imports none of
``workflows``, ``activities`` and ``workers``; ``workflows`` imports nothing from
``gpu_runtime`` (workflow code stays torch-free); ``activities`` imports no ``workers``.
Inside ``gpu_runtime`` its packages stand in layers (docs/architecture.md), and a package
imports only from layers below its own (``SIDEWAYS`` lists the few imports allowed within
a layer). Every import is checked, also the ones inside functions."""

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

# gpu_runtime's packages, bottom to top: proc at the bottom imports nothing else of gpu_runtime
LAYERS: tuple[tuple[str, ...], ...] = (
    ("proc",),
    ("store", "models", "algorithms"),
    ("data", "weight_sync"),
    ("engine", "trainer"),
    ("rollout",),
    ("node",),
)
LAYER = {pkg: i for i, layer in enumerate(LAYERS) for pkg in layer}
SIDEWAYS = {("algorithms", "models"), ("trainer", "engine")}  # (importer, imported) within one layer


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, dotted name) of every absolute import; ``from a import b`` names ``a.b``."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
    return out


def imported_packages(path: Path) -> list[tuple[int, str]]:
    return [(line, mod.split(".")[0]) for line, mod in imported_modules(path)]


def _shown(path: Path) -> Path:
    return path.relative_to(ROOT) if path.is_relative_to(ROOT) else path


def layer_violations(path: Path, package: str) -> list[str]:
    """The imports of ``path`` (a file of ``gpu_runtime/<package>/``) that reach a layer above
    its own, or a package beside it that ``SIDEWAYS`` does not allow."""
    bad = []
    for line, mod in imported_modules(path):
        parts = mod.split(".")
        if parts[0] != "gpu_runtime" or len(parts) < 2 or parts[1] == package:
            continue
        other = parts[1]
        if other not in LAYER:
            bad.append(f"{_shown(path)}:{line} imports gpu_runtime.{other}, which is in no layer")
        elif LAYER[other] > LAYER[package] or (LAYER[other] == LAYER[package] and (package, other) not in SIDEWAYS):
            bad.append(f"{_shown(path)}:{line} ({package}, layer {LAYER[package]}) imports "
                       f"gpu_runtime.{other} (layer {LAYER[other]})")
    return bad


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_imports_point_one_way(package: str) -> None:
    files = sorted((ROOT / package).rglob("*.py"))
    assert files, f"no Python files under {package}/"
    bad = [f"{f.relative_to(ROOT)}:{line} imports {mod}" for f in files for line, mod in imported_packages(f)
           if mod in FORBIDDEN[package]]
    assert not bad, "\n".join(bad)


def test_every_gpu_runtime_package_has_a_layer() -> None:
    packages = {p.name for p in (ROOT / "gpu_runtime").iterdir() if (p / "__init__.py").exists()}
    assert packages == set(LAYER), f"packages without a layer: {packages - set(LAYER)}; gone: {set(LAYER) - packages}"


@pytest.mark.parametrize("package", sorted(LAYER))
def test_gpu_runtime_layers_import_downward(package: str) -> None:
    files = sorted((ROOT / "gpu_runtime" / package).rglob("*.py"))
    bad = [v for f in files for v in layer_violations(f, package)]
    assert not bad, "\n".join(bad)


def test_the_check_sees_a_wrong_import(tmp_path: Path) -> None:
    f = tmp_path / "m.py"
    f.write_text("def f():\n    from workflows.config import RunConfig\n    return RunConfig\n")
    assert imported_packages(f) == [(2, "workflows")]


def test_the_layer_check_sees_upward_and_sideways_imports(tmp_path: Path) -> None:
    f = tmp_path / "m.py"
    f.write_text("from gpu_runtime import store\nfrom gpu_runtime.trainer.api import RunSetup\n\n\ndef f():\n"
                 "    from gpu_runtime.rollout.chunks import ChunkPlan\n    import gpu_runtime.node.runtime\n")

    def lines(package: str) -> list[int]:
        return sorted(int(b.split(" ", 1)[0].rsplit(":", 1)[1]) for b in layer_violations(f, package))

    assert lines("proc") == [1, 2, 6, 7]
    assert lines("engine") == [2, 6, 7]  # trainer stands beside engine: an import that way is not allowed
    assert lines("trainer") == [6, 7]  # trainer -> engine is (SIDEWAYS); store is below both
