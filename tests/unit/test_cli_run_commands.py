"""``milestone pause / set / resume / status`` reach a running ``TrainingRun`` through the
workflow's own methods (``TrainingRun.pause``, ``.set_hparams``, ``.set_engines``,
``.progress``), on Temporal's time-skipping test server (tests/unit/workflow_harness.py)."""

from __future__ import annotations

import json
from argparse import Namespace

import pytest
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from milestone_cli.main import cmd_set, cmd_signal, cmd_status
from tests.unit.workflow_harness import Cluster, finish, run_config, scenario, start_run, wait_progress
from workflows.stubs import TRAIN_STEP


def test_pause_set_resume_and_status_from_the_cli(capsys: pytest.CaptureFixture[str]) -> None:
    cluster = Cluster()
    held = cluster.gate(TRAIN_STEP, 1)

    async def body(env: WorkflowEnvironment, nodes: dict[str, Worker]) -> None:
        # no liveness watch: the test server does not skip time while an activity runs
        handle = await start_run(env, run_config(steps=2, node={"liveness_timeout_s": 0}))
        await held.wait_reached()
        await cmd_signal(env.client, Namespace(run=handle.id, command="pause"))
        await wait_progress(handle, lambda p: p.state == "paused", "the pause signal")
        await cmd_set(env.client, Namespace(run=handle.id, assignments=["lr=1e-3", "engines.num_engines=3"]))
        held.release.set()  # step 1 commits with what it was sent; step 2 waits for the resume
        await wait_progress(handle, lambda p: p.step == 1, "step 1 to commit")
        await cmd_signal(env.client, Namespace(run=handle.id, command="resume"))
        await finish(handle)
        assert [(t.batch.step, t.batch.hparams.lr) for t in cluster.train_inputs] == [(1, 1e-4), (2, 1e-3)]
        assert [n for _, n in cluster.engine_counts] == [2, 2, 3]  # v0 and step 1, then step 2
        capsys.readouterr()
        await cmd_status(env.client, Namespace(run=handle.id, json=True))

    scenario(cluster, body)
    status = json.loads(capsys.readouterr().out)
    assert (status["state"], status["step"], status["policy_version"]) == ("completed", 2, 2)


def test_set_sends_nothing_when_an_assignment_is_bad(capsys: pytest.CaptureFixture[str]) -> None:
    """Both updates are parsed before either is sent: a bad ``engines.*`` leaves ``train`` unchanged."""
    from milestone_cli.errors import CLIError

    cluster = Cluster()
    held = cluster.gate(TRAIN_STEP, 1)

    async def body(env: WorkflowEnvironment, nodes: dict[str, Worker]) -> None:
        handle = await start_run(env, run_config(steps=2))
        await held.wait_reached()
        with pytest.raises(CLIError):
            await cmd_set(env.client, Namespace(run=handle.id, assignments=["lr=1e-3", "engines.nope=3"]))
        held.release.set()
        await finish(handle)
        assert [t.batch.hparams.lr for t in cluster.train_inputs] == [1e-4, 1e-4]

    scenario(cluster, body)
