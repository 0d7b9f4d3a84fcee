"""What the node agent receives to run a step's rollout: ``RolloutRequest``, the step's
identity and its ``rollout`` section (``spec.rollout.RolloutSpec``, agent episodes included)."""

from __future__ import annotations

from dataclasses import dataclass

from spec.rollout import RolloutSpec


@dataclass(frozen=True)
class RolloutRequest:
    run_id: str
    step: int
    seed: int
    policy_version: int
    data_cursor: int
    n_rows: int
    rollout: RolloutSpec  # prompts_per_step: the prompts this request draws (a dynamic-sampling round's own number)
    round: int = 0  # dynamic sampling: the step's round (0: the first, or no filter)
    node: str = ""  # the node id that generates: stamped on every chunk it stores
    chunks: tuple[int, ...] | None = None  # this node's share of the chunks (keys of its own); None: all of them
