"""The fault hooks (``gpu_runtime.proc.faults``): each variable's values as parsed, each
malformed value refused naming its variable, the hooks firing where their values say, the
table in docs/fault-tolerance.md listing every hook, and no production file reading one."""

from __future__ import annotations

import ast
import errno
import logging
import time
from pathlib import Path

import pytest

from gpu_runtime.proc import faults
from gpu_runtime.proc.disk import is_no_space
from gpu_runtime.proc.faults import CellDelay, Enospc, Faults, FaultSpecError, UploadGate, parse

ROOT = Path(__file__).resolve().parents[2]
PRODUCTION = ("spec", "gpu_runtime", "workflows", "activities", "workers", "milestone_cli", "infra")


def test_unset_and_empty_variables_do_nothing() -> None:
    assert parse({}) == Faults()
    assert parse({v: "" for v in faults.VARIABLES}) == Faults()


def test_each_variable_parsed_into_its_field() -> None:
    got = parse({
        "MILESTONE_ENGINE_STEP_DELAY_MS": "150",
        "MILESTONE_FAULT_TRAIN_DELAY_S": "2",
        "MILESTONE_FAULT_CHECKPOINT_DELAY_S": "1.5",
        "MILESTONE_FAULT_UPLOAD_DELAY_S": "0.25",
        "MILESTONE_FAULT_UPLOAD_GATE": "2:/tmp/gate",
        "MILESTONE_FAULT_WEIGHT_BROADCAST_DELAY_S": "3",
        "MILESTONE_FAULT_CELL_DELAY": "1:2:2,0:600:3:quorum,,1:0.5,0:1:*:allreduce",
        "MILESTONE_FAULT_CELL_GATE": "/tmp/cell_gate",
        "MILESTONE_FAULT_ENOSPC": "checkpoint:4:/tmp/a:b",
    })
    assert got == Faults(
        engine_step_delay_ms=150.0, train_delay_s=2.0, checkpoint_delay_s=1.5, upload_delay_s=0.25,
        upload_gate=UploadGate(file=Path("/tmp/gate"), step=2), weight_broadcast_delay_s=3.0,
        cell_delays=(CellDelay(cell=1, seconds=2.0, version=2), CellDelay(cell=0, seconds=600.0, version=3, where="quorum"),
                     CellDelay(cell=1, seconds=0.5), CellDelay(cell=0, seconds=1.0)),
        cell_gate=Path("/tmp/cell_gate"),
        enospc=Enospc(phase="checkpoint", step=4, gate=Path("/tmp/a:b")),  # the file keeps its colons
    )
    assert parse({"MILESTONE_FAULT_UPLOAD_GATE": "/tmp/gate"}).upload_gate == UploadGate(file=Path("/tmp/gate"))


@pytest.mark.parametrize(("variable", "value"), [
    ("MILESTONE_ENGINE_STEP_DELAY_MS", "fast"),
    ("MILESTONE_FAULT_TRAIN_DELAY_S", "-1"),
    ("MILESTONE_FAULT_CHECKPOINT_DELAY_S", "nan"),
    ("MILESTONE_FAULT_UPLOAD_DELAY_S", "inf"),
    ("MILESTONE_FAULT_WEIGHT_BROADCAST_DELAY_S", "2s"),
    ("MILESTONE_FAULT_UPLOAD_GATE", "two:/tmp/gate"),
    ("MILESTONE_FAULT_UPLOAD_GATE", "2:"),
    ("MILESTONE_FAULT_CELL_DELAY", "1"),
    ("MILESTONE_FAULT_CELL_DELAY", "1:2:3:quorum:x"),
    ("MILESTONE_FAULT_CELL_DELAY", "one:2"),
    ("MILESTONE_FAULT_CELL_DELAY", "1:-2"),
    ("MILESTONE_FAULT_CELL_DELAY", "1:2:v3"),
    ("MILESTONE_FAULT_CELL_DELAY", "1:2::quorum"),
    ("MILESTONE_FAULT_CELL_DELAY", "1:2:*:commit"),
    ("MILESTONE_FAULT_CELL_DELAY", "1:2,0:x"),
    ("MILESTONE_FAULT_ENOSPC", "checkpoint:3"),
    ("MILESTONE_FAULT_ENOSPC", "train:3:/tmp/gate"),
    ("MILESTONE_FAULT_ENOSPC", "checkpoint:last:/tmp/gate"),
    ("MILESTONE_FAULT_ENOSPC", "checkpoint:3:"),
])
def test_a_malformed_value_is_refused_naming_its_variable(variable: str, value: str) -> None:
    with pytest.raises(FaultSpecError) as got:
        parse({variable: value})
    assert (got.value.variable, got.value.value) == (variable, value)
    assert isinstance(got.value, ValueError)


def test_a_hook_reads_the_environment_when_it_fires(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MILESTONE_ENGINE_STEP_DELAY_MS", "40")
    assert faults.engine_step_delay_ms() == 40.0
    monkeypatch.setenv("MILESTONE_ENGINE_STEP_DELAY_MS", "0")
    assert faults.engine_step_delay_ms() == 0.0
    monkeypatch.setenv("MILESTONE_FAULT_CELL_DELAY", "1:x")
    with pytest.raises(FaultSpecError) as got:
        faults.delay("train")  # any hook: the malformed variable is named however it is reached
    assert got.value.variable == "MILESTONE_FAULT_CELL_DELAY"


def test_delays_sleep_at_their_point(monkeypatch: pytest.MonkeyPatch) -> None:
    slept: list[float] = []
    monkeypatch.setattr(time, "sleep", slept.append)
    monkeypatch.setenv("MILESTONE_FAULT_TRAIN_DELAY_S", "2")
    monkeypatch.setenv("MILESTONE_FAULT_WEIGHT_BROADCAST_DELAY_S", "0.5")
    points: tuple[faults.DelayPoint, ...] = ("train", "checkpoint", "upload", "weight_broadcast")
    for point in points:
        faults.delay(point)
    assert slept == [2.0, 0.5]


def test_the_upload_gate_holds_its_steps_write_until_the_file_exists(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    gate = tmp_path / "gate"
    polls: list[float] = []

    def poll(s: float) -> None:
        polls.append(s)
        if len(polls) == 3:
            gate.touch()

    monkeypatch.setattr(time, "sleep", poll)
    monkeypatch.setenv("MILESTONE_FAULT_UPLOAD_GATE", f"2:{gate}")
    faults.delay("upload", 1)  # another checkpoint's write: not held
    faults.delay("train", 2)  # the gate is the upload's only
    assert polls == []
    faults.delay("upload", 2)
    assert polls == [faults.GATE_POLL_S] * 3 and gate.exists()


def test_a_cell_delay_fires_for_its_cell_version_and_point(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    slept: list[float] = []
    monkeypatch.setattr(time, "sleep", slept.append)
    monkeypatch.setenv("MILESTONE_FAULT_CELL_DELAY", "1:2:2,1:3:*:quorum,1:4")
    with caplog.at_level(logging.WARNING, logger=faults.__name__):
        faults.cell_delay(0, 2)  # another cell
        faults.cell_delay(1, 3)  # the last entry only (every version, before the allreduce)
        faults.cell_delay(1, 2)  # both allreduce entries, in order
        faults.cell_delay(1, 5, "quorum")
    assert slept == [4.0, 2.0, 4.0, 3.0]
    assert "fault delay before the allreduce of v2: 2 s" in caplog.text  # what the DP tests wait for
    assert "fault delay before the quorum of v5: 3 s" in caplog.text

    slept.clear()
    gate = tmp_path / "gate"
    gate.touch()
    monkeypatch.setenv("MILESTONE_FAULT_CELL_GATE", str(gate))
    faults.cell_delay(1, 2)  # the gate exists: the delay ends at once
    assert slept == []


def test_injected_enospc_only_at_its_phase_and_step_while_the_gate_exists(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    gate = tmp_path / "gate"
    monkeypatch.setenv("MILESTONE_FAULT_ENOSPC", f"checkpoint:3:{gate}")
    faults.enospc("checkpoint", 3)  # no gate: no fault
    gate.touch()
    faults.enospc("checkpoint", 2)
    with pytest.raises(OSError) as got:
        faults.enospc("checkpoint", 3)
    assert got.value.errno == errno.ENOSPC and is_no_space(got.value)
    gate.unlink()
    faults.enospc("checkpoint", 3)


def test_the_docs_table_lists_every_hook() -> None:
    doc = (ROOT / "docs" / "fault-tolerance.md").read_text()
    rows = {line.split("|")[1].strip().strip("`") for line in doc.splitlines() if line.startswith("| `MILESTONE_")}
    assert rows == set(faults.VARIABLES)


def _strings(path: Path) -> list[tuple[int, str]]:
    """(line, text) of the string constants in ``path``, docstrings left out."""
    tree = ast.parse(path.read_text(), str(path))
    docs = {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
            and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    return [(n.lineno, n.value) for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs]


def test_only_the_faults_module_names_a_fault_variable() -> None:
    """A hook read anywhere else would have its own parser again."""
    own = ROOT / "gpu_runtime" / "proc" / "faults.py"
    bad = [f"{f.relative_to(ROOT)}:{line}" for package in PRODUCTION for f in sorted((ROOT / package).rglob("*.py"))
           if f != own for line, text in _strings(f)
           if "MILESTONE_FAULT_" in text or any(v in text for v in faults.VARIABLES)]
    assert not bad, bad
