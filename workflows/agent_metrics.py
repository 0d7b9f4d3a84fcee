"""Episode metrics of several rollouts (rounds, or shares of one rollout on several nodes) as one."""

from __future__ import annotations

# episode metrics that are counts (summed over rounds); the others are means over episodes
AGENT_COUNTS = ("episodes", "tool_calls", "tool_errors", "turns_reused", "model_turns_reused", "tools_run")
AGENT_MAXES = ("calls_per_turn_max",)  # the largest over the rounds


def pool_agent_metrics(rounds: list[dict[str, float]]) -> dict[str, float] | None:
    """Several rollouts' episode metrics as one: counts summed, maxima the largest, means weighted by episodes."""
    if not rounds:
        return None
    n = sum(r.get("episodes", 0.0) for r in rounds) or 1.0
    keys = sorted({k for r in rounds for k in r})
    return {
        k: sum(r.get(k, 0.0) for r in rounds) if k in AGENT_COUNTS
        else max(r.get(k, 0.0) for r in rounds) if k in AGENT_MAXES
        else sum(r.get(k, 0.0) * r.get("episodes", 0.0) for r in rounds) / n
        for k in keys
    }
