"""Every activity the workers register has a stub (``workflows.stubs``) whose input and
output types are the implementation's annotations and whose queue kind is the queue
it is registered on; every stub is implemented. The workflow harness's stand-ins are
held to the same stubs, so the workflow tests exercise the real contract."""

from __future__ import annotations

import ast
from collections.abc import Callable
from pathlib import Path
from typing import cast

import pytest
from temporalio import activity

from activities.node import NodeActivities
from gpu_runtime.node.runtime import NodeRuntime
from tests.unit.workflow_harness import Cluster
from workers.control import CONTROL_ACTIVITIES
from workflows.queues import QueueKind
from workflows.stubs import STUBS, TRAIN_STEP, ActivityStub

BY_NAME = {s.name: s for s in STUBS}


def registered() -> dict[QueueKind, list[Callable]]:
    """What ``workers.control`` and ``workers.gpu`` register, by the kind of queue."""
    node = NodeActivities(cast(NodeRuntime, None))  # the methods only; no runtime is touched
    return {QueueKind.CONTROL: list(CONTROL_ACTIVITIES), QueueKind.POOL: node.pool(), QueueKind.NODE: node.all()}


def stand_ins() -> dict[QueueKind, list[Callable]]:
    cluster = Cluster()
    return {QueueKind.CONTROL: [cluster.prepare_data],
            QueueKind.POOL: [cluster.claim_node], QueueKind.NODE: cluster.nodes[0].activities()}


def check(fn: Callable, kind: QueueKind) -> str:
    """The stub ``fn`` implements, after checking its name, types and queue against it."""
    defn = activity._Definition.must_from_callable(fn)
    stub = BY_NAME.get(defn.name or "")
    assert stub is not None, f"{fn.__qualname__} registers {defn.name!r}, which no stub declares"
    assert defn.arg_types == [stub.input], f"{stub.name}: takes {defn.arg_types}, its stub says {stub.input}"
    returns = None if defn.ret_type is type(None) else defn.ret_type  # a stub says None for "returns nothing"
    assert returns is stub.output, f"{stub.name}: returns {defn.ret_type}, its stub says {stub.output}"
    assert stub.queue == kind, f"{stub.name} is registered on a {kind} queue, its stub says {stub.queue}"
    return stub.name


def test_every_registered_activity_matches_its_stub_and_every_stub_is_implemented() -> None:
    names = [check(fn, kind) for kind, fns in registered().items() for fn in fns]
    assert sorted(names) == sorted(BY_NAME), "each stub is registered exactly once"


def test_the_harness_stand_ins_match_the_stubs() -> None:
    names = {check(fn, kind) for kind, fns in stand_ins().items() for fn in fns}
    assert names <= set(BY_NAME)


def test_a_stub_names_its_queue() -> None:
    by_kind = {s.queue: s for s in STUBS}
    assert by_kind[QueueKind.CONTROL].task_queue(None) == "milestone-control"
    assert by_kind[QueueKind.POOL].task_queue(None) == "milestone-gpu-pool"
    assert TRAIN_STEP.task_queue("node-a-1") == "node-a-1"
    for stub, queue in ((TRAIN_STEP, None), (by_kind[QueueKind.CONTROL], "node-a-1")):
        with pytest.raises(TypeError, match="pass queue= exactly for node activities"):
            stub.task_queue(queue)


def test_stub_names_are_unique() -> None:
    assert len(BY_NAME) == len(STUBS) and all(isinstance(s, ActivityStub) for s in STUBS)


PACKAGES = ("workflows", "activities", "workers", "milestone_cli", "infra", "bench")


def bare_string_activities(path: Path) -> list[str]:
    """Where ``path`` calls an activity (``execute_activity``, ``start_activity``) or
    registers one (``activity.defn(name=...)``) by a string literal instead of a stub."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.Call):
            continue
        fn = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
        literal_name = [k.value for k in node.keywords if k.arg == "name" and isinstance(k.value, ast.Constant)]
        if fn in ("execute_activity", "start_activity") and node.args and isinstance(node.args[0], ast.Constant):
            found.append(f"{path}:{node.lineno}: {fn}({node.args[0].value!r})")
        elif fn == "defn" and literal_name and getattr(getattr(node.func, "value", None), "id", "") == "activity":
            found.append(f"{path}:{node.lineno}: activity.defn(name={literal_name[0].value!r})")
    return found


def test_no_activity_is_called_or_registered_by_a_bare_string() -> None:
    root = Path(__file__).resolve().parents[2]
    found = [f for pkg in PACKAGES for path in sorted((root / pkg).rglob("*.py")) for f in bare_string_activities(path)]
    assert not found, "use the activity's stub (workflows/stubs.py):\n" + "\n".join(found)


def test_the_bare_string_check_sees_both_kinds(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text('@activity.defn(name="train_step")\ndef f(): ...\n@workflow.defn(name="RLStep")\nclass W: ...\n'
                   'async def g():\n    await workflow.execute_activity("rollout", x)\n')
    assert [f.split(": ", 1)[1] for f in bare_string_activities(bad)] == [
        "activity.defn(name='train_step')", "execute_activity('rollout')"]
