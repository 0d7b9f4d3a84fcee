"""Prometheus metrics of a worker process (scrape ``http://127.0.0.1:<port>/metrics``).

Names follow DESIGN §9; the node agent and the control worker each serve their own.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram, start_http_server

PHASE_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300)

ROLLOUT_TOKENS_PER_S = Gauge("milestone_rollout_tokens_per_second", "generated tokens per second, last rollout")
RESPONSE_LENGTH = Gauge("milestone_response_length_mean", "mean response length (tokens), last rollout")
REWARD_MEAN = Gauge("milestone_reward_mean", "mean reward, last step")
REWARD_STD = Gauge("milestone_reward_std", "reward standard deviation, last step")
REWARD_ERRORS = Counter(
    "milestone_reward_errors_total", "samples scored 0 after a failed reward call (error_policy zero)"
)
REWARD_JUDGE_CALLS = Counter(
    "milestone_reward_judge_calls_total", "samples judged by a judge endpoint (recorded results are not asked again)"
)
DYNAMIC_SAMPLING = Gauge(
    "milestone_dynamic_sampling", "dynamic sampling in the last step (groups by fate, rounds)", ["metric"]
)
AGENT = Gauge("milestone_agent", "agent episodes of the last rollout (docs/agents.md: turns_mean, tool_calls, ...)",
              ["metric"])
EVAL_GREEDY_ACCURACY = Gauge("milestone_eval_greedy_accuracy", "held-out greedy accuracy (pass@1), last eval")
EVAL_PASS_AT_K = Gauge("milestone_eval_pass_at_k", "held-out pass@k (k = eval.k samples per prompt), last eval")
TRAIN_METRIC = Gauge("milestone_train", "last train step metric", ["metric"])  # loss, kl, entropy, grad_norm, ...
POLICY_VERSION = Gauge("milestone_policy_version", "policy version held by this node's trainer")
PHASE_SECONDS = Histogram("milestone_phase_seconds", "activity time per phase", ["phase"], buckets=PHASE_BUCKETS)
WEIGHT_SYNC_BYTES = Counter("milestone_weight_sync_bytes_total", "bytes of weights pushed to engines")
ENGINE_EVENTS = Counter("milestone_engine_events_total", "engine fleet events", ["kind"])
ENGINES_HEALTHY = Gauge("milestone_engines_healthy", "healthy engines on this node")
TRAINER_RESTARTS = Counter("milestone_trainer_restarts_total", "trainer process restarts")
RECLAIMED_BYTES = Counter("milestone_node_reclaimed_bytes_total", "bytes of closed runs' files removed from this node")
DP_CELLS_ALIVE = Gauge("milestone_dp_cells_alive", "live DP cells of this node's trainer (trainer.cells)")
DP_CELL_EVENTS = Counter("milestone_dp_cell_events_total", "DP cell events (cell_lost, cell_restarted, cell_healed, "
                         "cells_diverged, lighthouse_restarted)", ["kind"])
DP_CELL_KINDS = ("cell_lost", "cell_restarted", "cell_restart_failed", "cell_healed", "cells_diverged",
                 "lighthouse_restarted", "lighthouse_restart_failed")
REPLAYED_STEPS = Counter("milestone_replayed_steps_total", "steps replayed to rebuild trainer state")

TRAIN_KEYS = ("loss", "pg_loss", "kl", "entropy", "clip_fraction", "grad_norm", "lr", "tokens_per_s", "distill_kl",
              "rollout_logprob_abs_diff", "rollout_logprob_abs_diff_max")  # the last two: the train-inference gap


def serve(port: int, host: str = "127.0.0.1") -> None:
    """Start the /metrics endpoint on ``host:port`` (0 = disabled). Loopback unless asked:
    a container's Prometheus scrapes it from another host (``--metrics-host 0.0.0.0``)."""
    if port:
        start_http_server(port, addr=host)


SAMPLING_KEYS = ("rounds", "groups_generated", "groups_kept", "groups_filtered_all_correct",
                 "groups_filtered_all_wrong", "groups_filtered_other", "groups_trained")


def record_sampling(stats: dict[str, float]) -> None:
    for key in SAMPLING_KEYS:
        DYNAMIC_SAMPLING.labels(key).set(stats[key])


def record_dp(alive: int | None, event_kinds: list[str]) -> None:
    """The DP cells after a trainer call: how many live, and their events."""
    if alive is not None:
        DP_CELLS_ALIVE.set(alive)
    for kind in event_kinds:
        if kind in DP_CELL_KINDS:
            DP_CELL_EVENTS.labels(kind).inc()


def record_train(metrics: dict[str, float], seconds: float, replayed: int) -> None:
    for key in TRAIN_KEYS:
        if key in metrics:
            TRAIN_METRIC.labels(key).set(metrics[key])
    PHASE_SECONDS.labels("train").observe(seconds)
    if replayed:
        REPLAYED_STEPS.inc(replayed)
