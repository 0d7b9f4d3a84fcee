"""The held-out eval in ``RLStep`` on Temporal's time-skipping test server, with the
stand-in activities of tests/unit/workflow_harness.py: which steps evaluate, what the
summaries carry, and that a failed eval costs its numbers but never the run."""

from __future__ import annotations

from temporalio.exceptions import ApplicationError
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from tests.unit.workflow_harness import Cluster, eval_of, finish, progress, run_config, scenario, start_run
from spec.events import EvalFailed, EvalSkipped
from workflows.failures import Failure, failure
from workflows.stubs import CHECKPOINT, EVALUATE, TRAIN_STEP


def test_eval_runs_on_due_steps_and_after_the_last() -> None:
    cluster = Cluster()

    async def body(env: WorkflowEnvironment, nodes: dict[str, Worker]) -> None:
        handle = await start_run(env, run_config(steps=5, eval={"every": 2, "k": 3, "max_new_tokens": 5}))
        summary = await finish(handle)
        # the post-SFT policy once before RL (step 0, v0), then the due steps
        assert [(c.step, c.version) for c in cluster.served(EVALUATE)] == [(0, 0), (2, 2), (4, 4), (5, 5)]
        inp = cluster.eval_inputs[1]
        assert (inp.k, inp.temperature, inp.max_new_tokens, inp.chunk_size) == (3, 1.0, 5, 4)
        assert inp.eval_key == f"runs/{handle.id}/data/eval.jsonl"
        # after the step's checkpoint (steps 2 and 4 checkpoint: checkpoint.every is 2)
        step4 = [c.name for c in cluster.calls if c.step == 4]
        assert step4[-2:] == [CHECKPOINT.name, EVALUATE.name]
        p = await progress(handle)
        evals = {s.step: (s.eval_greedy, s.eval_pass_at_k, s.eval_k, s.eval_n) for s in p.steps}
        assert evals == {1: (None,) * 4, 2: (*eval_of(2), 3, 3), 3: (None,) * 4, 4: (*eval_of(4), 3, 3),
                         5: (*eval_of(5), 3, 3)}
        assert p.steps[1].phase_seconds["eval"] == 0.4 and "eval" not in p.steps[0].phase_seconds
        assert (summary.eval_step, summary.eval_greedy, summary.eval_pass_at_k, summary.eval_k) == (5, *eval_of(5), 3)
        assert (summary.eval_before_greedy, summary.eval_before_pass_at_k) == eval_of(0)

    scenario(cluster, body)


def test_eval_every_0_evaluates_only_after_the_last_step() -> None:
    cluster = Cluster()

    async def body(env: WorkflowEnvironment, nodes: dict[str, Worker]) -> None:
        summary = await finish(await start_run(env, run_config(steps=3)))  # the default: every 0
        assert [c.step for c in cluster.served(EVALUATE)] == [0, 3]
        assert (summary.eval_step, summary.eval_greedy, summary.eval_pass_at_k) == (3, *eval_of(3))

    scenario(cluster, body)


def test_no_eval_when_disabled_or_without_a_heldout_split() -> None:
    cluster = Cluster()

    async def body(env: WorkflowEnvironment, nodes: dict[str, Worker]) -> None:
        off = await finish(await start_run(env, run_config(steps=2, eval={"enabled": False, "every": 1})))
        handle = await start_run(env, run_config(steps=2, data={"kind": "jsonl", "path": "/data/train.jsonl"}))
        no_split = await finish(handle)
        assert cluster.served(EVALUATE) == []
        assert off.eval_step is None and no_split.eval_greedy is None
        skipped = [e.why for e in (await progress(handle)).events if isinstance(e, EvalSkipped)]
        assert skipped == ["data.eval_path is not set"]

    scenario(cluster, body)


def test_failed_eval_costs_its_numbers_not_the_run() -> None:
    """A retryable failure is retried; a final one leaves the step without eval numbers
    and an ``eval_failed`` event, and the summary reports the eval before it."""
    cluster = Cluster()

    async def once(queue: str, attempt: int) -> None:
        if attempt == 1:
            raise ApplicationError("no engine alive", type=Failure.NO_HEALTHY_ENGINE.value)

    async def broken(queue: str, attempt: int) -> None:
        raise failure(Failure.INVALID_INPUT, "row h3: field 'answer' has no integer answer")

    cluster.hook(EVALUATE, 1, once)
    cluster.hook(EVALUATE, 3, broken)

    async def body(env: WorkflowEnvironment, nodes: dict[str, Worker]) -> None:
        handle = await start_run(env, run_config(steps=3, eval={"every": 1}))
        summary = await finish(handle)
        assert [(c.step, c.attempt) for c in cluster.served(EVALUATE)] == [(0, 1), (1, 1), (1, 2), (2, 1), (3, 1)]
        p = await progress(handle)
        assert p.state == "completed" and [s.step for s in p.steps] == [1, 2, 3]
        assert p.steps[0].eval_greedy == eval_of(1)[0] and p.steps[2].eval_greedy is None
        failed = [(e.step, e.message) for e in p.events if isinstance(e, EvalFailed)]
        assert failed == [(3, "row h3: field 'answer' has no integer answer")]
        assert (summary.eval_step, summary.eval_greedy) == (2, eval_of(2)[0])

    scenario(cluster, body)


def test_node_lost_during_eval_reruns_the_step_elsewhere() -> None:
    cluster = Cluster(n_nodes=2)
    node_a, node_b = cluster.queues

    async def lost_on_a(queue: str, attempt: int) -> None:
        if queue == node_a:
            raise failure(Failure.NODE_LOST, f"{queue} lost its engines")

    cluster.hook(EVALUATE, 2, lost_on_a)

    async def body(env: WorkflowEnvironment, nodes: dict[str, Worker]) -> None:
        summary = await finish(await start_run(env, run_config(steps=2)))
        assert [(c.queue, c.step) for c in cluster.served(EVALUATE)] == [(node_a, 0), (node_a, 2), (node_b, 2)]
        assert [(c.queue, c.step) for c in cluster.served(TRAIN_STEP)] == [(node_a, 1), (node_a, 2), (node_b, 2)]
        assert (summary.steps, summary.eval_step) == (2, 2)

    scenario(cluster, body)


def test_failed_eval_before_rl_is_an_event_not_a_failure() -> None:
    cluster = Cluster()

    async def broken(queue: str, attempt: int) -> None:
        raise failure(Failure.INVALID_INPUT, "eval split unreadable")

    cluster.hook(EVALUATE, 0, broken)

    async def body(env: WorkflowEnvironment, nodes: dict[str, Worker]) -> None:
        handle = await start_run(env, run_config(steps=2))
        summary = await finish(handle)
        assert summary.eval_before_greedy is None and summary.eval_step == 2
        p = await progress(handle)
        assert [(e.step, e.message) for e in p.events if isinstance(e, EvalFailed)] == [(0, "eval split unreadable")]

    scenario(cluster, body)
