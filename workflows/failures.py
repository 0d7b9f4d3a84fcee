"""Every failure type an activity or workflow raises, in one enum.

The raising side builds its ``ApplicationError`` with :func:`failure`, and the
retry policies (the activity stubs, ``workflows.stubs``) read which types are final from
:data:`NON_RETRYABLE`, so the two sides cannot disagree on a spelling.
"""

from __future__ import annotations

from enum import StrEnum

from temporalio.exceptions import ApplicationError


class Failure(StrEnum):
    INVALID_INPUT = "InvalidInput"  # bad config, dataset row or reward function: retrying cannot help
    DIVERGENCE = "Divergence"  # NaN/inf: the run pauses on its last good state
    NODE_LOST = "NodeLost"  # the node's queue is not served: the workflow re-places the run
    # every rollout node of the run was lost during a step (engines.nodes): the run replaces them, then re-runs it
    ROLLOUT_NODES_LOST = "RolloutNodesLost"
    NODE_EXCLUDED = "NodeExcluded"  # this node was lost by the run before: let another claim it
    NODE_BUSY = "NodeBusy"  # this node serves another live run: let a free one claim it (or wait)
    NO_HEALTHY_ENGINE = "NoHealthyEngine"  # no engine can generate: slots restarted, then retried
    STALE_WEIGHTS = "StaleWeights"  # an engine served another weight version than the step's
    WEIGHT_MISMATCH = "WeightMismatch"  # engines' checksums differ from the trainer's
    WEIGHT_PULL_FAILED = "WeightPullFailed"  # a rollout node could not pull a version from the trainer's node
    TRAINER_DIED = "TrainerDied"  # the trainer process exited during a call: restarted, then retried
    TRAINER_ERROR = "TrainerError"  # any other trainer-side error (message names its class)
    REWARD_ERROR = "RewardError"  # a reward function raised or timed out, an endpoint failed
    SAMPLING_SHORTFALL = "SamplingShortfall"  # dynamic sampling kept too few groups (on_shortfall: fail)
    # a trainer write failed for lack of space: final for the activity, the workflow waits and calls again
    DISK_FULL = "DiskFull"

    @property
    def retryable(self) -> bool:
        return self not in NON_RETRYABLE


NON_RETRYABLE: frozenset[Failure] = frozenset({
    Failure.INVALID_INPUT, Failure.DIVERGENCE, Failure.NODE_LOST, Failure.DISK_FULL, Failure.ROLLOUT_NODES_LOST,
})


def failure(kind: Failure, message: str, *details: object, final: bool = False) -> ApplicationError:
    """An ``ApplicationError`` of this type, final when the retry policies say so or ``final``
    (a ``RewardError`` that no retry can fix: an endpoint's 4xx, ``error_policy: fail``)."""
    return ApplicationError(message, *details, type=kind.value, non_retryable=final or not kind.retryable)


def failure_details(err: BaseException | None, kind: Failure) -> tuple:
    """The details of the first ``kind`` failure in an error's cause chain (empty: none)."""
    cause = err
    while cause is not None:
        if isinstance(cause, ApplicationError) and cause.type == kind.value:
            return tuple(cause.details)
        cause = cause.__cause__
    return ()


def failure_in(err: BaseException | None) -> tuple[Failure | None, str]:
    """The first of our failure types in an error's cause chain and its message
    (``(None, str(err))`` when the chain holds none)."""
    cause = err
    while cause is not None:
        if isinstance(cause, ApplicationError) and cause.type is not None and cause.type in Failure._value2member_map_:
            return Failure(cause.type), cause.message
        cause = cause.__cause__
    return None, str(err)
