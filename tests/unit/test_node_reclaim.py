"""A node reclaims a closed run's files (``gpu_runtime.node.reclaim``, ``workers.node_reclaim``):
exactly that run's paths, never another run's (ids that share a prefix included), never a
run that Temporal says is running or that the node serves, and nothing when Temporal
cannot be asked."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from types import SimpleNamespace

from temporalio.client import WorkflowExecutionStatus
from temporalio.service import RPCError, RPCStatusCode

from gpu_runtime.node.reclaim import TRASH_PREFIX, reclaim_run, remove_trash, run_paths, runs_on_node, size_of
from gpu_runtime.trainer.work_dir import is_temp_dir, remove_temp_dirs
from spec.trainer_rpc import RunForgotten
from workers.node_reclaim import RunReclaimer

RUNS = ("a", "a_b", "ab", "a_data_x")  # ids a careless prefix or pattern match would mix up


def write(path: Path, size: int) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"x" * size)
    return path


def node_with_runs(work: Path) -> Path:
    """A node's work dir holding files of each of ``RUNS`` laid out as a node keeps them,
    the engines' weights hard links to the trainer's export, as on a real node."""
    for run in RUNS:
        export = write(work / "trainer" / run / "weights" / "v000001" / "model.safetensors", 1000)
        write(work / "trainer" / run / "checkpoints" / "step-000001" / "policy.safetensors", 3000)
        write(work / "trainer" / run / "dataset.jsonl", 10)
        (work / "weights" / run / "v000001").mkdir(parents=True)
        os.link(export, work / "weights" / run / "v000001" / "model.safetensors")
        for split in ("train", "eval"):
            write(work / "data" / f"runs_{run}_data_{split}.jsonl", 100)
    write(work / "logs" / "trainer.log", 50)
    write(work / "children.json", 5)
    return work


def test_run_paths_are_the_runs_own(tmp_path: Path) -> None:
    work = node_with_runs(tmp_path)
    assert run_paths(work, "a") == [
        work / "trainer" / "a", work / "weights" / "a",
        work / "data" / "runs_a_data_eval.jsonl", work / "data" / "runs_a_data_train.jsonl",
    ]
    assert run_paths(work, "a_data_x")[2:] == [work / "data" / "runs_a_data_x_data_eval.jsonl",
                                               work / "data" / "runs_a_data_x_data_train.jsonl"]
    assert runs_on_node(work) == set(RUNS)
    assert run_paths(work, "nope") == []


def test_reclaim_removes_one_run_and_counts_linked_bytes_once(tmp_path: Path) -> None:
    work = node_with_runs(tmp_path)
    others = {p: p.stat().st_size for run in RUNS[1:] for p in (work / "trainer" / run).rglob("*") if p.is_file()}
    # 1000 (export, linked from weights/) + 3000 + 10 + 2 x 100
    assert size_of(run_paths(work, "a")) == 4210
    assert reclaim_run(work, "a") == 4210
    assert run_paths(work, "a") == [] and runs_on_node(work) == set(RUNS[1:])
    assert {p: p.stat().st_size for p in others} == others  # every other run's files untouched
    assert (work / "logs" / "trainer.log").exists() and (work / "children.json").exists()
    assert not [p for p in work.rglob("*") if p.name.startswith(TRASH_PREFIX)]
    assert reclaim_run(work, "a") == 0


def test_an_interrupted_reclaims_trash_goes_at_the_next_sweep(tmp_path: Path) -> None:
    work = node_with_runs(tmp_path)
    (work / "trainer" / "a").rename(work / "trainer" / f"{TRASH_PREFIX}1234abcd-a")
    assert "a" in runs_on_node(work)  # its weights/ and data/ are still there
    remove_trash(work)
    assert not (work / "trainer" / f"{TRASH_PREFIX}1234abcd-a").exists() and (work / "trainer" / "a_b").exists()


def test_trainer_temp_dirs_but_never_a_run_named_like_one(tmp_path: Path) -> None:
    write(tmp_path / "save-ab12cd34" / "model.safetensors", 10)  # a killed trainer's half-written save
    (tmp_path / "restore-zz_9yy8x").mkdir()
    write(tmp_path / "save-run12345" / "checkpoints" / "step-000001" / "policy.safetensors", 10)  # a run's folder
    write(tmp_path / "restore-me" / "dataset.jsonl", 10)  # a run id, not tempfile's 8 characters
    assert [p.name for p in sorted(tmp_path.iterdir()) if is_temp_dir(p)] == ["restore-zz_9yy8x", "save-ab12cd34"]
    remove_temp_dirs(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["restore-me", "save-run12345"]
    assert runs_on_node(tmp_path.parent) == set()  # (the node's trainer dir is <work>/trainer)


class FakeTemporal:
    """``describe`` answers from ``status`` (a run id missing: NOT_FOUND; ``error``: unavailable)."""

    def __init__(self, status: dict[str, WorkflowExecutionStatus], error: set[str] | None = None) -> None:
        self.status = status
        self.error = error or set()
        self.asked: list[str] = []

    def get_workflow_handle(self, run_id: str) -> SimpleNamespace:
        async def describe() -> SimpleNamespace:
            self.asked.append(run_id)
            if run_id in self.error:
                raise RPCError("unavailable", RPCStatusCode.UNAVAILABLE, b"")
            if run_id not in self.status:
                raise RPCError("workflow not found", RPCStatusCode.NOT_FOUND, b"")
            return SimpleNamespace(status=self.status[run_id])

        return SimpleNamespace(describe=describe)


class FakeTrainer:
    def __init__(self) -> None:
        self.forgot: list[str] = []

    def alive(self) -> bool:
        return True

    def forget_run(self, run_id: str) -> RunForgotten:
        self.forgot.append(run_id)
        return RunForgotten(run_id=run_id, held=True)


def test_only_closed_runs_nobody_serves_here_are_reclaimed(tmp_path: Path) -> None:
    """a: completed; a_b: running elsewhere (it moved: it may come back); ab: unknown to
    Temporal (NOT_FOUND); a_data_x: Temporal unavailable (files stay, asked again later);
    and a completed run that is claimed here again (a resume) keeps its files."""
    work = node_with_runs(tmp_path)
    write(work / "trainer" / "back" / "dataset.jsonl", 10)
    S = WorkflowExecutionStatus
    temporal = FakeTemporal({"a": S.COMPLETED, "a_b": S.RUNNING, "back": S.TERMINATED}, error={"a_data_x"})
    trainer = FakeTrainer()
    runtime = SimpleNamespace(work_dir=work, node_id="n0", trainer=trainer, setups={"a": object(), "back": object()})
    reclaimer = RunReclaimer(temporal, runtime, lambda: {"back"})
    asyncio.run(reclaimer.sweep())
    assert runs_on_node(work) == {"a_b", "a_data_x", "back"}
    assert sorted(temporal.asked) == ["a", "a_b", "a_data_x", "ab"]  # a live run is not even asked about
    assert trainer.forgot == ["a", "ab"] and set(runtime.setups) == {"back"}
    temporal.error.clear()
    temporal.status["a_b"] = S.FAILED
    asyncio.run(reclaimer.sweep())
    assert runs_on_node(work) == {"back"}


def test_after_a_watch_ends_the_run_is_asked_about_until_it_closes(tmp_path: Path) -> None:
    work = node_with_runs(tmp_path)
    temporal = FakeTemporal({"a": WorkflowExecutionStatus.RUNNING})
    runtime = SimpleNamespace(work_dir=work, node_id="n0", trainer=FakeTrainer(), setups={})
    reclaimer = RunReclaimer(temporal, runtime, set, after_watch_s=(0.0, 0.3, 0.3, 0.3))

    async def main() -> None:
        reclaimer.run_left("a")
        while not temporal.asked:  # it closes just after its watch ended
            await asyncio.sleep(0.01)
        temporal.status["a"] = WorkflowExecutionStatus.COMPLETED
        while reclaimer._tasks:
            await asyncio.sleep(0.01)

    asyncio.run(asyncio.wait_for(main(), 10))
    assert "a" not in runs_on_node(work) and len(temporal.asked) == 2
