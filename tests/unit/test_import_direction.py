"""Imports point one way (README, "Layout"): ``gpu_runtime`` imports none of
``workflows``, ``activities`` and ``workers``; ``workflows`` imports nothing from
``gpu_runtime`` (workflow code stays torch-free); ``activities`` imports no ``workers``.
Inside ``gpu_runtime/trainer`` the backend folders import each other only through
``common/`` and ``policy/`` (docs/trainer-backends.md, "Folders"). Every import is checked,
also the ones inside functions."""

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


# what each folder of gpu_runtime/trainer may import of the trainer: its own folder, the wire
# messages (api), the Trainer protocol and common/; fsdp2 and dp build on policy/; policy
# imports no backend folder; common/ imports none of them (nor the process's top level)
TRAINER = ROOT / "gpu_runtime" / "trainer"
TRAINER_BELOW = {"api", "protocol", "common"}
TRAINER_MAY_IMPORT = {
    "common": {"common", "api"},
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
    f.write_text("def f():\n    from workflows.config import RunConfig\n    return RunConfig\n")
    assert imported_packages(f) == [(2, "workflows")]
