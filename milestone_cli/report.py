"""``milestone report RUN``: a PNG of the run's curves (reward, loss, KL / grad norm with the
train-inference logprob gap, time per phase, and held-out eval accuracy when the run has evals), from the run's
``progress`` query."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

from workflows.run_state import RunProgress
from workflows.contracts.step import StepSummary

if TYPE_CHECKING:
    import matplotlib.axes

PHASES = ("rollout", "reward", "train", "update_weights", "checkpoint", "eval")


def moving_average(values: list[float], window: int) -> list[float]:
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def render_report(p: RunProgress, out: Path, window: int = 10) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not p.steps:
        raise ValueError(f"run {p.run_id} has no committed step yet")
    steps = [s.step for s in p.steps]
    evals = [s for s in p.steps if s.eval_greedy is not None]
    fig = plt.figure(figsize=(17 if evals else 12, 7.5))
    grid = fig.add_gridspec(2, 3 if evals else 2)
    ax = [[fig.add_subplot(grid[r, c]) for c in range(2)] for r in range(2)]
    rewards = [s.reward_mean for s in p.steps]
    ax[0][0].plot(steps, rewards, ".", alpha=0.4, label="reward (mean per step)")
    ax[0][0].plot(steps, moving_average(rewards, window), "-", label=f"{window}-step average")
    ax[0][0].set_title("reward")
    ax[0][0].legend(loc="lower right")
    ax[0][1].plot(steps, [s.loss for s in p.steps], "-", lw=1)
    ax[0][1].set_title("loss")
    ax[1][0].plot(steps, [s.grad_norm for s in p.steps], "-", lw=1, label="grad norm")
    ax[1][0].plot(steps, [s.kl for s in p.steps], "-", lw=1, label="KL")
    ax[1][0].set_title("grad norm / KL")
    ax[1][0].legend(loc="upper right")
    if any(s.rollout_logprob_abs_diff_max for s in p.steps):  # the train-inference gap, on a log axis
        plot_gap(ax[1][0].twinx(), steps, p.steps)
    ax[1][1].stackplot(steps, *[[s.phase_seconds.get(ph, 0.0) for s in p.steps] for ph in PHASES], labels=PHASES)
    ax[1][1].plot(steps, [s.step_seconds for s in p.steps], "k-", lw=1, label="step wall")
    if any(s.overlap_seconds for s in p.steps):  # one_step_off / fully_async: later batches sampled during train
        ax[1][1].plot(steps, [s.overlap_seconds for s in p.steps], "k--", lw=1, label="overlapped (later batches)")
    ax[1][1].set_title("seconds per step")
    ax[1][1].legend(loc="upper right", fontsize=7)
    if any(s.staleness or s.buffer_depth for s in p.steps):  # off-policy modes: versions, on a right-hand axis
        versions = ax[1][1].twinx()
        versions.step(steps, [s.staleness for s in p.steps], "m-", where="mid", lw=1, label="staleness (versions)")
        versions.step(steps, [s.buffer_depth for s in p.steps], "c:", where="mid", lw=1, label="buffer depth (batches)")
        versions.set_ylim(bottom=0)
        versions.legend(loc="upper left", fontsize=7)
    if evals:  # a third column, both rows high
        plot_eval(fig.add_subplot(grid[:, 2]), evals, steps, [s.accuracy for s in p.steps])
    for a in fig.axes:
        a.set_xlabel("step")
        a.grid(alpha=0.3)
    fig.suptitle(f"{p.run_id}: {p.state}, step {p.step}/{p.total_steps}, policy v{p.policy_version}")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def plot_gap(a: matplotlib.axes.Axes, steps: list[int], summaries: list[StepSummary]) -> None:
    """The train-inference logprob gap per step (mean and max |engine - trainer| over the
    trained tokens), on a log scale: ~1e-7 when both sides compute the same distribution."""
    a.semilogy(steps, [max(s.rollout_logprob_abs_diff, 1e-12) for s in summaries], "g-", lw=1, label="logprob gap mean")
    a.semilogy(steps, [max(s.rollout_logprob_abs_diff_max, 1e-12) for s in summaries], "g:", lw=1,
               label="logprob gap max")
    a.legend(loc="upper left", fontsize=7)


def _or_nan(v: float | None) -> float:
    """A missing value as NaN, which matplotlib leaves out of a line (as it does None)."""
    return math.nan if v is None else v


def plot_eval(a: matplotlib.axes.Axes, evals: list[StepSummary], steps: list[int], train_acc: list[float]) -> None:
    """Held-out greedy accuracy and pass@k per evaluated step, with the rollout accuracy for reference."""
    x = [s.step for s in evals]
    a.plot(x, [_or_nan(s.eval_greedy) for s in evals], "o-", label="held-out greedy (pass@1)")
    ks = sorted({s.eval_k for s in evals if s.eval_k is not None})  # set with eval_greedy, on every evaluated step
    a.plot(x, [_or_nan(s.eval_pass_at_k) for s in evals], "s-", label=f"held-out pass@{'/'.join(map(str, ks))}")
    a.plot(steps, train_acc, "-", lw=1, alpha=0.4, label="rollout accuracy")
    a.set_ylim(-0.02, 1.02)
    a.set_title(f"eval accuracy ({evals[-1].eval_n} held-out prompts)")
    a.legend(loc="lower right")
