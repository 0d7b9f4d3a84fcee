"""Imports point one way (README, "Layout"). Every top-level package declares the project
packages it may import (``ALLOWED``): ``spec``, the shared vocabulary, imports none of them;
``gpu_runtime`` and ``workflows`` import only ``spec`` (workflow code stays torch-free, the
runtime knows no workflow); ``activities`` adds those two; ``workers`` adds ``activities``.
Inside ``gpu_runtime`` its packages stand in layers (docs/architecture.md), and a package
imports only from layers below its own (``SIDEWAYS`` lists the few imports allowed within
a layer). Inside ``gpu_runtime/trainer`` the backend folders import each other only through
``common/`` and ``policy/`` (docs/trainer-backends.md, "Folders"). Every import is checked,
also the ones inside functions."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# the project packages each top-level package may import (besides itself), bottom to top
ALLOWED: dict[str, set[str]] = {
    "spec": set(),
    "gpu_runtime": {"spec"},
    "workflows": {"spec"},
    "activities": {"spec", "gpu_runtime", "workflows"},
    "workers": {"spec", "gpu_runtime", "workflows", "activities"},
    "milestone_cli": {"spec", "gpu_runtime", "workflows", "workers"},
    "infra": {"spec", "gpu_runtime", "workflows", "activities", "workers", "milestone_cli"},
    "tests": {"spec", "gpu_runtime", "workflows", "activities", "workers", "milestone_cli", "infra"},
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


def test_every_top_level_package_declares_what_it_may_import() -> None:
    packages = {p.name for p in ROOT.iterdir() if (p / "__init__.py").exists()}
    assert packages == set(ALLOWED), f"undeclared: {packages - set(ALLOWED)}; gone: {set(ALLOWED) - packages}"


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_imports_point_one_way(package: str) -> None:
    files = sorted((ROOT / package).rglob("*.py"))
    assert files, f"no Python files under {package}/"
    bad = [f"{f.relative_to(ROOT)}:{line} imports {mod}" for f in files for line, mod in imported_packages(f)
           if mod in ALLOWED and mod != package and mod not in ALLOWED[package]]
    assert not bad, "\n".join(bad)


def test_every_gpu_runtime_package_has_a_layer() -> None:
    packages = {p.name for p in (ROOT / "gpu_runtime").iterdir() if (p / "__init__.py").exists()}
    assert packages == set(LAYER), f"packages without a layer: {packages - set(LAYER)}; gone: {set(LAYER) - packages}"


@pytest.mark.parametrize("package", sorted(LAYER))
def test_gpu_runtime_layers_import_downward(package: str) -> None:
    files = sorted((ROOT / "gpu_runtime" / package).rglob("*.py"))
    bad = [v for f in files for v in layer_violations(f, package)]
    assert not bad, "\n".join(bad)


# what each folder of gpu_runtime/trainer may import of the trainer: its own folder, the
# Trainer protocol and common/; fsdp2 and dp build on policy/; policy imports no backend
# folder; common/ imports none of them (nor the process's top level). The wire messages are
# ``spec.trainer_rpc``'s.
TRAINER = ROOT / "gpu_runtime" / "trainer"
TRAINER_BELOW = {"protocol", "common"}
TRAINER_MAY_IMPORT = {
    "common": {"common"},
    "policy": {"policy"} | TRAINER_BELOW,
    "fsdp2": {"fsdp2", "policy"} | TRAINER_BELOW,
    "dp": {"dp", "policy"} | TRAINER_BELOW,
    "megatron": {"megatron"} | TRAINER_BELOW,
}


def trainer_parts(path: Path) -> list[tuple[int, str]]:
    """The parts of ``gpu_runtime.trainer`` that ``path`` imports: ``policy`` for
    ``gpu_runtime.trainer.policy.trainer`` or ``from gpu_runtime.trainer import policy``."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [f"{node.module}.{a.name}" for a in node.names] if node.module == "gpu_runtime.trainer" \
                else [node.module]
        out += [(node.lineno, n.split(".")[2]) for n in names if n.startswith("gpu_runtime.trainer.")]
    return out


@pytest.mark.parametrize("folder", sorted(TRAINER_MAY_IMPORT))
def test_trainer_backends_import_each_other_only_through_common_and_policy(folder: str) -> None:
    files = sorted((TRAINER / folder).rglob("*.py"))
    assert files, f"no Python files under gpu_runtime/trainer/{folder}/"
    bad = [f"{f.relative_to(ROOT)}:{line} imports gpu_runtime.trainer.{part}" for f in files
           for line, part in trainer_parts(f) if part not in TRAINER_MAY_IMPORT[folder]]
    assert not bad, "\n".join(bad)


def test_every_trainer_folder_has_its_rule() -> None:
    folders = {d.name for d in TRAINER.iterdir() if d.is_dir() and any(d.glob("*.py"))}
    assert folders == set(TRAINER_MAY_IMPORT)


def test_the_trainer_check_sees_a_backend_import(tmp_path: Path) -> None:
    f = tmp_path / "m.py"
    f.write_text("from gpu_runtime.trainer import layouts\n"
                 "def f():\n    from gpu_runtime.trainer.fsdp2.cell import TrainerCell\n    return TrainerCell\n")
    assert sorted(trainer_parts(f)) == [(1, "layouts"), (3, "fsdp2")]


def test_the_check_sees_a_wrong_import(tmp_path: Path) -> None:
    f = tmp_path / "m.py"
    f.write_text("def f():\n    from workflows.run_state import RunState\n    return RunState\n")
    assert imported_packages(f) == [(2, "workflows")]


def test_the_layer_check_sees_upward_and_sideways_imports(tmp_path: Path) -> None:
    f = tmp_path / "m.py"
    f.write_text("from gpu_runtime import store\nfrom gpu_runtime.trainer.work_dir import weights_folder\n\n\ndef f():\n"
                 "    from gpu_runtime.rollout.chunks import ChunkPlan\n    import gpu_runtime.node.runtime\n")

    def lines(package: str) -> list[int]:
        return sorted(int(b.split(" ", 1)[0].rsplit(":", 1)[1]) for b in layer_violations(f, package))

    assert lines("proc") == [1, 2, 6, 7]
    assert lines("engine") == [2, 6, 7]  # trainer stands beside engine: an import that way is not allowed
    assert lines("trainer") == [6, 7]  # trainer -> engine is (SIDEWAYS); store is below both
