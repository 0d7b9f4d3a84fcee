"""A rollout's episode metrics, from its samples (docs/agents.md lists them)."""

from __future__ import annotations

from collections.abc import Sequence

from gpu_runtime.rollout.agent.records import OUTCOMES
from gpu_runtime.store.artifacts import Sample


def episode_metrics(samples: Sequence[Sample]) -> dict[str, float]:
    """Means over the episodes: turns, tool calls, tool errors, tokens (model + tool turns),
    model tokens; totals of tool calls and errors; the share of each outcome."""
    eps = [(s, s.episode) for s in samples if s.episode is not None]
    n = len(eps)
    if not n:
        return {}
    out = {
        "episodes": float(n),
        "turns_mean": sum(e.turns for _, e in eps) / n,
        "tool_calls": float(sum(e.tool_calls for _, e in eps)),
        "tool_errors": float(sum(e.tool_errors for _, e in eps)),
        "tool_calls_mean": sum(e.tool_calls for _, e in eps) / n,
        "calls_per_turn_max": float(max(e.max_calls_per_turn for _, e in eps)),
        "episode_tokens_mean": sum(len(s.response_ids) for s, _ in eps) / n,
        "model_tokens_mean": sum(sum(s.loss_mask or []) for s, _ in eps) / n,
        "truncation_rate": sum(e.outcome == "truncated" for _, e in eps) / n,
    }
    for o in dict.fromkeys([*OUTCOMES, *(e.outcome for _, e in eps)]):  # the kind openai's ends too
        out[f"outcome_{o}"] = sum(e.outcome == o for _, e in eps) / n
    if any(e.segments != 1 for _, e in eps):
        out["segments_untrained"] = float(sum(max(0, e.segments - 1) for _, e in eps))
    turn_rewards = [r for _, e in eps for r in e.turn_rewards if r is not None]
    if turn_rewards:
        out["turn_reward_mean"] = sum(turn_rewards) / len(turn_rewards)
    return out
