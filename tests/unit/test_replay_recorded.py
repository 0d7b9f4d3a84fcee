"""Replay the recorded workflow histories (tests/histories/) against the current workflow code.

They are the replay baseline (docs/workflow-versioning.md): recorded by this code, from real runs
(the e2e tests) and, for the off-policy modes, the workflow harness (tests/recorded_histories.py
names each). A change to ``TrainingRun``, ``RLStep`` or ``SFTStep`` that would break a running
workflow (non-determinism) fails here without any server; such a change follows the rule in
docs/workflow-versioning.md (a ``workflow.patched`` branch, or a new workflow type), and the
recordings are refreshed with ``MILESTONE_RECORD_HISTORY=1``.
"""

from __future__ import annotations

import asyncio
import ast
import json
from pathlib import Path

import pytest
from temporalio.api.enums.v1 import EventType
from temporalio.client import WorkflowHistory
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.worker import Replayer, UnsandboxedWorkflowRunner
from temporalio.workflow import NondeterminismError

import workflows
import workflows.rl_step
from tests.recorded_histories import HISTORY_DIR, RECORDINGS
from workflows.training_run import RUN_WORKFLOWS
from workflows.versioning import PATCHES

HISTORIES = sorted(HISTORY_DIR.glob("*.json"))


def history(name: str) -> WorkflowHistory:
    return WorkflowHistory.from_json(RECORDINGS[name][0], (HISTORY_DIR / f"{name}.json").read_text())


def replay(h: WorkflowHistory, *, sandboxed: bool = True) -> None:
    """Replay ``h`` on the current code (``sandboxed`` False: outside the workflow sandbox, so a
    monkeypatched workflow module is the code that replays)."""
    runner = {} if sandboxed else {"workflow_runner": UnsandboxedWorkflowRunner()}
    replayer = Replayer(workflows=RUN_WORKFLOWS, data_converter=pydantic_data_converter, **runner)
    asyncio.run(replayer.replay_workflow(h))


def patched_ids_in_code() -> set[str]:
    """The ids passed to ``workflow.patched`` / ``deprecate_patch`` anywhere in the workflows
    package: names of ``workflows.versioning.PATCHES``' entries or string literals."""
    ids: set[str] = set()
    for path in Path(workflows.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in ("patched", "deprecate_patch") and node.args):
                arg = node.args[0]
                ids.add(arg.value if isinstance(arg, ast.Constant) else ast.unparse(arg))
    return ids


@pytest.mark.parametrize("name", sorted(RECORDINGS))
def test_recorded_history_replays(name: str) -> None:
    replay(history(name))


def test_every_recording_is_declared_and_present() -> None:
    assert {p.stem for p in HISTORIES} == set(RECORDINGS)


@pytest.mark.parametrize("name", sorted(RECORDINGS))
def test_recordings_carry_only_declared_patches(name: str) -> None:
    """The baseline has no patch: a history with a patch marker was recorded by code that had
    one. A patch added later (docs/workflow-versioning.md) is declared in
    ``workflows.versioning.PATCHES``, and only those ids may appear."""
    markers = [e.marker_recorded_event_attributes for e in history(name).events
               if e.event_type == EventType.EVENT_TYPE_MARKER_RECORDED]
    patch_ids = {json.loads(m.details["patch-data"].payloads[0].data)["id"]
                 for m in markers if m.marker_name == "core_patch"}
    assert patch_ids <= set(PATCHES)


def test_a_changed_step_does_not_replay(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check can fail: a step that skips its due checkpoint (one command fewer than it
    recorded) is caught as non-determinism."""

    async def never(*_: object) -> None:
        return None

    replay(history("rl_step_eval"), sandboxed=False)  # as recorded: replays outside the sandbox too
    monkeypatch.setattr(workflows.rl_step, "checkpoint_if_due", never)
    with pytest.raises(NondeterminismError):
        replay(history("rl_step_eval"), sandboxed=False)


def test_every_patch_in_the_code_is_declared() -> None:
    """The baseline's code has no ``workflow.patched`` call; a later one passes an id declared
    in ``PATCHES`` (by name, ``PATCHES[i]``, or as the literal itself)."""
    assert all(i in PATCHES or i.startswith("PATCHES[") for i in patched_ids_in_code()), patched_ids_in_code()
    assert len(set(PATCHES)) == len(PATCHES)
