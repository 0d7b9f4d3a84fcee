"""How ``NodeActivities._generating`` types the failures of generating work: the type
decides whether Temporal retries (``workflows.failures.NON_RETRYABLE``)."""

from __future__ import annotations

import pytest
from temporalio.exceptions import ApplicationError

from activities.node import NodeActivities
from gpu_runtime.agent.tools import load_tools
from gpu_runtime.engine.rollout import NonFiniteLogprobs
from workflows.failures import Failure


def raising(err: BaseException):
    def fn() -> None:
        raise err
    return fn


def test_an_agent_tool_the_node_cannot_import_is_invalid_input_not_retried() -> None:
    acts = NodeActivities.__new__(NodeActivities)  # _generating reads no runtime state on these paths

    def rollout() -> None:
        load_tools(["no_such_pkg.tools:make"], 5.0)  # what the agent rollout does on the node

    with pytest.raises(ApplicationError) as err:
        acts._generating("run", 1, "rollout step 1", rollout)
    assert err.value.type == Failure.INVALID_INPUT.value and err.value.non_retryable
    assert "rollout step 1: agent.tools: cannot import 'no_such_pkg.tools:make'" in err.value.message


def test_non_finite_logprobs_are_a_divergence() -> None:
    acts = NodeActivities.__new__(NodeActivities)
    with pytest.raises(ApplicationError) as err:
        acts._generating("run", 1, "rollout step 1", raising(NonFiniteLogprobs("nan")))
    assert err.value.type == Failure.DIVERGENCE.value and err.value.non_retryable
