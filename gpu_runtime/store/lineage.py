"""A forked run's ancestry: which run's prefix holds the artifacts of each step.

A fork of run P at step N trains steps N+1.. under its own prefix and reads the
steps up to N (step batches, rollout chunks, rewards, checkpoints) from P's,
read-only. ``lineage`` is a list of ``(run_id, last_step)`` pairs, oldest ancestor
first: steps up to the first pair's ``last_step`` belong to its run, the next ones
up to the second pair's to its run, and so on; later steps are the run's own.
"""

from __future__ import annotations

from collections.abc import Sequence

Lineage = Sequence[tuple[str, int]]


def owner(lineage: Lineage, own_run_id: str, step: int) -> str:
    """The run whose prefix holds ``step``'s artifacts."""
    for run_id, last_step in lineage:
        if step <= last_step:
            return run_id
    return own_run_id


def fork_lineage(parent_lineage: Lineage, parent_id: str, step: int) -> list[tuple[str, int]]:
    """The lineage of a fork of ``parent_id`` at ``step``: the parent's own ancestors
    that ``step`` still reaches, then the run that owns ``step`` (the parent, or one
    of its ancestors when the parent itself was forked after ``step``)."""
    if step < 0:
        raise ValueError(f"fork step must be >= 0, got {step}")
    out: list[tuple[str, int]] = []
    for run_id, last_step in [*parent_lineage, (parent_id, step)]:
        if last_step >= step:
            out.append((run_id, step))
            return out
        out.append((run_id, last_step))
    return out  # unreachable: the parent's own pair always ends the loop
