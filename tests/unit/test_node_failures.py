"""How the node's activities type failures: of generating work (the type decides whether
Temporal retries, ``workflows.failures.NON_RETRYABLE``) and of a claim on a busy node."""

from __future__ import annotations

import pytest
from temporalio.exceptions import ApplicationError

from activities.node_placement import PlacementActivities
from activities.node_rollout import RolloutActivities
from gpu_runtime.rollout.agent.tools import load_tools
from gpu_runtime.rollout.chunks import NonFiniteLogprobs
from workflows.failures import Failure


def raising(err: BaseException):
    def fn() -> None:
        raise err
    return fn


def test_an_agent_tool_the_node_cannot_import_is_invalid_input_not_retried() -> None:
    acts = RolloutActivities.__new__(RolloutActivities)  # _generating reads no runtime state on these paths

    def rollout() -> None:
        load_tools(["no_such_pkg.tools:make"], 5.0)  # what the agent rollout does on the node

    with pytest.raises(ApplicationError) as err:
        acts._generating("run", 1, "rollout step 1", rollout)
    assert err.value.type == Failure.INVALID_INPUT.value and err.value.non_retryable
    assert "rollout step 1: agent.tools: cannot import 'no_such_pkg.tools:make'" in err.value.message


def test_non_finite_logprobs_are_a_divergence() -> None:
    acts = RolloutActivities.__new__(RolloutActivities)
    with pytest.raises(ApplicationError) as err:
        acts._generating("run", 1, "rollout step 1", raising(NonFiniteLogprobs("nan")))
    assert err.value.type == Failure.DIVERGENCE.value and err.value.non_retryable


def test_a_node_serving_a_live_run_refuses_another_runs_claim() -> None:
    """One run per node: once run A has claimed the node and while its liveness watch runs there, run B's claim fails
    retryably with NodeBusy (the claim goes to a free node, or waits); A's own re-claim is
    served; once A's watch has ended, B's claim is served. The activities are the node's
    real ones in Temporal's activity environment; the runtime is reduced to the fields a
    claim reads (no store: epoch 0)."""
    import asyncio
    from types import SimpleNamespace

    from temporalio.testing import ActivityEnvironment

    from workflows.contracts.placement import ClaimNodeInput, NodeLivenessInput

    acts = PlacementActivities(SimpleNamespace(node_id="node0", boot_id="b", task_queue="gpu-node0", weights_url="",
                                               set_run=lambda run_id: None))

    async def main() -> None:
        claim = ActivityEnvironment().run(acts.claim_node, ClaimNodeInput(run_id="A", exclude_queues=[], store_uri=""))
        with pytest.raises(ApplicationError, match="serves run A"):  # claimed, its watch not yet started
            ActivityEnvironment().run(acts.claim_node, ClaimNodeInput(run_id="B", exclude_queues=[], store_uri=""))
        watch_env = ActivityEnvironment()
        watch = asyncio.ensure_future(watch_env.run(acts.node_liveness, NodeLivenessInput(run_id="A", interval_s=0.05)))
        while not acts.watching["A"]:
            await asyncio.sleep(0.01)
        with pytest.raises(ApplicationError) as err:
            ActivityEnvironment().run(acts.claim_node, ClaimNodeInput(run_id="B", exclude_queues=[], store_uri=""))
        assert err.value.type == Failure.NODE_BUSY.value and not err.value.non_retryable
        assert "node0 (gpu-node0) serves run A" in err.value.message
        claim = ActivityEnvironment().run(acts.claim_node, ClaimNodeInput(run_id="A", exclude_queues=[], store_uri=""))
        assert claim.task_queue == "gpu-node0"
        with pytest.raises(ApplicationError) as err:  # as another of A's nodes (a rollout node): never
            ActivityEnvironment().run(acts.claim_node, ClaimNodeInput(run_id="A", held_queues=["gpu-node0"]))
        assert err.value.type == Failure.NODE_EXCLUDED.value
        watch_env.cancel()
        with pytest.raises(asyncio.CancelledError):
            await watch
        assert acts.watching["A"] == 0
        claim = ActivityEnvironment().run(acts.claim_node, ClaimNodeInput(run_id="B", exclude_queues=[], store_uri=""))
        assert claim.node_id == "node0"

    asyncio.run(main())
