"""The run's ``rollout.temperature`` reaches the trainer with every RL step (``TrainStepInput``
-> the stored ``StepBatch``), and a new RL run that samples what the trainer cannot train
(greedy, top-p, top-k) fails at once, naming the field: by the workflow (a run started from
the Temporal CLI), by ``milestone start``'s config check and by ``milestone fork --set``."""

from __future__ import annotations

from pathlib import Path

import pytest
from temporalio.client import WorkflowFailureError
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from milestone_cli.config_file import ConfigError, load_run_config
from milestone_cli.fork import ForkError, apply_sets
from spec.rollout import RolloutSpec, rl_sampling_conflicts
from spec.run import RunConfig
from spec.train import TrainSpec
from tests.unit.workflow_harness import PROMPTS_PER_STEP, Cluster, finish, run_config, scenario, start_run
from workflows.failures import Failure, failure_in

ROLLOUT = {"prompts_per_step": PROMPTS_PER_STEP, "group_size": 2, "chunk_size": 4}


def test_every_rl_step_trains_at_the_rollout_temperature() -> None:
    cluster = Cluster()

    async def body(env: WorkflowEnvironment, nodes: dict[str, Worker]) -> None:
        summary = await finish(await start_run(env, run_config(steps=2, rollout={**ROLLOUT, "temperature": 0.7})))
        assert summary.steps == 2
        assert [t.batch.temperature for t in cluster.train_inputs] == [0.7, 0.7]

    scenario(cluster, body)


@pytest.mark.parametrize("field,value", [("top_p", 0.9), ("top_k", 20), ("temperature", 0.0)])
def test_a_new_rl_run_refuses_a_sampling_it_cannot_train(field: str, value: float) -> None:
    cluster = Cluster()

    async def body(env: WorkflowEnvironment, nodes: dict[str, Worker]) -> None:
        handle = await start_run(env, run_config(rollout={**ROLLOUT, field: value}))
        with pytest.raises(WorkflowFailureError) as err:
            await finish(handle)
        kind, message = failure_in(err.value)
        assert kind == Failure.INVALID_INPUT and f"rollout.{field}: " in message, message
        assert cluster.train_inputs == [] and cluster.init_inputs == []

    scenario(cluster, body)


def test_the_config_check_and_fork_name_the_field(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("steps: 2\nrollout:\n  group_size: 4\n  top_p: 0.9\n")
    with pytest.raises(ConfigError, match=rf"{path}:4: rollout.top_p: 0.9 is not supported in mode rl"):
        load_run_config(path)
    path.write_text("mode: sft\nsft: {steps: 0}\nrollout: {top_p: 0.9}\n")
    assert load_run_config(path).rollout.top_p == 0.9  # mode sft samples nothing
    with pytest.raises(ForkError, match="rollout.top_k: 5 is not supported"):
        apply_sets(RunConfig(), TrainSpec(), ["rollout.top_k=5"])
    assert RolloutSpec(top_p=0.5, top_k=3, temperature=0.0)  # a recorded history still decodes
    assert rl_sampling_conflicts(RolloutSpec(temperature=0.7)) == []
